"""Row table: rows, row_to_slot, the LIFO free-slot stack and compaction, in one place (DESIGN §4).

Rows `0..active-1` hold the live requests in row order; `row_to_slot[row]` maps a row to its state slot in the
bank; rows >= active hold -1.  Slots come from a LIFO free stack (a freed slot is reused first).  Compaction
fills holes left to right by moving the right-most live row into the left-most hole; a moved row carries
all its bookkeeping (request id, slot, position) and its old row is set to -1.  State never moves: only
these small tables do.

The host lists are the authority the scheduler reads; the device tensor `row_to_slot_dev` mirrors
`row_to_slot` and is updated with the same moves by index ops that never synchronise.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Move:
    """Compaction move: row `src` (the right-most live row) now lives at row `dst` (the left-most hole)."""
    src: int
    dst: int


def compaction_moves(live: list[bool]) -> list[Move]:
    """Moves that pack the live rows of `live` to the left: right-most live row fills the left-most hole."""
    live = list(live)
    moves: list[Move] = []
    lo, hi = 0, len(live) - 1
    while True:
        while lo < len(live) and live[lo]:
            lo += 1
        while hi >= 0 and not live[hi]:
            hi -= 1
        if lo >= hi:
            return moves
        moves.append(Move(hi, lo))
        live[lo], live[hi] = True, False


def index_pair(moves: list[Move], device: torch.device) -> tuple[Tensor, Tensor]:
    """(src, dst) int64 index tensors on `device` for a list of moves (host -> device, non-blocking)."""
    host = torch.tensor([[m.src for m in moves], [m.dst for m in moves]], dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    dev = host.to(device, non_blocking=True)
    return dev[0], dev[1]


def apply_moves_(t: Tensor, src: Tensor, dst: Tensor, fill: int | float | None = None) -> Tensor:
    """In place: t[dst] = t[src] (moves are disjoint: every src > every dst), then t[src] = fill if given."""
    if src.numel() == 0:
        return t
    t.index_copy_(0, dst, t.index_select(0, src))
    if fill is not None:
        t.index_fill_(0, src, fill)
    return t


class RowTable:
    """Host mirror + device tables of the engine's rows and slots (max_requests R of each)."""

    def __init__(self, max_requests: int, device: torch.device | str = "cpu"):
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        self.R = max_requests
        self.device = torch.device(device)
        self.active = 0
        self.row_to_slot: list[int] = [-1] * max_requests
        self.row_request: list[str | None] = [None] * max_requests
        self.row_pos: list[int] = [0] * max_requests          # next absolute position of the row's request
        # LIFO: the top of the stack is the end of the list; slot 0 is handed out first.
        self.free_slots: list[int] = list(range(max_requests - 1, -1, -1))
        self.row_to_slot_dev = torch.full((max_requests,), -1, dtype=torch.int32, device=self.device)

    # ---- queries ---------------------------------------------------------------------------------
    def has_free_slot(self) -> bool:
        """True while a slot is free for admission."""
        return bool(self.free_slots)

    def row_of(self, request_id: str) -> int:
        """Row of a live request (ValueError if it is not live)."""
        for r in range(self.active):
            if self.row_request[r] == request_id:
                return r
        raise ValueError(f"request {request_id!r} is not live")

    def live_requests(self) -> list[str]:
        """Live request ids in row order."""
        return [rid for rid in self.row_request[: self.active] if rid is not None]

    # ---- admission / release / compaction -----------------------------------------------------------
    def admit(self, request_id: str, start_pos: int = 0) -> tuple[int, int]:
        """Give `request_id` the next row and the top free slot; returns (row, slot)."""
        if not self.free_slots:
            raise RuntimeError("admit: no free slot")
        if self.active >= self.R:
            raise RuntimeError("admit: no free row")
        slot = self.free_slots.pop()
        row = self.active
        self.active += 1
        self.row_to_slot[row], self.row_request[row], self.row_pos[row] = slot, request_id, start_pos
        self.row_to_slot_dev[row] = slot
        return row, slot

    def advance(self, row: int, n_tokens: int) -> None:
        """The row's request consumed n_tokens (its next absolute position moves on)."""
        self.row_pos[row] += n_tokens

    def release(self, rows: list[int]) -> list[tuple[str, int]]:
        """Free the slots of finished `rows` (pushed in the given order); returns [(request_id, slot)]."""
        freed = []
        for r in rows:
            if not 0 <= r < self.active or self.row_request[r] is None:
                raise ValueError(f"release: row {r} is not live")
            rid, slot = self.row_request[r], self.row_to_slot[r]
            self.free_slots.append(slot)
            self.row_request[r], self.row_to_slot[r], self.row_pos[r] = None, -1, 0
            freed.append((rid, slot))
        return freed

    def compact(self) -> list[Move]:
        """Pack live rows to the left (host and device tables); vacated rows become -1."""
        live = [self.row_request[r] is not None for r in range(self.active)]
        moves = compaction_moves(live)
        for m in moves:
            self.row_to_slot[m.dst] = self.row_to_slot[m.src]
            self.row_request[m.dst] = self.row_request[m.src]
            self.row_pos[m.dst] = self.row_pos[m.src]
            self.row_to_slot[m.src], self.row_request[m.src], self.row_pos[m.src] = -1, None, 0
        n_live = sum(live)
        if moves:
            src, dst = index_pair(moves, self.device)
            apply_moves_(self.row_to_slot_dev, src, dst, fill=-1)
        if n_live < self.active:   # finished rows at the right end need no move, only clearing
            self.row_to_slot_dev[n_live:self.active] = -1
        self.active = n_live
        return moves

    def check(self) -> None:
        """Invariants: rows < active live with distinct slots, rows >= active -1, free ∪ used = all slots."""
        used = self.row_to_slot[: self.active]
        if any(s < 0 for s in used) or any(rid is None for rid in self.row_request[: self.active]):
            raise AssertionError(f"row table: hole among live rows 0..{self.active - 1}: {used}")
        if any(s != -1 for s in self.row_to_slot[self.active:]):
            raise AssertionError(f"row table: rows >= {self.active} must hold -1: {self.row_to_slot}")
        if len(set(used)) != len(used) or sorted(used + self.free_slots) != list(range(self.R)):
            raise AssertionError(f"row table: slots used {used} + free {self.free_slots} != 0..{self.R - 1}")
