"""The draft proposer's short catch-up of several tokens as one forward (docs/engine.md "Speculative decoding").

A catch-up of n_r new tokens per row (at most W: the accepted drafts and the bonus, or the tokens of a backoff pause)
runs as one verify-shaped batch of nb rows x w positions (fastpath/engine/verify.py's layout and sequential mixers,
no snapshots), right-aligned: row r's tokens sit at positions w-n_r..w-1 of its column, slot -1 before them, so no
kernel reads or writes state there. Projections and MLPs read the weights once for all nb*w tokens where n replays
of the decode graph would read them n times; the LM head runs on the last position only, whose greedy tokens are
every row's first draft. Shapes are (row bucket, width bucket) with the decode graphs' row buckets and widths
2, 3, 5, 9, ..., W; on CUDA each is captured once as a graph, and the eager path (capture=False) runs exactly the
same shapes, so the two are bitwise equal by construction.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import ops
from .bank import StateBank
from .graphs import buckets
from .verify import VerifyBatch, capture_idle, pack_rows, upload_meta, verify_hidden, width_buckets


class CatchUp:
    """Catch-up forwards of 2..W tokens per row over the draft's own bank (module docstring)."""

    def __init__(self, model, bank: StateBank, R: int, W: int, capture: bool):
        if W < 2:
            raise ValueError(f"CatchUp: widest catch-up W = {W}, needs >= 2 (one token is a decode replay)")
        self.model, self.bank, self.device = model, bank, bank.device
        self.capture = capture and self.device.type == "cuda"
        self.row_buckets, self.widths = buckets(R), width_buckets(W - 1)
        self.stage = torch.zeros(3 * R * W + R, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self.meta: dict[tuple[int, int], Tensor] = {}
        self.tok: dict[tuple[int, int], Tensor] = {}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.replays = 0
        self.runs: dict[tuple[int, int], int] = {}        # forwards run per (nb, w) bucket (tests, benchmarks)

    def shape(self, rows: int, width: int) -> tuple[int, int]:
        """(nb, w): the buckets a catch-up of `rows` rows and at most `width` tokens a row runs at."""
        if not 0 < rows <= self.row_buckets[-1] or not 2 <= width <= self.widths[-1]:
            raise ValueError(f"CatchUp: {rows} rows x {width} tokens is outside the buckets "
                             f"({self.row_buckets[-1]} rows, 2..{self.widths[-1]} tokens)")
        return next(b for b in self.row_buckets if b >= rows), next(w for w in self.widths if w >= width)

    def _buffers(self, key: tuple[int, int]) -> tuple[Tensor, Tensor]:
        if key not in self.meta:
            nb, w = key
            self.meta[key] = torch.zeros(3 * nb * w + nb, dtype=torch.int64, device=self.device)
            self.tok[key] = torch.zeros(nb, dtype=torch.int64, device=self.device)
        return self.meta[key], self.tok[key]

    def _body(self, key: tuple[int, int]) -> None:
        """The layers over every position, the LM head and greedy sampling over the last position's nb rows."""
        nb, w = key
        meta, tok = self._buffers(key)
        h = verify_hidden(self.model, VerifyBatch.view(meta, nb, w), self.bank, None)
        ops.greedy_sample(self.model._logits(h[(w - 1) * nb:]), tok, backend=self.model.backend)

    def _capture(self, key: tuple[int, int]) -> None:
        """Warm up on a side stream with every slot -1 (the bank untouched), then capture; metadata restored."""
        meta, _ = self._buffers(key)
        g, _ = capture_idle(meta, *key, lambda: self._body(key), self.pool)
        self.pool = g.pool()
        self.graphs[key] = g

    def capture_all(self) -> None:
        """Capture every (rows, width) bucket now (benchmarks: no capture inside a timed run), largest first."""
        if self.capture:
            for key in sorted(((nb, w) for nb in self.row_buckets for w in self.widths), reverse=True):
                if key not in self.graphs:
                    self._capture(key)

    def run(self, new: list[list[int]], starts: list[int], slots: list[int]) -> Tensor:
        """Row r feeds new[r] (1..W tokens) at positions starts[r].. in slots[r]; returns the greedy token after
        each row's last one ([len(new)], on the device; valid until the next run). Positions and slots go up from
        the pinned stage in one non-blocking copy, reused only after the caller's next host read."""
        S = len(new)
        nb, w = self.shape(S, max(len(x) for x in new))
        vals = pack_rows(new, starts, slots, nb, w, right=True) + [0] * nb    # src: the replay's field, unused
        meta, tok = self._buffers((nb, w))
        self.runs[(nb, w)] = self.runs.get((nb, w), 0) + 1
        upload_meta(self.stage, meta, vals)
        if self.capture:
            if (nb, w) not in self.graphs:
                self._capture((nb, w))
            self.graphs[(nb, w)].replay()
            self.replays += 1
        else:
            self._body((nb, w))
        return tok[:S]
