"""How often the threshold-carry top-K falls back on real weights.

The carry (``score_topk(..., carry=)``, ``policy.topk: carry``) selects among the
scores above the previous step's threshold and falls back to the whole row when
their count leaves ``[k_top, CAP]``: a fallback costs ~3x the radix path on a GPU
(docs/perf.md, session 7), so the rate decides what the carry is worth. On the
random-weight benchmark model it was 3-4% of the cache rank's calls with the
predicted query and most calls with the oracle's true query; this measures it on a
real model's queries and keys.

One dense teacher-forced pass over an essay captures every layer's post-RoPE
queries and keys (``spade.eval.capture``); then, for consecutive decode
positions ``t``, each sampled layer selects the middle ``[sink, t + 1 - recent)``
of the cache ``k[:, :t + 1]`` with the Triton kernel (the CPU interpreter here),
one carry per (layer, method, budget), for:

* ``oracle``: the true query ``q_t``;
* ``asyncspade/<predictor>``: ``q̂_t`` predicted from the W + 1 queries before
  ``t`` (``spade.policies.predictors.predict``; post-RoPE, as ``rope_aware=false``).

Reported per method and budget: the fallback rate over the calls after each
carry's first (which always falls back: it has no threshold yet).

    python -m benchmarks.carry_rate [--model smollm2-135m] [--context 2048] [--steps 48]
                                    [--budgets 128,256] [--layer-stride 3] [--out results/carry_rate.json]
    python -m benchmarks.carry_rate --tiny   # random tiny model: checks the script in seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a registered offline model (spade.hf)")
    ap.add_argument("--context", type=int, default=2048, help="essay tokens captured (the last step's cache)")
    ap.add_argument("--steps", type=int, default=48, help="consecutive decode positions, ending at --context")
    ap.add_argument("--budgets", default="128,256", help="K per KV head, sinks and recent window included")
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--recent", type=int, default=16)
    ap.add_argument("--window", type=int, default=16, help="W of the predictors")
    ap.add_argument("--predictors", default="assembled,last")
    ap.add_argument("--group-reduce", default="sum_logits", choices=["sum_logits", "max_logits", "sum_softmax"])
    ap.add_argument("--layer-stride", type=int, default=3, help="every n-th layer (from 0)")
    ap.add_argument("--tiny", action="store_true", help="a random 2-layer model and a short context")
    ap.add_argument("--out", default="results/carry_rate.json")
    a = ap.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported: CPU runs them here
    import torch

    from spade.kernels import scoring
    from spade.kernels.carry import CARRY_MARGIN, carry_stats, new_carry
    from spade.policies.predictors import predict

    torch.manual_seed(0)
    if a.tiny:
        Hq, Hkv, D, n_layers = 4, 2, 16, 2
        a.context, a.steps, a.layer_stride = 160, 6, 1
        budgets = [32]
        g = torch.Generator().manual_seed(1)
        drift = torch.randn(n_layers, Hq, 1, D, generator=g)
        qs = [drift[i] + 0.3 * torch.randn(Hq, a.context, D, generator=g) for i in range(n_layers)]
        ks = [torch.randn(Hkv, a.context, D, generator=g) for _ in range(n_layers)]
        model_name = "tiny (random)"
    else:
        from spade.eval.capture import capture_qk
        from spade.eval.common import essay_token_segments, load_model

        model, tok = load_model(a.model, "cpu")
        ids = essay_token_segments(tok, a.context, 1)[0]
        t0 = time.time()
        with torch.no_grad():
            cap = capture_qk(model, ids)
        print(f"# captured {len(cap.q)} layers x {a.context} tokens in {time.time() - t0:.1f} s", flush=True)
        qs, ks = cap.q, cap.k
        Hq, D = qs[0].shape[0], qs[0].shape[2]
        Hkv = ks[0].shape[0]
        budgets = [int(x) for x in a.budgets.split(",") if x]
        model_name = a.model
    layers = list(range(0, len(qs), a.layer_stride))
    methods = ["oracle"] + [f"asyncspade/{p}" for p in a.predictors.split(",") if p]
    scale = D ** -0.5
    first = a.context - a.steps
    if first <= a.window + 1 + a.sink + a.recent or any(b - a.sink - a.recent <= 0 for b in budgets):
        raise SystemExit(f"--context {a.context} / --steps {a.steps} / --budgets {budgets}: leave room for the "
                         f"window ({a.window + 1}), sinks ({a.sink}) and recent tokens ({a.recent})")
    rows = []
    t_start = time.time()
    total = len(layers) * len(methods) * len(budgets)
    for n, (layer, method, K) in enumerate(((lay, m, b) for lay in layers for m in methods for b in budgets)):
        q_all, k_all = qs[layer].float(), ks[layer].float()  # [Hq, T, D], [Hkv, T, D]
        carry = new_carry(1, Hkv, "cpu")
        k_top = K - a.sink - a.recent
        for t in range(first, a.context):
            if method == "oracle":
                q = q_all[:, t]
            else:
                w = q_all[:, t - a.window - 1:t][None]  # [1, Hq, W + 1, D]: the queries before t
                q = predict(w, a.window + 1, method.split("/")[1])[0]
            lo = torch.tensor([a.sink])
            hi = torch.tensor([t + 1 - a.recent])
            scoring.score_topk_triton(q[None], k_all[None, :, :t + 1], lo, hi, k_top, scale=scale,
                                      reduce=a.group_reduce, kv_lens=torch.tensor([t + 1]), carry=carry)
            if t == first:  # the first call always falls back (no threshold yet): count from the second on
                base = carry_stats(carry)
        st = carry_stats(carry)
        calls, fb = st["calls"] - base["calls"], st["fallbacks"] - base["fallbacks"]
        rows.append(dict(layer=layer, method=method, budget=K, calls=calls, fallbacks=fb,
                         fallback_rate=fb / calls if calls else 0.0))
        print(f"  [{n + 1}/{total}, {time.time() - t_start:.0f} s] layer {layer:>2} {method:<22} K={K:<4} "
              f"fallbacks {fb}/{calls}", flush=True)
    summary = {}
    for method in methods:
        for K in budgets:
            sel = [r for r in rows if r["method"] == method and r["budget"] == K]
            calls = sum(r["calls"] for r in sel)
            fb = sum(r["fallbacks"] for r in sel)
            summary[f"{method}/K={K}"] = dict(calls=calls, fallbacks=fb, fallback_rate=fb / calls if calls else 0.0)
            print(f"# {method:<22} K={K:<4} fallback rate {fb / max(calls, 1):.1%} ({fb} of {calls} row selections, "
                  f"layers {layers[0]}..{layers[-1]} step {a.layer_stride}, {a.steps - 1} steps after the first)",
                  flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": dict(model=model_name, context=a.context, steps=a.steps, budgets=budgets,
                                            sink=a.sink, recent=a.recent, window=a.window,
                                            group_reduce=a.group_reduce, layers=layers,
                                            margin=CARRY_MARGIN, wall_s=time.time() - t_start),
                               "summary": summary, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
