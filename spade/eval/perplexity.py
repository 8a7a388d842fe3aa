"""Measurement 2: perplexity of essay text under each policy vs full attention.

``spade.teacher`` runs a whole sequence with every layer attending, at each
position ``t >= prefill_tokens``, exactly what the policy would select at decode
step ``t`` (its logits match token-by-token sparse decoding), so one pass per
(text, policy, budget) gives the perplexity of sparse decoding. Reported per
policy and budget: perplexity, its relative change vs full attention, the
top-1 agreement of the next-token prediction with full attention (teacher
forced: how often the argmax is unchanged), and the mean number of keys
attended (the budget actually used).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from spade.eval.common import (budget_label, check_policy_entries, essay_token_segments, load_model, policy_config,
                               policy_label, progress, say, write_json)
from spade.eval.config import PerplexityEvalConfig


def budgets_for(cfg: PerplexityEvalConfig) -> list[tuple[str, int]]:
    """(label, K): the fixed budgets, then K = context_tokens / n for each fraction."""
    out = [(budget_label(b), b) for b in cfg.budgets]
    floor = cfg.sink_tokens + cfg.recent_tokens + 8
    for f in cfg.context_fractions:
        out.append((budget_label(fraction=f) + f" ({max(floor, cfg.context_tokens // f)})",
                    max(floor, cfg.context_tokens // f)))
    return out


@torch.no_grad()
def nll_and_argmax(model, ids: torch.Tensor, policy_cfg, prefill_len: int) -> tuple[float, torch.Tensor, float]:
    """Mean NLL of ``ids[prefill_len:]`` under sparse decoding with ``policy_cfg``
    (as ``spade.teacher.sparse_perplexity`` computes it), the argmax predictions
    of those positions [T - prefill_len] and the mean keys attended per step."""
    from spade.teacher import teacher_forced_logits

    logits, forcing = teacher_forced_logits(model, ids, policy_cfg, prefill_len=prefill_len, return_forcing=True)
    T = ids.shape[0]
    pred = logits[prefill_len - 1:T - 1]
    nll = F.cross_entropy(pred, ids[prefill_len:].to(pred.device))
    return float(nll), pred.argmax(-1).cpu(), forcing.mean_attended()


@torch.no_grad()
def run_perplexity(cfg: PerplexityEvalConfig, out_dir: Path, device: str = "cpu") -> dict:
    """Perplexity of every configured policy and budget; writes ``perplexity_<model>.json``."""
    from spade.config import FullPolicyConfig

    from spade.eval import plots

    if cfg.prefill_tokens >= cfg.context_tokens:
        raise ValueError(f"eval.perplexity.prefill_tokens ({cfg.prefill_tokens}) must be below "
                         f"context_tokens ({cfg.context_tokens})")
    budgets = budgets_for(cfg)
    check_policy_entries(cfg.policies, "perplexity", sink_tokens=cfg.sink_tokens, recent_tokens=cfg.recent_tokens,
                         budgets=[b for _, b in budgets])
    results: dict[str, Any] = {"config": cfg.model_dump(mode="json"), "models": {}}
    for name in cfg.models:
        model, tok = load_model(name, device)
        texts = essay_token_segments(tok, cfg.context_tokens, cfg.n_texts)
        runs = [(lab, b, e) for lab, b in budgets for e in cfg.policies]
        rows: list[dict[str, Any]] = []
        full_nll: list[float] = []
        hf_nll: list[float] = []
        full_pred: list[torch.Tensor] = []
        with progress(f"perplexity {name}", len(texts) * (1 + len(runs))) as advance:
            for ids in texts:
                nll, pred, _ = nll_and_argmax(model, ids, FullPolicyConfig(), cfg.prefill_tokens)
                full_nll.append(nll)
                full_pred.append(pred)
                # the plain transformers forward (no spade attention): must equal ``full``
                dev = next(model.parameters()).device
                lg = model(input_ids=ids[None].to(dev), use_cache=False).logits[0].float()
                hf_nll.append(float(F.cross_entropy(lg[cfg.prefill_tokens - 1:-1],
                                                    ids[cfg.prefill_tokens:].to(dev))))
                advance()
            for lab, b, entry in runs:
                pc = policy_config(entry, b, sink_tokens=cfg.sink_tokens, recent_tokens=cfg.recent_tokens)
                nlls, agree, att = [], [], []
                for i, ids in enumerate(texts):
                    advance(0, description=f"perplexity {name} {policy_label(entry)} {lab}")
                    nll, pred, attended = nll_and_argmax(model, ids, pc, cfg.prefill_tokens)
                    nlls.append(nll)
                    agree.append(float((pred == full_pred[i]).double().mean()))
                    att.append(attended)
                    advance()
                ppl = math.exp(sum(nlls) / len(nlls))  # equal-length texts: pooled perplexity
                rows.append({"budget": lab, "K": b, "policy": policy_label(entry), "ppl": ppl,
                             "nll_per_text": nlls, "top1_agreement": sum(agree) / len(agree),
                             "mean_attended": sum(att) / len(att)})
        ppl_full = math.exp(sum(full_nll) / len(full_nll))
        for r in rows:
            r["rel_change"] = r["ppl"] / ppl_full - 1.0
        res = {"ppl_full": ppl_full, "ppl_hf": math.exp(sum(hf_nll) / len(hf_nll)), "nll_full_per_text": full_nll,
               "tokens_per_text": cfg.context_tokens - cfg.prefill_tokens, "rows": rows}
        write_json(out_dir / f"perplexity_{name}.json", res | {"config": results["config"]})
        res["plots"] = plots.perplexity_plot(name, res, out_dir)
        results["models"][name] = res
        say(f"perplexity {name}: full {ppl_full:.3f} (HF forward {res['ppl_hf']:.3f}); "
            f"wrote {out_dir / f'perplexity_{name}.json'}")
    return results
