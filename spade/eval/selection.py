"""Measurement 1: how well does each selection keep the true query's attention?

For real text, one dense teacher-forced pass captures every layer's post-RoPE
queries and keys (``spade.eval.capture``). Each sampled decode position ``t``
is then replayed through the policies' own code, as batch rows (one row per
position, the cache ``k[:, :t+1]`` shared):

* ``oracle``: ``OraclePolicy.select`` with the true query q_t;
* ``asyncspade``: ``AsyncSpadePolicy.prefill`` with the W+1 queries before t
  (the window the policy holds at step t), then ``select`` (no current query);
* ``quest``: ``QuestPolicy.prefill`` on the prefix ``[0, t)`` (page bounds),
  then ``select`` with q_t;
* ``streaming``: ``select``;
* ``tova``: a sequential run (``prefill`` on ``[0, start)``, then ``select`` and
  ``observe`` at every position up to the end: its evictions are path
  dependent), all layers at once as batch rows.

Metrics (``docs/fidelity.md``):

* **attention recall**: Σ over the attended tokens (sinks, recent window and
  selection) of softmax(q_t·K/√d), per query head over its KV head's selection,
  averaged over the query heads; 1 means no attention mass is lost;
* **overlap**: the fraction of the oracle's selected middle tokens (the top-K
  beyond sinks and recent window, same budget and group reduction) that the
  policy attends. For asyncspade this is the paper's |S(q̂) ∩ S(q)| / |S|.

Also reproduced: the paper's Fig. 4 (overlap of the top-K of q_{t-d} with that
of q_t, vs d) and Fig. 5 (ridge prediction with vs without the one-step shift).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from spade.eval.common import (budget_label, essay_token_segments, fraction_budget, load_model, progress, say,
                               policy_config, write_json)
from spade.eval.config import SelectionEvalConfig
from spade.policies import POLICIES  # light: the registry


# --------------------------------------------------------------------------- metric primitives
def true_probs(q: torch.Tensor, k: torch.Tensor, kv_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax of each query head over ``[0, kv_lens)``: [B, Hkv, G, L] float32
    (zero beyond ``kv_lens``). ``q`` [B, Hq, D]; ``k`` [B, Hkv, L, D] (may be an
    expanded view)."""
    B, Hq, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    qg = q.float().view(B, Hkv, Hq // Hkv, D)
    logits = torch.einsum("bhgd,bhld->bhgl", qg, k.float()) * scale
    valid = torch.arange(L, device=k.device)[None, :] < kv_lens.to(k.device).long()[:, None]  # [B, L]
    logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1)


def index_mask(indices: torch.Tensor, length: int) -> torch.Tensor:
    """[B, H, length] bool: the positions named by ``indices`` [B, H, n] (``-1`` = none).

    Scatters into one spare column for the empty slots, so an empty slot can
    never clear a real position (duplicate scatter targets have no defined order)."""
    B, H, _ = indices.shape
    out = torch.zeros(B, H, length + 1, dtype=torch.bool, device=indices.device)
    idx = indices.long()
    idx = torch.where(idx >= 0, idx, torch.full_like(idx, length))
    out.scatter_(2, idx, True)
    return out[..., :length]


def attended_mask(sel, kv_lens: torch.Tensor, length: int, n_kv_heads: int) -> torch.Tensor:
    """[B, Hkv, length] bool: every position a ``Selection`` attends (sinks, middle
    indices, recent window); ``None`` (dense) attends ``[0, kv_lens)``."""
    kv = kv_lens.long()
    B = kv.shape[0]
    pos = torch.arange(length, device=kv.device)[None, :]  # [1, L]
    if sel is None:
        return (pos < kv[:, None])[:, None, :].expand(B, n_kv_heads, length)
    s = torch.zeros_like(kv) if sel.kv_start is None else sel.kv_start.to(kv.device).long()
    sink_end = torch.minimum(s + sel.n_sink, kv)
    recent_start = torch.maximum(kv - sel.n_recent, sink_end)
    fixed = ((pos >= s[:, None]) & (pos < sink_end[:, None])) | ((pos >= recent_start[:, None]) & (pos < kv[:, None]))
    return fixed[:, None, :] | index_mask(sel.indices.to(kv.device), length)


