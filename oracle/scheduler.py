"""The scheduler as an explicit state machine — the executable form of docs/scheduler.md (DESIGN §4).

Plain Python lists and dicts for all bookkeeping: rows, `row_to_slot`, the LIFO free-slot stack, compaction,
chunked prefill and the async overlap. The model runs per request (state keyed by request id, independent of
slots), so the tokens are the ground truth and the slot bookkeeping is pure policy, checked by the log.
Independent on purpose of the fast path's and the llama.cpp worker's schedulers (docs/scheduler.md: why).

A step (legacy, or async when not overlapped):  resolve(k-1) → admit(k) → build_batch(k) → forward → sample.
An overlapped async step:                       launch(k) = overlap_batch + forward + sample → resolve(k-1).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .batched import Segment, batches, forward_segments
from .sampling import sample
from .schedule_log import BatchRow, ScheduleLog, StepRecord, TraceResult, digest
from .trace import (FIRST_ENGINE, Request, Trace, TraceError, check_against_model, model_positions, transfer_at,
                    validate_request)

__all__ = ["Scheduler", "TraceResult", "run_trace", "run_request_alone", "piece_length", "state_bytes",
           "check_state_memory"]


@dataclass
class RequestState:
    """Host bookkeeping of one request."""

    req: Request
    output: list[int] = field(default_factory=list)
    done: int = 0                   # prompt tokens already prefilled
    model_state: Any = None         # the oracle model's per-request state (None = zeroed / fresh)
    admitted: bool = False
    finish_reason: str | None = None
    ctx: tuple[int, ...] | None = None   # the tokens its prefill computes: the prompt, + the output when resumed
    admit_seq: int = 0                   # admission order (DESIGN §18 victim rule)
    engine: str = FIRST_ENGINE           # DESIGN §19: the engine instance the request is on
    moving: bool = False                 # handed over with its state, not yet admitted by the receiver

    @property
    def prefill_tokens(self) -> tuple[int, ...]:
        return self.req.prompt if self.ctx is None else self.ctx

    @property
    def prefilling(self) -> bool:
        return self.done < len(self.prefill_tokens)

    @property
    def held(self) -> int:
        """KV positions the request holds (DESIGN §18): what it prefilled, or every token fed so far."""
        return self.done if self.prefilling else len(self.req.prompt) + len(self.output) - 1


@dataclass
class Pending:
    """A launched, not yet resolved step: its batch, log record and per-row sampled tokens (the device buffer)."""

    step: int
    batch: list[BatchRow]
    record: StepRecord
    row_tokens: list[int]           # indexed by row (compacted along with the rows); -1 = no token

    @property
    def decode_only(self) -> bool:
        return bool(self.batch) and all(b.kind in ("decode", "extra") for b in self.batch)


def piece_length(start: int, prompt_len: int, left: int, prefill_chunk: int, chunk_size: int) -> int:
    """Tokens of the next prefill piece (docs/scheduler.md §3.3): the rest if it fits, else whole chunks, or 0."""
    cap = min(left, prefill_chunk)
    if prompt_len - start <= cap:
        return prompt_len - start
    return (cap // chunk_size) * chunk_size


def state_bytes(config: Any, positions: int, elem: int) -> int:
    """Bytes of one request's oracle state (OracleState) after `positions` tokens: K and V of every attention layer
    at every position, and each Mamba layer's conv window and SSM state, in elements of `elem` bytes."""
    c = config
    kv = 2 * len(c.attention_layer_ids) * c.n_kv_heads * c.attn_head_dim * positions
    mamba = len(c.mamba_layer_ids) * (c.conv_dim * (c.mamba_d_conv - 1) + c.mamba_n_heads * c.mamba_head_dim
                                      * c.mamba_d_state)
    return elem * (kv + mamba)


