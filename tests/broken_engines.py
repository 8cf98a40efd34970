"""Deliberately broken engine pieces, shared by the tests that prove a check can fail."""
from __future__ import annotations

import torch

from fastpath.engine.rows import compaction_moves


def compact_without_moving_slots(self):
    """RowTable.compact with the bug: a compacted row carries its request but not its slot mapping (keeps -1)."""
    live = [self.row_request[r] is not None for r in range(self.active)]
    moves = compaction_moves(live)
    for m in moves:
        self.row_request[m.dst], self.row_pos[m.dst] = self.row_request[m.src], self.row_pos[m.src]
        self.row_to_slot[m.src], self.row_request[m.src], self.row_pos[m.src] = -1, None, 0
    self.row_to_slot_dev.copy_(torch.tensor(self.row_to_slot, dtype=self.row_to_slot_dev.dtype))
    self.active = sum(live)
    return moves
