"""The inference rank's selector: where each layer's selection comes from.

``AsyncSelector`` copies each layer's (q, k_new, v_new) into the pack buffers the
cache rank receives, and hands back what the cache rank selected one step ahead
(plus sinks and the recent window), and in the ``kv`` return mode attends the K/V the
cache rank gathered (``attend_gathered``, for ``AsyncAttentionContext`` and serving's
``AsyncSlotContext``). ``theta_eff`` and ``is_async_policy`` decide when and whether the
cache rank selects at all.
"""

from __future__ import annotations

import torch

from spade import kernels
from spade.attention import AttentionContext
from spade.kernels.stage import stage_qkv
from spade.policies.base import Policy, Selection
from spade.policies.common import last_token_keys
from spade.runtime.cache_rank import SharedKV


def theta_eff(theta: int, policy: Policy) -> int:
    """Steps with cache length ``<= theta_eff`` decode densely (0 means the budget)."""
    b = policy.budget
    return max(int(theta), int(b)) if b is not None else int(theta)


def is_async_policy(policy: Policy) -> bool:
    """Whether the policy can select one step ahead on a cache rank."""
    return not policy.needs_current_query and policy.budget is not None


# ============================================================================ inference rank
class AsyncSelector:
    """The inference rank's ``Selector``: hands out the cache rank's selections and
    stages each layer's (q, k_new, v_new) for the pack message."""

    def __init__(self, spec, packs: list[tuple[int, int]], *, stage_kv: bool, shared: SharedKV | None,
                 return_mode: str, rerank: tuple[int, str] | None = None, q_rows: int = 0):
        self.spec = spec
        self.q_rows = int(q_rows or 0)
        """The prompt's last queries the cache rank's boot takes (``Policy.rows``; 0: all): a
        prefill keeps only these per layer, not the prompt's every query (2 GB per layer of
        Qwen3-8B at 256k tokens)."""
        self.rerank = rerank
        """``Policy.rerank_keep()``: the cache rank's selections are candidates, of which
        the attention keeps ``rerank[0]`` by the true query (``Selection.keep``)."""
        self.packs = packs
        self.where = {}  # layer -> (pack, slot in pack)
        for p, (l0, l1) in enumerate(packs):
            for j, layer in enumerate(range(l0, l1)):
                self.where[layer] = (p, j)
        self.stage_kv = stage_kv
        self.shared = shared
        self.return_mode = return_mode
        n = spec.n_layers
        self.cur: list[Selection | None] = [None] * n  # what selection() returns this step
        self.sel: list[Selection | None] = [None] * n  # fixed-buffer selection per layer
        self.idx: list[torch.Tensor | None] = [None] * n  # [B, Hkv, K] int32
        self.k_sel: list[torch.Tensor | None] = [None] * n  # kv mode: [B, Hkv, K, D]
        self.v_sel: list[torch.Tensor | None] = [None] * n
        # pack -> (idx [n, B, Hkv, K], k, v or None, idx's layer views, (n_sink, n_recent)): the layers'
        # buffers as slots of one tensor per pack (``ensure_pack_buffers``), so a selection lands in one copy
        self.pack_idx: dict[int, tuple] = {}
        self.dense_flag = [False] * n  # the cache rank said "no selection" (policy returned None)
        self.key: tuple = ()
        self.seq_len = 0
        self.kv_start: torch.Tensor | None = None
        self.boot: dict[int, tuple] = {}
        #: a paged cache's table when ``boot`` holds the pools the prompt went into (its K/V are read
        #: through it at the boot, one layer at a time), else None: ``boot`` holds the prompt's K/V
        self.boot_table: torch.Tensor | None = None
        self.kv_refs: dict[int, tuple] = {}  # layer -> this rank's (k, v) cache: a restarted cache rank boots from it
        self.q_buf: list[torch.Tensor] = []  # per pack [n, B, Hq, D] (views of pack_buf when fused)
        self.k_buf: list[torch.Tensor] = []  # per pack [n, B, Hkv, D]
        self.v_buf: list[torch.Tensor] = []
        self.pack_buf: list[torch.Tensor] = []  # per pack [n, B, Hq + 2 Hkv, D]: one message tensor
        self.kv_lens0: torch.Tensor | None = None
        self.g_lens: torch.Tensor | None = None  # kv mode: [B] = K
        self.slot_ar: torch.Tensor | None = None  # kv mode: [K]
        self.no_idx: torch.Tensor | None = None  # kv mode: [B, Hkv, 1] of -1
        #: a paged cache's block table during decode steps (``AttentionContext.block_table``), else None
        self.block_table: torch.Tensor | None = None

    # ------------------------------------------------------------------ Selector protocol
    def begin_step(self, seq_len, kv_start):
        self.seq_len = seq_len
        self.kv_start = kv_start

    def selection(self, layer, q, k_cache, kv_lens):
        return self.cur[layer]

    def q_out(self, layer, B):
        """The query's staging slot [B, Hq, D] where q has a buffer of its own (a cache rank
        on this GPU, which reads the cache itself, is sent q alone): the step writes q there
        as it makes it, and ``after`` copies no query. That copy was a memcpy node per layer
        in the step's graph, between two kernels that otherwise overlap their launches (PDL).
        None for a fused pack message (q, k and v heads of one tensor: the attention keeps
        reading a contiguous q, and ``stage_qkv`` stages all three in one launch), before the
        buffers exist, and for another batch size."""
        if not self.q_buf or self.pack_buf:
            return None
        p, j = self.where[layer]
        slot = self.q_buf[p][j]
        return slot if slot.shape[0] == B else None

    def _stage_q(self, p, j, q):
        slot = self.q_buf[p][j]
        if q.data_ptr() != slot.data_ptr() or q.stride() != slot.stride() or q.shape != slot.shape:
            slot.copy_(q)

    def after(self, layer, q, k_cache, v_cache, kv_lens):
        p, j = self.where[layer]
        bt = self.block_table
        if bt is not None:  # a paged cache: the newest k/v row through the table
            self._stage_q(p, j, q)
            if self.stage_kv:
                self.k_buf[p][j].copy_(last_token_keys(k_cache, kv_lens, bt))
                self.v_buf[p][j].copy_(last_token_keys(v_cache, kv_lens, bt))
        elif self.pack_buf and q.dim() == 3 and k_cache.shape[0] == q.shape[0]:
            # one launch: q and the newest k/v row (device-side position) into the pack slot
            stage_qkv(q, k_cache, v_cache, kv_lens, self.pack_buf[p][j])
        else:
            self._stage_q(p, j, q)
            if self.stage_kv:  # device-side gather at kv_lens - 1: graph-safe
                self.k_buf[p][j].copy_(last_token_keys(k_cache, kv_lens))
                self.v_buf[p][j].copy_(last_token_keys(v_cache, kv_lens))
        self.kv_refs[layer] = (k_cache, v_cache)
        if self.shared is not None:
            self.shared.refs[layer] = (k_cache, v_cache)
            self.shared.tables[layer] = bt

    def prefill(self, layer, q, k_cache, v_cache, kv_lens, pool=None):
        """A static batch's prompt, layer by layer, for the cache rank's boot: the queries,
        and the K/V (``pool``: a paged cache's (key pool, value pool, table), kept instead of
        the prompt's contiguous K/V, which would double the cache until the boot)."""
        if not self.q_buf:
            self.allocate(q.shape[0], q.shape[1], k_cache.shape[1], q.shape[3], q.dtype, k_cache.dtype, q.device)
            self.kv_lens0 = kv_lens.clone()
        if self.q_rows and q.shape[2] > self.q_rows:  # a copy: a view would keep the whole [B, Hq, T, D] alive
            q = q[:, :, q.shape[2] - self.q_rows:].contiguous()
        table = None
        if pool is not None:  # a paged cache: keep its pools, not the prompt's contiguous copies (a second KV)
            k_cache, v_cache, table = pool
        self.boot_table = table
        self.boot[layer] = (q, k_cache, v_cache)
        self.kv_refs[layer] = (k_cache, v_cache)
        if self.shared is not None:  # a colocated cache rank reads them (through the table, if any)
            self.shared.refs[layer] = (k_cache, v_cache)
            self.shared.tables[layer] = table

    # ------------------------------------------------------------------ runtime side
    def graph_key(self) -> tuple:
        return self.key

    def allocate(self, B: int, Hq: int, Hkv: int, D: int, q_dtype, kv_dtype, device) -> None:
        """Per-pack staging buffers. With K/V to ship and one dtype, q, k and v are
        head ranges of one [n, B, Hq + 2 Hkv, D] tensor: one message tensor per pack
        (one NCCL send instead of three)."""
        self.q_buf, self.k_buf, self.v_buf, self.pack_buf = [], [], [], []
        for l0, l1 in self.packs:
            n = l1 - l0
            if self.stage_kv and q_dtype == kv_dtype:
                buf = torch.zeros(n, B, Hq + 2 * Hkv, D, dtype=q_dtype, device=device)
                self.pack_buf.append(buf)
                self.q_buf.append(buf[:, :, :Hq])
                self.k_buf.append(buf[:, :, Hq:Hq + Hkv])
                self.v_buf.append(buf[:, :, Hq + Hkv:])
                continue
            self.q_buf.append(torch.zeros(n, B, Hq, D, dtype=q_dtype, device=device))
            if self.stage_kv:
                self.k_buf.append(torch.zeros(n, B, Hkv, D, dtype=kv_dtype, device=device))
                self.v_buf.append(torch.zeros(n, B, Hkv, D, dtype=kv_dtype, device=device))

    def pack_tensors(self, p: int) -> list[torch.Tensor]:
        """The "qkv" message of pack ``p``: [qkv] fused, [q, k, v], or [q] (shared cache)."""
        if self.pack_buf:
            return [self.pack_buf[p]]
        if self.stage_kv:
            return [self.q_buf[p], self.k_buf[p], self.v_buf[p]]
        return [self.q_buf[p]]

    def ensure_pack_buffers(self, p: int, B: int, H: int, K: int, n_sink: int, n_recent: int, device,
                            kv_dtype=None, D: int = 0, kv_start=None) -> None:
        """Pack ``p``'s layers' selection buffers as views of one [n, B, H, K] tensor (and
        [n, B, H, K, D] K/V in the kv return mode), so that a pack's selection lands with
        one copy (``land_pack``). Kept when already in place at this layout."""
        l0, l1 = self.packs[p]
        n = l1 - l0
        got = self.pack_idx.get(p)
        if got is not None and got[0].shape == (n, B, H, K) and got[4] == (n_sink, n_recent) and self.pack_intact(p):
            return
        idx = torch.full((n, B, H, K), -1, dtype=torch.int32, device=device)
        ks = vs = None
        if self.return_mode == "kv":
            ks = torch.zeros(n, B, H, K, D, dtype=kv_dtype, device=device)
            vs = torch.zeros(n, B, H, K, D, dtype=kv_dtype, device=device)
        views = idx.unbind(0)
        self.pack_idx[p] = (idx, ks, vs, views, (n_sink, n_recent))
        for j, layer in enumerate(range(l0, l1)):
            self._set_buffers(layer, views[j], n_sink, n_recent, B, K, device, kv_start,
                              None if ks is None else ks[j], None if vs is None else vs[j])

    def gathered(self, layer: int, sel: Selection | None) -> bool:
        """Whether ``layer`` attends its selection's middle tokens from the K/V the cache
        rank gathered (the ``kv`` return mode, a sparse step with a middle; streaming's
        sinks and window alone are all local)."""
        return self.return_mode == "kv" and sel is not None and self.idx[layer].shape[-1] > 0

    def attend_gathered(self, layer: int, q, k_cache, v_cache, kv_lens, sel: Selection, *, scale: float, kv_start,
                        stats, block_table=None) -> torch.Tensor:
        """The ``kv`` return mode's attention: the middle tokens from the gathered K/V the
        cache rank sent (re-ranked first by the true query when they are candidates)
        merged exactly, by log-sum-exp, with the sinks and recent window of the local
        cache (``block_table``: its pools' table)."""
        idx = self.idx[layer]  # [B, Hkv, K]
        slots = torch.where(idx >= 0, self.slot_ar, torch.full_like(idx, -1))  # gathered buffer positions
        if sel.keep > 0:  # two-stage: the candidates' K/V travelled; the true query keeps the best
            slots = kernels.rerank_select(q, self.k_sel[layer], slots, sel.keep, scale=scale, reduce=sel.keep_reduce)
        # the two launches add their tokens to ``stats``; one counts the call
        out_a, lse_a = kernels.sparse_decode_attention(q, self.k_sel[layer], self.v_sel[layer], self.g_lens, slots,
                                                       scale=scale, return_lse=True, stats=stats, count_call=False)
        out_b, lse_b = kernels.sparse_decode_attention(q, k_cache, v_cache, kv_lens, self.no_idx, n_sink=sel.n_sink,
                                                       n_recent=sel.n_recent, scale=scale, kv_start=kv_start,
                                                       return_lse=True, stats=stats, block_table=block_table)
        out, _ = kernels.merge_attention_states(out_a, lse_a, out_b, lse_b)
        return out

    def pack_intact(self, p: int, allow_none: bool = False) -> bool:
        """Whether every layer of pack ``p`` still hands out its slot of the pack's tensor
        (``allow_none``: or has no buffer yet); a layer re-made alone (``ensure_buffers``)
        takes its pack off the one-copy landing."""
        got = self.pack_idx.get(p)
        l0, l1 = self.packs[p]
        if got is None:
            return allow_none and all(self.idx[layer] is None for layer in range(l0, l1))
        views = got[3]
        return all(self.idx[layer] is views[j] or (allow_none and self.idx[layer] is None)
                   for j, layer in enumerate(range(l0, l1)))

    def land_pack(self, p: int, msg: list[torch.Tensor], n_sink: int, n_recent: int, device, kv_dtype=None,
                  D: int = 0, kv_start=None) -> bool:
        """Copy a whole pack's selection (``msg``: [idx [n, B, H, K]] and, in the kv mode,
        its K and V) into the pack's buffers, made or re-made for that layout, in one copy
        per tensor. False (nothing copied) when a layer holds buffers of its own: the
        caller lands layer by layer."""
        if not self.pack_intact(p, allow_none=True):
            return False
        _, B, H, K = msg[0].shape
        self.ensure_pack_buffers(p, B, H, K, n_sink, n_recent, device, kv_dtype=kv_dtype, D=D, kv_start=kv_start)
        got = self.pack_idx[p]
        got[0].copy_(msg[0], non_blocking=True)
        if self.return_mode == "kv":
            got[1].copy_(msg[1], non_blocking=True)
            got[2].copy_(msg[2], non_blocking=True)
        return True

    def ensure_buffers(self, layer: int, B: int, H: int, K: int, n_sink: int, n_recent: int, device,
                       kv_dtype=None, D: int = 0, kv_start=None) -> None:
        idx = self.idx[layer]
        if idx is not None and idx.shape == (B, H, K) and self.sel[layer].n_sink == n_sink \
                and self.sel[layer].n_recent == n_recent:
            return
        k_sel = v_sel = None
        if self.return_mode == "kv":
            k_sel = torch.zeros(B, H, K, D, dtype=kv_dtype, device=device)
            v_sel = torch.zeros(B, H, K, D, dtype=kv_dtype, device=device)
        self._set_buffers(layer, torch.full((B, H, K), -1, dtype=torch.int32, device=device), n_sink, n_recent,
                          B, K, device, kv_start, k_sel, v_sel)

    def _set_buffers(self, layer: int, idx: torch.Tensor, n_sink: int, n_recent: int, B: int, K: int, device,
                     kv_start, k_sel: torch.Tensor | None, v_sel: torch.Tensor | None) -> None:
        H = idx.shape[1]
        self.idx[layer] = idx
        self.sel[layer] = Selection(indices=self.idx[layer], n_sink=n_sink, n_recent=n_recent, kv_start=kv_start)
        if self.rerank is not None and K > self.rerank[0]:  # candidates: re-ranked at attention
            self.sel[layer].keep, self.sel[layer].keep_reduce = self.rerank
        if self.return_mode == "kv":
            self.k_sel[layer] = k_sel
            self.v_sel[layer] = v_sel
            if self.g_lens is None or self.g_lens.numel() != B or int(self.slot_ar.numel()) != K:
                self.g_lens = torch.full((B,), K, dtype=torch.int64, device=device)
                self.slot_ar = torch.arange(K, dtype=torch.int32, device=device)
                self.no_idx = torch.full((B, H, 1), -1, dtype=torch.int32, device=device)


class AsyncAttentionContext(AttentionContext):
    """``AttentionContext`` whose graph key is the runtime's, and which attends the
    ``kv`` return mode: the gathered middle tokens (sent by the cache rank) and
    the sinks + recent window of the local cache, merged exactly."""

    def graph_key(self) -> tuple:
        return self.selector.graph_key()

    def attend(self, layer, q, k_cache, v_cache, kv_lens):
        s = self.selector
        sel = s.selection(layer, q, k_cache, kv_lens)
        if not s.gathered(layer, sel):
            return super().attend(layer, q, k_cache, v_cache, kv_lens)
        kv_start = sel.kv_start if sel.kv_start is not None else self.kv_start
        out = s.attend_gathered(layer, q, k_cache, v_cache, kv_lens, sel, scale=self.spec.softmax_scale,
                                kv_start=kv_start, stats=self.layer_stats(layer, q, k_cache),
                                block_table=self.block_table)
        s.after(layer, q, k_cache, v_cache, kv_lens)
        return out
