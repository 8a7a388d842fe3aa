"""GPU microbenchmarks of spade (``python -m benchmarks.<name>``)."""
