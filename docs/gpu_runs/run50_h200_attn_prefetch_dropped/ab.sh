export PYTHONPATH=$PWD; python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention.py -k "prefetch or qwen or graph_replay or hopper" 2>&1 | tail -3
for bl in 8x32768 16x32768 32x16384; do
  for pf in none 0.25 0.5 1 1:normal none; do
    if [ $pf = none ]; then e="env -u SPADE_ATTN_PREFETCH"; else e="env SPADE_ATTN_PREFETCH=${pf%%:*}"; fi
    [ "${pf#*:}" = normal ] && e="$e SPADE_ATTN_PREFETCH_EVICT=normal"
    [ $bl != 8x32768 ] && [ $pf != none ] && [ $pf != 1 ] && continue
    r=$($e python3 -m benchmarks.bench_tpot --batch ${bl%x*} --context ${bl#*x} --budget 2048 --packs 4 --score-keys int4 --iters 50 --methods optimal --no-plots --out $OUT/ab_${bl}_$pf.json 2>&1 | grep -E "^\s+optimal ")
    echo "$bl pf=$pf $r"
  done
done
