"""Decode-only steps at bucket sizes (1, 2, 4, ..., R): padded rows point at slot -1; CUDA graphs replay them.

A decode-only batch of S rows runs at the smallest bucket nb >= S: rows S..nb-1 get token 0, position 0 and
slot -1, which every kernel skips (no read, no write), and their sampled tokens are ignored.  On CUDA each
bucket's forward + greedy sampling is captured once into a graph over static input/output buffers and
replayed; the eager path (`capture=False`) runs exactly the same padded shapes, so graph replay and eager
are bitwise equal by construction (same kernels, same GEMM shapes).

A step outside the graph is two copies: positions and slots (and, when they are not already there, the input
tokens) from a pinned staging buffer, and the sampled tokens back. The input tokens are read from — and the
greedy tokens written to — the engine's one token buffer `sampled` itself, so an overlapped async step needs no
device-side copy at all.

Every capture (decode, verify, draft catch-up and prefill graphs) goes through `capture()` (the warmed-up ones through
`warm_capture()`, which wraps it): Python's cyclic garbage collector is off
while a stream captures. torch.cuda.graph no longer collects before a capture (torch >= 2.9: gc.collect() only under
TORCH_CUDAGRAPH_GC), and a speculative Engine is a reference cycle (Engine.spec <-> Speculator.engine), so an earlier,
unreachable engine keeps its CUDAGraphs until a collection; one that ran during a capture destroyed them there
(CUDAGraph.reset: "operation not permitted when stream is capturing") and invalidated the capture in progress. With
the collector off, that garbage is collected after the capture, outside it.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager

import torch
from torch import Tensor

from . import ops


@contextmanager
def capture(graph, pool=None):
    """torch.cuda.graph(graph, pool=pool) with the cyclic garbage collector disabled from before the capture begins
    until after it ends (and restored to its previous state): no collection can destroy another graph, or free
    anything else through a CUDA call, while the stream captures (module docstring)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if was_enabled:
            gc.enable()


def warm_capture(body, pool=None):
    """Every graph's capture: body() twice on a side stream (kernels compiled, the allocator warm), then once
    captured into a new CUDAGraph in `pool` (capture(): the collector off). Returns (graph, what the captured body
    returned: its static output, which every replay refills)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capture(graph, pool):
        out = body()
    return graph, out


def buckets(max_rows: int) -> list[int]:
    """Powers of two below max_rows, then max_rows itself."""
    out, b = [], 1
    while b < max_rows:
        out.append(b)
        b *= 2
    return out + [max_rows]


class DecodeGraphs:
    """Static buffers + one captured graph per bucket (CUDA), or the same padded forward run eagerly."""

    def __init__(self, engine, capture: bool = True):
        from fastpath.model import StepBatch
        self.model, self.bank = engine.model, engine.bank      # no back-reference: no engine <-> runner cycle
        dev, R = engine.device, engine.R
        self.capture = capture and dev.type == "cuda"
        self.buckets = buckets(R)
        self.tok = engine.sampled                  # input tokens and greedy outputs, in place
        # per bucket, [positions | slots] side by side: one H2D copy fills both
        offs = {nb: 2 * sum(self.buckets[:i]) for i, nb in enumerate(self.buckets)}
        meta = torch.zeros(2 * sum(self.buckets), dtype=torch.int64, device=dev)
        self.meta = {nb: meta[o:o + 2 * nb] for nb, o in offs.items()}
        for m in self.meta.values():
            m[m.shape[0] // 2:] = -1
        self.last = torch.arange(R, dtype=torch.int64, device=dev)
        empty = torch.zeros(0, dtype=torch.int32, device=dev)
        self.batches = {nb: StepBatch(self.tok[:nb], self.meta[nb][:nb], nb, self.meta[nb][nb:],
                                      torch.zeros(1, dtype=torch.int32, device=dev), empty,
                                      torch.zeros(0, dtype=torch.int64, device=dev), empty, self.last[:nb],
                                      [0], []) for nb in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, Tensor] = {}       # each bucket's logits (graph memory: rewritten by every replay)
        self.pool = None
        self.replays = 0

    def covers(self, rows: int) -> bool:
        """True if a decode-only batch of `rows` rows fits a bucket."""
        return 0 < rows <= self.buckets[-1]

    def bucket(self, rows: int) -> int:
        """Smallest bucket >= rows."""
        return next(b for b in self.buckets if b >= rows)

    def _body(self, nb: int) -> None:
        logits = self.model.forward(self.batches[nb], self.bank)
        ops.greedy_sample(logits, self.tok[:nb], backend=self.model.backend)
        self._logits[nb] = logits

    def _capture(self, nb: int) -> None:
        """Warm up on a side stream (pads only: slot -1 everywhere, so the bank is untouched), then capture; the
        bucket's positions/slots and the token buffer are restored afterwards (the warm-up samples into it)."""
        saved_meta, saved_tok = self.meta[nb].clone(), self.tok.clone()
        self.meta[nb][nb:].fill_(-1)
        g, _ = warm_capture(lambda: self._body(nb), self.pool)
        self.pool = g.pool()
        self.graphs[nb] = g
        self.meta[nb].copy_(saved_meta)
        self.tok.copy_(saved_tok)

    def capture_all(self) -> None:
        """Capture every bucket now (before serving), largest first so the pool fits them all."""
        if self.capture:
            for nb in reversed(self.buckets):
                if nb not in self.graphs:
                    self._capture(nb)

    def logits(self, rows: int) -> Tensor:
        """The logits of the last run's first `rows` rows (valid until the next run)."""
        return self._logits[self.bucket(rows)][:rows]

    def run(self, pos: list[int], slot: list[int], ids: list[int] | None, stage: Tensor) -> None:
        """A decode-only batch of S = len(pos) rows through bucket nb (graph or eager): positions and slots (pads:
        0 and -1) go from the pinned `stage` in one copy, `ids` (None: already in the token buffer, the
        overlapped async case) in a second; the greedy tokens land in the token buffer's first S rows. `stage` must
        not be rewritten before this copy has run (the engine alternates two)."""
        S = len(pos)
        nb = self.bucket(S)
        pad = nb - S
        vals = pos + [0] * pad + slot + [-1] * pad + (ids or [])
        stage[:len(vals)].copy_(torch.tensor(vals, dtype=torch.int64))
        self.meta[nb].copy_(stage[:2 * nb], non_blocking=True)
        if ids is not None:
            self.tok[:S].copy_(stage[2 * nb:2 * nb + S], non_blocking=True)
        if self.capture:
            if nb not in self.graphs:
                self._capture(nb)
            self.graphs[nb].replay()
            self.replays += 1
        else:
            self._body(nb)
