"""Speculative decoding in the fast-path engine (DESIGN §13, docs/engine.md "Speculative decoding").

A step with verify rows runs its decode and verify rows as one verify batch (fastpath/engine/verify.py): row r
feeds [last token, d_1..d_m] at positions [p, p+m]; projections run once over every token, the Mamba layers'
decode-step kernels and attention_decode position by position, and each Mamba layer's conv window and SSM state
after every position but the last are kept as per-position snapshots in scratch allocated once. Rollback = copy
snapshot a (the last accepted input) back into the slot: no second forward. Verify batches run at (rows, width)
buckets as CUDA graphs when the engine has graphs (greedy rows), else eagerly (padded like the graphs under
pad_decode: the bitwise reference). Prefill pieces of the same step run as a second, ordinary forward. Verify
steps are synchronous (the host needs the tokens to decide acceptance), and a step with verify rows is never
overlapped in async mode (the oracle's rule: speculative traces never overlap). Written independently of
oracle/speculative.py: only oracle's trace/log types are imported.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch
from torch import Tensor

from oracle.schedule_log import BatchRow
from oracle.trace import TraceError

from . import ops
from .bank import StateBank
from .packing import pack_step
from .sample import sample_rows


@dataclass
class Piece:
    """One packed sequence: tokens at positions [start, start+len) continued from bank[slot]."""
    tokens: list[int]
    start: int
    slot: int
    all_logits: bool = False     # logits at every position (verify rows), else only at the last


def _kw(model) -> dict:
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


class Snapshot:
    """Conv windows and SSM states of up to R slots of a bank, copied out and back (the draft model's own state
    around its drafting steps)."""

    def __init__(self, bank: StateBank, R: int):
        self.bank = bank
        self.conv = torch.zeros_like(bank.conv_state[:, :R])
        self.ssm = torch.zeros_like(bank.ssm_state[:, :R])

    def save(self, slots: list[int]) -> None:
        """snapshot[:, j] := bank[:, slots[j]] (the index goes up by a non-blocking pinned copy: no host sync)."""
        idx = torch.tensor(slots, dtype=torch.int64)
        if self.bank.device.type == "cuda":
            idx = idx.pin_memory()
        idx = idx.to(self.bank.device, non_blocking=True)
        self.conv[:, :len(slots)] = self.bank.conv_state.index_select(1, idx)
        self.ssm[:, :len(slots)] = self.bank.ssm_state.index_select(1, idx)

    def restore(self, j: int, slot: int) -> None:
        """bank[:, slot] := snapshot[:, j] (conv window and SSM state of every Mamba layer)."""
        self.bank.conv_state[:, slot].copy_(self.conv[:, j])
        self.bank.ssm_state[:, slot].copy_(self.ssm[:, j])


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


class DraftModel:
    """The draft proposer: a FastModel with its own StateBank (slot = the request's slot), greedy. Each request's
    draft state covers its tokens seen so far; drafting past them runs on the bank and is undone from a snapshot.
    graphs ("capture" / "eager" / None, the target engine's choice): the drafting steps run as the decode graphs'
    buckets on the draft's bank (tokens read from and sampled into one device buffer: no host sync until the end)."""

    def __init__(self, model, R: int, max_len: int, graphs: str | None = None, k: int = 1):
        import types
        from .graphs import DecodeGraphs
        self.model, self.R = model, R
        self.bank = StateBank(model.config, R, max_len, model.device, kv_dtype=model.dtype)
        self.snap = Snapshot(self.bank, R)
        self.seen: dict[str, int] = {}
        self.graphs = None
        if graphs is not None:
            host = types.SimpleNamespace(model=model, bank=self.bank, device=model.device, R=R,
                                         sampled=torch.zeros(R, dtype=torch.int64, device=model.device))
            self.graphs = DecodeGraphs(host, capture=graphs == "capture")
            self.stage = torch.zeros(max(k - 1, 1) * 2 * R, dtype=torch.int64, pin_memory=model.device.type == "cuda")

    def propose(self, rows: list[tuple[str, int, list[int], int]]) -> dict[str, list[int]]:
        """rows (request, slot, tokens, room): catch each draft state up on the new tokens, then `room` greedy
        drafts per row (all rows decoded together; one host sync at the end)."""
        if not rows:
            return {}
        drafts = self.propose_device(rows).tolist()
        return {rid: drafts[j][:room] for j, (rid, _, _, room) in enumerate(rows)}

    def propose_device(self, rows: list[tuple[str, int, list[int], int]]) -> Tensor:
        """propose() without the host read: drafts [len(rows), max room] on the device (row j's first room_j
        are its drafts)."""
        m, dev = self.model, self.model.device
        pieces = [Piece(list(t[self.seen.get(rid, 0):]), self.seen.get(rid, 0), s) for rid, s, t, _ in rows]
        sb, _ = pack(self.bank, m.config.chunk_size, [], pieces, kw=_kw(m))
        tok = torch.empty(len(rows), dtype=torch.int64, device=dev)
        ops.greedy_sample(m.forward(sb, self.bank), tok, **_kw(m))
        for rid, _, t, _ in rows:
            self.seen[rid] = len(t)
        out, k = [tok.clone()], max(r[3] for r in rows)
        if k > 1:
            self.snap.save([s for _, s, _, _ in rows])
            if self.graphs is not None:
                out += self._graph_steps(rows, tok, k)
            for i in range(1, k if self.graphs is None else 1):
                dec = [(0, len(t) + i - 1, s) for _, s, t, _ in rows]
                sb, _ = pack(self.bank, m.config.chunk_size, dec, [], dec_ids=out[-1], kw=_kw(m))
                nxt = torch.empty(len(rows), dtype=torch.int64, device=dev)
                ops.greedy_sample(m.forward(sb, self.bank), nxt, **_kw(m))
                out.append(nxt)
            for j, (_, s, _, _) in enumerate(rows):
                self.snap.restore(j, s)
        return torch.stack(out, 1)

    def _graph_steps(self, rows, tok: Tensor, k: int) -> list[Tensor]:
        """Drafts 2..k through the decode buckets: each step reads the previous step's tokens from the buffer it
        samples into; each its own stage slice (no host sync between them)."""
        g, n, out = self.graphs, len(rows), []
        g.tok[:n].copy_(tok)
        for i in range(1, k):
            g.run([len(t) + i - 1 for _, _, t, _ in rows], [s for _, s, _, _ in rows], None,
                  self.stage[(i - 1) * 2 * self.R:i * 2 * self.R])
            out.append(g.tok[:n].clone())
        return out

    def forget(self, rid: str) -> None:
        """A finished request's draft state is dropped (its slot is reused from zero: first piece has no state)."""
        self.seen.pop(rid, None)


def load_draft(path, target_config, R: int, max_len: int, device, dtype, options=None, graphs: str | None = None,
               k: int = 1) -> DraftModel:
    """The draft folder as a FastModel on the target's device and dtype; another vocab is an error naming the field."""
    from oracle.checkpoint import load_checkpoint
    from fastpath.model import FastModel
    cfg, tensors = load_checkpoint(path)
    if cfg.vocab_size != target_config.vocab_size:
        raise TraceError("engine.speculative.proposer.model", f"draft vocab_size {cfg.vocab_size} != the target's "
                         f"{target_config.vocab_size}: a draft must share the target's vocabulary")
    return DraftModel(FastModel(cfg, tensors, device, dtype, options), R, max_len, graphs, k)


# ----------------------------------------------------------------------------------------- the engine's hooks

def engine_key(spec):
    """What a speculative config fixes about the engine (k and the proposer, not a scripted trace's proposals)."""
    if spec is None:
        return None
    p = spec.proposer
    return (spec.k, p.kind, p.min_n, p.max_n, p.model)


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
            self.draft = load_draft(model_path(spec), engine.config, R, bank.max_len + self.k, engine.device,
                                    engine.model.dtype, getattr(engine.model, "options", None),
                                    None if g is None else "capture" if g.capture else "eager", self.k)
        self._drafts: dict[str, list[int]] = {}
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
        rows = []
        for r, st in live:
            if not st.prefilling:
                room = min(self.k, st.req.max_new_tokens - len(st.output))
                rows.append((st.req.id, self.engine.rows.row_to_slot[r], list(st.req.prompt) + st.output, room))
        if self._on_device:                            # drafts stay on the device (spec_device.py)
            self.device_drafts.drafts = (self.draft.propose_device(rows), [rid for rid, _, _, _ in rows])
            return
        self._drafts = self.draft.propose(rows)

    def proposals(self, st) -> list[int]:
        """At most min(k, tokens left) proposals for a decoding request."""
        room = min(self.k, st.req.max_new_tokens - len(st.output))
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
        sb, _ = pack(eng.bank, eng.config.chunk_size, [], pieces, kw=_kw(eng.model), checkpoints=ckpts)
        logits = eng.model.forward(sb, eng.bank)
        seeded = []
        for j, b in enumerate(pre):
            sp = eng.requests[b.request].req.sampling
            if sp.kind == "seeded":
                seeded.append((j, float(sp.temperature), int(sp.seed), b.pos + b.count))
        sample_rows(logits, self.out[:len(pre)], seeded, **_kw(eng.model))
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
