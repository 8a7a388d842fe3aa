"""Next-query predictors for ``asyncspade`` and the RoPE helpers they use.

The asynchronous selection for step t must be made before q_t exists, so it
scores the cache with a prediction q̂_t made from a window of past queries
``q_{t-R}, ..., q_{t-1}`` (oldest first). The kinds (the math lives in
``spade.kernels.ridge``; see ``docs/policies.md`` for the equations):

* ``last``: q̂_t = q_{t-1} (a one-step-stale query).
* ``ridge``: express the newest query as a combination of the ones before it
  with ridge-regularised weights, then apply the same weights one step later.
* ``softmax_ridge``: the same with the weights softmax-normalised.
* ``assembled``: the softmax ridge fitted for every window size 1..W and
  average-pooled (the paper's predictor).

``rope_aware``: queries carry RoPE, a rotation that advances with the position,
so a regression over post-RoPE queries must also learn the rotation. Instead
the policy un-rotates each observed query to its pre-RoPE form (rotation by
``-position``), predicts in that space and rotates the prediction to the
position of the token being decoded. Both rotations are pure (without the
model's ``attention_scaling``), so un-rotate ∘ rotate is the identity.
"""

from __future__ import annotations

import dataclasses

import torch

from spade import kernels
from spade.policies.base import RopeSpec

PREDICTOR_KINDS = ("last", "ridge", "softmax_ridge", "assembled")


def predict(window: torch.Tensor, n_valid: int, kind: str = "assembled", eps: float = 1e-2,
            skip: torch.Tensor | None = None) -> torch.Tensor:
    """Predict the next query of every (row, head) from its window.

    ``window``: [B, H, R, D] past queries, oldest first, the last ``n_valid``
    (host int, 1 <= n_valid <= R) rows valid. Returns q̂ [B, H, D] float32.
    ``skip`` ([B] bool, ``PolicyState.idle``): rows predicted as their newest query (no solve).

    >>> w = torch.arange(12.0).view(1, 1, 3, 4)
    >>> predict(w, 3, "last")
    tensor([[[ 8.,  9., 10., 11.]]])
    """
    if kind not in PREDICTOR_KINDS:
        raise ValueError(f"unknown predictor {kind!r}; choose one of: {', '.join(PREDICTOR_KINDS)}")
    B, H, R, D = window.shape
    if not 1 <= n_valid <= R:
        raise ValueError(f"n_valid={n_valid} must lie in [1, {R}]")
    out = kernels.ridge_predict(window.reshape(B * H, R, D), n_valid, mode=kind, eps=eps, skip=skip, per=H)
    return out.view(B, H, D)


def rope_cos_sin(rope: RopeSpec, positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-rotation cos, sin of shape [*positions.shape, rot_dim] float32 on the
    positions' device (``rot_dim = rope.dim`` or ``head_dim`` when 0)."""
    dim = rope.dim or head_dim
    if dim != rope.dim:
        rope = dataclasses.replace(rope, dim=dim)
    cos, sin = rope.cos_sin(positions, device=positions.device, dtype=torch.float32)
    if rope.attention_scaling != 1.0:  # a pure rotation: the model's scaling stays in q
        cos, sin = cos / rope.attention_scaling, sin / rope.attention_scaling
    return cos, sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotate(x: torch.Tensor, positions: torch.Tensor, rope: RopeSpec, *, inverse: bool = False) -> torch.Tensor:
    """Rotate ``x`` by its positions (``inverse``: by minus them), in float32.

    ``x``: [B, H, D] with ``positions`` [B], or [B, H, T, D] with ``positions``
    [B, T]. Only the first ``rope.dim`` dims rotate (partial rotary), HF
    ``rotate_half`` layout. ``rotate(rotate(x, p), p, inverse=True) == x`` up to
    float rounding.

    >>> spec = RopeSpec(theta=10000.0, dim=4)
    >>> x = torch.randn(2, 3, 4); p = torch.tensor([5, 17])
    >>> torch.allclose(rotate(rotate(x, p, spec), p, spec, inverse=True), x, atol=1e-6)
    True
    """
    D = x.shape[-1]
    cos, sin = rope_cos_sin(rope, positions, D)  # [B, rot] or [B, T, rot]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    if inverse:
        sin = -sin
    x = x.float()
    rot = cos.shape[-1]
    xr = x[..., :rot]
    xr = xr * cos + _rotate_half(xr) * sin
    return xr if rot == D else torch.cat([xr, x[..., rot:]], dim=-1)
