"""Causal attention of a prompt piece (chunked prefill), split so that fused kernels run it.

A piece's queries ``q`` [B, Hq, c, D] are the last ``c`` of the ``n`` cache positions
``k``/``v`` [B, Hkv, n, D]; query ``i`` sees keys ``0 .. n - c + i`` (the lower-right
causal mask). Two parts cover that mask exactly:

* **the earlier pieces** (keys ``0 .. n - c - 1``): every query sees every key, no mask.
  The ``G = Hq / Hkv`` query heads of a KV head are folded into its rows
  (``[B, Hkv, G * c, D]``, a view), so the cache is read as it lies: no grouped-head
  copy of the whole prompt so far;
* **the piece itself** (its ``c`` keys): a square causal mask, the grouped heads of
  only these ``c`` keys expanded.

Each part returns its output and its rows' log-sum-exp, and the two merge exactly:
``o = (o1 e^{l1} + o2 e^{l2}) / (e^{l1} + e^{l2})``. On CUDA the parts run on the fused
SDPA kernels that return the log-sum-exp (cuDNN's, else flash's): unmasked and
top-left-causal calls, which take the fastest kernels, where one lower-right-masked call
takes only flash (measured on an H200 at 32k tokens in 2,048-token pieces: flash at
~340 TFLOP/s against cuDNN's ~650 in the whole-prompt pass; docs/serving.md). Those
kernels take fp16 / bf16 only (``fused_ok``): in fp32 on a GPU, and on a CPU,
``chunk_attention`` keeps one masked SDPA call; ``split=True`` runs the split on a CPU
too, with a torch log-sum-exp (the tests' reference of the merge).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_FUSED: str | None = None  # "cudnn" | "flash": the kernel the split runs on, chosen by the first call


def _lse_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and its rows' natural log-sum-exp, written out (scores in fp32 or wider)."""
    ct = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.to(ct), k.to(ct).transpose(-1, -2)) * scale  # [B, H, L, S]
    if causal:
        L, S = s.shape[-2:]
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), v.to(ct)).to(q.dtype), lse


def _lse_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same from a fused SDPA kernel: cuDNN's, else flash's (the first that runs is kept)."""
    global _FUSED
    if _FUSED != "flash":
        try:
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                     scale=scale)
            _FUSED = "cudnn"
            return out[0], out[1].reshape(out[0].shape[:-1])
        except (RuntimeError, AttributeError, NotImplementedError) as e:
            if _FUSED is None:  # never ran here: flash from now on
                _FUSED = "flash"
            log.info("prompt pieces: cuDNN attention did not run (%s); flash runs this call%s",
                     str(e).splitlines()[0][:200], "" if _FUSED == "cudnn" else " and the next ones")
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out[0], out[1].reshape(out[0].shape[:-1])


def fused_ok(q: torch.Tensor) -> bool:
    """Whether the split runs on the fused kernels: CUDA, fp16 / bf16, head dim <= 256
    (what cuDNN's and flash's kernels take). Otherwise (fp32 on a GPU, a CPU) one masked
    SDPA call: on CUDA the lower-right causal bias (the efficient kernel in fp32)."""
    return q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    split: bool | None = None) -> torch.Tensor:
    """Lower-right causal attention of a prompt piece: q [B, Hq, c, D], k/v [B, Hkv, n, D]
    (n >= c) -> [B, Hq, c, D]. ``split`` (default: ``fused_ok``) runs the two parts and
    merges them (module doc); otherwise one masked SDPA call."""
    B, Hq, c, D = q.shape
    Hkv, n = k.shape[1], k.shape[2]
    G = Hq // Hkv
    if split is None:
        split = fused_ok(q)
    if not split:
        if G > 1:
            k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # [B, Hq, n, D]
        if q.device.type == "cuda":  # flash's lower-right mask (bf16 / fp16), else the efficient kernel
            from torch.nn.attention.bias import causal_lower_right

            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(c, n), scale=scale)
        mask = torch.ones(c, n, dtype=torch.bool, device=q.device).tril(diagonal=n - c)  # [c, n]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    part = _lse_fused if q.device.type == "cuda" else _lse_torch
    kc, vc = k[:, :, n - c:], v[:, :, n - c:]
    if G > 1:
        kc, vc = kc.repeat_interleave(G, dim=1), vc.repeat_interleave(G, dim=1)  # [B, Hq, c, D]: the piece only
    o2, l2 = part(q, kc, vc, True, scale)  # the piece: square causal
    if n == c:
        return o2
    qf = q.reshape(B, Hkv, G * c, D)  # head h = kv * G + g, row g * c + i: a view of a contiguous q
    o1, l1 = part(qf, k[:, :, :n - c], v[:, :, :n - c], False, scale)  # the earlier pieces: no mask
    o1, l1 = o1.reshape(B, Hq, c, D), l1.reshape(B, Hq, c)
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m)[..., None], torch.exp(l2 - m)[..., None]
    ct = torch.promote_types(q.dtype, torch.float32)
    return ((o1.to(ct) * w1 + o2.to(ct) * w2) / (w1 + w2)).to(q.dtype)
