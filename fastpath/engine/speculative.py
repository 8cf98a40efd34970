"""Speculative decoding in the fast-path engine (DESIGN §13, docs/engine.md "Speculative decoding").

A step with verify rows runs its decode and verify rows as one verify batch (fastpath/engine/verify.py): row r feeds
[last token, d_1..d_m] at positions [p, p+m]; projections run once over every token, the Mamba layers' conv and SSM
steps as one launch each over the positions, attention_decode position by position, and each Mamba layer's conv
window and SSM state after every position but the last are kept as per-position snapshots in scratch allocated
once. Rollback = copy snapshot a (the last accepted input) back into the slot: no second forward. Verify batches run
at (rows, width) buckets as CUDA graphs when the engine has graphs (greedy rows), else eagerly (padded like the
graphs under pad_decode: the bitwise reference). Prefill pieces of the same step run as a second, ordinary forward.
Verify steps are synchronous (the host needs the tokens to decide acceptance), and a step with verify rows is never
overlapped in async mode (the oracle's rule: a speculative trace overlaps only steps backoff pauses). The draft-model
proposer is fastpath/engine/draft.py. Written independently of oracle/speculative.py: only oracle's trace/log types
are imported.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch
from torch import Tensor

from oracle.schedule_log import BatchRow
from oracle.trace import TraceError

from .packing import Piece, backend_kw, pack
from .sample import sample_rows


# ------------------------------------------------------------------------------------------------- proposers

_ITEM = array("I").itemsize        # bytes per packed token id (ids < 2**32)


def ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup (DESIGN §13): longest n whose suffix occurred before; the <= k tokens after its latest match.
    The search runs as bytes.rfind over the packed token ids (a host cost on every decode step: ~25x
    fewer Python operations than comparing slices), keeping only matches at token boundaries."""
    L = len(tokens)
    if L < 2:
        return []
    packed, W = array("I", tokens), _ITEM
    packed = packed.tobytes()
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        tail, end = packed[W * (L - n):], W * (L - 1)     # a match must start before the suffix: i + n <= L - 1
        while (f := packed.rfind(tail, 0, end)) >= 0:
            if f % W == 0:
                i = f // W
                return tokens[i + n:i + n + k]
            end = f + W * n - 1                            # not at a token boundary: look further left
    return []


# ----------------------------------------------------------------------------------------- the engine's hooks

def engine_key(spec):
    """What a speculative config fixes about the engine (k and the proposer, not a scripted trace's proposals)."""
    if spec is None:
        return None
    p = spec.proposer
    return (spec.k, p.kind, p.min_n, p.max_n, p.model, spec.backoff)


class Backoff:
    """Drafting less while drafts miss (DESIGN §13 backoff, cap > 0): after a request's n-th consecutive verify row
    that accepted nothing, its next min(2^(n-1), cap) decode rows propose nothing; an accepted draft resets it."""

    def __init__(self, cap: int):
        self.cap, self.misses, self.pause = cap, {}, {}

    def paused(self, rid: str) -> bool:
        """Whether the next decode row of `rid` proposes nothing (read only: the draft pass asks before rows)."""
        return self.pause.get(rid, 0) > 0

    def take(self, rid: str) -> bool:
        """Once per decode row built: paused() and count the paused row off."""
        if not self.paused(rid):
            return False
        self.pause[rid] -= 1
        return True

    def record(self, rid: str, accepted: int) -> None:
        """A verify row of `rid` accepted `accepted` drafts."""
        if not self.cap:
            return
        if accepted:
            self.misses.pop(rid, None)
            return
        n = self.misses[rid] = self.misses.get(rid, 0) + 1
        self.pause[rid] = min(2 ** min(n - 1, 62), self.cap)


@dataclass
class Verified:
    """A verify row's outcome: the sampler's choices c_0..c_m, the accepted count, its row in the verify batch
    (its snapshots' index), its inputs."""
    choices: list[int]
    accepted: int
    snap: int
    inputs: list[int]


