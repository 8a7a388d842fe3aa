"""Measurement 2: perplexity of essay text under each policy vs full attention.

``spade.eval.teacher`` runs a whole sequence with every layer attending, at each
position ``t >= prefill_tokens``, exactly what the policy would select at decode
step ``t`` (its logits match token-by-token sparse decoding), so one pass per
(text, policy, budget) gives the perplexity of sparse decoding. Reported per
policy and budget: perplexity, its relative change vs full attention, the
top-1 agreement of the next-token prediction with full attention (teacher
forced: how often the argmax is unchanged), and the mean number of keys
attended (the budget actually used).

The dense prompt pass is the same for every policy, so it runs once per text
(``PromptPass``: the HF KV cache, every layer's prompt queries and the last
prompt logits); each policy then runs only the continuation tokens on top of
that cache (``continuation_nll``), with ``spade.eval.teacher.TeacherForcing``
driving the policy exactly as in ``teacher_forced_logits``. At 4k tokens with
half of them scored this halves the model's work per policy.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from spade.eval.common import (budget_label, check_policy_entries, essay_token_segments, load_model, policy_config,
                               policy_label, progress, say, write_json)
from spade.eval.config import PerplexityEvalConfig


class _PromptCapture:
    """``spade_forced`` object of the dense prompt pass: causal sdpa, and every
    layer's post-RoPE queries kept for the policies' ``prefill``."""

    def __init__(self) -> None:
        self.queries: dict[int, torch.Tensor] = {}

    def attention(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  scale: float | None) -> torch.Tensor:
        """``query`` [1, Hq, P, D], ``key``/``value`` [1, Hkv, P, D] -> [1, Hq, P, D]."""
        self.queries[layer] = query.clone()
        G = query.shape[1] // key.shape[1]
        return F.scaled_dot_product_attention(query, key.repeat_interleave(G, dim=1),
                                              value.repeat_interleave(G, dim=1), is_causal=True, scale=scale)


class _ContinuationForcing:
    """``spade_forced`` object of a continuation pass over a prompt cache: the
    keys are the whole sequence [1, Hkv, T, D], the queries only positions
    ``P..T-1``; the prompt's queries come from the ``PromptPass``. The masks are
    ``TeacherForcing.masks`` of the whole sequence (rows ``>= P`` used), so the
    policy sees the same calls as in ``spade.eval.teacher``."""

    def __init__(self, forcing, prompt_queries: dict[int, torch.Tensor]) -> None:
        self.forcing = forcing
        self.prompt_queries = prompt_queries

    def attention(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  scale: float | None) -> torch.Tensor:
        """``query`` [1, Hq, T - P, D], ``key``/``value`` [1, Hkv, T, D] -> [1, Hq, T - P, D]."""
        from spade.eval.teacher import _ROW_CHUNK

        P = self.forcing.prefill_len
        if key.shape[2] != P + query.shape[2]:
            raise RuntimeError(f"continuation pass: cache of {key.shape[2]} keys for a {P}-token prompt "
                               f"and {query.shape[2]} new tokens")
        q_all = torch.cat([self.prompt_queries[layer], query], dim=2)  # [1, Hq, T, D]
        G = query.shape[1] // key.shape[1]
        mask = self.forcing.masks(layer, q_all, key, value)[:, P:]  # [Hkv, T - P, T]
        scale = self.forcing.spec.softmax_scale if scale is None else scale
        kx = key.repeat_interleave(G, dim=1)  # [1, Hq, T, D]
        vx = value.repeat_interleave(G, dim=1)
        out = torch.empty_like(query)
        n = query.shape[2]
        for a in range(0, n, _ROW_CHUNK):
            b = min(a + _ROW_CHUNK, n)
            m = mask[:, a:b].repeat_interleave(G, dim=0)[None]  # [1, Hq, b - a, T]
            out[:, :, a:b] = F.scaled_dot_product_attention(query[:, :, a:b], kx, vx, attn_mask=m, scale=scale)
        return out


class PromptPass:
    """The dense pass over ``ids[:prefill_len]``, shared by every policy of one
    text: the KV cache (cropped back after each continuation), each layer's
    prompt queries [1, Hq, P, D] and the logits of the last prompt position."""

    @torch.no_grad()
    def __init__(self, model, ids: torch.Tensor, prefill_len: int) -> None:
        from transformers import DynamicCache

        from spade.models.hf import cache_kwarg, use_spade_attention

        if not 1 <= prefill_len < ids.shape[0]:
            raise ValueError(f"prefill_len must be in [1, {ids.shape[0]}); got {prefill_len}")
        self.model = model
        self.ids = ids
        self.prefill_len = prefill_len
        dev = next(model.parameters()).device
        cap = _PromptCapture()
        self.cache = DynamicCache(config=model.config)
        with use_spade_attention(model):
            out = model(input_ids=ids[:prefill_len].to(dev)[None], use_cache=True, spade_forced=cap,
                        **{cache_kwarg(model.forward): self.cache})
        self.queries = cap.queries
        self.last_logits = out.logits[0, -1].float()  # [V]: predicts token prefill_len

    @torch.no_grad()
    def logits(self, policy_cfg) -> tuple[torch.Tensor, float]:
        """Logits [T - P, V] predicting tokens ``P..T-1`` under sparse decoding with
        ``policy_cfg`` (row 0 is the dense prompt pass's), and the mean keys
        attended per (decode position, KV head, layer)."""
        from spade.eval.decoding import _crop_to
        from spade.models.hf import _as_policy, cache_kwarg, attention_spec, use_spade_attention
        from spade.eval.teacher import TeacherForcing

        P, model = self.prefill_len, self.model
        dev = next(model.parameters()).device
        spec = attention_spec(model)
        forcing = TeacherForcing(_as_policy(policy_cfg, spec), spec, P, dev)
        _crop_to(self.cache, P)
        try:
            with use_spade_attention(model):
                # every token is fed (the last one's logits are unused), so the policy
                # runs the same steps as in ``spade.eval.teacher`` (equal ``mean_attended``)
                out = model(input_ids=self.ids[P:].to(dev)[None], use_cache=True,
                            spade_forced=_ContinuationForcing(forcing, self.queries),
                            **{cache_kwarg(model.forward): self.cache})
        finally:
            _crop_to(self.cache, P)
        logits = torch.cat([self.last_logits[None], out.logits[0, :-1].float()])  # [T - P, V]
        return logits, forcing.mean_attended()


@torch.no_grad()
def continuation_nll(prompt: PromptPass, policy_cfg) -> tuple[float, torch.Tensor, float]:
    """``nll_and_argmax`` over a shared ``PromptPass``: mean NLL of ``ids[P:]``,
    argmax predictions [T - P] and mean keys attended per step."""
    logits, attended = prompt.logits(policy_cfg)
    target = prompt.ids[prompt.prefill_len:].to(logits.device)
    return float(F.cross_entropy(logits, target)), logits.argmax(-1).cpu(), attended


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
    (as ``spade.eval.teacher.sparse_perplexity`` computes it), the argmax predictions
    of those positions [T - prefill_len] and the mean keys attended per step."""
    from spade.eval.teacher import teacher_forced_logits

    logits, forcing = teacher_forced_logits(model, ids, policy_cfg, prefill_len=prefill_len, return_forcing=True)
    T = ids.shape[0]
    pred = logits[prefill_len - 1:T - 1]
    nll = F.cross_entropy(pred, ids[prefill_len:].to(pred.device))
    return float(nll), pred.argmax(-1).cpu(), forcing.mean_attended()


@torch.no_grad()
def run_perplexity(cfg: PerplexityEvalConfig, out_dir: Path, device: str = "cpu") -> dict:
    """Perplexity of every configured policy and budget; writes ``perplexity_<model>.json``."""
    from spade.policies.full import FullPolicyConfig

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
        texts = essay_token_segments(tok, cfg.context_tokens, cfg.n_texts,
                                     offset_tokens=cfg.first_text * cfg.context_tokens)
        runs = [(lab, b, e) for lab, b in budgets for e in cfg.policies]
        per_run: list[dict[str, list[float]]] = [{"nll": [], "agree": [], "att": [], "sec": []} for _ in runs]
        full_nll: list[float] = []
        hf_nll: list[float] = []
        with progress(f"perplexity {name}", len(texts) * (1 + len(runs))) as advance:
            for ids in texts:  # texts outer: one shared prompt pass per text
                t0 = time.time()
                prompt = PromptPass(model, ids, cfg.prefill_tokens)
                nll, full_pred, _ = continuation_nll(prompt, FullPolicyConfig())
                full_nll.append(nll)
                # the plain transformers forward (no spade attention, no prompt cache): must equal ``full``
                dev = next(model.parameters()).device
                lg = model(input_ids=ids[None].to(dev), use_cache=False).logits[0].float()
                hf_nll.append(float(F.cross_entropy(lg[cfg.prefill_tokens - 1:-1],
                                                    ids[cfg.prefill_tokens:].to(dev))))
                say(f"perplexity {name}: prompt pass + full + HF forward {time.time() - t0:.0f} s")
                advance()
                for (lab, b, entry), acc in zip(runs, per_run):
                    pc = policy_config(entry, b, sink_tokens=cfg.sink_tokens, recent_tokens=cfg.recent_tokens)
                    advance(0, description=f"perplexity {name} {policy_label(entry)} {lab}")
                    t0 = time.time()
                    nll, pred, attended = continuation_nll(prompt, pc)
                    acc["sec"].append(time.time() - t0)
                    acc["nll"].append(nll)
                    acc["agree"].append(float((pred == full_pred).double().mean()))
                    acc["att"].append(attended)
                    say(f"perplexity {name} {policy_label(entry)} {lab}: ppl {math.exp(nll):.3f} "
                        f"({acc['sec'][-1]:.0f} s)")
                    advance()
                del prompt
        rows: list[dict[str, Any]] = []
        for (lab, b, entry), acc in zip(runs, per_run):
            n = len(acc["nll"])
            rows.append({"budget": lab, "K": b, "policy": policy_label(entry),
                         "ppl": math.exp(sum(acc["nll"]) / n),  # equal-length texts: pooled perplexity
                         "nll_per_text": acc["nll"], "top1_agreement": sum(acc["agree"]) / n,
                         "mean_attended": sum(acc["att"]) / n, "seconds": sum(acc["sec"])})
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