def check_state_memory(model: Any, trace: Trace) -> None:
    """Refuse, before the first step, a trace whose oracle states cannot fit where the model runs: the max_requests
    longest requests at full length, plus the prefix cache's checkpoints at the longest prompt, against free memory
    (a model without a dtype keeps no states: ScheduleOnly replays)."""
    from .streamed import available_memory_bytes, gpu_free_bytes
    if getattr(model, "dtype", None) is None or not trace.requests:
        return
    elem = torch.empty(0, dtype=model.dtype).element_size()
    device = torch.device(getattr(model, "device", "cpu"))
    free = gpu_free_bytes(device) if device.type == "cuda" else available_memory_bytes()
    if free is None:
        return
    c = model.config
    lengths = sorted(((len(r.prompt) + r.max_new_tokens, i) for i, r in enumerate(trace.requests)), reverse=True)
    live = lengths[:trace.engine.max_requests]
    need = sum(state_bytes(c, n, elem) for n, _ in live)
    pc = trace.engine.prefix_cache
    cache = 0 if pc is None else pc.capacity * state_bytes(c, max(len(r.prompt) for r in trace.requests), elem)
    if need <= free < need + cache:
        raise TraceError("engine.prefix_cache.capacity", f"{pc.capacity} checkpoints of up to the longest prompt "
                         f"need {cache / 2 ** 30:.3g} GiB beside the requests' {need / 2 ** 30:.3g} GiB, more than the "
                         f"{free / 2 ** 30:.3g} GiB free on {device} ({model.dtype})")
    if need > free:
        n, i = live[0]
        r = trace.requests[i]
        raise TraceError(f"requests[{i}].max_new_tokens",
                         f"{r.max_new_tokens}: the oracle's states of the {len(live)} longest requests at full length "
                         f"(this one {n} positions) need {need / 2 ** 30:.3g} GiB, more than the {free / 2 ** 30:.3g} "
                         f"GiB free on {device} ({model.dtype})", r.id)


