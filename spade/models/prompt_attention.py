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

**Bounded cuDNN shapes.** cuDNN builds an execution plan for every new (shape, strides)
it runs, ~68 ms on an H100 (cached: 0.94 ms for a 2,048-token piece over 16k earlier
tokens, flash 1.59), and keeps every plan for the life of the thread. A served trace's
prompts have random lengths and their first and last pieces random sizes, so every
piece would build a plan: more than the piece's whole attention. So only calls of a
bounded set of shapes go to cuDNN, the rest to flash (no plan):

* a piece whose size ``c`` is a power of two ``>= PLAN_MIN_ROWS`` (``serving.prefill_chunk``'s
  middle pieces) sends its first ``plan_keys(n - c)`` earlier keys, the longest length of
  the ladder ``j * 2^e`` (``j = 4..7``: four per octave, ``>= PLAN_MIN_KEYS``) that fits,
  to cuDNN unmasked; the rest of the earlier keys (under a quarter) and the piece itself go
  to one lower-right causal flash call;
* any other piece runs both parts on flash;
* with a paged cache the piece's keys so far are gathered into a buffer of
  ``plan_capacity`` positions (its strides are part of the plan's key too);
* a whole prompt (``causal_attention``) shorter than ``WHOLE_PLAN_MIN`` tokens runs on
  flash, longer ones on cuDNN: a whole pass of a new length (Qwen3-8B, one H100) took
  127 / 279 / 664 ms at 4k / 8k / 16k on flash against 177 / 318 / 596 on cuDNN with its
  plan (docs/perf.md, "Prefill").
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_FUSED: str | None = None  # "cudnn" | "flash": the kernel the plan-bounded calls run on, chosen by the first call
PLAN_MIN_ROWS = 512  # the smallest piece whose earlier keys may go to cuDNN (a power of two)
PLAN_MIN_KEYS = 2048  # the fewest earlier keys sent to cuDNN (the ladder's first rung)
WHOLE_PLAN_MIN = 16384  # the shortest whole prompt whose causal pass runs on cuDNN


def plan_keys(m: int) -> int:
    """The earlier keys of a piece sent to cuDNN: the longest ``j * 2^e <= m`` with
    ``j`` in 4..7 (four lengths per octave; what is left is under a quarter of ``m``),
    at least ``PLAN_MIN_KEYS``; 0 when ``m`` is shorter."""
    if m < PLAN_MIN_KEYS:
        return 0
    e = m.bit_length() - 3
    return (m >> e) << e


def plan_capacity(n: int) -> int:
    """The positions of a buffer that holds ``n``: the shortest ``j * 2^e >= n`` (``j`` in
    4..7), so that the buffers' strides, like ``plan_keys``'s lengths, take four values
    per octave."""
    if n <= 4:
        return max(n, 0)
    e = (n - 1).bit_length() - 3
    j = -(-n >> e) if n % (1 << e) else n >> e
    return (j << e) if j < 8 else 8 << e


def plan_rows(c: int) -> bool:
    """Whether a piece of ``c`` queries sends its earlier keys to cuDNN (a power of two
    ``>= PLAN_MIN_ROWS``: the chunked prefill's middle pieces)."""
    return c >= PLAN_MIN_ROWS and c & (c - 1) == 0


def _lse_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and its rows' natural log-sum-exp, written out (scores in fp32 or wider)."""
    ct = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.to(ct), k.to(ct).transpose(-1, -2)) * scale  # [B, H, L, S]
    if causal:  # lower-right: the last query sees every key
        L, S = s.shape[-2:]
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool, device=s.device).tril(S - L), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), v.to(ct)).to(q.dtype), lse


def _lse_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same from flash's kernel (no plan to build; ``causal`` is lower-right there)."""
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out[0], out[1].reshape(out[0].shape[:-1])


def _lse_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same from cuDNN's kernel (a plan per new shape: plan-bounded calls only), else
    flash's (where cuDNN never ran, flash from then on)."""
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
    return _lse_flash(q, k, v, causal, scale)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a whole prompt, q/k/v [B, H, T, D] (grouped heads expanded):
    flash's kernel below ``WHOLE_PLAN_MIN`` tokens on the fused path (no cuDNN plan for a
    one-off length), else SDPA's own choice."""
    if fused_ok(q) and q.shape[2] < WHOLE_PLAN_MIN:
        try:
            return _lse_flash(q, k, v, True, scale)[0]
        except RuntimeError as e:  # no flash kernel for this GPU or shape: SDPA chooses
            log.info("prompt pass: flash attention did not run (%s); SDPA's choice runs it", str(e).splitlines()[0][:200])
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


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
    planned, free = (_lse_cudnn, _lse_flash) if q.device.type == "cuda" else (_lse_torch, _lse_torch)
    early = n - c  # the earlier pieces' keys
    cut = plan_keys(early) if plan_rows(c) else 0  # keys [0, cut) go to the plan-bounded call
    qf = q.reshape(B, Hkv, G * c, D)  # head h = kv * G + g, row g * c + i: a view of a contiguous q
    if cut:
        o1, l1 = planned(qf, k[:, :, :cut], v[:, :, :cut], False, scale)  # no mask
    kc, vc = k[:, :, cut or early:], v[:, :, cut or early:]  # the rest and the piece (lower-right), or the piece
    if G > 1:
        kc, vc = kc.repeat_interleave(G, dim=1), vc.repeat_interleave(G, dim=1)  # [B, Hq, < early / 4 + c, D]
    o2, l2 = free(q, kc, vc, True, scale)
    if not cut:
        if early == 0:
            return o2
        o1, l1 = free(qf, k[:, :, :early], v[:, :, :early], False, scale)  # the earlier pieces: no mask
    o1, l1 = o1.reshape(B, Hq, c, D), l1.reshape(B, Hq, c)
    mx = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - mx)[..., None], torch.exp(l2 - mx)[..., None]
    ct = torch.promote_types(q.dtype, torch.float32)
    return ((o1.to(ct) * w1 + o2.to(ct) * w2) / (w1 + w2)).to(q.dtype)
