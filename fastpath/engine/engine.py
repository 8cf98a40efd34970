"""The fast-path engine: the step loop of docs/scheduler.md over the batched model and the ONE state bank.

Independent on purpose of oracle/scheduler.py and the llama.cpp worker (docs/scheduler.md: why); it imports only
oracle's trace/log types and IO.  Per step:

    legacy (and non-overlapped async):  resolve(k-1) -> admit(k) -> build_batch(k) -> launch(k)
    overlapped async:                   launch(k) with step k-1's tokens from the device buffer -> resolve(k-1)

`launch` packs the batch (decode rows first, then prefill pieces), uploads its metadata in one pinned
host->device copy, runs the model, samples into the int64 device buffer `sampled` (allocated once), and starts
an asynchronous device->pinned-host copy of the tokens with an event.  `resolve` waits for that event only —
the one synchronisation per step — then appends tokens, frees finished slots (LIFO) and compacts the row
table; in an overlapped step the same moves are applied to `sampled`, which feeds the next launch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from oracle.schedule_log import BatchRow, ScheduleLog, StepRecord, TraceResult, digest
from oracle.trace import (FIRST_ENGINE, EngineConfig, Request, Trace, TraceError, check_against_model,
                          model_positions, transfer_at, validate_request)
from oracle.trace import check_prefix_cache_against_model
from fastpath.options import FastOptions, check_options

from .bank import StateBank
from .launched import DECODE_KINDS, Launched
from .memory import check_weights_fit
from .packing import pack_step
from .rows import RowTable, apply_moves_, index_pair
from .sample import sample_rows
from .validate import _flag, check_engine_args, check_kernels_run_on, check_path, resolve_device, resolve_dtype

MODES = ("legacy", "async")


@dataclass
class RequestState:
    """Host bookkeeping of one request."""
    req: Request
    output: list[int] = field(default_factory=list)
    done: int = 0                     # prompt tokens prefilled so far
    admitted: bool = False
    finish_reason: str | None = None
    ctx: tuple[int, ...] | None = None   # what its prefill computes: the prompt, + the output when resumed (§18)
    admit_seq: int = 0                   # admission order (the DESIGN §18 victim rule)
    engine: str = FIRST_ENGINE           # DESIGN §19: the engine instance it is on (fastpath/engine/transfer.py)
    moved: object = None                 # its exported state while handed over, not yet admitted (SlotState)

    @property
    def prefill_tokens(self) -> tuple[int, ...]:
        return self.req.prompt if self.ctx is None else self.ctx

    @property
    def prefilling(self) -> bool:
        return self.done < len(self.prefill_tokens)

    @property
    def held(self) -> int:
        """KV positions held (DESIGN §18): what it prefilled, or every token fed so far."""
        return self.done if self.prefilling else len(self.req.prompt) + len(self.output) - 1


def piece_length(start: int, prompt_len: int, left: int, prefill_chunk: int, chunk_size: int) -> int:
    """Next prefill piece: the rest of the prompt if it fits min(left, prefill_chunk), else whole chunks (or 0)."""
    cap = min(left, prefill_chunk)
    if prompt_len - start <= cap:
        return prompt_len - start
    return cap - cap % chunk_size


class Engine:
    """Batched engine over one StateBank; `run_trace` or `add_request` + `step` (streaming)."""

    def __init__(self, model, engine_config: EngineConfig, max_len: int = 2048, graphs: bool = False,
                 pad_decode: bool = False, prefill_graphs: bool = False,
                 prefill_buckets: tuple[int, ...] | str | None = None):
        """graphs: decode-only steps replay CUDA graphs at bucket sizes (on CUDA); pad_decode: run those padded
        bucket shapes eagerly (the bitwise reference for graphs, and the pad-row path on CPU); prefill_graphs: a
        short prefill-only step shape seen before (a prefix-cache hit's suffix) replays a CUDA graph
        (fastpath/engine/prefill_graphs.py; on CPU its kept-batch path runs eagerly); prefill_buckets (None: off;
        "default": chunk size · 1, 2, 4, … within the step budget and max_len, none if none fits; the Triton
        backend): one-piece prefill-only steps padded to these token counts, built (captured) here, so a hit of any
        suffix length below the largest, at any start and slot, is never eager; in the default mode a padded step's
        bits are its bucket's (fastpath/engine/prefill_buckets.py)."""
        engine_config = check_engine_args(model, engine_config, max_len, graphs, pad_decode)  # before allocating
        _flag("prefill_graphs", prefill_graphs)
        from .prefill_buckets import check_buckets
        prefill_buckets = check_buckets(prefill_buckets, model, engine_config, max_len, prefill_graphs)
        self.model, self.config, self.ec = model, model.config, engine_config
        self.device = model.device
        self.R = engine_config.max_requests
        self.prefix = None                             # prefix cache (DESIGN §12): pool slots in the same bank
        pc = engine_config.prefix_cache
        if pc is not None:
            check_prefix_cache_against_model(engine_config, model.config.chunk_size,
                                             len(model.config.mamba_layer_ids), "engine_config")
        state = getattr(getattr(model, "options", None), "state_dtype", "float32")   # DESIGN §20
        if state != "float32" and getattr(model, "backend", "torch") != "torch":
            from fastpath.options import OptionsError
            raise OptionsError(f"options.state_dtype: {state!r} needs backend 'torch' (the Triton kernels keep an "
                               "fp32 state bank)")
        self.bank = StateBank(model.config, self.R, max_len, self.device, kv_dtype=model.dtype,
                              state_dtype=getattr(torch, state), pool=pc.capacity if pc is not None else 0)
        if pc is not None:
            from .prefix_cache import PrefixCache
            self.prefix = PrefixCache(pc, self.bank)
        self.sampled = torch.zeros(self.R, dtype=torch.int64, device=self.device)   # the one token buffer
        cuda = self.device.type == "cuda"
        self._host = [torch.zeros(self.R, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._stage = [torch.zeros(3 * self.R, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]   # H2D
        self.on_logits = None      # optional hook(batch, logits [S, V]) after every forward (tests, debugging)
        self.graphs = None
        if graphs or pad_decode:
            from .graphs import DecodeGraphs
            self.graphs = DecodeGraphs(self, capture=graphs)
        self.prefill_graphs = None
        if prefill_graphs:
            from .prefill_graphs import PrefillGraphs
            self.prefill_graphs = PrefillGraphs(model, self.bank, buckets=prefill_buckets)
            self.prefill_graphs.prepare()
        self.spec = None                               # speculative decoding (DESIGN §13): verify rows, rollback
        if engine_config.speculative is not None:
            from .speculative import Speculator
            self.spec = Speculator(self, engine_config.speculative)
            if pc is not None and pc.store_decoded and self.spec.runner.replaying:
                raise TraceError("engine_config.prefix_cache.store_decoded", "decode stores read the verify "
                                 "step's per-position snapshots, which FastOptions.spec_replay does not keep")
        self.reset(engine_config.mode)

    @classmethod
    def from_pretrained(cls, path: str | Path, engine_config: EngineConfig, device=None, dtype=None,
                        max_len: int = 2048, graphs: bool = False, pad_decode: bool = False,
                        options: FastOptions | None = None, prefill_graphs: bool = False,
                        prefill_buckets: tuple[int, ...] | str | None = None) -> "Engine":
        """Load an HF-format folder (config.json + safetensors) into a FastModel run with `options` (kernel backend,
        fusions, batch invariance: fastpath/options.py) and build an engine (batch-invariant: its piece rule)."""
        from oracle.checkpoint import load_checkpoint
        from fastpath.model import make_model
        options = check_options(options)
        device = resolve_device(device)
        check_kernels_run_on(device, options)
        dtype = resolve_dtype(dtype, device)
        cfg, tensors = load_checkpoint(check_path(path))
        check_weights_fit(tensors, dtype, device)
        cls = engine_class(options) if cls is Engine else cls
        return cls(make_model(cfg, tensors, device, dtype, options), engine_config, max_len=max_len, graphs=graphs,
                   pad_decode=pad_decode, prefill_graphs=prefill_graphs, prefill_buckets=prefill_buckets)

    # ---------------------------------------------------------------------------------------- lifecycle
    def reset(self, mode: str | None = None) -> None:
        """Forget all requests and bookkeeping (the bank stays allocated where it is)."""
        mode = mode or self.ec.mode
        if mode not in MODES:
            raise TraceError("mode", f"unknown mode {mode!r}; expected {MODES}")
        self.mode = mode
        self.rows = RowTable(self.R, self.device)
        self.requests: dict[str, RequestState] = {}
        self.arrival_order: list[Request] = []
        self.pending: Launched | None = None
        self.log = ScheduleLog(mode)
        if self.prefix is not None:
            self.prefix.reset()
            self.log.prefix_cache = True
        if self.spec is not None:
            self.spec.reset()
        self.k = 0
        self.name, self.transit, self._drained = FIRST_ENGINE, [], None     # DESIGN §19 (transfer.py)
        self._seq = 0                                   # admissions so far (DESIGN §18 victim rule)
        self._flip = 0
        self.emitted: dict[str, list[int]] = {}
        self.wait_s = 0.0                               # host time blocked on device events (bench)

    def add_request(self, req: Request) -> None:
        """Submit a request that arrives at `req.arrival_step` (>= the current step)."""
        where = f"requests[{len(self.requests)}]"
        req = validate_request(req, where, self.config.vocab_size,   # the checks parse_trace/run_trace make
                               model_positions(self.config))
        if req.id in self.requests:
            raise TraceError(f"{where}.id", "duplicate request id", req.id)
        if req.arrival_step < self.k:
            raise TraceError(f"{where}.arrival_step", f"must be >= the current step {self.k}", req.id)
        if req.transfer and not hasattr(self, "_instances"):
            raise TraceError(f"{where}.transfer", "a streamed request cannot be handed over: transfers run "
                             "through run_trace (fastpath/engine/transfer.py)", req.id)
        need = len(req.prompt) + req.max_new_tokens
        if self.config.attention_layer_ids and need > self.bank.max_len:
            raise TraceError(f"{where}.max_new_tokens", f"prompt + max_new_tokens = {need} exceeds the engine's "
                             f"max_len {self.bank.max_len}", req.id)
        self.requests[req.id] = RequestState(req)
        self.arrival_order = sorted(self.arrival_order + [req], key=lambda r: (r.arrival_step, r.id))

    def waiting(self, k: int) -> list[RequestState]:
        """Requests handed to this instance (DESIGN §19), then arrived, not yet admitted ones in (arrival_step, id)
        order."""
        arrived = (self.requests[r.id] for r in self.arrival_order if r.arrival_step <= k)
        return self.transit + [s for s in arrived if not s.admitted and s.moved is None and s.engine == self.name]

    def all_finished(self) -> bool:
        """Every request on this instance has finished."""
        return all(s.finish_reason is not None for s in self.requests.values() if s.engine == self.name)

    # -------------------------------------------------------------------------------------------- steps
    def _overlappable(self, prev: Launched | None) -> bool:
        """The step after `prev` is one async mode overlaps: prev decode-only, live rows, nobody waiting, no prefill
        in progress, no speculation unless backoff pauses every row (docs/scheduler.md §10). One predicate for both
        modes, so legacy's shadow rows follow async's extra rows exactly."""
        return (prev is not None and prev.decode_only and self.rows.active > 0 and not self.waiting(self.k)
                and (self.spec is None or self.spec.overlappable(prev))
                and (self.prefix is None or not self.prefix.blocks_overlap(prev.batch))       # DESIGN §17
                and self.ec.kv_tokens is None                        # DESIGN §18: preemption is decided at build
                and not any(transfer_at(self.requests[b.request].req, prev.step) for b in prev.batch)   # §19
                and not any(self.requests[rid].prefilling for rid in self.rows.live_requests()))

    def can_overlap(self) -> bool:
        """Async: the pending step's successor is overlappable (_overlappable)."""
        return self.mode == "async" and self._overlappable(self.pending)

    def step(self) -> bool:
        """Run step k (overlapped or not) and log it; False when the run is over (nothing logged)."""
        if self.can_overlap():
            prev = self.pending
            rec = StepRecord(self.k, overlap=1)
            self.log.steps.append(rec)
            pos = {b.request: b.pos for b in prev.batch}
            batch = [BatchRow(r, rid, self.rows.row_to_slot[r], "decode", pos[rid] + 1, 1)
                     for r, rid in enumerate(self.rows.row_request[: self.rows.active])]
            if self.spec is not None:
                self.spec.overlapped(batch)
            launched = self.launch(batch, rec, tokens_on_device=True)
            self.resolve(prev, inflight=launched)
            gone = {f["request"] for f in prev.record.free}
            for b in batch:
                if b.request in gone:
                    b.kind = "extra"
            self.pending = launched
        else:
            prev, self._drained = self.drain(), None           # drain before admitting
            if self.all_finished():
                return False
            rec = StepRecord(self.k)
            self.log.steps.append(rec)
            shadows = self.shadow_rows(prev)
            self.admit(rec)
            batch = self.build_batch()
            while self.ec.kv_tokens is not None and self.kv_need(batch) > self.ec.kv_tokens:
                self.preempt(rec)                      # DESIGN §18: by recompute, then the batch again
                batch = self.build_batch()
            if batch and shadows:
                batch = batch + shadows            # decode-only (shadow_rows' condition): after the decode rows
            if batch:
                self.pending = self.launch(batch, rec, tokens_on_device=False)
                if self.prefix is not None:            # the step's checkpoints (planned in launch), after its forward
                    self.prefix.after_launch()
            else:
                rec.row_to_slot = list(self.rows.row_to_slot)
        self.k += 1
        return True

    def drain(self) -> Launched | None:
        """Resolve the pending step before a step that is not overlapped; returns the step drained (kept until that
        step runs: the instances of fastpath/engine/transfer.py drain a sender before its hand-overs)."""
        if self.pending is not None:
            self.resolve(self.pending)
            self._drained, self.pending = self.pending, None
        return self._drained

    def shadow_rows(self, prev: Launched | None) -> list[BatchRow]:
        """Legacy: the rows async mode still computes this step (requests freed by the decode-only step before,
        when async would overlap: _overlappable) run again as shadow rows — computed in
        their freed slot, discarded, not logged — so both modes run every step at the same row count.  The
        projections' bits depend on it (cuBLAS picks kernels by M; one row takes the folded GEMV), and DESIGN §4
        requires async == legacy bitwise (docs/engine.md, "Shadow rows")."""
        if self.mode != "legacy" or prev is None or not prev.record.free or not self._overlappable(prev):
            return []
        pos = {b.request: b.pos for b in prev.batch}
        return [BatchRow(f["row"], f["request"], f["slot"], "shadow", pos[f["request"]] + 1, 1)
                for f in prev.record.free]

    def admit(self, rec: StepRecord) -> None:
        """Admit arrived requests while a slot is free; the slot's state is zeroed."""
        for st in self.waiting(self.k):
            if not self.rows.has_free_slot():
                return
            ctx = tuple(st.req.prompt) + tuple(st.output)          # a resumed request recomputes its output
            if self.ec.kv_tokens is not None and self.kv_held() + len(ctx) > self.ec.kv_tokens:
                return                                            # DESIGN §18: admission within the KV budget
            row, slot = self.rows.admit(st.req.id)
            self.bank.zero_slot(slot)
            if st.moved is not None:                   # DESIGN §19: the sender's state into the zeroed slot
                from .transfer import admit_moved
                admit_moved(self, st, row, slot, rec)
                continue
            st.admitted, st.done, st.ctx = True, 0, ctx
            self._seq += 1
            st.admit_seq = self._seq
            rec.admit.append({"request": st.req.id, "row": row, "slot": slot})
            if st.output:
                rec.admit[-1]["resumed"] = len(st.output)
            if self.prefix is not None:
                self.prefix.admit(st, slot, rec, self.k)      # longest hit copied into the zeroed slot

    def kv_held(self) -> int:
        """KV positions every live request holds (DESIGN §18)."""
        return sum(self.requests[rid].held for rid in self.rows.live_requests())

    def kv_need(self, batch: list[BatchRow]) -> int:
        """KV positions held after `batch`: a row's end position, else what its request holds."""
        ends = {b.request: b.pos + b.count for b in batch}
        return sum(ends.get(rid, self.requests[rid].held) for rid in self.rows.live_requests())

    def preempt(self, rec: StepRecord) -> None:
        """DESIGN §18 by recompute: the live request admitted last frees its slot (state dropped, output kept), rows
        compact, and it waits in its arrival place to prefill prompt + output again."""
        rid = max(self.rows.live_requests(), key=lambda r: self.requests[r].admit_seq)
        row = self.rows.row_of(rid)
        (_, slot), = self.rows.release([row])
        st = self.requests[rid]
        st.admitted, st.done = False, 0
        moves = [{"from_row": m.src, "to_row": m.dst, "request": self.rows.row_request[m.dst],
                  "slot": self.rows.row_to_slot[m.dst]} for m in self.rows.compact()]
        if rec.preempt is None:
            rec.preempt = []
        rec.preempt.append({"request": rid, "row": row, "slot": slot, "generated": len(st.output), "moves": moves})

    def build_batch(self) -> list[BatchRow]:
        """Decode rows first (row order), then prefill pieces (row order) within the token budget."""
        rt, batch = self.rows, []
        live = [(r, self.requests[rt.row_request[r]]) for r in range(rt.active)]
        if self.spec is not None:
            self.spec.prepare(live)                    # the draft proposer's batched pass
        for r, st in live:
            if not st.prefilling:
                batch.append(self.spec.row(r, st, rt.row_to_slot[r]) if self.spec is not None else
                             BatchRow(r, st.req.id, rt.row_to_slot[r], "decode",
                                      len(st.req.prompt) + len(st.output) - 1, 1))
        spec_extra = sum(b.count - 1 for b in batch)   # a verify row costs its m+1 tokens
        used = len(batch)
        for r, st in live:
            if st.prefilling:
                n = self.piece_for(st, self.ec.max_tokens_per_step - used - spec_extra)
                if n > 0:
                    batch.append(BatchRow(r, st.req.id, rt.row_to_slot[r], "prefill", st.done, n))
                    used += n
        return batch

    def piece_for(self, st: RequestState, left: int) -> int:
        """Length of the request's next prefill piece given `left` budget tokens (docs/scheduler.md §3.3)."""
        return piece_length(st.done, len(st.prefill_tokens), left, self.prefill_cap(st), self.config.chunk_size)

    def prefill_cap(self, st: RequestState) -> int:
        """The largest piece a prefilling row may get: prefill_chunk (a prefix cache cuts nothing: DESIGN §12)."""
        return self.ec.prefill_chunk

    # ------------------------------------------------------------------------------------------- launch
    def launch(self, batch: list[BatchRow], rec: StepRecord, tokens_on_device: bool) -> Launched:
        """Pack, forward, sample into `sampled`, start the token copy to the host; returns the pending step."""
        if self.spec is not None and any(b.kind == "verify" for b in batch):
            return self.spec.launch(batch, rec)        # eager and synchronous; see fastpath/engine/speculative.py
        rec.batch = [b for b in batch if b.kind != "shadow"]
        dec = [b for b in batch if b.kind in DECODE_KINDS]
        pre = [b for b in batch if b.kind == "prefill"]
        assert batch[: len(dec)] == dec, "decode rows must come first"
        n = len(dec)
        if (self.graphs is not None and not pre and self.graphs.covers(n)
                and all(self.requests[b.request].req.sampling.kind != "seeded" for b in dec)):
            # decode-only greedy step: the graph reads its tokens from (and samples into) `sampled`
            ids_host = None if tokens_on_device else [self.requests[b.request].output[-1] for b in dec]
            self.graphs.run([b.pos for b in dec], [b.slot for b in dec], ids_host, self._stage[self._flip])
            if self.on_logits is not None:
                self.on_logits(batch, self.graphs.logits(n))
            return self._fetch(batch, rec, [True] * n)
        ids, pos, samples, seeded = [], [], [], []
        for j, b in enumerate(batch):
            st = self.requests[b.request]
            if b.kind in DECODE_KINDS:
                ids.append(0 if tokens_on_device else st.output[-1])
                pos.append(b.pos)
            else:
                ids.extend(st.prefill_tokens[b.pos:b.pos + b.count])
                pos.extend(range(b.pos, b.pos + b.count))
                st.done = b.pos + b.count
            samples.append(b.kind in DECODE_KINDS or not st.prefilling)
            if st.req.sampling.kind == "seeded":
                seeded.append((j, float(st.req.sampling.temperature), int(st.req.sampling.seed), b.pos + b.count))
        last, end = list(range(n)), n             # logits rows: every decode row, each piece's last token
        for b in pre:
            end += b.count
            last.append(end - 1)
        ckpts = self.prefix.plan(list(enumerate(pre)), self.requests, rec, self.k) if self.prefix and pre else []
        pieces = [(b.pos, b.count, b.slot) for b in pre]
        pack = lambda: pack_step(self.device, self.config.chunk_size, ids, pos, [b.slot for b in dec],  # noqa: E731
                                 pieces, last, self.bank.ssm_state.shape[1], backend=self.model.backend,
                                 checkpoints=ckpts)
        key = None if self.prefill_graphs is None else self.prefill_graphs.key(n, pieces, ckpts, len(ids))
        if key is not None:             # a short prefill-only step: replayed once its shape repeats
            logits = self.prefill_graphs.forward(key, ids, pack)
        else:
            sb = pack()
            if tokens_on_device:        # overlapped: rows 0..n-1 in order, straight from the device tables
                sb.ids[:n].copy_(self.sampled[:n])
                sb.dec_slot = self.rows.row_to_slot_dev[:n]
            logits = self.model.forward(sb, self.bank)
        sample_rows(logits, self.sampled[:len(batch)], seeded, backend=self.model.backend)
        if self.on_logits is not None:
            self.on_logits(batch, logits)
        return self._fetch(batch, rec, samples)

    def _fetch(self, batch: list[BatchRow], rec: StepRecord, samples: list[bool]) -> Launched:
        """Start the copy of the step's sampled tokens to one of the two pinned host buffers; record its event."""
        S = len(batch)
        hostbuf = self._host[self._flip]
        self._flip ^= 1
        hostbuf[:S].copy_(self.sampled[:S], non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return Launched(self.k, batch, rec, samples, hostbuf, event)

    # ------------------------------------------------------------------------------------------ resolve
    def resolve(self, p: Launched, inflight: Launched | None = None) -> None:
        """Append p's tokens (decode rows then prefill rows, each by current row), finish/free (ascending row),
        compact rows (and `sampled` if a step is in flight)."""
        if p.event is not None:
            t0 = time.perf_counter()
            p.event.synchronize()                       # the one wait per step: this step's tokens
            self.wait_s += time.perf_counter() - t0
        if p.finalize is not None:
            p.finalize(p)
        toks = p.host_tokens[: len(p.batch)].tolist()
        rec, rt = p.record, self.rows
        row_of = {rid: r for r, rid in enumerate(rt.row_request[: rt.active]) if rid is not None}
        finished, emitted = [], {}                       # emitted: tokens appended per request (DESIGN §17)
        live = [(j, row_of[b.request]) for j, b in enumerate(p.batch) if b.request in row_of]  # extras gone
        for j, r in sorted(live, key=lambda jr: (p.batch[jr[0]].kind != "decode", jr[1])):      # decode first
            b = p.batch[j]
            if not p.samples[j]:                                                      # non-final prefill piece
                continue
            if self.requests[b.request].finish_reason is not None:       # a verify row's tokens after its stop
                continue
            st, tok = self.requests[b.request], toks[j]
            st.output.append(tok)
            emitted[b.request] = emitted.get(b.request, 0) + 1
            self.emitted.setdefault(b.request, []).append(tok)
            rec.sampled.append({"request": b.request, "pos": b.pos + b.count, "token": tok})
            if tok in st.req.stop_token_ids:
                st.finish_reason = "stop"
            elif len(st.output) == st.req.max_new_tokens:
                st.finish_reason = "length"
            if st.finish_reason is not None:
                finished.append(r)
        if self.prefix is not None and self.prefix.store_decoded:    # before rollback: snapshots still hold
            self.prefix.after_resolve(rec.batch, emitted, self.requests, rec, p.step,
                                      self.spec.snapshot if self.spec is not None else None)
        if self.spec is not None:
            self.spec.rollback()                       # rows that rejected a draft: copy their accepted snapshot
        finished.sort()
        for (rid, slot), r in zip(rt.release(finished), finished):
            rec.free.append({"request": rid, "row": r, "slot": slot, "reason": self.requests[rid].finish_reason})
        moves = rt.compact()
        for m in moves:
            rec.moves.append({"from_row": m.src, "to_row": m.dst, "request": rt.row_request[m.dst],
                              "slot": rt.row_to_slot[m.dst]})
        if inflight is not None and moves:
            src, dst = index_pair(moves, self.device)
            apply_moves_(self.sampled, src, dst)
        rec.row_to_slot = list(rt.row_to_slot)

    # ----------------------------------------------------------------------------------------- run/trace
    def run(self, max_steps: int = 1_000_000) -> TraceResult:
        """Step until every request finished and nothing is pending."""
        while self.step():
            if self.k > max_steps:
                raise RuntimeError(f"engine made no progress within {max_steps} steps")
        return TraceResult({rid: list(s.output) for rid, s in self.requests.items()},
                           {rid: s.finish_reason for rid, s in self.requests.items()},
                           self.log, digest(self.log))

    def run_trace(self, trace: Trace, mode: str | None = None) -> TraceResult:
        """Run a whole trace (engine limits must match this engine's); returns tokens, reasons, log, digest."""
        trace = check_against_model(trace, self.config.vocab_size, self.config.chunk_size,
                                    model_positions(self.config))    # normalised
        e = trace.engine
        from .speculative import engine_key                 # scripted proposals are the trace's, not the engine's
        if (e.max_requests, e.max_tokens_per_step, e.prefill_chunk, e.prefix_cache, engine_key(e.speculative),
                e.kv_tokens) != \
                (self.ec.max_requests, self.ec.max_tokens_per_step, self.ec.prefill_chunk, self.ec.prefix_cache,
                 engine_key(self.ec.speculative), self.ec.kv_tokens):
            raise TraceError("engine", f"trace engine config {e} differs from this engine's {self.ec}")
        if any(r.transfer for r in trace.requests):          # DESIGN §19: several instances
            from .transfer import EngineInstances
            return EngineInstances(self, trace, mode or e.mode).run()
        self.reset(mode or e.mode)
        if self.spec is not None:
            self.spec.use_trace(e.speculative)
        for req in trace.requests:
            self.add_request(req)
        return self.run()

    def take_emitted(self) -> dict[str, list[int]]:
        """Streaming: tokens appended since the last call, per request id."""
        out, self.emitted = self.emitted, {}
        return out


class BatchInvariantEngine(Engine):
    """Engine whose prefill pieces depend only on the request (whole-budget pieces, deferred if they do not fit)."""

    def piece_for(self, st, left: int) -> int:
        """The whole-budget piece (a function of the request alone), or none this step if it does not fit `left`."""
        n = piece_length(st.done, len(st.prefill_tokens), self.ec.max_tokens_per_step, self.prefill_cap(st),
                         self.config.chunk_size)
        return n if n <= left else 0


def engine_class(options: FastOptions | None) -> type:
    """The engine that goes with these options: BatchInvariantEngine (request-only pieces) or Engine."""
    return BatchInvariantEngine if check_options(options).batch_invariant else Engine