class Speculator:
    """Engine hooks: `row` (proposals when building a decode row), `launch` (a step with verify rows), `tokens`
    (what a resolved row emits), `rollback` (rows that rejected a draft get their accepted position's snapshot)."""

    def __init__(self, engine, spec):
        self.engine, self.spec, self.k = engine, spec, spec.k
        bank, R = engine.bank, engine.R
        if self.k + 1 > bank.max_len:
            raise TraceError("engine.speculative.k", f"k + 1 = {self.k + 1} positions exceed the engine's max_len "
                             f"{bank.max_len}")
        ec, C, V = engine.ec, engine.config.chunk_size, engine.config.vocab_size
        need = max(R * (self.k + 1), (R - 1) * (self.k + 1) + C)    # docs/scheduler.md §10, as the oracle checks
        if ec.max_tokens_per_step < need:
            raise TraceError("engine.speculative.k", f"k = {self.k} needs max_tokens_per_step >= {need}, got "
                             f"{ec.max_tokens_per_step}")
        for rid, per in (spec.proposer.proposals if spec.proposer.kind == "scripted" else ()):
            for n, toks in per:
                for j, t in enumerate(toks):
                    if t >= V:
                        raise TraceError(f"engine.speculative.proposer.proposals.{rid}.{n}[{j}]",
                                         f"token id {t} >= vocab_size {V}")
        from .verify import VerifyRunner
        g = engine.graphs                               # verify buckets follow the decode graphs' choice
        self.runner = VerifyRunner(engine, self.k, capture=g is not None and g.capture, padded=g is not None)
        self.snap = self.runner.snaps                   # per-position snapshots (rollback)
        self.out = torch.zeros(R * (self.k + 1), dtype=torch.int64, device=engine.device)   # verify-step tokens
        self.verified: list[tuple[BatchRow, Verified]] = []     # the last verify step's rows, until resolved
        p = spec.proposer
        self.draft = None
        self.table = p.table() if p.kind == "scripted" else {}
        if p.kind == "draft":
            from oracle.speculative import model_path
            from .draft import load_draft
            self.draft = load_draft(model_path(spec), engine.config, R, bank.max_len + self.k, engine.device,
                                    engine.model.dtype, getattr(engine.model, "options", None),
                                    None if g is None else "capture" if g.capture else "eager", self.k, spec.backoff)
        self._drafts: dict[str, list[int]] = {}
        self.backoff = Backoff(spec.backoff)
        self.device_drafts = None                       # drafts on the device in the decode loop (spec_device.py)
        if g is not None and p.kind in ("ngram", "draft") and \
                getattr(getattr(engine.model, "options", None), "spec_device_drafts", False):
            from .spec_device import DeviceProposals
            self.device_drafts = DeviceProposals(self, engine)
        self._on_device = False

    def use_trace(self, spec) -> None:
        """run_trace: the trace's scripted proposals (its ids checked against the vocab, as at construction)."""
        if spec.proposer.kind == "scripted":
            V = self.engine.config.vocab_size
            for rid, per in spec.proposer.proposals:
                for n, toks in per:
                    for j, t in enumerate(toks):
                        if t >= V:
                            raise TraceError(f"engine.speculative.proposer.proposals.{rid}.{n}[{j}]",
                                             f"token id {t} >= vocab_size {V}")
            self.table = spec.proposer.table()

    def reset(self) -> None:
        """Forget per-request state (a new run)."""
        self.verified, self._drafts, self._on_device = [], {}, False
        self.backoff = Backoff(self.spec.backoff)
        if self.device_drafts is not None:
            self.device_drafts.reset()
        if self.draft is not None:
            self.draft.seen = {}

    # ---- batch building ------------------------------------------------------------------------------------
    def prepare(self, live) -> None:
        """Whether this step takes device drafts; draft proposer: one batched draft pass for every decoding row before
        the batch is built."""
        self._on_device = self.device_drafts is not None and self.device_drafts.applies(live)
        if self.draft is None:
            return
        from .draft import DraftRow
        slot = self.engine.rows.row_to_slot
        rows = [DraftRow(st.req.id, slot[r], st.req.prompt, st.output, self.room(st, peek=True))
                for r, st in live if not st.prefilling]
        if rows and not any(d.room for d in rows):     # every row paused (backoff): no pass, draft states kept
            self._drafts = {}
            return
        if self._on_device:                            # drafts stay on the device (spec_device.py)
            self.device_drafts.drafts = (self.draft.propose_device(rows), [d.rid for d in rows])
            return
        self._drafts = self.draft.propose(rows)

    def overlappable(self, prev) -> bool:
        """The step after `prev` may overlap it (async): prev had no verify row and every request decoding in it is
        paused by backoff, so the next step proposes nothing (docs/scheduler.md §10)."""
        return not prev.record.verify and all(self.backoff.paused(b.request) for b in prev.batch if b.kind == "decode")

    def overlapped(self, batch: list[BatchRow]) -> None:
        """An overlapped step's rows are decode rows built without row(): count their paused step off."""
        for b in batch:
            self.backoff.take(b.request)

    def room(self, st, peek: bool = False) -> int:
        """Most proposals this decode row may take: min(k, tokens left), 0 while backoff pauses the request (counted
        off unless `peek`)."""
        rid = st.req.id
        if self.backoff.paused(rid) if peek else self.backoff.take(rid):
            return 0
        return min(self.k, st.req.max_new_tokens - len(st.output))

    def proposals(self, st) -> list[int]:
        """At most room(st) proposals for a decoding request (called once per decode row)."""
        room = self.room(st)
        if not room:
            return []
        p = self.spec.proposer
        if p.kind == "ngram":
            props = ngram(list(st.req.prompt) + st.output, room, p.min_n, p.max_n)
        elif p.kind == "scripted":
            props = list(self.table.get(st.req.id, {}).get(len(st.output), ()))
        else:
            props = self._drafts.get(st.req.id, [])
        return props[:room]

    def row(self, r: int, st, slot: int) -> BatchRow:
        """A decode row, or a verify row of m+1 tokens carrying its m proposals (device drafts: a placeholder)."""
        if self._on_device:
            return self.device_drafts.row(r, st, slot)
        pos = len(st.req.prompt) + len(st.output) - 1
        props = self.proposals(st)
        if not props:
            return BatchRow(r, st.req.id, slot, "decode", pos, 1)
        return BatchRow(r, st.req.id, slot, "verify", pos, len(props) + 1, proposals=list(props))

    # ---- the verify step -----------------------------------------------------------------------------------
    def launch(self, batch: list[BatchRow], rec):
        """Decode + verify rows as one verify batch (each verify position sampled; seeded: keyed by its own absolute
        position), prefill pieces as a second forward; acceptance decided on the host. The returned pending step
        lists each verify row as m+1 one-token rows (pos+i), of which the first a+1 sample, so resolve appends them
        in order and stops at a stop token or max_new_tokens like any other token."""
        from .launched import Launched
        if self._on_device:
            return self.device_drafts.launch(batch, rec)
        eng = self.engine
        rec.batch = batch
        rows = [b for b in batch if b.kind in ("decode", "verify")]
        pre = [b for b in batch if b.kind == "prefill"]
        inputs = [[eng.requests[b.request].output[-1]] + list(b.proposals or ()) for b in rows]
        nb, _ = self.runner.shape(len(rows), max(len(x) for x in inputs))
        seeded = []
        for r, b in enumerate(rows):
            sp = eng.requests[b.request].req.sampling
            if sp.kind == "seeded":
                first_pos = b.pos + 1                           # the token logits row r predicts
                for i in range(len(inputs[r])):                 # each verify position keyed by its own position
                    seeded.append((i * nb + r, float(sp.temperature), int(sp.seed), first_pos + i))
        nb, w, logits, tok = self.runner.run(inputs, [b.pos for b in rows], [b.slot for b in rows], seeded)
        plog = self._prefill(pre, rec) if pre else None
        if eng.on_logits is not None:                      # one pseudo decode row per logits row
            eng.on_logits(*self._expand(rows, inputs, nb, logits, pre, plog))
        vt = tok[:nb * w].tolist()                         # verify steps are synchronous
        pt = self.out[:len(pre)].tolist()
        out_rows, samples, host = self.outcome(batch, rows, inputs, vt, nb, pre, pt, rec)
        return Launched(eng.k, out_rows, rec, samples, torch.tensor(host, dtype=torch.int64), None)

    def outcome(self, batch: list[BatchRow], rows: list[BatchRow], inputs: list[list[int]], vt: list[int], nb: int,
                pre: list[BatchRow], pt: list[int], rec) -> tuple[list[BatchRow], list[bool], list[int]]:
        """A verify step's resolve view from the host tokens vt (j*nb + r) and pt (prefill pieces): acceptance per
        verify row (logged in rec.verify, kept for rollback), each verify row as m+1 one-token rows."""
        eng = self.engine
        row_of = {id(b): r for r, b in enumerate(rows)}
        out_rows, samples, host = [], [], []
        rec.verify, self.verified = [], []
        for b in batch:
            if b.kind == "prefill":
                out_rows.append(b)
                samples.append(not eng.requests[b.request].prefilling)
                host.append(pt[pre.index(b)])
                continue
            r = row_of[id(b)]
            choices = [vt[i * nb + r] for i in range(len(inputs[r]))]
            if b.kind == "decode":
                out_rows.append(b)
                samples.append(True)
                host.append(choices[0])
                continue
            a = 0
            while a < len(b.proposals) and b.proposals[a] == choices[a]:
                a += 1
            self.backoff.record(b.request, a)
            rec.verify.append({"request": b.request, "accepted": a})
            self.verified.append((b, Verified(choices, a, r, inputs[r])))
            for i in range(len(choices)):                  # emitted: c_0..c_a (accepted drafts, then the bonus)
                out_rows.append(BatchRow(b.row, b.request, b.slot, "decode", b.pos + i, 1))
                samples.append(i <= a)
                host.append(choices[i])
        return out_rows, samples, host

    def _prefill(self, pre: list[BatchRow], rec) -> Tensor:
        """The step's prefill pieces as an ordinary forward (the engine's packer; prefix-cache checkpoints planned
        for them); their tokens sampled into self.out[:len(pre)]."""
        eng = self.engine
        pieces = []
        for b in pre:
            pieces.append(Piece(list(eng.requests[b.request].req.prompt[b.pos:b.pos + b.count]), b.pos, b.slot))
            eng.requests[b.request].done = b.pos + b.count
        ckpts = (eng.prefix.plan(list(enumerate(pre)), eng.requests, rec, eng.k) if eng.prefix is not None else [])
        sb, _ = pack(eng.bank, eng.config.chunk_size, [], pieces, kw=backend_kw(eng.model), checkpoints=ckpts)
        logits = eng.model.forward(sb, eng.bank)
        seeded = []
        for j, b in enumerate(pre):
            sp = eng.requests[b.request].req.sampling
            if sp.kind == "seeded":
                seeded.append((j, float(sp.temperature), int(sp.seed), b.pos + b.count))
        sample_rows(logits, self.out[:len(pre)], seeded, **backend_kw(eng.model))
        return logits

    @staticmethod
    def _expand(rows: list[BatchRow], inputs: list[list[int]], nb: int, logits: Tensor, pre: list[BatchRow],
                plog: Tensor | None) -> tuple[list[BatchRow], Tensor]:
        """on_logits' view of a verify step: every real verify position as a decode row (row order, then
        position), then the prefill pieces; their logits rows gathered in that order."""
        out, idx = [], []
        for r, b in enumerate(rows):
            for i in range(len(inputs[r])):
                out.append(b if b.kind == "decode" else BatchRow(b.row, b.request, b.slot, "decode", b.pos + i, 1))
                idx.append(i * nb + r)
        lg = logits.index_select(0, torch.tensor(idx, dtype=torch.int64, device=logits.device))
        return out + list(pre), (lg if plog is None else torch.cat([lg, plog]))

    # ---- resolve -------------------------------------------------------------------------------------------
    def snapshot(self, b: BatchRow, j: int):
        """A verify row's (conv, ssm) state after its input j (every Mamba layer), before rollback; None when the
        slot holds it (j is the row's last input: every draft accepted). For DESIGN §17 decode stores."""
        v = next(x for row, x in self.verified if row is b)
        if j == len(b.proposals):
            return None
        return self.snap.conv[:, j, v.snap], self.snap.ssm[:, j, v.snap]

    def rollback(self) -> None:
        """Rows that rejected a draft and go on: bank[slot] := their snapshot after the last accepted input (every
        Mamba layer's conv window and SSM state). A row that accepted every draft already holds that state (its
        positions past m were slot -1 in the verify forward); a finished row is skipped. With FastOptions.spec_replay
        the rows' pre-verify state comes back and their accepted positions' conv/SSM steps re-run instead."""
        eng, redo = self.engine, []
        verified, self.verified = self.verified, []
        for b, v in verified:
            if eng.requests[b.request].finish_reason is not None:
                continue
            if v.accepted == len(b.proposals):             # every draft accepted: the forward left the right state
                continue
            if self.runner.replaying:                      # FastOptions.spec_replay: re-run the accepted steps
                redo.append((v.snap, v.accepted, b.slot))
                continue
            self.snap.restore(v.accepted, v.snap, b.slot)
        if redo:
            self.runner.replay(redo)
