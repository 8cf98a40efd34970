"""The draft-model proposer of speculative decoding (DESIGN §13, docs/engine.md "Speculative decoding").

A smaller FastModel with its own StateBank (slot = the request's slot in the target's bank), greedy. Each decoding
request's draft state covers exactly the tokens the engine has accepted; a pass catches it up on the tokens emitted
since the previous pass, drafts on from there, and undoes the drafting from a snapshot taken after the catch-up.

With decode graphs (the engine's `graphs` or `pad_decode`) a short catch-up (1..k+1 new tokens: the accepted drafts
and the bonus, the decode loop's usual case; after a backoff pause of B steps up to catch_up_width's tokens) runs
as one forward: a single new token per row is one decode-graph replay; more is one catch-up forward
(fastpath/engine/catch_up.py: rows right-aligned over 2..W positions, the LM head on the last only), whose greedy
tokens are every row's first draft. The first catch-up after a prompt (long) runs as an eager packed prefill of every
row. Drafts 2..k are decode replays reading the tokens the replay before sampled. Positions and slots go up from
pinned stage slices: no host read until the caller wants the drafts (propose) or none at all (propose_device).
"""
from __future__ import annotations

import time
import types
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from oracle.trace import TraceError

from . import ops
from .bank import StateBank
from .packing import Piece, backend_kw, pack


CATCH_UP_MAX = 128        # widest catch-up forward (its positions step one by one: ~6 us a position and Mamba layer)
CATCH_UP_TOKENS = 2048    # ... and at most this many tokens over the rows (its activations; k+1 a row always fits)


