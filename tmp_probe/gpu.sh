#!/usr/bin/env bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
git log --oneline -1 2>/dev/null
if [[ " $* " == *" tests "* ]]; then
  timeout 300 python -m pytest -q tests/serving/test_gpu.py tests/runtime/test_paged_runtime.py tests/runtime/test_gpu.py \
    -k "joined_requests or gpu_paged or kv" 2>&1 | tail -8
fi
if [[ " $* " == *" oom "* ]]; then
  timeout 330 python -m benchmarks.bench_tpot --preset qwen3-8b --batch 8 --context 32768 --budget 2048 --packs 9 \
    --score-keys int4 --iters 16 --block-size 0,16 --methods optimal,asyncspade/colocated --no-plots --out $OUT/oom 2>&1 | tail -20
fi
if [[ " $* " == *" kvtrace "* ]]; then
  for mode in indices kv; do
    timeout 200 python -m benchmarks.bench_serving --preset qwen3-8b --max-batch 8 --max-seq-len 12288 --budget 2048 \
      --set model.block_size=16 --set model.kv_blocks=6000 --requests 16 --rate inf --prompt-min 4096 --prompt-max 8192 \
      --out-min 256 --out-max 512 --device cuda:0 --topology colocated --policies asyncspade \
      --set policy.score_keys=int4 --set runtime.pack_layers=auto --set runtime.return_mode=$mode --out $OUT/kv_$mode 2>&1 | tail -6
  done
fi