class Scheduler:
    """One engine run over a trace: rows, slots, free stack, pending step; `run()` drives it to completion."""

    def __init__(self, model: Any, trace: Trace, mode: str, forced_tokens: dict[str, list[int]] | None = None,
                 instance: str | None = None):
        """`instance`: this engine's id among several (DESIGN §19, oracle/transfer.py); None: the only one."""
        if mode not in ("legacy", "async"):
            raise TraceError("mode", f"unknown mode {mode!r}; expected 'legacy' or 'async'")
        cfg = model.config
        trace = check_against_model(trace, cfg.vocab_size, cfg.chunk_size, model_positions(cfg))       # normalised: ints, tuples
        check_state_memory(model, trace)
        self.model, self.trace, self.mode = model, trace, mode
        moved = [i for i, r in enumerate(trace.requests) if r.transfer]
        if moved and instance is None:
            raise TraceError(f"requests[{moved[0]}].transfer", "a trace with transfers runs on several engine "
                             "instances: oracle.scheduler.run_trace (oracle/transfer.py)", trace.requests[moved[0]].id)
        self.name = instance or FIRST_ENGINE
        self.transit: list[RequestState] = []          # DESIGN §19: handed over to this instance, not yet admitted
        # Replay hook (hybridqual.qualify): request id -> its output tokens, taken instead of sampling while they last,
        # so the log is this policy's schedule for another engine's (tie-accepted) outputs.
        self.forced = forced_tokens or {}
        self.chunk_size = cfg.chunk_size
        e = trace.engine
        self.R, self.budget, self.prefill_chunk = e.max_requests, e.max_tokens_per_step, e.prefill_chunk
        self.rows: list[str | None] = [None] * self.R
        self.row_to_slot: list[int] = [-1] * self.R
        self.free_slots: list[int] = list(range(self.R - 1, -1, -1))   # top = last element = slot 0 first
        self.requests = {r.id: RequestState(r) for r in trace.requests}
        self.arrival_order = sorted(trace.requests, key=lambda r: (r.arrival_step, r.id))
        self.pending: Pending | None = None
        self.log = ScheduleLog(mode)
        self.k = 0
        self.kv = trace.engine.kv_tokens                 # DESIGN §18: the KV budget (None: nothing preempts)
        self._seq = 0
        self.spec = None
        if trace.engine.speculative is not None:          # DESIGN §13: proposals, verify rows
            from .speculative import SpecRunner
            self.spec = SpecRunner(trace)
        self.cache = None
        if trace.engine.prefix_cache is not None:        # DESIGN §12: the cache modelled exactly (prefix_cache.py)
            from .prefix_cache import SchedulerCache
            from .trace import check_prefix_cache_against_model
            mamba = getattr(cfg, "mamba_layer_ids", None)        # None: a test stand-in model without layers
            check_prefix_cache_against_model(trace.engine, cfg.chunk_size, None if mamba is None else len(mamba))
            pc = trace.engine.prefix_cache
            self.cache = SchedulerCache(pc.checkpoint_block, pc.capacity, pc.store_decoded)   # DESIGN §21
            self.log.prefix_cache = True
            if self.spec is not None and pc.store_decoded:       # DESIGN §17: verified states at boundaries
                self.spec.keep_states = self.cache.keep

    def add_request(self, req: Request) -> None:
        """Streaming use: submit a request arriving at `req.arrival_step` (>= the current step)."""
        where = f"requests[{len(self.requests)}]"
        req = validate_request(req, where, self.model.config.vocab_size,    # the checks parse_trace makes
                               model_positions(self.model.config))
        if req.id in self.requests:
            raise TraceError(f"{where}.id", "duplicate request id", req.id)
        if req.arrival_step < self.k:
            raise TraceError(f"{where}.arrival_step", f"must be >= the current step {self.k}", req.id)
        if req.transfer:
            raise TraceError(f"{where}.transfer", "a streamed request cannot be handed over: transfers run "
                             "through run_trace (oracle/transfer.py)", req.id)
        self.requests[req.id] = RequestState(req)
        self.arrival_order = sorted(self.arrival_order + [req], key=lambda r: (r.arrival_step, r.id))

    # ------------------------------------------------------------------------------------------- queries
    @property
    def active(self) -> int:
        """Number of live rows (they are rows 0..active-1)."""
        return sum(r is not None for r in self.rows)

    def waiting(self, k: int) -> list[RequestState]:
        """Requests handed over to this instance (DESIGN §19, in hand-over order), then arrived, not yet admitted
        requests of this instance in (arrival_step, id) order."""
        arrived = (self.requests[r.id] for r in self.arrival_order if r.arrival_step <= k)
        return self.transit + [s for s in arrived if not s.admitted and not s.moving and s.engine == self.name]

    def all_finished(self) -> bool:
        """True when every request on this instance has finished."""
        return all(s.finish_reason is not None for s in self.requests.values() if s.engine == self.name)

    # ------------------------------------------------------------------------------------------- resolve
    def resolve(self, p: Pending, inflight: Pending | None = None) -> None:
        """Append step p's tokens, detect finishes, free slots (ascending row), compact rows and per-row outputs.

        `inflight` is the step launched after p (async overlap): its per-row outputs are compacted too.
        """
        rec = p.record
        row_of = {rid: r for r, rid in enumerate(self.rows) if rid is not None}
        finished: list[int] = []
        emitted: dict[str, int] = {}                   # tokens appended per request (DESIGN §17 decode stores)
        live = [(b, row_of[b.request]) for b in p.batch if b.request in row_of]    # extra rows are gone
        for b, r in sorted(live, key=lambda br: (br[0].kind not in ("decode", "verify"), br[1])):  # decode first
            if p.row_tokens[r] < 0:                    # no sample: a non-final prefill piece
                continue
            st = self.requests[b.request]
            row_toks = self.spec.tokens(rec, b, p.row_tokens[r]) if self.spec else [p.row_tokens[r]]
            for j, tok in enumerate(row_toks):         # a verify row emits several; stop / length cut them
                st.output.append(tok)
                emitted[b.request] = emitted.get(b.request, 0) + 1
                pos = b.pos + 1 + j if b.kind == "verify" else b.pos + b.count
                rec.sampled.append({"request": b.request, "pos": pos, "token": tok})
                if tok in st.req.stop_token_ids:
                    st.finish_reason = "stop"
                elif len(st.output) == st.req.max_new_tokens:
                    st.finish_reason = "length"
                if st.finish_reason is not None:
                    finished.append(r)
                    break
        if self.cache is not None:
            self.cache.after_resolve(p.batch, emitted, self.requests, rec, p.step)
        for r in sorted(finished):
            rid, slot = self.rows[r], self.row_to_slot[r]
            rec.free.append({"request": rid, "row": r, "slot": slot, "reason": self.requests[rid].finish_reason})
            self.free_slots.append(slot)
            self.rows[r], self.row_to_slot[r] = None, -1
            p.row_tokens[r] = -1
        if inflight is not None:
            for r in finished:
                inflight.row_tokens[r] = -1                # the extra row's token is discarded
        buffers = [p.row_tokens] + ([inflight.row_tokens] if inflight is not None else [])
        rec.moves.extend(self.compact(buffers))
        rec.row_to_slot = list(self.row_to_slot)

    def compact(self, buffers: list[list[int]]) -> list[dict[str, Any]]:
        """Right-most live row fills the left-most hole until rows 0..active-1 are live; returns the moves."""
        moves = []
        while True:
            holes = [r for r in range(self.R) if self.rows[r] is None]
            live = [r for r in range(self.R) if self.rows[r] is not None]
            if not holes or not live or holes[0] > live[-1]:
                return moves
            src, dst = live[-1], holes[0]
            rid, slot = self.rows[src], self.row_to_slot[src]
            self.rows[dst], self.row_to_slot[dst] = rid, slot
            self.rows[src], self.row_to_slot[src] = None, -1
            for buf in buffers:
                buf[dst], buf[src] = buf[src], -1
            moves.append({"from_row": src, "to_row": dst, "request": rid, "slot": slot})

    # --------------------------------------------------------------------------------------------- admit
    def admit(self, k: int, rec: StepRecord) -> None:
        """Admit arrived requests in (arrival_step, id) order while a slot is free; zero the slot."""
        for st in self.waiting(k):
            if not self.free_slots:
                return
            ctx = tuple(st.req.prompt) + tuple(st.output)        # a resumed request recomputes its output too
            if self.kv is not None and self.held_total() + len(ctx) > self.kv:
                return                                          # DESIGN §18: admission within the KV budget
            slot, row = self.free_slots.pop(), self.active
            self.rows[row], self.row_to_slot[row] = st.req.id, slot
            if st.moving:                                       # DESIGN §19: a zeroed slot, the moved state in it
                self.transit.remove(st)
                st.admitted, st.moving = True, False
                rec.admit.append({"request": st.req.id, "row": row, "slot": slot, "imported": st.held})
                continue
            st.admitted, st.model_state, st.done, st.ctx = True, None, 0, ctx   # zeroed slot = fresh state
            self._seq += 1
            st.admit_seq = self._seq
            rec.admit.append({"request": st.req.id, "row": row, "slot": slot})
            if st.output:
                rec.admit[-1]["resumed"] = len(st.output)
            if self.cache is not None:
                self.cache.admit(st, rec, k)                    # longest hit: restored state, done = p

    # --------------------------------------------------------------------------------------- build batch
    def build_batch(self) -> list[BatchRow]:
        """Decode rows first in row order, then prefill pieces in row order within the token budget."""
        batch: list[BatchRow] = []
        live = [(r, self.requests[rid]) for r, rid in enumerate(self.rows) if rid is not None]
        for r, st in live:
            if not st.prefilling:
                pos = len(st.req.prompt) + len(st.output) - 1
                batch.append(self.spec.row(r, st, self.row_to_slot[r]) if self.spec else
                             BatchRow(r, st.req.id, self.row_to_slot[r], "decode", pos, 1))
        used = sum(b.count for b in batch)               # a verify row costs its m+1 tokens
        for r, st in live:
            if st.prefilling:
                n = piece_length(st.done, len(st.prefill_tokens), self.budget - used, self.prefill_chunk,
                                 self.chunk_size)         # a prefix cache cuts nothing (DESIGN §12)
                if n > 0:
                    batch.append(BatchRow(r, st.req.id, self.row_to_slot[r], "prefill", st.done, n))
                    used += n
        return batch

    def held_total(self) -> int:
        """KV positions all live requests hold (DESIGN §18)."""
        return sum(self.requests[rid].held for rid in self.rows if rid is not None)

    def need(self, batch: list[BatchRow]) -> int:
        """KV positions the live requests hold after this batch: a row's end position, else what it holds."""
        ends = {b.request: b.pos + b.count for b in batch}
        return sum(ends.get(rid, self.requests[rid].held) for rid in self.rows if rid is not None)

    def hand_over(self, rid: str) -> None:
        """DESIGN §19, the sender's side: the live request's slot is freed as at a finish (reason "transfer", in the
        record of the step just resolved) and rows compact; its state stays with it (RequestState.model_state)."""
        row = self.rows.index(rid)
        slot, rec = self.row_to_slot[row], self.log.steps[-1]
        self.free_slots.append(slot)
        self.rows[row], self.row_to_slot[row] = None, -1
        self.requests[rid].admitted = False
        rec.free.append({"request": rid, "row": row, "slot": slot, "reason": "transfer"})
        rec.moves.extend(self.compact([]))
        rec.row_to_slot = list(self.row_to_slot)

    def preempt(self, rec: StepRecord) -> None:
        """DESIGN §18 by recompute: the live request admitted last gives its slot back (its state dropped, its output
        kept), rows compact, and it waits in its arrival place to prefill prompt + output again."""
        live = [rid for rid in self.rows if rid is not None]
        rid = max(live, key=lambda r: self.requests[r].admit_seq)
        row = self.rows.index(rid)
        st, slot = self.requests[rid], self.row_to_slot[row]
        self.free_slots.append(slot)
        self.rows[row], self.row_to_slot[row] = None, -1
        st.admitted, st.model_state, st.done = False, None, 0
        if rec.preempt is None:
            rec.preempt = []
        rec.preempt.append({"request": rid, "row": row, "slot": slot, "generated": len(st.output),
                            "moves": self.compact([])})

    def overlap_batch(self, prev: Pending) -> list[BatchRow]:
        """Async overlapped launch: every current row decodes the token step `prev` left in the device buffer."""
        prev_pos = {b.request: b.pos for b in prev.batch}
        return [BatchRow(r, rid, self.row_to_slot[r], "decode", prev_pos[rid] + 1, 1)
                for r, rid in enumerate(self.rows) if rid is not None]

    # ------------------------------------------------------------------------------------ forward/sample
    def forward_and_sample(self, batch: list[BatchRow], inputs: dict[int, int]) -> list[int]:
        """Run each batch row through the model on its request's state; sample rows that sample, per row. Plain
        prefill and decode rows share one pass over the weights when the model offers it (oracle/batched.py)."""
        row_tokens = [-1] * self.R
        passed = self.forward_plain_rows(batch, inputs)
        for b in batch:
            st = self.requests[b.request]
            if b.kind == "verify":
                row_tokens[b.row] = self.spec.forward(self.model, st, b, self.forced.get(b.request, ()))
                continue
            if b.kind == "prefill":
                logits, st.model_state = (passed[b.row] if b.row in passed else
                                          self.cache.prefill(self.model, st, b) if self.cache is not None else
                                          self.model.prefill(list(st.prefill_tokens[b.pos:b.pos + b.count]),
                                                             st.model_state))
                st.done = b.pos + b.count
                if st.prefilling:
                    continue
                last = logits[-1]
            else:
                if b.row in passed:
                    logits, st.model_state = passed[b.row]
                    last = logits[-1]
                else:
                    token = inputs[b.row] if b.row in inputs else st.output[-1]
                    last, st.model_state = self.model.decode(token, st.model_state)
            forced, i = self.forced.get(b.request, ()), b.pos + b.count - len(st.req.prompt)
            row_tokens[b.row] = forced[i] if i < len(forced) else sample(last, st.req.sampling, b.pos + b.count)
        return row_tokens

    def forward_plain_rows(self, batch: list[BatchRow], inputs: dict[int, int]) -> dict[int, tuple[Any, Any]]:
        """row -> (logits, new state) of the step's plain rows (prefill pieces outside the prefix cache, decodes),
        all in one pass over the weights (oracle/batched.py); empty when the model does not batch or fewer than two
        rows are plain."""
        plain = [b for b in batch if b.kind == "decode" or (b.kind == "prefill" and self.cache is None)]
        if not batches(self.model) or len(plain) < 2:
            return {}
        segments = []
        for b in plain:
            st = self.requests[b.request]
            if b.kind == "prefill":
                segments.append(Segment(list(st.prefill_tokens[b.pos:b.pos + b.count]), st.model_state, "chunked"))
            else:
                token = inputs[b.row] if b.row in inputs else st.output[-1]
                segments.append(Segment([token], st.model_state, "recurrence"))
        return {b.row: out for b, out in zip(plain, forward_segments(self.model, segments))}

    # ---------------------------------------------------------------------------------------------- step
    def can_overlap(self, k: int) -> bool:
        """Async only: previous step decode-only, live rows, nobody waiting, no prefill in progress (docs §5)."""
        p = self.pending
        return (self.mode == "async" and p is not None and p.decode_only and self.active > 0
                and not self.waiting(k)
                and (self.spec is None or self.spec.overlappable(p.batch))   # §10: only steps backoff pauses
                and (self.cache is None or not self.cache.blocks_overlap(p.batch))   # DESIGN §17
                and self.kv is None                                                   # DESIGN §18: builds decide
                and not any(transfer_at(self.requests[b.request].req, p.step) for b in p.batch)   # DESIGN §19
                and not any(self.requests[rid].prefilling for rid in self.rows if rid is not None))

    def launch_overlapped(self, rec: StepRecord) -> None:
        """Async overlap: launch step k from step k-1's device tokens, then resolve k-1 (extras found here)."""
        prev = self.pending
        rec.overlap = 1
        rec.batch = self.overlap_batch(prev)
        if self.spec is not None:
            self.spec.overlapped(rec.batch)
        launched = Pending(self.k, rec.batch, rec, [])
        launched.row_tokens = self.forward_and_sample(rec.batch, {b.row: prev.row_tokens[b.row] for b in rec.batch})
        self.resolve(prev, inflight=launched)
        finished = {f["request"] for f in prev.record.free}
        for b in rec.batch:
            if b.request in finished:
                b.kind = "extra"
        self.pending = launched

    def step(self) -> bool:
        """Run step k (overlapped or not), appending its record; False when the run is over (nothing logged)."""
        if self.can_overlap(self.k):
            rec = StepRecord(self.k)
            self.log.steps.append(rec)
            self.launch_overlapped(rec)
        else:
            if self.pending is not None:                   # drain before admitting
                self.resolve(self.pending)
                self.pending = None
            if self.all_finished():
                return False
            rec = StepRecord(self.k)
            self.log.steps.append(rec)
            self.admit(self.k, rec)
            rec.batch = self.build_batch()
            while self.kv is not None and self.need(rec.batch) > self.kv:      # DESIGN §18: preempt, rebuild
                self.preempt(rec)
                rec.batch = self.build_batch()
            if rec.batch:
                self.pending = Pending(self.k, rec.batch, rec, self.forward_and_sample(rec.batch, {}))
                if self.cache is not None:
                    self.cache.after_forward(rec.batch, self.requests, rec, self.k)
            else:
                rec.row_to_slot = list(self.row_to_slot)
        self.k += 1
        return True

    def run(self, max_steps: int = 1_000_000) -> TraceResult:
        """Step until every request finished and nothing is pending; return tokens, reasons, log, digest."""
        while self.step():
            if self.k > max_steps:
                raise RuntimeError(f"scheduler made no progress within {max_steps} steps")
        return TraceResult({rid: list(s.output) for rid, s in self.requests.items()},
                           {rid: s.finish_reason for rid, s in self.requests.items()},
                           self.log, digest(self.log))