def catch_up_width(k: int, backoff: int, R: int) -> int:
    """The longest catch-up through the graphs for R rows: k+1 (the decode loop's), after a backoff pause up to
    CATCH_UP_MAX and CATCH_UP_TOKENS / R (a longer catch-up is one eager packed prefill: docs/engine.md)."""
    return min(k + 1 + backoff, max(k + 1, min(CATCH_UP_MAX, CATCH_UP_TOKENS // R)))


@dataclass
class DraftRow:
    """A decoding request as the draft sees it: slot, prompt and output (referenced, not copied), room = the drafts
    it may take (min(k, tokens left))."""
    rid: str
    slot: int
    prompt: Sequence[int]
    output: list[int]
    room: int

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def tail(self, lo: int) -> list[int]:
        """(prompt + output)[lo:] without building the whole list (the decode loop's lo is past the prompt)."""
        P = len(self.prompt)
        return self.output[lo - P:] if lo >= P else list(self.prompt[lo:]) + self.output


class Snapshot:
    """Conv windows and SSM states of up to R slots of a bank, copied out and back (the draft model's own state
    around its drafting steps)."""

    def __init__(self, bank: StateBank, R: int):
        self.bank = bank
        self.conv = torch.zeros_like(bank.conv_state[:, :R])
        self.ssm = torch.zeros_like(bank.ssm_state[:, :R])
        self.idx: Tensor | None = None

    def save(self, slots: list[int]) -> None:
        """snapshot[:, j] := bank[:, slots[j]] (the index goes up by a non-blocking pinned copy: no host sync)."""
        idx = torch.tensor(slots, dtype=torch.int64)
        if self.bank.device.type == "cuda":
            idx = idx.pin_memory()
        self.idx = idx.to(self.bank.device, non_blocking=True)
        self.conv[:, :len(slots)] = self.bank.conv_state.index_select(1, self.idx)
        self.ssm[:, :len(slots)] = self.bank.ssm_state.index_select(1, self.idx)

    def restore(self) -> None:
        """bank[:, slots[j]] := snapshot[:, j] for every slot of the last save (two copies, whatever the rows)."""
        n = self.idx.shape[0]
        self.bank.conv_state.index_copy_(1, self.idx, self.conv[:, :n])
        self.bank.ssm_state.index_copy_(1, self.idx, self.ssm[:, :n])


class DraftModel:
    """The draft proposer (module docstring). graphs ("capture" / "eager" / None, the target engine's choice): the
    short catch-ups and the drafting steps run as the decode graphs' buckets on the draft's own bank.
    `short_catch_up` False: every catch-up is the packed prefill (the reference the graph catch-up is tested and
    benchmarked against). `timing` (a dict, None = off): seconds per phase of each pass, the device synchronised at
    each phase boundary (benchmarks only)."""

    def __init__(self, model, R: int, max_len: int, graphs: str | None = None, k: int = 1, backoff: int = 0):
        from .catch_up import CatchUp
        from .graphs import DecodeGraphs
        self.model, self.R, self.k = model, R, k
        self.catch_up_max = catch_up_width(k, backoff, R)
        self.bank = StateBank(model.config, R, max_len, model.device, kv_dtype=model.dtype)
        self.snap = Snapshot(self.bank, R)
        self.seen: dict[str, int] = {}            # request -> tokens its draft state covers
        self.out = torch.zeros(R, k, dtype=torch.int64, device=model.device)     # a pass's drafts
        self.graphs = None
        self.short_catch_up = True
        self.timing: dict[str, float] | None = None
        self.catch_ups = {"graph": 0, "prefill": 0}                              # rows caught up each way
        if graphs is not None:
            host = types.SimpleNamespace(model=model, bank=self.bank, device=model.device, R=R,
                                         sampled=torch.zeros(R, dtype=torch.int64, device=model.device))
            self.graphs = DecodeGraphs(host, capture=graphs == "capture")
            self.catch_up = CatchUp(model, self.bank, R, self.catch_up_max, graphs == "capture")
            self.slice = 3 * R                     # a replay's positions, slots (bucket <= R) and ids
            self.stage = torch.zeros(k * self.slice, dtype=torch.int64, pin_memory=model.device.type == "cuda")

    def capture_all(self) -> None:
        """Capture every decode and catch-up bucket of the draft now (benchmarks: no capture inside a timed run)."""
        if self.graphs is not None:
            self.graphs.capture_all()
            self.catch_up.capture_all()

    def propose(self, rows: list[DraftRow]) -> dict[str, list[int]]:
        """Each row's `room` greedy drafts after catching its draft state up (one host read at the end)."""
        if not rows:
            self.seen = {}
            return {}
        drafts = self.propose_device(rows).tolist()
        return {r.rid: drafts[j][:r.room] for j, r in enumerate(rows)}

    def propose_device(self, rows: list[DraftRow]) -> Tensor:
        """propose() without the host read: drafts [len(rows), max room] on the device (row j's first room_j are
        its drafts). `rows` are every decoding request: the draft state of any other request is forgotten."""
        t0 = self._tick()
        S, g = len(rows), self.graphs
        starts = [self.seen.get(r.rid, 0) for r in rows]
        self.seen = {r.rid: len(r) for r in rows}
        short = (g is not None and self.short_catch_up
                 and all(s > 0 and 1 <= len(r) - s <= self.catch_up_max for r, s in zip(rows, starts)))
        in_tok = short and all(len(r) - s == 1 for r, s in zip(rows, starts))
        if in_tok:                                 # one token a row: one decode replay, its tokens in g.tok
            g.run(starts, [r.slot for r in rows], [r.tail(s)[0] for r, s in zip(rows, starts)], self.stage[:self.slice])
            n, first = 1, g.tok[:S]
        elif short:
            n, first = 0, self.catch_up.run([r.tail(s) for r, s in zip(rows, starts)], starts, [r.slot for r in rows])
        else:
            n, first = 0, self._prefill_catch_up(rows, starts)
        self.catch_ups["graph" if short else "prefill"] += S
        t1 = self._tick("catch_up_graph" if short else "catch_up_prefill", t0)
        kmax = max(r.room for r in rows)
        out = self.out[:S, :kmax]
        out[:, 0].copy_(first)
        if kmax > 1:
            self.snap.save([r.slot for r in rows])
            if g is not None:
                if not in_tok:
                    g.tok[:S].copy_(first)
                self._graph_steps(rows, kmax, out, n)
            else:
                self._eager_steps(rows, kmax, out)
            t2 = self._tick("drafts", t1)
            self.snap.restore()
            self._tick("restore", t2)
        return out

    def _prefill_catch_up(self, rows: list[DraftRow], starts: list[int]) -> Tensor:
        """Every row's new tokens as one packed prefill (a piece from position 0 starts from no state); the greedy
        token after each row's last one."""
        m = self.model
        pieces = [Piece(r.tail(s), s, r.slot) for r, s in zip(rows, starts)]
        sb, _ = pack(self.bank, m.config.chunk_size, [], pieces, kw=backend_kw(m))
        tok = torch.empty(len(rows), dtype=torch.int64, device=m.device)
        ops.greedy_sample(m.forward(sb, self.bank), tok, **backend_kw(m))
        return tok

    def _graph_steps(self, rows: list[DraftRow], kmax: int, out: Tensor, used: int) -> None:
        """Drafts 2..kmax through the decode buckets: each replay reads the tokens the one before sampled (in
        place) and takes its own stage slice after the `used` ones of the catch-up."""
        g, S = self.graphs, len(rows)
        for i in range(1, kmax):
            o = (used + i - 1) * self.slice
            g.run([len(r) + i - 1 for r in rows], [r.slot for r in rows], None, self.stage[o:o + self.slice])
            out[:, i].copy_(g.tok[:S])

    def _eager_steps(self, rows: list[DraftRow], kmax: int, out: Tensor) -> None:
        """Drafts 2..kmax as exact-shape packed decode steps (no graphs: the engine has neither graphs nor
        pad_decode)."""
        m = self.model
        for i in range(1, kmax):
            dec = [(0, len(r) + i - 1, r.slot) for r in rows]
            sb, _ = pack(self.bank, m.config.chunk_size, dec, [], dec_ids=out[:, i - 1], kw=backend_kw(m))
            nxt = torch.empty(len(rows), dtype=torch.int64, device=m.device)
            ops.greedy_sample(m.forward(sb, self.bank), nxt, **backend_kw(m))
            out[:, i].copy_(nxt)

    def _tick(self, phase: str | None = None, since: float = 0.0) -> float:
        """With `timing` on: synchronise, add the time since `since` to `phase`, return now; off: nothing."""
        if self.timing is None:
            return 0.0
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        if phase is not None:
            self.timing[phase] = self.timing.get(phase, 0.0) + now - since
        return now

    def forget(self, rid: str) -> None:
        """A finished request's draft state is dropped (its slot is reused from zero: first piece has no state)."""
        self.seen.pop(rid, None)


def load_draft(path, target_config, R: int, max_len: int, device, dtype, options=None, graphs: str | None = None,
               k: int = 1, backoff: int = 0) -> DraftModel:
    """The draft folder as a FastModel on the target's device and dtype; another vocab is an error naming the field."""
    from oracle.checkpoint import load_checkpoint
    from fastpath.model import FastModel
    cfg, tensors = load_checkpoint(path)
    if cfg.vocab_size != target_config.vocab_size:
        raise TraceError("engine.speculative.proposer.model", f"draft vocab_size {cfg.vocab_size} != the target's "
                         f"{target_config.vocab_size}: a draft must share the target's vocabulary")
    return DraftModel(FastModel(cfg, tensors, device, dtype, options), R, max_len, graphs, k, backoff)
