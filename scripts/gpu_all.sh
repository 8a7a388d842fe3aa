#!/usr/bin/env bash
# Every GPU test and benchmark of spade in one device call (machines start bare).
#
#   bash scripts/gpu_all.sh [STAGE ...]
#
# STAGE (default: tests kernels gputests tpot transports):
#   tests      kernel + policy suites on the GPU (TESTS=paths to narrow; on GPU 1 when two are visible,
#              in the background, so that `kernels` runs beside it on GPU 0)
#   gputests   every test marked gpu/multigpu (runtime topologies, NCCL link, ...)
#   kernels    python -m benchmarks.kernels --full (B x L x K sweep, JSON per row)
#   decode     whole-model decode: spade fast path vs HF (one GPU); projections auto vs cuBLAS side by side
#   prefill    the serving prompt pass whole and in pieces against its FLOP floor, with a kernel profile
#   prefill_fresh  the prompt pass at lengths never run before (a served trace's prompts), paged
#   guidellm   `spade serve` driven by guidellm (wheels carried in .whl_guidellm; docs/serve.md)
#   syncs      host synchronisations of a served trace by Python line (SYNCS_POLICIES, default
#              "full:inline asyncspade:colocated")
#   gemv       the decode projections alone: split-K Triton GEMV vs cuBLAS (bench_gemv --quick)
#   headline   TPOT at issue #5's shape (B=8 L=32k K=2k, P=9, int4 keys): full, quest, optimal, local,
#              multiprocess, with device timelines (busy / idle per GPU) and the cache rank's host account
#   tpot       TPOT of every method and topology at B=8 L=32k K=2k, P in {2, 4} (TPOT_ITERS steps per row),
#              exact / int8 / int4 scoring keys, torch.profiler of the async rows and of one cache-rank layer
#   sweep      TPOT over B x L x K (the shapes that fit), fewer methods (SWEEP_KEYS scoring keys, default int8,int4;
#              SWEEP_B, SWEEP_L: batch sizes and contexts, default 8,1,16,32 and 32768,16384,65536)
#   transports bandwidth/latency of local and nccl (vs raw NCCL) for the runtime's messages
#   ucx, nixl  the same plus the contract and runtime tests for ucx / nixl, with their
#              wheels carried in .whl_ucx / .whl_nixl (each call carries one: 64 MiB limit)
#   select     score + top-K per stage (scoring, radix pass 1, split, ties) and the select launch grid
#              (SELECT_ARGS: more bench_select flags, e.g. --carry 8:16,4:16 --no-grid --keys int4)
#   softmax    sum_softmax's logits and finalize passes under bench_scoring's SOFTMAX_SWEEP launch configs, int4 and
#              int8 keys, kernel device time of the threshold-carry path, at SOFTMAX_SHAPES (default 16x16384,8x32768)
#   kernels_sweep  launch-config sweeps of the attention / Quest kernels at B=8 L=32k
#   large      TPOT and Table 3 at B=16 L=32k and B=32 L=16k (LARGE_SHAPES), under each of PDL_MODES
#   topk       threshold-carry top-K vs radix passes (policy.topk) side by side at TOPK_SHAPES (default
#              8x32768 16x32768 32x16384), int4 keys, P=9, with Table 3 per mode
#   carry_store  the threshold carry's scores stored compacted (SELECT_CONFIG carry_compact) beside whole rows:
#              tests/kernels/test_carry.py on the GPU, then bench_tpot --carry-store mark,compact of optimal and
#              colocated (int4, c=32, P=9; CARRY_STORE_ARGS: more flags) at CARRY_STORE_SHAPES (default 8x32768
#              16x16384), Table 3 per shape
#   colocated_gaps  where colocated's step goes over optimal's: torch.profiler over 4 steps of each at 8 x 32k
#              (int4, c=32, P=9; GAPS_ARGS: more bench_tpot flags, e.g. --carry-store compact), then
#              trace_summary --compare (the inference stream's excess by kernel and by the time between kernels)
#   overlap    the cache rank's top-K select of layer j beside layer j+1's scoring (select_overlap):
#              bench_select --overlap (a pack of 4 layers, serial vs side stream, OVERLAP_SPECS warps[:priority])
#              at OVERLAP_SHAPES (default 8x32768 16x32768 32x16384), then bench_tpot with
#              --select-overlap OVERLAP_MODES (default off,on) side by side, Table 3 per mode
#   p2p_channels  the multiprocess row under NCCL_MAX_P2P_NCHANNELS values (P2P_CHANNELS, default "default 1 2")
#   colocated  TPOT of the one-GPU topology (asyncspade/colocated) beside full, quest, optimal, inline at
#              COLOCATED_SHAPES (default 1x32768 8x32768 16x32768), exact and int4 scoring keys
#              (COLOCATED_ARGS: more bench_tpot flags, e.g. --refresh-every 1,2,4)
#   pair       every topology side by side on a GPU pair at PAIR_SHAPES (default 8x32768 16x32768 32x16384):
#              PAIR_METHODS (full, quest, optimal, colocated, local, multiprocess; B=8 adds tova, oracle, inline),
#              int4 keys, P=9, PAIR_ARGS (default --refresh-every 1,4), Table 3 per shape
#   glu        the gate/up GEMV with the SiLU product in its epilogue (SPADE_FUSE_GLU): bench_gemv --glu
#              (kernel level, bit-identity checked), then TPOT under SPADE_FUSE_GLU=off / on alternated
#              GLU_ROUNDS times at GLU_SHAPES (default 8x32768 16x32768), GLU_METHODS (full, optimal, local)
#   long       long contexts (issue: hold optimal from 4k to 512k): TPOT of LONG_METHODS (full, quest, optimal,
#              asyncspade local and colocated) at LONG_SHAPES (default B=1 64k/128k/256k/512k, B=2 256k, B=4 128k,
#              B=8 64k, 8x32k, 16x32k, 32x16k; LONG_SHAPES=... to run a part), int4 keys, K=2k, P=LONG_PACKS (9), the top-K
#              fallback rate and Table 3 per shape (LONG_TOPK: policy.topk modes side by side, default the default;
#              LONG_ARGS: more bench_tpot flags, e.g. --refresh-every 1,4),
#              then benchmarks/long_context.py: one table, TPOT vs context at B=1 (Fig. 2(b)) and ratio plots
#   twostage   two-stage selection: TPOT + Table 3 of colocated and local asyncspade with policy.rerank and
#              policy.score_channels variants (TWOSTAGE_ARGS, default --rerank 1,2 --score-channels 0,64) beside
#              full / quest / optimal at TWOSTAGE_SHAPES (default 8x32768 16x32768 32x16384)
#   faults     tests/runtime/test_faults.py on the GPU, then benchmarks/soak.py: SOAK_STEPS (10000) decode steps of the
#              Qwen3-1.7B preset with a cache-rank fault (kill, stop, close) every ~SOAK_EVERY (400) steps, multiprocess
#              over nccl on a pair (colocated on one GPU; SOAK_TOPOLOGY), JSON + plot
#   serving    tests/serving/test_gpu.py, then bench_serving per SERVING_POLICIES (full asyncspade) on SERVING_TOPOLOGY
#              (colocated), SERVING_ARGS (default 8 requests of 8k-16k prompts, 200-256 outputs)
#   trace      the serving core's offline trace (TRACE_ARGS; Poisson arrivals, 16 paged slots): full and quest (one GPU
#              each, side by side), asyncspade colocated (default and the GPU config's settings, side by side) and
#              local, then the static step at 16 x 16k (contiguous and paged) for the pair target
#   bucket     the served decode step with few rows on exactly that many slots vs 16 (what batch-size buckets
#              could save; BUCKET_ROWS, BUCKET_POLICIES); in the background on GPU 1 when two are visible
#   serve      `spade serve` + the openai client: bench_serve per SERVE_POLICIES (full asyncspade) with SERVE_ARGS
#              (default 12 requests of 16000 tokens / 256 outputs at 0.5, 1, 2 req/s), idle TPOT and SLO rate, one plot
#   cli        `spade run --config CLI_CONFIG` (default configs/h100_qwen3_8b.yaml: one GPU, colocated) end to end
#   serve_long the same at long outputs: 16k prompts / 2048 outputs, 20 requests per rate, 16 paged slots with a
#              logical max_seq_len of 36000 (SERVE_POLICIES, SERVE_LONG_RATES, SERVE_LONG_ARGS e.g. --search 2;
#              one policy per device call)
#   paged      the paged KV cache: bench_paged (kernels), bench_tpot --block-size 0,16 at PAGED_SHAPES (default
#              8x32768 1x131072), a served trace with a contiguous, a paged and a half-memory paged cache
#   kv_layout  bench_kv_layout: gather / sparse / dense attention reads by KV layout, budgets KV_LAYOUT_K
#   ab         bench_tpot AB_ARGS (default: colocated c=32 and optimal at B=8 L=32k, int4, P=9) on this tree and on
#              the tree in AB_BASE (extract it before the call: git archive <commit> | tar -x -C old; untracked
#              folders travel), AB_ROUNDS rounds (default 2), each side first in turn, one process per run
#   pdl        programmatic dependent launch: every headline row at B=8 L=32k K=2k under each SPADE_PDL mode of
#              PDL_MODES (default all,decode,off; Table 3 runs under the first), side by side; then
#              one run per AB_ENVS entry (VAR=VALUE, default: the indexed attention's programs per SM), to
#              hold against the first run's default rows
#
# The asynchronous rows run P=$PACKS layers per pack (default 9: runtime.pack_layers auto for the 36-layer
# Qwen3-8B preset; HEADLINE_PACKS / LONG_PACKS for those stages).
#
# On the lent GPU machines (torch/triton/transformers preinstalled, no pydantic):
# carry `.whl` (made by ../shared/tools/gpu-wheels) and the script installs it.
# Results (JSON, PNG, logs, profiles) go to results/gpu; when $OUT is set (the
# device tool's folder, which returns at most 8 files) they are packed into
# $OUT/gpu_results.tgz at the end, with the console log beside it.
set -uo pipefail
cd "$(dirname "$0")/.."
RET=${OUT:-}
OUT=results/gpu
rm -rf "$OUT"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# NVLink multicast stays off (shared hosts): keep these set for every child process
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ] && ! python3 -c "import pydantic_settings" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests kernels gputests tpot transports)  # ~8 min on 2x H200
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/gpu.txt"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
rc=0
T0=$(date +%s)
run() {  # run NAME TIMEOUT CMD...
  local name=$1 t=$2; shift 2
  echo "=== $name (t+$(( $(date +%s) - T0 )) s): $*"
  local t0=$(date +%s)
  timeout -k 10 "$t" "$@" > "$OUT/$name.log" 2>&1
  local r=$?
  echo "=== $name: rc=$r in $(( $(date +%s) - t0 )) s"
  tail -n 30 "$OUT/$name.log"
  [ $r -ne 0 ] && rc=$r
  return 0
}
bg_pid=""
wheels() {  # wheels DIR: install carried wheels (ucx/nixl) into /tmp/site
  [ -d "$1" ] || { echo "no $1 carried"; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$1"/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
}
for s in "${stages[@]}"; do
  case $s in
    tests)
      if [ "$NGPU" -ge 2 ]; then  # beside the next stage, on the other GPU
        ( CUDA_VISIBLE_DEVICES=1 timeout -k 10 330 python3 -m pytest -q -p no:cacheprovider -n 4 --maxfail=20 \
            --timeout 150 ${TESTS:-tests/kernels tests/policies} > "$OUT/tests.log" 2>&1; echo "rc=$?" >> "$OUT/tests.log" ) &
        bg_pid=$!
        echo "=== tests: in the background on GPU 1 (pid $bg_pid)"
      else
        run tests 330 python3 -m pytest -q -p no:cacheprovider -n 4 --maxfail=20 --timeout 150 ${TESTS:-tests/kernels tests/policies}
      fi ;;
    kernels)
      run bench_scoring 130 env CUDA_VISIBLE_DEVICES=0 python3 -m benchmarks.bench_scoring --full --budget-s 110 \
        --out "$OUT/bench_scoring.json"
      run kernels 190 env CUDA_VISIBLE_DEVICES=0 python3 -m benchmarks.kernels --no-scoring --budget-s 170 \
        --out "$OUT/kernels.json" ;;
    scoring)  # the scoring kernels alone, quick shapes + variants (GEMV / int8 / select configs)
      run bench_scoring 130 env CUDA_VISIBLE_DEVICES=0 python3 -m benchmarks.bench_scoring --quick --budget-s 110 \
        --out "$OUT/bench_scoring.json" ;;
    scoring_full)  # the scoring kernels over the whole B x L x K grid (no variants)
      run bench_scoring_full 190 env CUDA_VISIBLE_DEVICES=0 python3 -m benchmarks.bench_scoring --full --budget-s 170 \
        --out "$OUT/bench_scoring_full.json" ;;
    select)  # the fused score + top-K stage by stage (cumulative graphs) and the radix-select launch grid
      run bench_select ${SELECT_TIMEOUT:-140} env CUDA_VISIBLE_DEVICES=0 python3 -m benchmarks.bench_select --budget-s 120 \
        ${SELECT_ARGS:-} --out "$OUT/bench_select.json" ;;
    softmax)  # sum_softmax's two passes (logits, finalize) under the launch configs of bench_scoring's SOFTMAX_SWEEP
      run bench_softmax ${SOFTMAX_TIMEOUT:-200} env CUDA_VISIBLE_DEVICES=0 python3 -m benchmarks.bench_scoring --no-grid \
        --softmax-sweep ${SOFTMAX_SHAPES:-16x16384,8x32768} --out "$OUT/bench_softmax.json" ;;
    kernels_sweep)
      run kernels_sweep 200 python3 -m benchmarks.kernels --no-scoring --sweep --shapes 8x32768 --budget-s 180 \
        --out "$OUT/kernels_sweep.json" ;;
    decode) run bench_decode 300 python3 -m benchmarks.bench_decode --linear ${DECODE_LINEAR:-auto,cublas} \
              ${DECODE_ARGS:-} --out "$OUT/bench_decode.json" ;;
    gemv)  # the decode projections: split-K Triton GEMV vs cuBLAS on the Qwen3-8B shapes
      run bench_gemv 150 env CUDA_VISIBLE_DEVICES=0 python3 -m benchmarks.bench_gemv --quick --out "$OUT/bench_gemv.json" ;;
    headline)  # issue #5's shape only, int4 keys, P=4, with device timelines and the cache rank's host account
      run bench_tpot_headline 300 python3 -m benchmarks.bench_tpot --batch 8 --context 32768 --budget 2048 \
            --packs ${HEADLINE_PACKS:-9} ${HEADLINE_ARGS:-} \
            --score-keys int4 --iters ${TPOT_ITERS:-30} --linear ${TPOT_LINEAR:-auto} \
            --methods full,quest,optimal,asyncspade/local,asyncspade/multiprocess \
            --profile-rows ${HEADLINE_PROFILE:-optimal,local_P4_int4,multiprocess_P4_int4} --budget-s 270 \
            --out "$OUT/bench_tpot_headline.json" ;;
    pdl)  # programmatic dependent launch A/B at issue #5's shape: every headline row under SPADE_PDL=auto and
          # off in one run; then one run per AB_ENVS setting (the step's other switches, each against the default)
      run bench_tpot_pdl 300 python3 -m benchmarks.bench_tpot --batch 8 --context 32768 --budget 2048 \
            --packs ${HEADLINE_PACKS:-9} --score-keys int4 --iters ${TPOT_ITERS:-30} \
            --methods full,quest,optimal,asyncspade/local,asyncspade/multiprocess --pdl ${PDL_MODES:-all,decode,off} \
            --profile-rows ${PDL_PROFILE:-none} --budget-s 270 --out "$OUT/bench_tpot_pdl.json"
      for ab in ${AB_ENVS:-SPADE_ATTN_PROGRAMS_PER_SM=3}; do
        run "bench_tpot_ab_${ab%%=*}" 200 env "$ab" python3 -m benchmarks.bench_tpot --batch 8 \
              --context 32768 --budget 2048 --packs ${PACKS:-9} --score-keys int4 --iters ${TPOT_ITERS:-30} \
              --methods full,optimal,asyncspade/local --budget-s 170 --no-plots \
              --out "$OUT/bench_tpot_ab_${ab%%=*}.json"
      done ;;
    large)  # the larger shapes of the cache / inference question (Table 3): B=16 L=32k and B=32 L=16k,
            # PDL on and off side by side
      for bl in ${LARGE_SHAPES:-16x32768 32x16384}; do
        run "bench_tpot_large_$bl" 200 python3 -m benchmarks.bench_tpot --batch ${bl%x*} --context ${bl#*x} \
              --budget 2048 --packs ${PACKS:-9} --score-keys int4 --iters ${TPOT_ITERS:-20} --pdl ${PDL_MODES:-all,decode,off} \
              --methods full,quest,optimal,asyncspade/local --budget-s 170 --no-plots \
              --out "$OUT/bench_tpot_large_$bl.json"
      done ;;
    topk)  # the threshold-carry top-K against the radix passes (policy.topk), side by side, with Table 3 per
           # mode: issue #5's shape with every row, then the larger shapes of the cache / inference question
      for bl in ${TOPK_SHAPES:-8x32768 16x32768 32x16384}; do
        m=${TOPK_METHODS:-full,quest,oracle,optimal,asyncspade/local}
        [ "$bl" = 8x32768 ] && m=${TOPK_METHODS_HEADLINE:-full,quest,oracle,optimal,asyncspade/local,asyncspade/multiprocess}
        run "bench_tpot_topk_$bl" ${TOPK_TIMEOUT:-200} python3 -m benchmarks.bench_tpot --batch ${bl%x*} \
              --context ${bl#*x} --budget 2048 --packs ${PACKS:-9} --score-keys int4 --iters ${TPOT_ITERS:-30} \
              --topk ${TOPK_MODES:-carry,radix} --methods "$m" --budget-s $(( ${TOPK_TIMEOUT:-200} - 30 )) --no-plots \
              --out "$OUT/bench_tpot_topk_$bl.json"
      done ;;
    carry_store)  # the compacted score store: its kernel tests on the GPU, then the step beside whole rows
      run test_carry 200 python3 -m pytest -q -p no:cacheprovider --timeout 120 tests/kernels/test_carry.py
      for bl in ${CARRY_STORE_SHAPES:-8x32768 16x16384}; do
        run "bench_tpot_store_$bl" ${CARRY_STORE_TIMEOUT:-200} python3 -m benchmarks.bench_tpot --preset qwen3-8b \
              --batch ${bl%x*} --context ${bl#*x} --budget 2048 --packs ${PACKS:-9} --score-keys int4 \
              --score-channels 32 --iters ${TPOT_ITERS:-16} --carry-store mark,compact \
              --methods optimal,asyncspade/colocated ${CARRY_STORE_ARGS:-} --budget-s $(( ${CARRY_STORE_TIMEOUT:-200} - 30 )) \
              --no-plots --out "$OUT/bench_tpot_store_$bl.json"
      done ;;
    colocated_gaps)  # the profiled steps of optimal and colocated, then the inference stream's account of each
      mkdir -p "$OUT/gaps"
      run bench_tpot_gaps 240 python3 -m benchmarks.bench_tpot --preset qwen3-8b --batch 8 --context 32768 \
            --budget 2048 --packs ${PACKS:-9} --score-keys int4 --score-channels 32 --iters 12 \
            --methods optimal,asyncspade/colocated --profile --profile-rows colocated_P${PACKS:-9}_int4_c32 \
            ${GAPS_ARGS:-} --no-plots --out "$OUT/gaps/bench_tpot_gaps.json"
      run trace_compare 60 python3 -m benchmarks.trace_summary "$OUT/gaps/profile_optimal_B8_L32768_K2048.json.gz" \
            --steps 4 --compare "$OUT/gaps/profile_colocated_P${PACKS:-9}_int4_c32_B8_L32768_K2048.json.gz" ;;
    overlap)  # layer j's select on a side stream beside layer j+1's scoring: kernel level, then TPOT + Table 3
      run bench_select_overlap ${OVERLAP_SELECT_TIMEOUT:-150} env CUDA_VISIBLE_DEVICES=0 python3 -m benchmarks.bench_select \
        --shapes "$(echo ${OVERLAP_SHAPES:-8x32768 16x32768 32x16384} | tr ' ' ,)" --keys int4 --no-grid \
        --carry default --overlap "${OVERLAP_SPECS:-0,4,8,16,0:-1}" --budget-s $(( ${OVERLAP_SELECT_TIMEOUT:-150} - 20 )) \
        --out "$OUT/bench_select_overlap.json"
      for bl in ${OVERLAP_SHAPES:-8x32768 16x32768 32x16384}; do
        m=${OVERLAP_METHODS:-optimal,asyncspade/local}
        [ "$bl" = 8x32768 ] && m=${OVERLAP_METHODS_HEADLINE:-full,quest,optimal,asyncspade/local}
        run "bench_tpot_overlap_$bl" ${OVERLAP_TIMEOUT:-170} python3 -m benchmarks.bench_tpot --batch ${bl%x*} \
              --context ${bl#*x} --budget 2048 --packs ${PACKS:-9} --score-keys int4 --iters ${TPOT_ITERS:-30} \
              --select-overlap ${OVERLAP_MODES:-off,on} --methods "$m" --budget-s $(( ${OVERLAP_TIMEOUT:-170} - 30 )) \
              --no-plots --out "$OUT/bench_tpot_overlap_$bl.json"
      done ;;
    p2p_channels)  # the multiprocess (nccl) row under NCCL_MAX_P2P_NCHANNELS values (P2P_CHANNELS; "default":
                   # unset): NCCL's send / recv kernels hold an SM per channel while they wait for the peer
      for c in ${P2P_CHANNELS:-default 1 2}; do
        if [ "$c" = default ]; then envs=(env -u NCCL_MAX_P2P_NCHANNELS); else envs=(env NCCL_MAX_P2P_NCHANNELS=$c); fi
        run "bench_tpot_p2p_$c" 150 "${envs[@]}" python3 -m benchmarks.bench_tpot --batch 8 --context 32768 \
              --budget 2048 --packs ${PACKS:-9} --score-keys int4 --iters ${TPOT_ITERS:-50} \
              --methods optimal,asyncspade/local,asyncspade/multiprocess --budget-s 130 --no-plots \
              --out "$OUT/bench_tpot_p2p_$c.json"
      done ;;
    tpot) run bench_tpot 290 python3 -m benchmarks.bench_tpot --quick --score-keys exact,int8,int4 --iters ${TPOT_ITERS:-20} \
            --profile --budget-s 260 --out "$OUT/bench_tpot.json" ;;
    sweep) run bench_tpot_sweep $(( ${SWEEP_S:-510} + 30 )) python3 -m benchmarks.bench_tpot \
             --batch ${SWEEP_B:-8,1,16,32} --context ${SWEEP_L:-32768,16384,65536} \
             --budget 2048,1024 --packs ${PACKS:-9} --score-keys ${SWEEP_KEYS:-int8,int4} --iters 10 \
             --methods full,quest,asyncspade/inline,asyncspade/local,asyncspade/multiprocess,optimal --budget-s ${SWEEP_S:-510} \
             --out "$OUT/bench_tpot_sweep.json" ;;
    colocated)  # the one-GPU topology: the cache rank on a side stream of the inference GPU, beside optimal / full /
                # quest / inline at COLOCATED_SHAPES, exact and int4 scoring keys (its reads share the GPU's HBM)
      for bl in ${COLOCATED_SHAPES:-1x32768 8x32768 16x32768}; do
        run "bench_tpot_colocated_$bl" ${COLOCATED_TIMEOUT:-180} python3 -m benchmarks.bench_tpot --batch ${bl%x*} \
              --context ${bl#*x} --budget 2048 --packs ${PACKS:-9} --score-keys ${COLOCATED_KEYS:-exact,int4} \
              --iters ${TPOT_ITERS:-30} --methods ${COLOCATED_METHODS:-full,quest,optimal,asyncspade/inline,asyncspade/colocated} \
              --budget-s $(( ${COLOCATED_TIMEOUT:-180} - 30 )) ${COLOCATED_ARGS:-} --no-plots \
              --out "$OUT/bench_tpot_colocated_$bl.json"
      done ;;
    pair)  # every topology on the pair, the select beside the next layer's scoring (the default) and refresh_every
      for bl in ${PAIR_SHAPES:-8x32768 16x32768 32x16384}; do
        m=${PAIR_METHODS:-full,quest,optimal,asyncspade/colocated,asyncspade/local,asyncspade/multiprocess}
        [ "$bl" = 8x32768 ] && m=${PAIR_METHODS_HEADLINE:-full,quest,tova,oracle,optimal,asyncspade/inline,asyncspade/colocated,asyncspade/local,asyncspade/multiprocess}
        run "bench_tpot_pair_$bl" ${PAIR_TIMEOUT:-200} python3 -m benchmarks.bench_tpot --batch ${bl%x*} \
              --context ${bl#*x} --budget 2048 --packs ${PACKS:-9} --score-keys int4 --iters ${TPOT_ITERS:-30} \
              --methods "$m" ${PAIR_ARGS:---refresh-every 1,4} --budget-s $(( ${PAIR_TIMEOUT:-200} - 30 )) \
              --no-plots --out "$OUT/bench_tpot_pair_$bl.json"
      done ;;
    glu)  # fused gate/up + SiLU product vs two launches: kernel level, then the step, off / on alternated
      run bench_gemv_glu 120 env CUDA_VISIBLE_DEVICES=0 python3 -m benchmarks.bench_gemv --glu --shapes gate_up \
        --out "$OUT/bench_gemv_glu.json"
      for bl in ${GLU_SHAPES:-8x32768 16x32768}; do
        for r in $(seq 1 ${GLU_ROUNDS:-2}); do
          for f in off on; do
            run "bench_tpot_glu_${bl}_${f}_$r" ${GLU_TIMEOUT:-120} env SPADE_FUSE_GLU=$f python3 -m benchmarks.bench_tpot \
              --batch ${bl%x*} --context ${bl#*x} --budget 2048 --packs ${PACKS:-9} --score-keys int4 --iters ${TPOT_ITERS:-40} \
              --methods ${GLU_METHODS:-full,optimal,asyncspade/local} --budget-s $(( ${GLU_TIMEOUT:-120} - 20 )) \
              --no-plots --out "$OUT/bench_tpot_glu_${bl}_${f}_$r.json"
          done
        done
      done ;;
    long)  # every method against context length; the 512k-token shapes need ~100 GB on the inference GPU
      for bl in ${LONG_SHAPES:-1x65536 1x131072 1x262144 1x524288 2x262144 4x131072 8x65536 8x32768 16x32768 32x16384}; do
        run "bench_tpot_long_$bl" ${LONG_TIMEOUT:-150} python3 -m benchmarks.bench_tpot --batch ${bl%x*} \
              --context ${bl#*x} --budget 2048 --packs ${LONG_PACKS:-9} --score-keys int4 --iters ${TPOT_ITERS:-20} \
              --methods ${LONG_METHODS:-full,quest,optimal,asyncspade/local,asyncspade/colocated} \
              ${LONG_TOPK:+--topk $LONG_TOPK} ${LONG_ARGS:-} --budget-s $(( ${LONG_TIMEOUT:-150} - 20 )) --no-plots \
              --out "$OUT/bench_tpot_long_$bl.json"
      done
      run long_context 60 python3 -m benchmarks.long_context "$OUT"/bench_tpot_long_*.json \
        --out "$OUT/long_context.json" ;;
    twostage)  # two-stage selection (policy.rerank m, policy.score_channels r) on one GPU (colocated) and a pair
               # (local) beside full / quest / optimal at TWOSTAGE_SHAPES, int4 keys, K=2k, P=4, Table 3 per row
      for bl in ${TWOSTAGE_SHAPES:-8x32768 16x32768 32x16384}; do
        run "bench_tpot_twostage_$bl" ${TWOSTAGE_TIMEOUT:-150} python3 -m benchmarks.bench_tpot --batch ${bl%x*} \
              --context ${bl#*x} --budget 2048 --packs ${PACKS:-9} --score-keys int4 --iters ${TPOT_ITERS:-16} \
              --methods ${TWOSTAGE_METHODS:-full,quest,optimal,asyncspade/colocated,asyncspade/local} \
              ${TWOSTAGE_ARGS:---rerank 1,2 --score-channels 0,64} --budget-s $(( ${TWOSTAGE_TIMEOUT:-150} - 20 )) \
              --no-plots --out "$OUT/bench_tpot_twostage_$bl.json"
      done ;;
    faults)  # the fault-injection suite on the GPU (nccl between GPUs), then a soak of SOAK_STEPS decode steps with a
             # cache-rank fault every ~SOAK_EVERY steps: SOAK_TOPOLOGY (default multiprocess over nccl; colocated on one GPU)
      run fault_tests ${FAULTS_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider --timeout 300 tests/runtime/test_faults.py
      topo=${SOAK_TOPOLOGY:-$([ "$NGPU" -ge 2 ] && echo multiprocess || echo colocated)}
      run "soak_$topo" ${SOAK_TIMEOUT:-480} python3 -m benchmarks.soak --preset ${SOAK_PRESET:-qwen3-1.7b} --device cuda:0 \
        --dtype bfloat16 --topology "$topo" --transport nccl --batch 4 --prompt-len 2048 --budget 256 \
        --steps ${SOAK_STEPS:-10000} --steps-per-request ${SOAK_PER_REQUEST:-2500} --fault-every ${SOAK_EVERY:-400} \
        --faults ${SOAK_FAULTS:-$([ "$topo" = multiprocess ] && echo kill,stop || echo kill,stop,close)} --peer-deadline-s 15 --threads 0 ${SOAK_ARGS:-} \
        --out "$OUT/soak_gpu_$topo.json" ;;
    cli)  # the CLI end to end on this GPU: `spade run` with the single-GPU config (CLI_CONFIG; random-weight
          # Qwen3-8B shape, colocated asyncspade, ~32k-token prompt), its summary JSON kept
      run spade_run ${CLI_TIMEOUT:-240} python3 -m spade.cli run --config ${CLI_CONFIG:-configs/h100_qwen3_8b.yaml} \
        ${CLI_ARGS:-} --out "$OUT/spade_run.json" ;;
    serving)  # spade.AsyncEngine on this GPU: the serving GPU tests, then an offline trace (SERVING_ARGS) per policy
      run serving_tests 240 python3 -m pytest -q -p no:cacheprovider --timeout 200 tests/serving/test_gpu.py
      for p in ${SERVING_POLICIES:-full asyncspade}; do
        extra=$([ "$p" = asyncspade ] && echo "--set policy.score_keys=int4 --set policy.group_reduce=sum_logits")
        run "bench_serving_$p" ${SERVING_TIMEOUT:-150} python3 -m benchmarks.bench_serving --preset qwen3-8b \
          --device cuda:0 --topology ${SERVING_TOPOLOGY:-colocated} --max-batch 8 --policies "$p" $extra \
          ${SERVING_ARGS:---requests 8 --prompt-min 8192 --prompt-max 16384 --out-min 200 --out-max 256 --max-seq-len 16640 --budget 2048} \
          --out "$OUT/bench_serving_$p.json"
      done ;;
    trace)  # the serving core's offline trace (issue workload, TRACE_ARGS: Poisson arrivals, 8k-24k prompts, 512-2048
            # outputs, 16 paged slots) for TRACE_ROWS (default: full and quest on one GPU each, side by side, then
            # asyncspade colocated (library default) beside gpucfg (the GPU config's sum_logits settings), one GPU
            # each, then local on the pair; TRACE_AS: asyncspade's extra settings, TRACE_TAG: a
            # file suffix), with a kernel profile of TRACE_PROFILE decode steps once all have joined (default 0: the
            # profiler's stop holds the scheduler for seconds, so a profiled row's tok/s is not comparable); then the
            # static step at 16 x 16k (TRACE_STATIC_METHODS, contiguous and paged; TRACE_STATIC_ARGS) for the pair's
            # "p50 TPOT <= 1.15x static optimal" target (TRACE_STATIC=0 skips it); TRACE_MSL: the logical
            # model.max_seq_len (default 26624 = the longest prompt + output; the KV pool stays TRACE_BLOCKS)
      TA=${TRACE_ARGS:---requests 32 --rate 1 --prompt-min 8192 --prompt-max 24576 --out-min 512 --out-max 2048}
      TS="--preset qwen3-8b --max-batch 16 --max-seq-len ${TRACE_MSL:-26624} --budget 2048 --set model.block_size=16 \
          --set model.kv_blocks=${TRACE_BLOCKS:-18000} --profile-steps ${TRACE_PROFILE:-0} $TA"
      AS="--set policy.score_keys=int4 --set runtime.pack_layers=auto ${TRACE_AS:-}"
      TG=${TRACE_TAG:-}
      rows=" ${TRACE_ROWS:-full quest colocated gpucfg local} "
      t_full=""
      if [[ $rows == *" full "* ]]; then
        run trace_full$TG 400 env CUDA_VISIBLE_DEVICES=0 python3 -m benchmarks.bench_serving $TS --device cuda:0 \
          --topology colocated --policies full --out "$OUT/trace_full$TG.json" &
        t_full=$!
      fi
      if [[ $rows == *" quest "* ]]; then
        gpu=$([ "$NGPU" -ge 2 ] && [ -n "$t_full" ] && echo 1 || echo 0)
        [ "$gpu" = 0 ] && [ -n "$t_full" ] && wait $t_full && t_full=""  # one GPU: one row at a time
        run trace_quest$TG 400 env CUDA_VISIBLE_DEVICES=$gpu python3 -m benchmarks.bench_serving $TS --device cuda:0 \
          --topology colocated --policies quest --out "$OUT/trace_quest$TG.json"
      fi
      [ -n "$t_full" ] && wait $t_full
      t_co=""
      if [[ $rows == *" colocated "* ]]; then
        run trace_colocated$TG 400 env CUDA_VISIBLE_DEVICES=0 python3 -m benchmarks.bench_serving $TS --device cuda:0 \
          --topology colocated --policies asyncspade $AS --out "$OUT/trace_colocated$TG.json" &
        t_co=$!
      fi
      if [[ $rows == *" gpucfg "* ]]; then  # the GPU config's one-GPU settings (configs/h100_qwen3_8b.yaml)
        gpu=$([ "$NGPU" -ge 2 ] && [ -n "$t_co" ] && echo 1 || echo 0)
        [ "$gpu" = 0 ] && [ -n "$t_co" ] && wait $t_co && t_co=""
        if [ "$gpu" = 1 ] && [ -n "$bg_pid" ]; then wait "$bg_pid"; echo "=== background stage done"; bg_pid=""; fi
        run trace_gpucfg$TG 400 env CUDA_VISIBLE_DEVICES=$gpu python3 -m benchmarks.bench_serving $TS --device cuda:0 \
          --topology colocated --policies asyncspade $AS --set policy.group_reduce=sum_logits \
          --set policy.rope_aware=false --set policy.recent_tokens=64 --out "$OUT/trace_gpucfg$TG.json"
      fi
      [ -n "$t_co" ] && wait $t_co
      if [[ $rows == *" local "* ]] && [ "$NGPU" -ge 2 ]; then
        if [ -n "$bg_pid" ]; then wait "$bg_pid"; echo "=== background stage done"; bg_pid=""; fi  # needs both GPUs
        run trace_local$TG 400 python3 -m benchmarks.bench_serving $TS --device cuda:0 --topology local \
          --policies asyncspade $AS --out "$OUT/trace_local$TG.json"
      fi
      if [ "${TRACE_STATIC:-1}" != 0 ]; then
        run trace_static$TG 300 python3 -m benchmarks.bench_tpot --batch 16 --context ${TRACE_STATIC_L:-16384} --budget 2048 \
          --packs ${PACKS:-9} --score-keys int4 --iters 24 --no-plots ${TRACE_STATIC_ARGS:---block-size 0,16} \
          --methods ${TRACE_STATIC_METHODS:-full,optimal,asyncspade/colocated,asyncspade/local} --out "$OUT/trace_static$TG.json"
      fi ;;
    bucket)  # what a decode step per batch-size bucket could save (issue 22): BUCKET_ROWS requests at once (8k prompts,
             # 256 outputs, paged) on exactly that many slots vs on 16 (the engine always steps max_batch rows), per
             # BUCKET_POLICIES (asyncspade colocated with int4 keys, full); BUCKET_PROFILE: a kernel profile of that many
             # decode steps (its stop holds the scheduler: compare unprofiled rows); on GPU 1 in the background when two
             # GPUs are visible (trace's local row waits for it)
      bucket_runs() {
        for p in ${BUCKET_POLICIES:-asyncspade full}; do
          extra=$([ "$p" = asyncspade ] && echo "--set policy.score_keys=int4 --set runtime.pack_layers=auto")
          for n in ${BUCKET_ROWS:-1 4}; do
            for mb in $n 16; do
              run "bucket_${p}_${n}of$mb" 150 env CUDA_VISIBLE_DEVICES=$1 python3 -m benchmarks.bench_serving \
                --preset qwen3-8b --device cuda:0 --topology colocated --policies "$p" $extra --max-batch $mb \
                --requests $n --rate inf --prompt-min 8192 --prompt-max 8192 --out-min 256 --out-max 256 \
                --max-seq-len 8704 --budget 2048 --set model.block_size=16 --profile-steps ${BUCKET_PROFILE:-0} \
                --out "$OUT/bucket_${p}_${n}of$mb.json"
            done
          done
        done
      }
      if [ "$NGPU" -ge 2 ]; then
        bucket_runs 1 > "$OUT/bucket.log" 2>&1 &
        bg_pid=$!
        echo "=== bucket: in the background on GPU 1 (pid $bg_pid)"
      else
        bucket_runs 0
      fi ;;
    serve)  # `spade serve` under the openai client: a request-rate sweep per policy (SERVE_POLICIES) with the idle
            # TPOT and the highest rate within 2x it (SERVE_ARGS), then one plot; needs the serve wheels in .whl
      for p in ${SERVE_POLICIES:-full asyncspade}; do
        run "bench_serve_$p" ${SERVE_TIMEOUT:-280} python3 -m benchmarks.bench_serve --config ${SERVE_CONFIG:-configs/h100_qwen3_8b.yaml} \
          --set serving.max_batch=8 --set serve.max_waiting=256 --policies "$p" \
          ${SERVE_ARGS:---input-len 16000 --output-len 256 --num-prompts 12 --rates 0.5,1,2} --out "$OUT/bench_serve_$p.json"
      done
      run bench_serve_plot 60 python3 -m benchmarks.bench_serve --plot "$OUT/bench_serve.png" \
        --plot-from $(for p in ${SERVE_POLICIES:-full asyncspade}; do echo "$OUT/bench_serve_$p.json"; done) ;;
    guidellm)  # `spade serve` driven by guidellm 0.8.1 (its wheels carried in .whl_guidellm beside .whl; docs/serve.md),
               # one policy per GUIDELLM_POLICIES entry, 16k prompts, SERVE_ARGS-like GUIDELLM_ARGS
      wheels .whl_guidellm || { rc=3; continue; }
      run bench_guidellm ${GUIDELLM_TIMEOUT:-560} python3 -m benchmarks.bench_guidellm --guidellm "python3 -m guidellm" \
        --config ${SERVE_CONFIG:-configs/h100_qwen3_8b.yaml} --set serving.max_batch=8 --set serve.max_waiting=256 \
        --policies ${GUIDELLM_POLICIES:-full,asyncspade} \
        ${GUIDELLM_ARGS:---input-len 16000 --output-len 256 --num-prompts 12 --rates 0.5,1} --out "$OUT/bench_guidellm.json" ;;
    serve_long)  # long outputs (16k prompts, 2048 outputs) on 16 paged slots with a logical max_seq_len of 36000
                 # (no wave admission under the shared write cursor), SERVE_LONG_RATES; one policy per call fits 10 min
                 # on one GPU; with two GPUs visible the policies run side by side, one GPU each
      i=0; pids=""
      for p in ${SERVE_POLICIES:-full asyncspade}; do
        gpu=$(( NGPU >= 2 ? i % NGPU : 0 ))
        cmd=(run "bench_serve_long_$p" ${SERVE_TIMEOUT:-580} env CUDA_VISIBLE_DEVICES=$gpu python3 -m benchmarks.bench_serve \
          --config ${SERVE_CONFIG:-configs/h100_qwen3_8b.yaml} \
          --set serving.max_batch=16 --set model.max_seq_len=36000 --set model.block_size=16 --set model.kv_blocks=18112 \
          --set serve.max_waiting=256 --policies "$p" --input-len 16000 --output-len 2048 --num-prompts 20 \
          --rates ${SERVE_LONG_RATES:-0.25,0.4} ${SERVE_LONG_ARGS:-} --out "$OUT/bench_serve_long_$p.json")
        if [ "$NGPU" -ge 2 ]; then "${cmd[@]}" & pids="$pids $!"; else "${cmd[@]}"; fi
        i=$((i + 1))
      done
      [ -n "$pids" ] && wait $pids ;;
    paged)  # the paged KV cache: its kernels against the contiguous ones, the whole step (PAGED_SHAPES, contiguous
            # and 16-token blocks side by side), then a served trace contiguous / paged / paged at half the memory
      run bench_paged 150 python3 -m benchmarks.bench_paged --graph --out "$OUT/bench_paged.json"
      for shape in ${PAGED_SHAPES:-8x32768 1x131072}; do
        run "tpot_paged_$shape" 200 python3 -m benchmarks.bench_tpot --batch ${shape%x*} --context ${shape#*x} \
          --budget 2048 --packs ${PACKS:-9} --score-keys int4 --iters 32 --no-plots --block-size 0,16 \
          --methods ${PAGED_METHODS:-full,optimal,asyncspade/colocated,asyncspade/local} --out "$OUT/tpot_paged_$shape.json"
      done
      PS="--preset qwen3-8b --device cuda:0 --topology colocated --max-batch 16 --prompt-min 12288 --prompt-max 16384 \
          --max-seq-len 17408 --budget 2048 --policies asyncspade --set policy.score_keys=int4 --set policy.group_reduce=sum_logits"
      for kv in contig paged paged_half; do
        extra=$(case $kv in paged) echo "--set model.block_size=16";; paged_half) echo "--set model.block_size=16 --set model.kv_blocks=8705";; esac)
        run "serving_${kv}_warm" 80 python3 -m benchmarks.bench_serving $PS $extra --requests 3 --out-min 24 --out-max 32 \
          --out "$OUT/serving_${kv}_warm.json"
        run "serving_$kv" 140 python3 -m benchmarks.bench_serving $PS $extra --requests 16 --out-min 768 --out-max 1024 \
          --out "$OUT/serving_$kv.json"
      done ;;
    prefill)  # the serving prompt pass (FastModel.prefill_row) whole and in pieces, against its FLOP floor, with a
              # kernel profile by class; contiguous, then paged (PREFILL_LENGTHS, PREFILL_CHUNKS)
      for bs in 0 16; do
        run "bench_prefill_bs$bs" 200 python3 -m benchmarks.bench_prefill --lengths ${PREFILL_LENGTHS:-4096,16384,32768} \
          --chunks ${PREFILL_CHUNKS:-0,2048,512} $( [ $bs -gt 0 ] && echo "--block-size $bs" ) --profile \
          --out "$OUT/bench_prefill_bs$bs.json"
      done ;;
    prefill_fresh)  # the prompt pass at lengths never run before (a served trace's prompts), paged 16-token blocks
      run bench_prefill_fresh 200 python3 -m benchmarks.bench_prefill --lengths ${PREFILL_LENGTHS:-4096,8192,16384} \
        --chunks 0,2048 --iters 3 --fresh --block-size 16 --out "$OUT/bench_prefill_fresh.json" ;;
    syncs)  # host synchronisations of a served trace by Python line, per policy (SYNCS_POLICIES)
      for p in ${SYNCS_POLICIES:-full:inline asyncspade:colocated}; do
        run "bench_syncs_${p%%:*}" 120 python3 -m benchmarks.bench_syncs --policy "${p%%:*}" --topology "${p##*:}" \
          --out "$OUT/bench_syncs_${p%%:*}.json"
      done ;;
    kv_layout)  # the sparse attention's scattered reads by KV layout and budget (marginal rate), L2 flushed
      run bench_kv_layout 150 env CUDA_VISIBLE_DEVICES=0 python3 -m benchmarks.bench_kv_layout \
        --K ${KV_LAYOUT_K:-512,1024,2048,4096} ${KV_LAYOUT_ARGS:-} --out "$OUT/bench_kv_layout.json" ;;
    gputests)
      [ -n "$bg_pid" ] && { wait "$bg_pid"; echo "=== tests (background) done"; tail -n 15 "$OUT/tests.log"; bg_pid=""; }
      run gputests 240 env NCCL_DEBUG=WARN python3 -m pytest -v -p no:cacheprovider --timeout 90 -m "gpu or multigpu" tests ;;
    transports) run bench_transports 100 python3 -m benchmarks.bench_transports --transports local,raw_nccl,nccl \
                  --budget-s 90 --out "$OUT/bench_transports.json" ;;
    ucx|nixl)  # carried wheels: .whl_ucx (ucxx-cu13 and its libraries) / .whl_nixl (nixl-cu13), one per call (size)
      wheels ".whl_$s" || { rc=3; continue; }
      run "contract_$s" 150 python3 -m pytest -v -p no:cacheprovider --timeout 60 -k "$s" \
        tests/transports/test_contract.py tests/runtime/test_transports_runtime.py
      run "bench_transports_$s" 120 python3 -m benchmarks.bench_transports --transports "$s,raw_nccl" --budget-s 110 \
        --out "$OUT/bench_transports_$s.json" ;;
    ab)  # this tree against a base tree (AB_BASE: an extracted `git archive`), alternated, one process per run
      if [ ! -d "${AB_BASE:-}/spade" ]; then
        echo "=== ab: AB_BASE must name a base tree, e.g. git archive <commit> | tar -x -C old (untracked: it travels)"
        rc=2; continue
      fi
      base=$(cd "$AB_BASE" && pwd); here=$PWD
      for i in $(seq 1 "${AB_ROUNDS:-2}"); do
        order="base tree"; [ $((i % 2)) -eq 0 ] && order="tree base"  # each side goes first in turn
        for side in $order; do
          dir=$here; [ "$side" = base ] && dir=$base
          # python -m puts the working folder first on sys.path: each side runs from its own tree
          run "ab_${side}_$i" "${AB_TIMEOUT:-280}" bash -c 'cd "$0" && exec "$@"' "$dir" env PYTHONPATH="$dir:$PYTHONPATH" \
            python3 -m benchmarks.bench_tpot ${AB_ARGS:---batch 8 --context 32768 --budget 2048 --packs 9 --score-keys int4 --score-channels 32 --iters 20 --methods optimal,asyncspade/colocated} \
            --no-plots --out "$here/$OUT/ab_${side}_$i.json"
          grep -E "^  (optimal|full|quest|asyncspade)" "$OUT/ab_${side}_$i.log" | sed "s/^/=== ab $side $i: /"
        done
      done ;;
    *) echo "unknown stage $s"; rc=2 ;;
  esac
done
if [ -n "$bg_pid" ]; then wait "$bg_pid"; echo "=== background stage done"; tail -n 15 "$OUT/tests.log" 2>/dev/null; fi
echo "=== total $(( $(date +%s) - T0 )) s"
if [ -n "$RET" ]; then
  tar czf "$RET/gpu_results.tgz" -C results gpu && echo "packed $(ls "$OUT" | wc -l) files into \$OUT/gpu_results.tgz"
fi
exit $rc