def recall_of(probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention mass kept per row, averaged over query heads: [B].
    ``probs`` [B, Hkv, G, L], ``mask`` [B, Hkv, L]."""
    return (probs * mask[:, :, None, :]).sum(-1).mean(dim=(1, 2))


def overlap_of(mask: torch.Tensor, ref_middle: torch.Tensor) -> torch.Tensor:
    """|attended ∩ ref| / |ref| per row, averaged over KV heads whose ``ref`` is not
    empty: [B] (NaN for rows where every ``ref`` is empty)."""
    inter = (mask & ref_middle).sum(-1).double()  # [B, Hkv]
    size = ref_middle.sum(-1).double()
    ok = size > 0
    frac = torch.where(ok, inter / size.clamp(min=1), torch.zeros_like(inter))
    n = ok.sum(-1)
    return torch.where(n > 0, frac.sum(-1) / n.clamp(min=1), torch.full_like(frac[:, 0], float("nan")))


# --------------------------------------------------------------------------- Fig. 5 ablation
def ridge_predict_shift(window: torch.Tensor, mode: str = "ridge", eps: float = 1e-2, *,
                        shift: bool = True) -> torch.Tensor:
    """The ridge predictors of ``spade.kernels.ridge`` with the one-step shift made optional.

    ``window`` [N, R, D] (all rows valid, oldest first). The weights a are fitted
    so that the w predecessors of the newest query reproduce it; with ``shift``
    they are applied to the window moved one step on (the predictor asyncspade
    runs, equal to ``ridge_predict_ref``); without it they are applied to the same
    window they were fitted on, which only reconstructs the newest query (the
    paper's Fig. 5 contrast). ``mode``: ``ridge`` (w = R-1, raw weights),
    ``softmax_ridge`` or ``assembled`` (softmax weights, averaged over w = 1..R-1).
    Returns [N, D] float32.
    """
    x = window.double()
    N, n, D = x.shape
    y = x[:, -1]
    lam = (eps * (x * x).sum(-1).mean(-1)).clamp_min(1e-20)

    def weights(w: int) -> torch.Tensor:
        X = x[:, n - 1 - w:n - 1]
        A = X @ X.transpose(1, 2) + lam[:, None, None] * torch.eye(w, dtype=x.dtype, device=x.device)
        return torch.linalg.solve(A, (X @ y[:, :, None])[..., 0])

    def applied(w: int) -> torch.Tensor:
        return x[:, n - w:n] if shift else x[:, n - 1 - w:n - 1]

    if mode == "ridge":
        out = (weights(n - 1)[..., None] * applied(n - 1)).sum(1)
    elif mode == "softmax_ridge":
        out = (torch.softmax(weights(n - 1), -1)[..., None] * applied(n - 1)).sum(1)
    elif mode == "assembled":
        out = torch.zeros_like(y)
        for w in range(1, n):
            out += (torch.softmax(weights(w), -1)[..., None] * applied(w)).sum(1)
        out /= n - 1
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return out.float()


# --------------------------------------------------------------------------- accumulation
class Acc:
    """Per-layer sums of metric values, keyed by ``(budget, policy, reduce, metric)``."""

    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        self.data: dict[tuple, list[torch.Tensor]] = {}

    def add(self, key: tuple, layer: int | torch.Tensor, vals: torch.Tensor) -> None:
        s, c = self.data.setdefault(key, [torch.zeros(self.n_layers, dtype=torch.float64),
                                          torch.zeros(self.n_layers, dtype=torch.float64)])
        vals = vals.detach().double().cpu()
        ok = ~torch.isnan(vals)
        if isinstance(layer, int):
            s[layer] += vals[ok].sum()
            c[layer] += ok.sum()
        else:
            lay = layer.cpu().long()
            s.index_add_(0, lay[ok], vals[ok])
            c.index_add_(0, lay[ok], ok[ok].double())

    def per_layer(self, key: tuple) -> list[float]:
        s, c = self.data[key]
        return [float(a / b) if b > 0 else float("nan") for a, b in zip(s.tolist(), c.tolist())]

    def mean(self, key: tuple) -> float:
        """Mean over layers of the per-layer means (each layer weighs the same)."""
        vals = [v for v in self.per_layer(key) if not math.isnan(v)]
        return sum(vals) / len(vals) if vals else float("nan")

    def count(self, key: tuple) -> int:
        return int(self.data[key][1].sum())


# --------------------------------------------------------------------------- the replay
def _asy_label(pred: str, rope: bool, channels: int = 1) -> str:
    return f"asyncspade[{pred}{',rope' if rope else ''}{f',r=d/{channels}' if channels > 1 else ''}]"


def recommend_channels(rows: list[dict], divisors: list[int], tol: float) -> dict[str, dict]:
    """Per (budget, asyncspade variant, reduce) with r = d measured: the smallest r (largest
    divisor n) whose recall is within ``tol`` of r = d's, as {"r": "d/n", recall, ...}."""
    by = {(r["budget"], r["policy"], r["reduce"]): r.get("recall") for r in rows}
    out: dict[str, dict] = {}
    for (b, pol, red), rec in sorted(by.items()):
        if not pol.startswith("asyncspade[") or ",r=d/" in pol or rec is None:
            continue
        best = 1
        for n in sorted(d for d in divisors if d > 1):
            got = by.get((b, pol[:-1] + f",r=d/{n}]", red))
            if got is not None and got >= rec - tol:
                best = n
        out[f"{b} {pol} {red}"] = {"r": f"d/{best}" if best > 1 else "d", "recall_full_channels": rec,
                                   "recall": by.get((b, pol[:-1] + f",r=d/{best}]", red), rec) if best > 1 else rec}
    return out


def _state(policy, batch: int, seq_len: int, device=None):
    """A bare policy state (layers filled lazily by the policy; layer 0 is the one
    replayed). Cheaper than ``new_state``, which allocates every layer."""
    from spade.policies.base import PolicyState

    return PolicyState(batch_size=batch, layers=[None] * policy.spec.n_layers, seq_len=seq_len)


_UNRANKED = 1 << 40  # rank of a token outside the ranking: above any budget


class Ranked:
    """The top-``kmax`` middle tokens of one query per row, best first.

    Token-level top-K selection (``oracle`` with the true query, ``asyncspade``
    with a predicted one) attends sinks + recent window + the ``K - sink - recent``
    best middle tokens by group score; a prefix of this ranking *is* that set for
    every smaller K (ties aside), so one ranking serves every budget. The scores
    are ``spade.kernels.group_scores``' (see :func:`group_scores_multi`);
    ``tests/eval`` checks the resulting sets against the policies' own ``select``.
    """

    def __init__(self, scores: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, kmax: int):
        B, H, L = scores.shape
        pos = torch.arange(L, device=scores.device)
        cand = (pos[None, :] >= lo[:, None]) & (pos[None, :] < hi[:, None])  # [B, L]
        s = scores.masked_fill(~cand[:, None, :], float("-inf"))
        kk = max(1, min(kmax, L))
        _, idx = s.topk(kk, dim=-1, sorted=True)  # [B, H, kk]
        ok = cand[:, None, :].expand(B, H, L).gather(2, idx)
        self.idx = torch.where(ok, idx, torch.full_like(idx, -1))  # [B, H, kk] long, best first
        self.length = L
        self.n_valid = ok.sum(-1)  # [B, H] candidates available
        self._rank: torch.Tensor | None = None

    @property
    def rank(self) -> torch.Tensor:
        """[B, H, L+1] long: each token's place in the ranking (large: not ranked;
        the last column absorbs empty slots)."""
        if self._rank is None:
            B, H, kk = self.idx.shape
            L = self.length
            big = _UNRANKED
            rank = torch.full((B, H, L + 1), big, dtype=torch.long, device=self.idx.device)
            ok = self.idx >= 0
            tgt = torch.where(ok, self.idx, torch.full_like(self.idx, L))
            src = torch.arange(kk, device=self.idx.device).expand(B, H, kk)
            rank.scatter_(2, tgt, torch.where(ok, src, torch.full_like(src, big)))
            rank[..., L] = big
            self._rank = rank
        return self._rank

    @classmethod
    def from_order(cls, idx: torch.Tensor, length: int) -> "Ranked":
        """A ranking given as positions best first ([B, H, kk] long, ``-1`` = empty)."""
        rk = cls.__new__(cls)
        rk.idx, rk.length, rk.n_valid, rk._rank = idx, length, (idx >= 0).sum(-1), None
        return rk

    def mask(self, k_top: torch.Tensor) -> torch.Tensor:
        """[B, H, L] bool: the best ``k_top[b]`` middle tokens of each row."""
        return self.rank[..., : self.length] < k_top.to(self.idx.device)[:, None, None]

    def recall(self, probs: torch.Tensor, fixed_mass: torch.Tensor, k_top: torch.Tensor) -> torch.Tensor:
        """Attention mass of sinks + recent + the best ``k_top[b]`` middle tokens: [B]."""
        B, H, G, L = probs.shape
        kk = self.idx.shape[-1]
        gi = self.idx.clamp(min=0)[:, :, None, :].expand(B, H, G, kk)
        pg = probs.gather(3, gi) * (self.idx >= 0)[:, :, None, :]
        cs = torch.cat([torch.zeros_like(pg[..., :1]), pg.cumsum(-1)], dim=-1)  # [B, H, G, kk+1]
        kt = k_top.to(probs.device).clamp(0, kk).long()
        got = cs.gather(3, kt.view(B, 1, 1, 1).expand(B, H, G, 1))[..., 0]
        return (fixed_mass + got).mean(dim=(1, 2))

    def overlap(self, ref: "Ranked", k_top: torch.Tensor) -> torch.Tensor:
        """|top-k_top of self ∩ top-k_top of ref| / |top-k_top of ref| per row: [B]."""
        B, H, kk = self.idx.shape
        kt = k_top.to(self.idx.device).long()[:, None, None]
        tgt = torch.where(self.idx >= 0, self.idx, torch.full_like(self.idx, self.length))
        ref_rank = ref.rank.gather(2, tgt)  # [B, H, kk] the ref's place of each of our tokens
        mine = (torch.arange(kk, device=self.idx.device)[None, None, :] < kt) & (self.idx >= 0)
        inter = (mine & (ref_rank < kt)).sum(-1).double()  # [B, H]
        size = torch.minimum(ref.n_valid, kt[..., 0]).double()
        return _mean_heads(inter, size)


def group_scores_multi(q: torch.Tensor, k: torch.Tensor, kv_lens: torch.Tensor, scale: float,
                       reduces: list[str]) -> dict[str, torch.Tensor]:
    """``spade.kernels.group_scores`` for several reductions at once, sharing the
    per-head logits: {reduce: [B, Hkv, L] float32, -inf beyond ``kv_lens``}.

    ``q`` [B, Hq, D]; ``k`` [Hkv, L, D] is one cache shared by every row (the
    replay's rows are positions of one sequence), so the logits are one GEMM per
    KV head instead of a per-row copy of the cache. Same math as the kernel's
    reference (fp32 products, softmax of ``sum_softmax`` over ``[0, kv_lens)``);
    ``tests/eval`` checks it against ``group_scores``.
    """
    B, Hq, D = q.shape
    Hkv, L = k.shape[0], k.shape[1]
    qg = q.to(k.dtype).float().view(B, Hkv, Hq // Hkv, D)
    logits = torch.einsum("bhgd,hld->bhgl", qg, k.float()) * scale  # [B, Hkv, G, L]
    valid = torch.arange(L, device=k.device)[None, :] < kv_lens.to(k.device).long()[:, None]  # [B, L]
    neg = torch.tensor(float("-inf"), device=k.device)
    out = {}
    for red in reduces:
        if red == "sum_logits":
            s = logits.sum(2)
        elif red == "max_logits":
            s = logits.amax(2)
        elif red == "sum_softmax":
            s = torch.softmax(logits.masked_fill(~valid[:, None, None, :], float("-inf")), -1).sum(2)
        else:
            raise ValueError(f"unknown group reduction {red!r}")
        out[red] = torch.where(valid[:, None, :], s, neg)
    return out


def _mean_heads(inter: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    ok = size > 0
    frac = torch.where(ok, inter / size.clamp(min=1), torch.zeros_like(inter))
    n = ok.sum(-1)
    return torch.where(n > 0, frac.sum(-1) / n.clamp(min=1), torch.full_like(frac[:, 0], float("nan")))


def fixed_mass(probs: torch.Tensor, kv_lens: torch.Tensor, n_sink: int, n_recent: int) -> torch.Tensor:
    """Attention mass on the sinks and the recent window: [B, Hkv, G] (their ranges
    clipped as in ``Selection``)."""
    L = probs.shape[-1]
    kv = kv_lens.long().to(probs.device)
    pos = torch.arange(L, device=probs.device)[None, :]
    sink_end = torch.clamp(kv, max=n_sink)
    recent_start = torch.maximum(kv - n_recent, sink_end)
    m = (pos < sink_end[:, None]) | ((pos >= recent_start[:, None]) & (pos < kv[:, None]))  # [B, L]
    return torch.einsum("bhgl,bl->bhg", probs, m.to(probs.dtype))


def _budget_settings(cfg: SelectionEvalConfig, ts: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(label, per-row budget [B]) for the fixed budgets and the context fractions."""
    floor = cfg.sink_tokens + cfg.recent_tokens + 8
    out = [(budget_label(b), torch.full((len(ts),), b, dtype=torch.long)) for b in cfg.budgets]
    for f in cfg.context_fractions:
        out.append((budget_label(fraction=f), torch.tensor([fraction_budget(int(t) + 1, f, floor) for t in ts])))
    return out


def _replay_layer(cfg: SelectionEvalConfig, spec, q: torch.Tensor, k: torch.Tensor, ts: torch.Tensor, layer: int,
                  acc: Acc) -> None:
    """All non-sequential policies at positions ``ts`` of one layer.
    ``q`` [Hq, T, D], ``k`` [Hkv, T, D] (the captured layer)."""
    _LayerReplay(cfg, spec, q, k, ts, layer, acc).run()


class _LayerReplay:
    """``_replay_layer``'s shared setup (the true attention, budgets, the oracle's
    ranking) and one method per family of policies it records into ``acc``."""

    def __init__(self, cfg: SelectionEvalConfig, spec, q: torch.Tensor, k: torch.Tensor, ts: torch.Tensor,
                 layer: int, acc: Acc) -> None:
        from spade.policies.common import middle_bounds

        self.cfg, self.spec, self.q, self.k, self.ts, self.layer, self.acc = cfg, spec, q, k, ts, layer, acc
        dev = self.dev = k.device
        B = self.B = len(ts)
        self.T = k.shape[1]
        self.Hkv, self.D = k.shape[0], k.shape[2]
        tsd = self.tsd = ts.to(dev)
        self.kc = k[None].expand(B, *k.shape)  # [B, Hkv, T, D] shared cache (a view)
        kv_sel = self.kv_sel = (tsd + 1).to(torch.int32)  # cache length at step t (token t included)
        self.kv_pre = tsd.to(torch.int32)  # the "prompt" before step t
        self.q_t = q[:, tsd].transpose(0, 1).contiguous()  # [B, Hq, D]
        self.probs = true_probs(self.q_t, self.kc, kv_sel, spec.softmax_scale)  # [B, Hkv, G, T]
        self.fmass = fixed_mass(self.probs, kv_sel, cfg.sink_tokens, cfg.recent_tokens)
        self.settings = _budget_settings(cfg, ts)
        self.n_fixed = cfg.sink_tokens + cfg.recent_tokens
        self.kmax = max(int(b.max()) for _, b in self.settings) - self.n_fixed
        self.lo, self.hi = middle_bounds(kv_sel, None, cfg.sink_tokens, cfg.recent_tokens)
        self.reduces = list(cfg.group_reduces)
        self.ref_reduce = self.reduces[0]
        self.common = dict(sink_tokens=cfg.sink_tokens, recent_tokens=cfg.recent_tokens)
        self._rerank_caches: dict[str, torch.Tensor] = {}
        self.ref: dict[str, Ranked] = {}
        self._kmass_cs: torch.Tensor | None = None  # prefix sums of the keys' pair norms (channel choice)

    def ranked(self, qv: torch.Tensor, reds: list[str]) -> dict[str, Ranked]:
        scores = group_scores_multi(qv, self.k, self.kv_sel, self.spec.softmax_scale, reds)
        return {red: Ranked(s, self.lo, self.hi, self.kmax) for red, s in scores.items()}

    def record_ranked(self, policy: str, red: str, rk: Ranked, ref: Ranked) -> None:
        acc, layer = self.acc, self.layer
        for label, budget in self.settings:
            kt = (budget - self.n_fixed).to(self.dev)
            acc.add((label, policy, red, "recall"), layer, rk.recall(self.probs, self.fmass, kt))
            acc.add((label, policy, red, "overlap"), layer, rk.overlap(ref, kt))

    def record_mask(self, label: str, rows: torch.Tensor, budget: int, policy: str, red: str, sel,
                    ref: Ranked) -> None:
        acc, layer, dev, probs, T = self.acc, self.layer, self.dev, self.probs, self.T
        r = rows.to(dev)
        mask = attended_mask(sel, self.kv_sel[r], T, self.Hkv)
        acc.add((label, policy, red, "recall"), layer,
                torch.einsum("bhgl,bhl->bhg", probs[r], mask.to(probs.dtype)).mean(dim=(1, 2)))
        kt = torch.full((len(r),), budget - self.n_fixed, device=dev)[:, None, None]
        ref_mid = ref.rank[r, :, :T] < kt
        acc.add((label, policy, red, "overlap"), layer,
                _mean_heads((mask & ref_mid).sum(-1).double(), ref_mid.sum(-1).double()))

    def run(self) -> None:
        # oracle: exact top-K of the true query, the reference of every overlap
        ref = self.ref = self.ranked(self.q_t, self.reduces)
        if "oracle" in self.cfg.baselines:
            for red in self.reduces:
                self.record_ranked("oracle", red, ref[red], ref[red])
        win = self._asyncspade()
        self._stale()
        if self.cfg.shift_ablation:
            self._shift_ablation(win)
        self._baselines()

    def _asyncspade(self) -> torch.Tensor:
        """The policy's own prefill + predict_query (the W+1 queries before t); returns
        that window [B, Hq, W+1, D]."""
        from spade.policies.asyncspade import AsyncSpadePolicy, AsyncSpadePolicyConfig

        cfg, spec, q, ts, B, dev, kc = self.cfg, self.spec, self.q, self.ts, self.B, self.dev, self.kc
        R = cfg.window + 1
        win = torch.stack([q[:, int(t) - R:int(t)] for t in ts.tolist()])  # [B, Hq, R, D]
        for pred in cfg.predictors:
            for rope in cfg.rope_aware:
                if rope and spec.rope is None:
                    continue
                pol = AsyncSpadePolicy(AsyncSpadePolicyConfig(budget=self.kmax + self.n_fixed, predictor=pred,
                                                              window=cfg.window, ridge_eps=cfg.ridge_eps,
                                                              rope_aware=rope, **self.common), spec)
                st = _state(pol, B, int(ts.max()), dev)
                pol.prefill(st, 0, win, kc, kc, self.kv_pre)
                st.seq_len += 1  # the decode step at t: the window holds q_{t-W-1} .. q_{t-1}
                q_hat = pol.predict_query(st, 0, self.kv_sel)  # [B, Hq, D]
                for red, rk in self.ranked(q_hat, self.reduces).items():
                    self.record_ranked(_asy_label(pred, rope), red, rk, self.ref[red])
                for m in cfg.reranks:
                    if m > 1:
                        self._rerank(q_hat, m, f"{_asy_label(pred, rope)[:-1]},rerank={m}]")
                for n in cfg.score_channels:
                    if n > 1:
                        q_sub = q_hat * self.channel_mask(win, self.D // n)
                        for red, rk in self.ranked(q_sub, self.reduces).items():
                            self.record_ranked(_asy_label(pred, rope, n), red, rk, self.ref[red])
        return win

    def _rerank(self, q_hat: torch.Tensor, m: int, policy: str) -> None:
        """Two-stage selection (``policy.rerank`` m): per budget, the predicted query's top
        ``m * K_mid`` middle tokens re-ranked by the true query (``kernels.rerank``'s
        reference: each head's softmax over the candidates for ``sum_softmax``)."""
        from spade.kernels.rerank import rerank_scores_ref

        scores = group_scores_multi(q_hat, self.k, self.kv_sel, self.spec.softmax_scale, self.reduces)
        for red, s in scores.items():
            pred = Ranked(s, self.lo, self.hi, m * self.kmax)
            for label, budget in self.settings:
                kt = (budget - self.n_fixed).to(self.dev)  # [B] K_mid per row
                width = int(kt.max()) * m
                cand = pred.idx[..., :width]
                slot = torch.arange(cand.shape[-1], device=self.dev)[None, None, :]
                cand = torch.where(slot < (m * kt)[:, None, None], cand, torch.full_like(cand, -1))
                for keys in self.cfg.rerank_keys:
                    rs = rerank_scores_ref(self.q_t, self.rerank_cache(keys), cand, scale=self.spec.softmax_scale,
                                           reduce=red)
                    order = torch.sort(-rs, dim=-1, stable=True).indices  # best first; -1 slots (-inf) last
                    rk = Ranked.from_order(cand.gather(-1, order), self.T)
                    pol = policy if keys == "exact" else f"{policy[:-1]},keys={keys}]"
                    self.acc.add((label, pol, red, "recall"), self.layer, rk.recall(self.probs, self.fmass, kt))
                    self.acc.add((label, pol, red, "overlap"), self.layer, rk.overlap(self.ref[red], kt))

    def rerank_cache(self, keys: str) -> torch.Tensor:
        """[B, Hkv, T, D] keys the re-rank scores its candidates on: the cache (``exact``), or
        its int8 / int4 copy dequantised, as the policy's scoring copy holds it (per-token
        scales; int4 with the per-channel smoothing fitted on each row's prompt
        ``[0, kv_pre)``, then kept for the later keys). Made once per layer and kind."""
        if keys == "exact":
            return self.kc
        got = self._rerank_caches.get(keys)
        if got is None:
            from spade.kernels import quant

            k = self.kc.contiguous()
            if keys == "int8":
                kq, ks = quant.quantize_keys_ref(k)
                got = kq.float() * ks[..., None]
            else:
                smooth = quant.fit_smoothing(k, self.kv_pre)
                kq, ks = quant.quantize_keys_int4_ref(k, smooth)
                got = quant.unpack_int4(kq).float() * ks[..., None] * smooth[:, :, None, :]
            got = self._rerank_caches[keys] = got.to(k.dtype)
        return got

    def channel_mask(self, win: torch.Tensor, r: int) -> torch.Tensor:
        """[B, Hq, D] 0/1: the r channels asyncspade's ``score_channels`` scores at each
        row's step t (``pick_channels`` of the window ``win`` and the keys ``[0, t)``,
        as a prefill of that prefix chooses them); the query times it scores what the
        gathered copy scores."""
        from spade.policies.asyncspade import pick_channels, query_pair_mass

        if r < 2 or r >= self.D:
            return torch.ones((), device=self.dev)
        if self._kmass_cs is None:
            h = self.D // 2
            kf = self.k.float()
            m = (kf[..., :h].square() + kf[..., h:].square()).sqrt()  # [Hkv, T, h]
            self._kmass_cs = m.cumsum(1)
        kmass = self._kmass_cs[:, (self.kv_pre.long() - 1).clamp(min=0)].transpose(0, 1)  # [B, Hkv, h]
        ch = pick_channels(query_pair_mass(win, self.Hkv), kmass, r)  # [B, Hkv, r]
        B, Hq = win.shape[0], win.shape[1]
        mask = torch.zeros(B, self.Hkv, self.D, device=self.dev)
        mask.scatter_(2, ch, 1.0)
        return mask.repeat_interleave(Hq // self.Hkv, dim=1)

    def _stale(self) -> None:
        """Fig. 4: the top-K of a stale query q_{t-d} vs that of q_t."""
        ref_reduce = self.ref_reduce
        for d in self.cfg.distances:
            q_old = self.q[:, self.tsd - d].transpose(0, 1).contiguous()
            self.record_ranked(f"stale[d={d}]", ref_reduce, self.ranked(q_old, [ref_reduce])[ref_reduce],
                               self.ref[ref_reduce])

    def _shift_ablation(self, win: torch.Tensor) -> None:
        """Fig. 5: ridge predictions with vs without the one-step shift (post-RoPE, as the paper)."""
        B, D, R, ref_reduce = self.B, self.D, self.cfg.window + 1, self.ref_reduce
        flat = win.reshape(B * win.shape[1], R, D)
        for mode in ("ridge", "assembled"):
            for shift in (True, False):
                q_hat = ridge_predict_shift(flat, mode, self.cfg.ridge_eps, shift=shift).view(B, -1, D)
                self.record_ranked(f"{mode}[{'shift' if shift else 'no shift'}]", ref_reduce,
                                   self.ranked(q_hat, [ref_reduce])[ref_reduce], self.ref[ref_reduce])

    def _baselines(self) -> None:
        """The other baselines (quest, streaming, ...): their own prefill + select with the true
        query and the prefix as the prompt, per budget group; evicting ones are replayed apart."""
        cfg, spec, ts, dev, kc, q_t = self.cfg, self.spec, self.ts, self.dev, self.kc, self.q_t
        at_positions = [b for b in cfg.baselines if b != "oracle" and not POLICIES.get(b).evicts]
        for label, budget in self.settings:
            for kb in sorted(set(budget.tolist())):
                rows = torch.nonzero(budget == kb).flatten()
                r = rows.to(dev)
                seq = int(ts[rows].max()) + 1
                for name in at_positions:
                    for red in baseline_reduces(name, self.reduces):
                        pol = _baseline(cfg, spec, name, kb, red)
                        st = _state(pol, len(r), seq - 1)
                        pol.prefill(st, 0, q_t[r, :, None], kc[: len(r)], kc[: len(r)], self.kv_pre[r])
                        st.seq_len = seq
                        sel = pol.select(st, 0, q_t[r], kc[: len(r)], self.kv_sel[r])
                        self.record_mask(label, rows, kb, name, red, sel,
                                         self.ref[red if red != "-" else self.ref_reduce])


def baseline_reduces(name: str, reduces: list[str]) -> list[str]:
    """The GQA reductions baseline ``name`` is measured with: those of ``reduces`` its
    config accepts when its selection scores the query (quest: sum_logits, max_logits);
    ``["-"]`` for one whose selection has no query scores (streaming, tova)."""
    field = POLICIES.config(name).model_fields.get("group_reduce")
    if field is None or not POLICIES.get(name).needs_current_query:
        return ["-"]
    from pydantic import TypeAdapter, ValidationError

    ok = []
    for red in reduces:
        try:
            TypeAdapter(field.annotation).validate_python(red)
            ok.append(red)
        except ValidationError:
            pass
    return ok


def _baseline(cfg: SelectionEvalConfig, spec, name: str, budget: int, red: str):
    """Baseline ``name`` (a registered policy) at ``budget``, reduction ``red`` ("-": its
    default); its sinks, recent window and page size from the measurement's settings."""
    from spade.policies import build_policy

    entry: dict[str, Any] = {"name": name}
    if red != "-":
        entry["group_reduce"] = red
    if "page_size" in POLICIES.config(name).model_fields:
        entry["page_size"] = cfg.page_size
    pcfg = policy_config(entry, budget, sink_tokens=cfg.sink_tokens, recent_tokens=cfg.recent_tokens)
    return build_policy(pcfg, spec)


def _replay_evicting(cfg: SelectionEvalConfig, spec, name: str, qs: list[torch.Tensor], ks: list[torch.Tensor],
                     ts: torch.Tensor, budget: int, acc: Acc, ref_fn) -> None:
    """An evicting baseline (TOVA) along the whole sequence, every layer at once (layers
    as batch rows): prompt ``[0, ts[0])``, then select/observe at each position; metrics
    at ``ts``."""

    q_all = torch.stack(qs)  # [NL, Hq, T, D]
    k_all = torch.stack(ks)  # [NL, Hkv, T, D]
    NL, Hkv, T, _ = k_all.shape
    dev = k_all.device
    pol = _baseline(cfg, spec, name, budget, "-")
    p0 = int(ts[0])
    st = _state(pol, NL, p0, dev)
    layers = torch.arange(NL)
    pol.prefill(st, 0, q_all[:, :, :p0], k_all, k_all, torch.full((NL,), p0, dtype=torch.int32, device=dev))
    want = set(ts.tolist())
    label = budget_label(budget)
    for t in range(p0, T):
        st.seq_len = t + 1
        kv = torch.full((NL,), t + 1, dtype=torch.int32, device=dev)
        sel = pol.select(st, 0, None, k_all, kv)
        qt = q_all[:, :, t]  # [NL, Hq, D]
        if t in want:
            mask = attended_mask(sel, kv, T, Hkv)
            probs = true_probs(qt, k_all, kv, spec.softmax_scale)
            acc.add((label, name, "-", "recall"), layers, recall_of(probs, mask))
            acc.add((label, name, "-", "overlap"), layers, overlap_of(mask, ref_fn(qt, k_all, kv, budget)))
        pol.observe(st, 0, qt, k_all, kv)


def _oracle_middle(cfg: SelectionEvalConfig, spec):
    """Oracle middle sets (best ``K - sink - recent`` tokens of the true query) for
    TOVA's rows (all layers at one position): fn(q [N, Hq, D], k [N, Hkv, L, D],
    kv_lens [N], K) -> [N, Hkv, L] bool."""
    from spade import kernels
    from spade.policies.common import middle_bounds

    def fn(qt, k_all, kv, budget):
        k_top = budget - cfg.sink_tokens - cfg.recent_tokens
        scores = kernels.group_scores(qt.to(k_all.dtype), k_all, kv, scale=spec.softmax_scale,
                                      reduce=cfg.group_reduces[0])
        lo, hi = middle_bounds(kv, None, cfg.sink_tokens, cfg.recent_tokens)
        rk = Ranked(scores, lo, hi, k_top)
        return rk.mask(torch.full((k_all.shape[0],), k_top, device=k_all.device))

    return fn


def positions_for(cfg: SelectionEvalConfig, length: int) -> torch.Tensor:
    """Decode positions evenly spaced in ``[start, length)`` (at least W+1 into the text)."""
    lo = max(cfg.start, cfg.window + 1, max(cfg.distances, default=1))
    if lo >= length:
        raise ValueError(f"eval.selection.start ({cfg.start}) must be below context_tokens ({length})")
    n = min(cfg.positions, length - lo)
    return torch.linspace(lo, length - 1, n).round().long().unique()


@torch.no_grad()
def evaluate_captured(cfg: SelectionEvalConfig, spec, qs: list[torch.Tensor], ks: list[torch.Tensor],
                      acc: Acc, advance=None) -> None:
    """Run every measurement on one captured text (``qs``/``ks`` per layer)."""
    T = ks[0].shape[1]
    ts = positions_for(cfg, T)
    for layer in range(len(qs)):
        for c in range(0, len(ts), cfg.batch_positions):
            _replay_layer(cfg, spec, qs[layer], ks[layer], ts[c:c + cfg.batch_positions], layer, acc)
        if advance:
            advance()
    evicting = _evicting(cfg)
    if evicting:
        ref_fn = _oracle_middle(cfg, spec)
        for b in cfg.budgets:
            for name in evicting:
                _replay_evicting(cfg, spec, name, qs, ks, ts, b, acc, ref_fn)
            if advance:
                advance()


def _evicting(cfg: SelectionEvalConfig) -> list[str]:
    """The baselines whose dropped tokens never come back (replayed along the sequence)."""
    return [b for b in cfg.baselines if POLICIES.get(b).evicts]


def summarize(acc: Acc) -> list[dict]:
    """One record per (budget, policy, reduce): layer-averaged and per-layer metrics."""
    keys = sorted({k[:3] for k in acc.data})
    out = []
    for b, p, r in keys:
        rec: dict[str, Any] = {"budget": b, "policy": p, "reduce": r}
        for m in ("recall", "overlap"):
            key = (b, p, r, m)
            if key in acc.data:
                rec[m] = acc.mean(key)
                rec[f"{m}_per_layer"] = acc.per_layer(key)
                rec["n"] = acc.count(key)
        out.append(rec)
    return out


def run_selection(cfg: SelectionEvalConfig, out_dir: Path, device: str = "cpu") -> dict:
    """The whole measurement for every configured model; writes
    ``selection_<model>.json`` and plots under ``out_dir``."""
    from spade.eval import plots
    from spade.models.hf import attention_spec
    from spade.eval.capture import capture_qk

    results: dict[str, Any] = {"config": cfg.model_dump(mode="json"), "models": {}}
    for name in cfg.models:
        model, tok = load_model(name, device)
        spec = attention_spec(model)
        acc = Acc(spec.n_layers)
        texts = essay_token_segments(tok, cfg.context_tokens, cfg.n_texts)
        n_steps = len(texts) * (spec.n_layers + (len(cfg.budgets) if _evicting(cfg) else 0))
        with progress(f"selection {name}", n_steps) as advance:
            for i, ids in enumerate(texts):
                cap = capture_qk(model, ids)
                evaluate_captured(cfg, spec, cap.q, cap.k, acc, advance)
                del cap
        rows = summarize(acc)
        results["models"][name] = {
            "spec": {"n_layers": spec.n_layers, "n_q_heads": spec.n_q_heads, "n_kv_heads": spec.n_kv_heads,
                     "head_dim": spec.head_dim},
            "positions": positions_for(cfg, cfg.context_tokens).tolist(),
            "rows": rows,
        }
        if any(n > 1 for n in cfg.score_channels):
            rec = recommend_channels(rows, cfg.score_channels, cfg.channels_tolerance)
            results["models"][name]["recommend_channels"] = rec
            for key, v in rec.items():
                say(f"selection {name}: {key}: score_channels r = {v['r']} (recall {v['recall']:.3f}, "
                    f"all channels {v['recall_full_channels']:.3f})")
        write_json(out_dir / f"selection_{name}.json", results["models"][name] | {"config": results["config"]})
        results["models"][name]["plots"] = plots.selection_plots(name, rows, cfg, out_dir)
        say(f"selection {name}: wrote {out_dir / f'selection_{name}.json'}")
    return results
