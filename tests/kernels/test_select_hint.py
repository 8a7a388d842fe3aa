"""The hint path of the fused score + top-K (``score_topk(hint=)``): a per-row score
threshold carried between calls lets stage 1 list the likely winners, and one program
per row finishes them; whatever the hint holds, the result is the exact top-K."""

from __future__ import annotations

import math

import pytest
import torch

from spade.kernels import quant, scoring
from tests.policies.sim import DecodeSim, make_policy, middle_sets

REDUCES = ("sum_logits", "max_logits", "sum_softmax")


def _sets(idx: torch.Tensor) -> list[list[set[int]]]:
    return [[set(x for x in row.tolist() if x >= 0) for row in head] for head in idx]


def _inputs(B: int, Hq: int, Hkv: int, L: int, D: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=g)
    k = torch.randn(B, Hkv, L, D, generator=g)
    lo = torch.randint(0, 9, (B,), generator=g)
    hi = L - torch.randint(0, 20, (B,), generator=g)
    return q, k, lo, hi, g


def _check_call(q, k, lo, hi, K, reduce, hint, hint_ref, k_scale=None, counts=None):
    kw = dict(reduce=reduce, kv_lens=hi, k_scale=k_scale)
    got = scoring.score_topk_triton(q, k, lo, hi, K, hint=hint, hint_counts=counts, **kw)
    want = scoring.score_topk_ref(q, k, lo, hi, K, hint=hint_ref, **kw)
    assert _sets(got) == _sets(want)
    n = (hi - lo).clamp(min=0)
    for b in range(q.shape[0]):
        assert ((got[b] >= 0).sum(-1) == min(K, int(n[b]))).all()  # -1 padding after the valid count
    torch.testing.assert_close(hint, hint_ref, rtol=0, atol=0)


@pytest.mark.parametrize("B,Hq,Hkv", [(1, 4, 4), (3, 4, 2), (3, 4, 1)])
@pytest.mark.parametrize("K", [1, 7, 33, 400])
@pytest.mark.parametrize("reduce", REDUCES)
def test_hint_path_is_exact_and_updates_like_the_reference(B, Hq, Hkv, K, reduce):
    """Over calls with a slowly drifting query: the same sets as the reference top-K,
    and the same next hint, call after call (the first call starts from -inf)."""
    q, k, lo, hi, g = _inputs(B, Hq, Hkv, 211, 16, seed=B * 100 + K)
    hint = torch.full((B, Hkv), float("-inf"))
    hint_ref = hint.clone()
    for _ in range(4):
        q = q + 0.05 * torch.randn(q.shape, generator=g)
        _check_call(q, k, lo, hi, K, reduce, hint, hint_ref)


@pytest.mark.parametrize("reduce", ["sum_logits", "sum_softmax"])
def test_hint_path_with_int8_keys(reduce):
    q, k, lo, hi, g = _inputs(3, 4, 2, 157, 16, seed=5)
    kq, ks = quant.quantize_keys_ref(k)
    hint = torch.full((3, 2), float("-inf"))
    hint_ref = hint.clone()
    for _ in range(3):
        q = q + 0.05 * torch.randn(q.shape, generator=g)
        _check_call(q, kq, lo, hi, 11, reduce, hint, hint_ref, k_scale=ks)


def test_the_list_path_is_taken_once_the_hint_is_set():
    """After the first call (-inf: every row falls back and aims its hint), a slowly
    drifting query keeps each row's list between K and CAP: no fallback."""
    B, Hkv, K = 3, 2, 9
    q, k, lo, hi, g = _inputs(B, 4, Hkv, 300, 16, seed=1)
    R, cap = scoring._hint_sizes(K)
    hint = torch.full((B, Hkv), float("-inf"))
    counts = torch.zeros(B, Hkv, dtype=torch.int32)
    n_valid = (hi - lo)[:, None].expand(B, Hkv)
    scoring.score_topk_triton(q, k, lo, hi, K, hint=hint, hint_counts=counts)
    assert (counts == n_valid).all() and (counts > cap).all()  # -inf lists every valid position: fallback
    assert torch.isfinite(hint).all()
    for _ in range(3):
        q = q + 0.02 * torch.randn(q.shape, generator=g)
        _check_call(q, k, lo, hi, K, "sum_logits", hint, hint.clone(), counts=counts)
        assert ((counts >= K) & (counts <= cap)).all(), counts
    assert R == math.ceil(1.25 * K)


