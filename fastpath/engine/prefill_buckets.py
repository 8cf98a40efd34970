"""Prefill-only steps of one short piece padded to a token bucket, one kept batch (a CUDA graph on CUDA) per bucket.

A prefix-cache hit's suffix of any length, at any checkpoint, into any slot runs the graph of the smallest bucket
b > count, built ahead of time (`prepare`), so a hit of a never-seen shape never runs eagerly:

    layout   the real piece (start, count, slot) first, then one dummy piece of b - count tokens (token 0) with
             slot -1 at a start pd < chunk_size, so that no kernel reads or writes any bank slot for it
    sizes    every host quantity a launch depends on is the bucket's alone: T = b tokens, 2 sequences, one logits
             row, the SSD chunk count cdiv(b, chunk_size) + 1 (pd is picked so that the two pieces' chunks add up
             to it), and the attention plan padded to fixed block / item / merge-row counts with no-op entries (a
             block past the dummy piece's end, a merge of zero splits into a dummy row)
    replay   the step's metadata is packed as usual (pack_step, the attention split plan) and copied into the
             kept batch's device tensors; then the graph replays (CPU: the same kept batch runs eagerly)

Bits. Every per-piece kernel here (conv, SSD chunks and state passing, attention items and their split-order merge,
the norms, RoPE) computes a piece from its own metadata; the projections run at M = b instead of M = count.
    batch-invariant  the fixed-tile GEMMs of `FastOptions.batch_invariant` give a row the same bits at every M: the
                     padded step == the unpadded step, bitwise
    default          cuBLAS (or the CPU's BLAS) picks its kernel and split-K by M: a padded step's bits are its
                     bucket's, a function of the step's shape alone. So the engine pads every step a bucket serves —
                     a cold request's pieces as well as a hit's — whether or not the prefix cache is on, and a step
                     that stores a checkpoint inside its piece runs its bucket's layout too (eagerly: the stores are
                     not in the graph). Cache on == cache off stays bitwise wherever the two runs' pieces are equal
                     (DESIGN §12), as without buckets
Buckets need the Triton backend: the padded attention plan is its attention's (`check_buckets`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from fastpath.kernels.attention import (SPLIT_MAX_QUERIES, AttentionPlan, attention_launch_rule, attention_split_rule,
                                        split_plan)

from .graphs import warm_capture
from .packing import pack_step
from .validate import ArgumentError

_FIELDS = ("ids", "pos", "pre_cu", "pre_slot", "pre_start", "pre_init", "last", "pre_tok_seq")
_TABLE = ("chunk_start", "chunk_len", "seq_chunk_ptr")


def default_buckets(chunk_size: int, max_tokens: int) -> tuple[int, ...]:
    """chunk_size, 2·chunk_size, 4·chunk_size, ... up to max_tokens (at least one bucket)."""
    out, b = [], chunk_size
    while b <= max_tokens or not out:
        out.append(b)
        b *= 2
    return tuple(out)


def check_buckets(buckets, model, engine_config, max_len: int, prefill_graphs: bool) -> tuple[int, ...] | None:
    """None, "default" (the `default_buckets` within the step budget and max_len - chunk size; None when not even
    one chunk fits), or rising ints >= 2, multiples of the chunk size, within the step budget and max_len, on the
    Triton backend. Errors name `prefill_buckets`."""
    if buckets is None:
        return None
    name, cs = "prefill_buckets", model.config.chunk_size
    if buckets == "default":
        top = min(engine_config.max_tokens_per_step, max_len - cs)
        buckets = tuple(b for b in default_buckets(cs, top) if b <= top)
        if not buckets:
            return None
    if not isinstance(buckets, (tuple, list)) or not buckets or not all(type(b) is int for b in buckets):
        raise ArgumentError(name, f"must be None, 'default' or a non-empty tuple of ints, got {buckets!r:.80}")
    if not prefill_graphs:
        raise ArgumentError(name, "needs prefill_graphs=True")
    o = model.options
    if o.backend != "triton":
        raise ArgumentError(name, f"needs the Triton backend (got {o.backend!r}): a bucket's padded attention plan is "
                            "the Triton attention's")
    for i, b in enumerate(buckets):
        if b < 2 or b % cs:
            raise ArgumentError(f"{name}[{i}]", f"{b} must be a multiple of the model's chunk size {cs} (and >= 2)")
        if i and b <= buckets[i - 1]:
            raise ArgumentError(f"{name}[{i}]", f"{b} must exceed the bucket before it ({buckets[i - 1]})")
        if b > engine_config.max_tokens_per_step:
            raise ArgumentError(f"{name}[{i}]", f"{b} exceeds engine_config.max_tokens_per_step "
                                f"{engine_config.max_tokens_per_step} (the step size the memory check sized)")
        if b + cs > max_len:
            raise ArgumentError(f"{name}[{i}]", f"{b} + chunk size {cs} exceeds max_len {max_len} (the dummy "
                                "piece's positions)")
    return tuple(buckets)


def _chunks(pos: int, n: int, cs: int) -> int:
    """SSD chunks of a piece of n > 0 tokens starting at absolute position pos (cut at multiples of cs)."""
    return -(-(pos % cs + n) // cs)


class BucketGraphs:
    """One kept StepBatch (+ a captured graph on CUDA) per token bucket, for one-piece prefill-only steps."""

    def __init__(self, model, bank, buckets: tuple[int, ...], capture: bool = True):
        self.model, self.bank, self.buckets = model, bank, tuple(buckets)
        self.cs = model.config.chunk_size
        self.capture = capture and model.device.type == "cuda"
        self.max_len, self.n_slots = bank.max_len, bank.ssm_state.shape[1]
        c = model.config
        self.rule = attention_launch_rule(c.attn_head_dim, model.dtype.itemsize)
        self.key_chunk = attention_split_rule(self.max_len)
        self.splits = max(1, -(-self.max_len // self.key_chunk))
        self.entries: dict[int, dict] = {}
        self.pool = None
        self.workspace: tuple[Tensor, Tensor] | None = None     # split partials (acc, ml), shared by every bucket
        self.runs = self.replays = self.captures = self.fallbacks = 0
        self.storing = 0                                         # runs with a checkpoint inside: eager
        self.graph_bytes = 0

    def bucket(self, count: int) -> int | None:
        """The smallest bucket with room for `count` real tokens and at least one pad token."""
        return next((b for b in self.buckets if b > count), None)

    def nbytes(self) -> int:
        """Device bytes held: the shared attention workspace and the growth of reserved memory at each capture (a lower
        bound: a capture that reuses blocks the allocator had cached adds nothing)."""
        ws = sum(t.numel() * t.element_size() for t in self.workspace) if self.workspace else 0
        return ws + self.graph_bytes

    # ---------------------------------------------------------------------------------------------- layout
    def _layout(self, b: int, start: int, count: int, slot: int):
        """(pos, pieces, last) of the padded step, or None if no dummy start gives the bucket's chunk count."""
        d, target = b - count, -(-b // self.cs) + 1
        real = _chunks(start, count, self.cs)
        pd = next((o for o in range(self.cs) if real + _chunks(o, d, self.cs) == target), None)
        if pd is None or start + count > self.max_len:
            return None
        pos = list(range(start, start + count)) + list(range(pd, pd + d))
        return pos, [(start, count, slot), (pd, d, -1)], [count - 1]

    def _sizes(self, b: int) -> tuple[int, int, int]:
        """Fixed (blocks, items, merge rows) of bucket b's attention plan: bounds over every layout it serves."""
        bm = self.rule["BLOCK_M"]
        n_blk = -(-b // bm) + 2                      # real + dummy blocks <= cdiv(b, bm) + 1, and one pad block
        return n_blk, n_blk * self.splits, max(1, min(b - 1, SPLIT_MAX_QUERIES))

    def _plan_meta(self, b: int, pieces) -> list[int] | None:
        """The split plan of the padded layout (attention.split_plan), padded to the bucket's sizes with no-ops."""
        cu = [0, pieces[0][1], b]
        p = split_plan(cu, [s for s, _, _ in pieces], [s for _, _, s in pieces], self.rule["BLOCK_M"], self.key_chunk)
        NB, NI, NR = self._sizes(b)
        n_blk, meta, rows = p["n_blk"], p["meta"], p["rows"]
        if n_blk >= NB or p["n_item"] > NI or len(rows) // 3 > NR or p["part_rows"] > self._part_rows(b):
            return None
        blk_seq, blk_q0 = meta[:n_blk], meta[n_blk:2 * n_blk]
        item_blk, item_split = meta[2 * n_blk:2 * n_blk + p["n_item"]], meta[2 * n_blk + p["n_item"]:-4]
        pad_blk = NB - n_blk
        blk_seq, blk_q0 = blk_seq + [1] * pad_blk, blk_q0 + [b] * pad_blk       # past the dummy piece: masked
        pad_item = NI - len(item_blk)
        item_blk, item_split = item_blk + [NB - 1] * pad_item, item_split + [-1] * pad_item
        rows = rows + [pieces[0][1], 0, 0] * (NR - len(rows) // 3)             # zero splits into a dummy row
        return blk_seq + blk_q0 + item_blk + item_split + meta[-4:] + rows

    def _part_rows(self, b: int) -> int:
        return max(1, min(b - 1, SPLIT_MAX_QUERIES) * self.splits)

    # ----------------------------------------------------------------------------------------------- build
    def _pack(self, b: int, start: int, count: int, slot: int, ids: list[int], checkpoints=()):
        lay = self._layout(b, start, count, slot)
        if lay is None:
            return None, None
        pos, pieces, last = lay
        meta = self._plan_meta(b, pieces)
        if meta is None:
            return None, None
        sb = pack_step(self.model.device, self.cs, list(ids) + [0] * (b - count), pos, [], pieces, last,
                       self.n_slots, backend=self.model.backend, checkpoints=checkpoints)
        return sb, meta

    def _plan(self, b: int, sb, meta: list[int]) -> AttentionPlan:
        c, dev = self.model.config, self.model.device
        NB, NI, NR = self._sizes(b)
        if self.workspace is None:
            rows = max(self._part_rows(x) for x in self.buckets)
            self.workspace = (torch.empty(rows * c.n_attn_heads * c.attn_head_dim, dtype=torch.float32, device=dev),
                              torch.empty(rows * c.n_attn_heads * 2, dtype=torch.float32, device=dev))
        m = torch.tensor(meta, dtype=torch.int32, device=dev)
        return AttentionPlan(tuple(sb.pre_cu_host), tuple(sb.pre_slot_host), tuple(sb.pre_start_host), self.n_slots,
                             self.max_len, c.n_attn_heads, c.attn_head_dim, self.key_chunk, self.rule, NB, NI, NR, m,
                             *self.workspace, self.model.dtype)

    def prepare(self) -> None:
        """Build every bucket's kept batch now (a layout whose pieces are all slot -1: nothing in the bank is read
        or written) and, on CUDA, warm it up on a side stream and capture it, largest bucket first."""
        for b in sorted(self.buckets, reverse=True):
            if b in self.entries:
                continue
            sb, meta = self._pack(b, 0, 1, -1, [0])
            if self.model.config.attention_layer_ids:
                sb.attn_plan = self._plan(b, sb, meta)
            entry = {"batch": sb, "graph": None, "logits": None}
            if self.capture:
                self._capture(entry)
            self.entries[b] = entry

    def _capture(self, entry: dict) -> None:
        sb = entry["batch"]
        before = torch.cuda.memory_reserved(self.model.device)
        graph, entry["logits"] = warm_capture(lambda: self.model.forward(sb, self.bank), self.pool)
        self.pool = graph.pool()
        entry["graph"] = graph
        self.captures += 1
        self.graph_bytes += max(0, torch.cuda.memory_reserved(self.model.device) - before)   # reused cache: 0

    # ------------------------------------------------------------------------------------------------- run
    def forward(self, b: int, piece: tuple[int, int, int], ids: list[int], checkpoints=()) -> Tensor | None:
        """Logits of the one-piece step `piece` (start, count, slot) through bucket b, or None when its layout does
        not fit the bucket's sizes (the caller then runs the step unpadded). `checkpoints` (piece 0, p, pool slot):
        prefix-cache stores inside the piece; such a step runs the bucket's layout eagerly (`_forward_storing`)."""
        entry = self.entries.get(b)
        start, count, slot = piece
        fresh, meta = self._pack(b, start, count, slot, ids, checkpoints) if entry is not None else (None, None)
        if fresh is None or fresh.table.n_chunks != entry["batch"].table.n_chunks:
            self.fallbacks += 1
            return None
        self.runs += 1
        if checkpoints:
            return self._forward_storing(b, fresh, meta)
        sb = entry["batch"]
        for f in _FIELDS:
            getattr(sb, f).copy_(getattr(fresh, f), non_blocking=True)
        for f in _TABLE:
            getattr(sb.table, f).copy_(getattr(fresh.table, f), non_blocking=True)
        sb.pre_cu_host, sb.pre_start_host, sb.pre_slot_host = fresh.pre_cu_host, fresh.pre_start_host, \
            fresh.pre_slot_host
        if sb.attn_plan is not None:
            host = torch.tensor(meta, dtype=torch.int32)
            sb.attn_plan.meta.copy_(host.pin_memory() if sb.ids.is_cuda else host, non_blocking=True)
        if entry["graph"] is None:
            return self.model.forward(sb, self.bank)
        entry["graph"].replay()
        self.replays += 1
        return entry["logits"]

    def _forward_storing(self, b: int, sb, meta: list[int]) -> Tensor:
        """The padded step with its checkpoint stores, eagerly: the kept batch's metadata values (the same layout
        and padded attention plan) in a fresh batch, so its rows have the bits of the bucket's replay."""
        if self.model.config.attention_layer_ids:
            sb.attn_plan = self._plan(b, sb, meta)
        self.storing += 1
        return self.model.forward(sb, self.bank)
