#!/usr/bin/env bash
# Every GPU test and benchmark of spade in one device call (machines start bare).
#
#   bash scripts/gpu_all.sh [STAGE ...]     STAGE: tests kernels decode tpot transports (default: all)
#
# On the lent GPU machines (torch/triton/transformers preinstalled, no pydantic):
# carry `.whl` (made by ../shared/tools/gpu-wheels) and the script installs it.
# Results (JSON, PNG, logs) go to $OUT (the device tool's folder) or results/gpu.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# NVLink multicast stays off (shared hosts): keep these set for every child process
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ] && ! python3 -c "import pydantic_settings" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests kernels decode tpot transports)
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/gpu.txt"
rc=0
run() {  # run NAME TIMEOUT CMD...
  local name=$1 t=$2; shift 2
  echo "=== $name: $*"
  local t0=$(date +%s)
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1
  local r=$?
  echo "=== $name: rc=$r in $(( $(date +%s) - t0 )) s"
  tail -n 40 "$OUT/$name.log"
  [ $r -ne 0 ] && rc=$r
  return 0
}
for s in "${stages[@]}"; do
  case $s in
    tests) run tests 330 python3 -m pytest -q -x -p no:cacheprovider --timeout 120 tests/kernels tests/policies
           run gputests 200 python3 -m pytest -v -p no:cacheprovider --timeout 60 -m "gpu or multigpu" tests ;;
    kernels) run bench_scoring 200 python3 -m benchmarks.bench_scoring --quick --out "$OUT/bench_scoring.json"
             run bench_attention 200 python3 -m benchmarks.bench_attention --quick --out "$OUT/bench_attention.json" ;;
    decode) run bench_decode 300 python3 -m benchmarks.bench_decode --out "$OUT/bench_decode.json" ;;
    tpot) run bench_tpot 330 python3 -m benchmarks.bench_tpot --quick --out "$OUT/bench_tpot.json" ;;
    gputests) run gputests 120 python3 -m pytest -v -p no:cacheprovider --timeout 40 -m "gpu or multigpu" tests ;;
    transports) run bench_transports 120 python3 -m benchmarks.bench_transports --out "$OUT/bench_transports.json" ;;
    *) echo "unknown stage $s"; rc=2 ;;
  esac
done
exit $rc