@pytest.mark.parametrize("fill", [float("inf"), float("-inf"), 0.0, "random"])
def test_any_hint_gives_the_exact_top_k(fill):
    """A stale, extreme or random hint changes only which path runs."""
    B, Hkv, K = 3, 2, 13
    q, k, lo, hi, g = _inputs(B, 4, Hkv, 260, 16, seed=7)
    if fill == "random":
        hint = torch.randn(B, Hkv, generator=g) * 3
    else:
        hint = torch.full((B, Hkv), fill)
    _check_call(q, k, lo, hi, K, "sum_logits", hint, hint.clone())
    if fill == float("inf"):  # an empty list: every row fell back and re-aimed its hint
        assert torch.isfinite(hint).all()


def test_k_at_least_the_context_takes_every_valid_position():
    B, Hkv = 2, 2
    q, k, lo, hi, _ = _inputs(B, 4, Hkv, 40, 16, seed=3)
    hint = torch.full((B, Hkv), float("-inf"))
    counts = torch.zeros(B, Hkv, dtype=torch.int32)
    got = scoring.score_topk_triton(q, k, lo, hi, 64, hint=hint, hint_counts=counts)
    for b in range(B):
        for h in range(Hkv):
            assert set(got[b, h].tolist()) - {-1} == set(range(int(lo[b]), int(hi[b])))
    assert (counts == (hi - lo)[:, None]).all()  # the list holds them all: no fallback
    assert torch.isneginf(hint).all()  # at most R valid positions: keep listing all of them


def test_hint_is_validated():
    q, k, lo, hi, _ = _inputs(1, 2, 2, 30, 8, seed=0)
    with pytest.raises(ValueError, match=r"hint must be a contiguous float32 \[1, 2\]"):
        scoring.score_topk_triton(q, k, lo, hi, 5, hint=torch.zeros(2, 1))
    with pytest.raises(ValueError, match="hint must be"):
        scoring.score_topk_triton(q, k, lo, hi, 5, hint=torch.zeros(1, 2, dtype=torch.float64))


def test_update_hint_ref_aims_at_r():
    """The next hint is the floor of the R-th largest score's 16-bit bucket: at least R
    scores reach it, and every score above the bucket does."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 3, 500, generator=g)
    lo, hi = torch.tensor([0, 50]), torch.tensor([500, 450])
    K = 40
    R, _ = scoring._hint_sizes(K)
    h = scoring.update_hint_ref(s, lo, hi, K, torch.full((2, 3), float("-inf")))
    for b in range(2):
        row = s[b, :, lo[b]:hi[b]]
        rth = row.topk(R, dim=-1).values[:, -1]
        assert ((row >= h[b, :, None]).sum(-1) >= R).all()
        assert (h[b] <= rth).all() and (rth - h[b] <= rth.abs() * 2 ** -7 + 1e-30).all()


def test_policy_selects_the_same_with_and_without_the_hint(monkeypatch):
    """asyncspade over decode steps: the hint (on by default) never changes a selection."""
    def run(hint_on: bool):
        if not hint_on:
            monkeypatch.setitem(scoring.SELECT_CONFIG, "hint_cap", 0)  # _hint_sizes -> None: the plain path
        sim = DecodeSim(B=3, Hq=4, Hkv=2, kv_start=[0, 5, 2], prompt_len=60, steps=5, n_layers=2, seed=4)
        pol = make_policy("asyncspade", sim, budget=24, sink_tokens=2, recent_tokens=4, predictor="assembled",
                          window=3, group_reduce="sum_logits")
        recs = sim.run(pol)
        monkeypatch.delitem(scoring.SELECT_CONFIG, "hint_cap", raising=False)
        return [middle_sets(r.sel) for r in recs if r.sel is not None and r.sel.indices is not None]

    with_hint, without = run(True), run(False)
    assert len(with_hint) == len(without) > 0
    assert with_hint == without