def run_trace(model: Any, trace: Trace, mode: str | None = None,
              forced_tokens: dict[str, list[int]] | None = None) -> TraceResult:
    """Run a trace through the oracle scheduler and model; mode defaults to the trace's engine.mode. `forced_tokens`
    (request id -> tokens) replaces sampling while a request's list lasts (replaying another engine's outputs). A trace
    with transfers runs on several instances (DESIGN §19, oracle/transfer.py)."""
    if isinstance(trace, Trace) and any(getattr(r, "transfer", ()) for r in trace.requests):
        from .transfer import Instances
        return Instances(Scheduler, model, trace, mode or trace.engine.mode, forced_tokens).run()
    return Scheduler(model, trace, mode or trace.engine.mode, forced_tokens).run()


def run_request_alone(model: Any, req: Request) -> tuple[list[int], str]:
    """The reference: one request alone, whole prompt in one prefill, then decode until stop or length."""
    logits, state = model.prefill(list(req.prompt), None)
    out, last = [], logits[-1]
    while True:
        tok = sample(last, req.sampling, len(req.prompt) + len(out))
        out.append(tok)
        if tok in req.stop_token_ids:
            return out, "stop"
        if len(out) == req.max_new_tokens:
            return out, "length"
        last, state = model.decode(tok, state)
