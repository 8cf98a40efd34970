"""The one step packer: host lists of a step (decode rows, then prefill pieces) -> the model's StepBatch.

Every forward that packs metadata goes through `pack_step` — the engine's ordinary steps, and speculative
decoding's verify steps, replays and draft passes (fastpath/engine/speculative.py) — so the layout of the metadata
and the SSD chunk table (built once per step, from the host lists, with the slots checked against the bank, so no
layer's kernels read metadata back) exist in one place.
"""
from __future__ import annotations

import torch

from . import ops


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
