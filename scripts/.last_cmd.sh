HEADLINE_PACKS=4,6,9 HEADLINE_PROFILE=local_P4_int4_coroutine,multiprocess_P9_int4 HEADLINE_ARGS="--cache-thread thread,coroutine" bash scripts/gpu_all.sh headline 2>&1 | grep -v "W1122\|USDT\|_warn_once\|UserWarning\|^      gap\|ms/step  [_vn]" | tail -30
mkdir -p results/gpu2
timeout 200 python3 -m benchmarks.bench_tpot --batch 8 --context 32768 --budget 2048 --packs 4,9 --score-keys int4 --iters 30 --methods optimal,asyncspade/local,asyncspade/multiprocess --cache-thread coroutine --blocking-sync --no-plots --out results/gpu2/bench_tpot_blocking.json 2>&1 | grep -v "W1122\|USDT\|_warn_once\|UserWarning" | grep "ms  (p90"
PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 timeout 200 python3 -m pytest -q -p no:cacheprovider --timeout 90 -m "gpu or multigpu" tests/runtime tests/models 2>&1 | tail -5
cp results/gpu2/*.json $OUT/ 2>/dev/null; true
