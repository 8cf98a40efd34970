"""The one step packer: host lists of a step (decode rows, then prefill pieces) -> the model's StepBatch.

Every forward that packs metadata goes through `pack_step` — the engine's ordinary steps, and (through `pack`: decode
rows, then `Piece`s) speculative decoding's prefill pieces and the draft model's prefill catch-ups and eager drafting
steps (fastpath/engine/speculative.py, fastpath/engine/draft.py) — so the layout of the metadata and the SSD chunk
table (built once per step, from the host lists, with the slots checked against the bank, so no layer's kernels read
metadata back) exist in one place.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import ops
from .bank import StateBank


def pack_step(device: torch.device, chunk_size: int, ids: list[int], pos: list[int], dec_slots: list[int],
              pieces: list[tuple[int, int, int]], last: list[int], n_slots: int, backend: str = "triton",
              checkpoints: list[tuple[int, int, int]] = ()):
    """StepBatch of `len(dec_slots)` decode rows (the first tokens of ids/pos) then `pieces` (start, count, slot)
    packed after them; `last` = the token index of every logits row. Metadata goes up in one pinned non-blocking
    copy; the chunk table of the pieces is built here (slots checked against the bank's `n_slots`).
    `checkpoints` (piece, position, bank slot): prefix-cache checkpoints inside pieces (fastpath/model.py)."""
    from fastpath.model import StepBatch
    n = len(dec_slots)
    cu = [0]
    for _, count, _ in pieces:
        cu.append(cu[-1] + count)
    starts, slots = [s for s, _, _ in pieces], [s for _, _, s in pieces]
    T = len(ids)
    meta = ids + pos + list(dec_slots) + cu + slots + starts + [int(s > 0) for s in starts] + last
    host = torch.tensor(meta, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    dev = host.to(device, non_blocking=True)
    o = 0

    def take(m: int) -> torch.Tensor:
        nonlocal o
        o += m
        return dev[o - m:o]
    ids_t, pos_t = take(T), take(T)
    dec_slot = take(n).to(torch.int32)
    pre_cu, pre_slot = take(len(cu)).to(torch.int32), take(len(pieces)).to(torch.int32)
    pre_start, pre_init, last_t = take(len(pieces)), take(len(pieces)).to(torch.int32), take(len(last))
    sb = StepBatch(ids_t, pos_t, n, dec_slot, pre_cu, pre_slot, pre_start, pre_init, last_t, cu, starts,
                   checkpoints=tuple(checkpoints), pre_slot_host=slots)
    if pieces and backend == "triton":   # every conv and attention layer's token -> piece index, built once
        from fastpath.kernels._common import token_sequence_index
        sb.pre_tok_seq = token_sequence_index(pre_cu, T - n)
    if pieces:   # once per step from the host lists, slots checked here: no layer's kernels read them back
        sb.table = ops.ssd_chunk_table(cu, starts, chunk_size, device, slots, n_slots, backend=backend,
                                       checkpoints=list(checkpoints) or None)
    return sb


@dataclass
class Piece:
    """One packed sequence: tokens at positions [start, start+len) continued from bank[slot]."""
    tokens: list[int]
    start: int
    slot: int
    all_logits: bool = False     # logits at every position (verify rows), else only at the last


def backend_kw(model) -> dict:
    """The kernel-backend keyword of the ops calls for this model (FastOptions.backend)."""
    return {"backend": model.backend} if hasattr(model, "backend") else {}


def pack(bank: StateBank, chunk_size: int, dec: list[tuple[int, int, int]], pieces: list[Piece],
         dec_ids: Tensor | None = None, kw: dict | None = None, checkpoints: list | None = None):
    """StepBatch for decode rows (token, pos, slot) then pieces, built by the engine's step packer (one chunk table
    per step, slots checked against `bank`); returns (batch, logits row ranges per sequence).
    dec_ids: the decode rows' tokens already on the device (the draft loop), instead of the host values;
    checkpoints: the prefix cache's (piece, position, bank slot) inside pieces (PrefixCache.plan)."""
    n = len(dec)
    ids = [t for t, _, _ in dec] + [t for p in pieces for t in p.tokens]
    pos = [q for _, q, _ in dec] + [q for p in pieces for q in range(p.start, p.start + len(p.tokens))]
    last, ranges, end = list(range(n)), [(j, j + 1) for j in range(n)], n
    for p in pieces:
        lo, end = end, end + len(p.tokens)
        rows = list(range(lo, end)) if p.all_logits else [end - 1]
        ranges.append((len(last), len(last) + len(rows)))
        last.extend(rows)
    sb = pack_step(bank.device, chunk_size, ids, pos, [s for _, _, s in dec],
                   [(p.start, len(p.tokens), p.slot) for p in pieces], last, bank.ssm_state.shape[1],
                   checkpoints=checkpoints or (), **(kw or {}))
    if dec_ids is not None:
        sb.ids[:n].copy_(dec_ids)
    return sb, ranges
