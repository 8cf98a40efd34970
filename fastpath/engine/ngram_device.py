"""The ngram proposer on the device (DESIGN §13 prompt lookup), for verify steps that take their drafts without a host
sync (docs/engine.md "Speculative decoding", "Device proposals").

    for n = max_n .. min_n (first n with a match wins):
        match_n[r, i] = hist[r, i:i+n] == hist[r, L_r-n:L_r]   for 0 <= i <= L_r-n-1   (starts before the suffix)
        i_r = the largest such i (the most recent occurrence)
    m_r = min(room_r, L_r - (i_r + n)) drafts hist[r, i_r+n : i_r+n+m_r], or none if no n matched

Every tensor has a shape fixed by (rows, history width, k): no data-dependent shape, no host read, so the search runs
eagerly between CUDA-graph replays without a synchronisation. Written from DESIGN §13; tests/test_ngram_device.py
proves it equal to oracle.speculative.ngram_propose on generated histories.
"""
from __future__ import annotations

import torch
from torch import Tensor


def ngram_device(hist: Tensor, L: Tensor, room: Tensor, k: int, min_n: int, max_n: int) -> tuple[Tensor, Tensor]:
    """hist [S, W] int64 (row r's tokens at [0, L_r), L_r <= W), room [S] (<= k): (drafts [S, k] zero-padded, m [S])."""
    S, W = hist.shape
    dev = hist.device
    ar = torch.arange(W, dtype=torch.int64, device=dev)
    best_i = torch.full((S,), -1, dtype=torch.int64, device=dev)
    best_n = torch.zeros(S, dtype=torch.int64, device=dev)
    for n in range(max_n, min_n - 1, -1):
        if n >= W:                                         # every L_r <= W <= n: no suffix of length n has a match
            continue
        sidx = ((L - n).clamp(min=0)[:, None] + ar[:n]).clamp(max=W - 1)
        suffix = hist.gather(1, sidx)                      # [S, n]
        match = (hist.unfold(1, n, 1) == suffix[:, None, :]).all(-1)              # [S, W-n+1]
        starts = ar[:W - n + 1]
        ok = match & (starts[None, :] < (L - n)[:, None])  # i <= L-n-1 (implies n < L)
        i = torch.where(ok, starts[None, :], -1).amax(1)
        take = (best_i < 0) & (i >= 0)
        best_i = torch.where(take, i, best_i)
        best_n = torch.where(take, n, best_n)
    start = best_i + best_n
    m = torch.where(best_i >= 0, torch.minimum(room, L - start), 0)
    j = torch.arange(k, dtype=torch.int64, device=dev)
    drafts = hist.gather(1, (start[:, None] + j[None, :]).clamp(0, W - 1))
    return torch.where(j[None, :] < m[:, None], drafts, 0), m


class TokenHistory:
    """Every slot's request tokens (prompt + output) on the device, [slots, width] int64, allocated once; rows are
    brought up to date from the host lists by one non-blocking pinned copy per step (only the new tokens)."""

    def __init__(self, slots: int, width: int, device: torch.device):
        self.hist = torch.zeros(slots, width, dtype=torch.int64, device=device)
        self.width, self.device = width, device
        self.synced: dict[str, int] = {}                   # request id -> tokens already on the device

    def reset(self) -> None:
        """A new run: nothing synced."""
        self.synced = {}

    def fits(self, n_tokens: int) -> bool:
        """A request of n_tokens tokens fits the history's width."""
        return n_tokens <= self.width

    def catch_up(self, rows: list[tuple[str, int, list[int]]]) -> None:
        """rows (request, slot, tokens): write each request's tokens past those already synced into its slot."""
        idx, vals, W = [], [], self.width
        for rid, slot, toks in rows:
            n0 = self.synced.get(rid, 0)
            idx.extend(range(slot * W + n0, slot * W + len(toks)))
            vals.extend(toks[n0:])
            self.synced[rid] = len(toks)
        if not vals:
            return
        host = torch.tensor([idx, vals], dtype=torch.int64)
        if self.device.type == "cuda":
            host = host.pin_memory()                      # the caching host allocator keeps it until the copy ran
        dev = host.to(self.device, non_blocking=True)
        self.hist.view(-1).index_copy_(0, dev[0], dev[1])

    def propose(self, slots: Tensor, L: Tensor, room: Tensor, k: int, min_n: int, max_n: int) -> tuple[Tensor, Tensor]:
        """Drafts [S, k] and counts m [S] for the rows in `slots` (device int64) of lengths L, room (device)."""
        return ngram_device(self.hist.index_select(0, slots), L, room, k, min_n, max_n)
