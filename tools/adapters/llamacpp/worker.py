"""The llama.cpp engine process: runs in .venv-llamacpp's python, speaks JSON lines on stdin/stdout.

One request per line, one reply per line; stdout carries nothing else (llama.cpp's own log goes to stderr). Ops:
  {"op": "load", "gguf": PATH, "n_ctx": N, "n_seq": S, "n_threads": T, "kv_type": "f32"|"f16"|"bf16",
   "flash_attn": "off"|"on"|"auto"}
      -> {"ok": true, "n_vocab": V, "meta": {...}}
  {"op": "run", "requests": [...], "max_requests": S, "max_tokens_per_step": B, "prefill_chunk": C,
   "chunk_size": K, "prefix_cache": {"block_size": N, "capacity": M[, "attention_block_size": A][, "store_decoded":
   true]} | null, "speculative": {"k": K, "proposer": {...}[, "backoff": B], "draft_gguf": PATH (a draft proposer)}
   | null}
      (a request may carry "transfer": [{"step": k, "to": ENGINE}], DESIGN §19: handover.py runs the instances)
      -> {"ok": true, "tokens": {id: [...]}, "finish": {id: "stop"|"length"}, "logits": {id: base64 float32},
          "steps": k, "seq_ids": {id: seq}, "prefix_cache": {"admit": [...], "steps": [...]} (with a cache),
          "speculation": {id: {"proposed", "accepted", "rollbacks"}} (speculative),
          "placements": {id: [{"engine", "seq", "step", "imported"?}]} (with transfers)}
  {"op": "quit"}
A failure inside an op is a reply {"ok": false, "error": "..."}; a GGML_ASSERT abort kills the process, and the
parent (adapter.py) reports the death. Imports only the standard library, numpy, llama_cpp and its siblings
speculation.py, checkpoints.py and handover.py (no hybridqual).
Its scheduler is independent on purpose of the oracle's and the fast path's (docs/scheduler.md: why).
"""
from __future__ import annotations

import base64
import ctypes
import json
import sys
from dataclasses import dataclass, field

import numpy as np

try:
    from . import handover
    from .checkpoints import Checkpoints
    from .speculation import Speculation
except ImportError:                     # run as a script in the llama venv: no package around it
    import handover
    from checkpoints import Checkpoints
    from speculation import Speculation


class Engine:
    """A llama.cpp model and context driven through the low-level API (llama_batch, llama_decode, seq ids)."""

    KV_TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2}   # ggml_type of the K/V cache (default f16)

    FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}   # llama_flash_attn_type; "auto" turns it on for the CPU

    def __init__(self, gguf: str, n_ctx: int, n_seq: int, n_threads: int, kv_type: str = "f32",
                 flash_attn: str = "off", model=None) -> None:
        """`model`: an already loaded llama_model to make this context on (a peer(), sharing the weights)."""
        import llama_cpp as lc
        self.lc = lc
        if model is None:
            lc.llama_backend_init()
            mp = lc.llama_model_default_params()
            # No extra buffer types (weight repacking, the AMX backend): they pick a kernel by the CPU, so a verdict
            # would depend on the machine, and on AMX CPUs the AMX q8_0 matmul segfaults on small shapes (llama.cpp
            # #20824; docs/findings.md L10). The plain ggml-cpu kernels run everywhere.
            mp.use_extra_bufts = False
            model = lc.llama_model_load_from_file(gguf.encode(), mp)
            if not model:
                raise RuntimeError(f"llama_model_load_from_file failed for {gguf}")
        self.model, self.gguf = model, gguf
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_ctx * n_seq
        cp.n_batch = cp.n_ubatch = max(n_ctx * n_seq, 32)
        cp.n_seq_max = n_seq
        cp.n_threads = cp.n_threads_batch = n_threads
        cp.kv_unified = True
        if kv_type not in self.KV_TYPES:
            raise ValueError(f"kv_type: {kv_type!r} is not one of {sorted(self.KV_TYPES)}")
        cp.type_k = cp.type_v = self.KV_TYPES[kv_type]
        if flash_attn not in self.FLASH_ATTN:
            raise ValueError(f"flash_attn: {flash_attn!r} is not one of {sorted(self.FLASH_ATTN)}")
        cp.flash_attn_type = self.FLASH_ATTN[flash_attn]
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed (context parameters refused)")
        self.n_seq, self.n_batch = n_seq, int(cp.n_batch)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.mem = lc.llama_get_memory(self.ctx)
        self.params = (n_ctx, n_seq, n_threads, kv_type, flash_attn)
        self._drafts: dict[str, Engine] = {}
        self._peers: dict[str, Engine] = {}

    def peer(self, name: str) -> "Engine":
        """Engine instance `name` of a trace with transfers (DESIGN §19): a second llama.cpp context on this one's
        loaded model, with its own memory and seq ids and the same n_ctx, threads and K/V settings (made once)."""
        if name not in self._peers:
            self._peers[name] = Engine(self.gguf, *self.params, model=self.model)
        return self._peers[name]

    def draft(self, gguf: str) -> "Engine":
        """The draft model of a speculative run: a second model and context with this one's n_ctx, seq ids, threads
        and K/V settings (loaded once per worker); it must share the target's vocabulary."""
        if gguf not in self._drafts:
            d = Engine(gguf, *self.params)
            if d.n_vocab != self.n_vocab:
                raise ValueError(f"engine.speculative.proposer.model: the draft GGUF {gguf} has {d.n_vocab} tokens, "
                                 f"the target {self.n_vocab}: a draft must share the target's vocabulary")
            self._drafts[gguf] = d
        return self._drafts[gguf]

    def meta(self) -> dict:
        """The GGUF's metadata as llama.cpp read it, plus whether it runs the model as recurrent / hybrid."""
        lc, out = self.lc, {}
        buf = ctypes.create_string_buffer(4096)
        for i in range(lc.llama_model_meta_count(self.model)):
            lc.llama_model_meta_key_by_index(self.model, i, buf, len(buf))
            key = buf.value.decode(errors="replace")
            lc.llama_model_meta_val_str_by_index(self.model, i, buf, len(buf))
            if not key.startswith("tokenizer."):
                out[key] = buf.value.decode(errors="replace")
        out["is_recurrent"] = bool(lc.llama_model_is_recurrent(self.model))
        out["is_hybrid"] = bool(lc.llama_model_is_hybrid(self.model))
        return out

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> list[np.ndarray | None]:
        """One llama_decode of (token, pos, seq_id, want_logits) rows; the float32 logits of the rows that want them."""
        lc = self.lc
        if len(rows) > self.n_batch:
            raise RuntimeError(f"a step of {len(rows)} tokens exceeds n_batch={self.n_batch}")
        batch = lc.llama_batch_init(len(rows), 0, 1)
        try:
            for i, (tok, pos, seq, want) in enumerate(rows):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, bool(want)
            batch.n_tokens = len(rows)
            rc = lc.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} for a batch of {len(rows)} tokens")
            out: list[np.ndarray | None] = []
            for i, (_, _, _, want) in enumerate(rows):
                if want:
                    ptr = lc.llama_get_logits_ith(self.ctx, i)
                    out.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float32, copy=True))
                else:
                    out.append(None)
            return out
        finally:
            lc.llama_batch_free(batch)

    def snapshot(self, seq: int) -> bytes:
        """The sequence's whole state (recurrent conv/SSM state and attention K/V), llama_state_seq_get_data."""
        lc = self.lc
        n = lc.llama_state_seq_get_size(self.ctx, seq)
        buf = (ctypes.c_uint8 * n)()
        got = lc.llama_state_seq_get_data(self.ctx, buf, n, seq)
        if got != n:
            raise RuntimeError(f"llama_state_seq_get_data wrote {got} of {n} bytes for seq {seq}")
        return bytes(buf)

    def restore(self, data: bytes, seq: int) -> None:
        """Put a snapshot into `seq` (llama_state_seq_set_data clears the sequence first)."""
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        got = self.lc.llama_state_seq_set_data(self.ctx, buf, len(data), seq)
        if got != len(data):
            raise RuntimeError(f"llama_state_seq_set_data read {got} of {len(data)} bytes into seq {seq}")

    def run(self, requests: list[dict], max_requests: int, max_tokens_per_step: int, prefill_chunk: int,
            chunk_size: int = 1, prefix_cache: dict | None = None, speculative: dict | None = None) -> dict:
        """Continuous batching as docs/scheduler.md's legacy steps: requests join at arrival_step in (arrival, id)
        order while a seq id is free (the lowest; reused after a finish), rows compact after finishes, decode rows
        first then prompt pieces (piece_length) in row order within the step's budget; greedy from the float32
        logits, lowest index on ties. With `prefix_cache` ({"block_size", "capacity"}, DESIGN §12) the state is
        checkpointed at block boundaries and restored on a hit (Checkpoints); with its `store_decoded` (DESIGN §17)
        also at generated-token boundaries, filed only where the step's outcome proves them verified. With
        `speculative` (DESIGN §13, scripted, ngram, or a draft GGUF as "draft_gguf"; backoff) a decode row verifies
        its proposals in the same batch and a rejection restores the sequence's snapshot from before the step, then
        re-decodes the inputs it kept.
        Requests with a `transfer` run on several instances in lock step (handover.run_instances)."""
        if any(r.get("transfer") for r in requests):
            if prefix_cache or speculative:
                raise ValueError("requests[].transfer: state transfer (DESIGN §19) is not combined with "
                                 "engine.prefix_cache or engine.speculative")
            return handover.run_instances(self, RunState, requests, max_requests, max_tokens_per_step,
                                          prefill_chunk, chunk_size)
        n_slots = min(max_requests, self.n_seq)
        self.lc.llama_memory_clear(self.mem, True)
        cache = Checkpoints.from_config(prefix_cache) if prefix_cache else None
        spec = None
        if speculative:
            draft = speculative.get("draft_gguf")
            spec = Speculation(speculative, self.draft(draft) if draft else None)
        st = RunState(pending=sorted(requests, key=lambda r: (r["arrival_step"], r["id"])),
                      free=list(range(n_slots)), rows=[None] * n_slots,
                      tokens={r["id"]: [] for r in requests}, logits={r["id"]: [] for r in requests},
                      cache=cache, spec=spec)
        while st.pending or st.waiting or st.live:
            self._admit(st)
            plan = self._plan(st, max_tokens_per_step, prefill_chunk, chunk_size)
            st.pieces.append([{"request": rid, "pos": start, "tokens": n} for rid, start, n in plan.pieces])
            snaps = self._forward(plan.decode, plan.pieces, st.live, st.tokens, st.logits, cache, plan.props)
            emitted = {row[4]: 1 for row in plan.decode}            # a decode row emits one token
            if plan.props:
                emitted.update(self._resolve(plan.props, st.live, st.tokens, st.logits, spec))
            if cache is not None:                                   # before the finishes free their seq ids
                decoded = [(row[4], row[1], emitted[row[4]]) for row in plan.decode]
                st.cache_steps.append(cache.store_step(plan.pieces, st.live, snaps, st.step, decoded, st.tokens))
            self._retire(st)
            st.step += 1
            if st.step > 100_000:
                raise RuntimeError("the trace did not finish within 100000 steps")
        return self._reply(st)

    def _admit(self, st: RunState) -> None:
        """Handed-over requests first (DESIGN §19: their state imported), then arrived requests in (arrival, id)
        order take the lowest free seq id (restoring a prefix-cache hit) and the first free row."""
        while st.pending and st.pending[0]["arrival_step"] <= st.step:
            st.waiting.append(st.pending.pop(0))
        st.waiting.sort(key=lambda r: (r["arrival_step"], r["id"]))     # one handed over while waiting: its place
        while st.transit and st.free:
            s, data = st.transit.pop(0)
            seq = st.free.pop(0)
            self.lc.llama_memory_seq_rm(self.mem, seq, -1, -1)            # a zeroed slot, then the moved state
            self.restore(data, seq)
            s["seq"] = seq
            st.live[s["req"]["id"]] = s
            st.rows[sum(r is not None for r in st.rows)] = s["req"]["id"]
            st.seq_ids[s["req"]["id"]] = seq
            st.admits.append({"request": s["req"]["id"], "seq": seq, "step": st.step, "imported": s["pos"]})
        while st.waiting and st.free:
            req = st.waiting.pop(0)
            seq = st.free.pop(0)
            self.lc.llama_memory_seq_rm(self.mem, seq, -1, -1)
            s = {"req": req, "seq": seq, "pos": 0, "next": None}
            if st.cache is not None:
                p, data = st.cache.lookup(req["prompt"], st.step)
                if data is not None:
                    self.restore(data, seq)
                    s["pos"] = p
                st.admits.append({"request": req["id"], "cached_tokens": p})
            st.live[req["id"]] = s
            st.rows[sum(r is not None for r in st.rows)] = req["id"]
            st.seq_ids[req["id"]] = seq
            if st.transit is not None and st.cache is None:
                st.admits.append({"request": req["id"], "seq": seq, "step": st.step})

    def _plan(self, st: RunState, max_tokens_per_step: int, prefill_chunk: int, chunk_size: int) -> StepPlan:
        """The step's decode rows (with their proposals, snapshotted first) then prompt pieces within the budget."""
        live, tokens, spec = st.live, st.tokens, st.spec
        order = [rid for rid in st.rows if rid is not None]
        decode = [(live[rid]["next"], live[rid]["pos"], live[rid]["seq"], True, rid)
                  for rid in order if live[rid]["next"] is not None]
        budget = max_tokens_per_step - len(decode)
        props: dict[str, list[int]] = {}
        if spec is not None:
            props, budget = spec.propose_step([(rid, seq, live[rid]["req"]["prompt"] + tokens[rid],
                                                len(tokens[rid]), live[rid]["req"]["max_new_tokens"])
                                               for _, _, seq, _, rid in decode], budget)
            for rid in props:
                spec.before[rid] = self.snapshot(live[rid]["seq"])
        pieces = []                                 # (rid, start, count), in row order
        for rid in order:
            s = live[rid]
            plen = len(s["req"]["prompt"])
            if s["next"] is not None or s["pos"] >= plen:
                continue
            n = piece_length(s["pos"], plen, budget, prefill_chunk, chunk_size)
            if n > 0:
                pieces.append((rid, s["pos"], n))
                budget -= n
        return StepPlan(decode, pieces, props)

    def _retire(self, st: RunState) -> None:
        """Finished requests leave: finish reason, seq id freed (its memory cleared), row emptied; rows compact."""
        rows, live, tokens = st.rows, st.live, st.tokens
        finished = [r for r, rid in enumerate(rows) if rid is not None and self._finished(live[rid], tokens[rid])]
        for r in finished:
            rid = rows[r]
            s, got = live.pop(rid), tokens[rid]
            st.finish[rid] = "stop" if got[-1] in s["req"].get("stop_token_ids", []) else "length"
            self.lc.llama_memory_seq_rm(self.mem, s["seq"], -1, -1)
            if st.spec is not None:
                st.spec.forget(rid, s["seq"])
            st.free.append(s["seq"])
            st.free.sort()
            rows[r] = None
        compact(rows)

    def _release(self, st: RunState, rid: str) -> tuple[dict, bytes]:
        """DESIGN §19, the sender's side of a hand-over: the live request's sequence state is read
        (llama_state_seq_get_data), then the sequence removed and its seq id freed as at a finish; rows compact.
        The request's live record and its state."""
        s = st.live.pop(rid)
        data = self.snapshot(s["seq"])
        self.lc.llama_memory_seq_rm(self.mem, s["seq"], -1, -1)
        st.free.append(s["seq"])
        st.free.sort()
        st.rows[st.rows.index(rid)] = None
        compact(st.rows)
        return s, data

    @staticmethod
    def _reply(st: RunState) -> dict:
        """The run op's reply: tokens, finish reasons, base64 float32 logits, steps, seq ids, cache and spec facts."""
        enc = {rid: base64.b64encode(np.stack(v).astype("<f4").tobytes()).decode() if v else ""
               for rid, v in st.logits.items()}
        out = {"tokens": st.tokens, "finish": st.finish, "logits": enc, "steps": st.step, "seq_ids": st.seq_ids,
               "pieces": st.pieces}
        if st.cache is not None:
            out["prefix_cache"] = {"admit": st.admits, "steps": st.cache_steps}
        if st.spec is not None:
            out["speculation"] = st.spec.counts
        return out

    @staticmethod
    def _finished(s: dict, got: list[int]) -> bool:
        return bool(got) and (got[-1] in s["req"].get("stop_token_ids", []) or len(got) >= s["req"]["max_new_tokens"])

    def _forward(self, decode: list, pieces: list, live: dict, tokens: dict, logits: dict,
                 cache: "Checkpoints | None", props: dict | None = None) -> dict[tuple[str, int], bytes]:
        """One step's rows through llama_decode: one call, or (with a cache) one per block boundary a prompt piece
        passes, and with decode stores (DESIGN §17) a decode or verify row, snapshotting each sequence at each
        boundary; samples the rows that end a prompt or decode. The snapshots, by (request, position)."""
        segs: dict[str, list[list[tuple]]] = {}        # per request: its rows (tok, pos, seq, want, rid), cut
        marks: dict[str, list[int]] = {}               # per request: the boundaries snapshotted
        for tok, pos, seq, _, rid in decode:           # a verify row: the drafts after its input
            inputs = [tok, *(props or {}).get(rid, ())]
            marks[rid] = cache.decode_cuts(pos, len(inputs), len(live[rid]["req"]["prompt"])) if cache else []
            segs[rid] = split_rows([(t, pos + j, seq, True, rid) for j, t in enumerate(inputs)], marks[rid])
        for rid, start, n in pieces:
            s = live[rid]
            prompt = s["req"]["prompt"]
            marks[rid] = cache.boundaries(start, n) if cache is not None else []
            segs[rid] = split_rows([(prompt[p], p, s["seq"], p == len(prompt) - 1, rid)
                                    for p in range(start, start + n)], marks[rid])
        snaps: dict[tuple[str, int], bytes] = {}
        for i in range(max((len(v) for v in segs.values()), default=0)):
            rows = [row for v in segs.values() if i < len(v) for row in v[i]]
            out = self._decode([r[:4] for r in rows])
            for (tok, pos, seq, want, rid), lg in zip(rows, out):
                if props and rid in props:                 # a verify row's outputs: resolved in _resolve
                    props[rid] = props[rid] if isinstance(props[rid], tuple) else (props[rid], [])
                    props[rid][1].append(lg)
                    continue
                s = live[rid]
                s["pos"] = pos + 1
                if lg is None:
                    continue
                t = int(np.argmax(lg))             # first maximum: the lowest index on ties
                tokens[rid].append(t)
                logits[rid].append(lg)
                s["next"] = t
            for rid, v in segs.items():
                end = v[i][-1][1] + 1 if i < len(v) else None
                if end in marks[rid]:
                    snaps[(rid, end)] = self.snapshot(live[rid]["seq"])
        return snaps

    def _resolve(self, props: dict, live: dict, tokens: dict, logits: dict, spec: "Speculation") -> dict[str, int]:
        """Each verify row: c_i = argmax after input i, the leading drafts equal to them accepted, c_0..c_a
        emitted (cut at a stop token or max_new_tokens); a row that kept fewer inputs than it decoded gets its
        snapshot back and re-decodes the inputs it kept (a recurrent state cannot drop positions). The tokens
        each row emitted."""
        out: dict[str, int] = {}
        for rid, (drafts, outs) in props.items():
            s = live[rid]
            req, pos, last = s["req"], s["pos"], s["next"]
            c = [int(np.argmax(lg)) for lg in outs]    # first maximum: the lowest index on ties
            a = 0
            while a < len(drafts) and drafts[a] == c[a]:
                a += 1
            emitted = []
            for t, lg in zip(c[:a + 1], outs):
                emitted.append(t)
                tokens[rid].append(t)
                logits[rid].append(lg)
                if t in req.get("stop_token_ids", []) or len(tokens[rid]) >= req["max_new_tokens"]:
                    break
            spec.counts.setdefault(rid, {"proposed": 0, "accepted": 0, "rollbacks": 0})
            spec.counts[rid]["proposed"] += len(drafts)
            spec.counts[rid]["accepted"] += a
            spec.record(rid, a)
            kept = [last, *drafts][:len(emitted)]          # the inputs the state must hold after the step
            snap = spec.before.pop(rid)
            if len(kept) < len(drafts) + 1 and not self._finished(s, tokens[rid]):
                spec.counts[rid]["rollbacks"] += 1
                self.restore(snap, s["seq"])
                self._decode([(t, pos + j, s["seq"], False) for j, t in enumerate(kept)])
            s["pos"], s["next"] = pos + len(kept), emitted[-1]
            out[rid] = len(emitted)
        return out


@dataclass
class RunState:
    """One run op's scheduler state: requests not yet arrived or waiting for a seq id, free seq ids, the row order,
    the live requests (id -> {"req", "seq", "pos", "next"}), the step, and what the reply reports."""
    pending: list[dict]
    free: list[int]
    rows: list[str | None]                  # row order: admission appends, finishes compact
    tokens: dict[str, list[int]]
    logits: dict[str, list[np.ndarray]]
    cache: Checkpoints | None
    spec: Speculation | None
    waiting: list[dict] = field(default_factory=list)
    live: dict[str, dict] = field(default_factory=dict)
    finish: dict[str, str] = field(default_factory=dict)
    seq_ids: dict[str, int] = field(default_factory=dict)
    admits: list[dict] = field(default_factory=list)
    cache_steps: list[dict] = field(default_factory=list)
    pieces: list[list[dict]] = field(default_factory=list)     # per step: its prompt pieces {request, pos, tokens}
    step: int = 0
    transit: list[tuple[dict, bytes]] | None = None     # DESIGN §19: handed over here with their state (instances)


@dataclass
class StepPlan:
    """One step's batch: decode rows (token, pos, seq, want_logits, id), prompt pieces (id, start, count) in row
    order, and the decode rows' proposals (id -> drafts)."""
    decode: list[tuple]
    pieces: list[tuple]
    props: dict[str, list[int]]


def piece_length(start: int, prompt_len: int, left: int, prefill_chunk: int, chunk_size: int) -> int:
    """Tokens of the next prefill piece (docs/scheduler.md §3.3, oracle.scheduler.piece_length): the rest if it
    fits, else whole chunks, or 0."""
    cap = min(left, prefill_chunk)
    if prompt_len - start <= cap:
        return prompt_len - start
    return (cap // chunk_size) * chunk_size


def split_rows(rows: list[tuple], cuts: list[int]) -> list[list[tuple]]:
    """A request's consecutive rows (tok, pos, ...) cut after every position p - 1 with p in `cuts`."""
    out: list[list[tuple]] = [[]]
    for row in rows:
        out[-1].append(row)
        if row[1] + 1 in cuts and row is not rows[-1]:
            out.append([])
    return out


def compact(rows: list) -> None:
    """The right-most live row fills the left-most hole until the live rows are 0..active-1 (docs/scheduler.md)."""
    while True:
        holes = [r for r, rid in enumerate(rows) if rid is None]
        used = [r for r, rid in enumerate(rows) if rid is not None]
        if not holes or not used or holes[0] > used[-1]:
            return
        rows[holes[0]], rows[used[-1]] = rows[used[-1]], None


def main() -> None:
    """Serve ops from stdin until quit or EOF."""
    out = sys.stdout
    sys.stdout = sys.stderr                      # nothing but replies on the pipe
    engine: Engine | None = None
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
            op = msg.get("op")
            if op == "quit":
                break
            if op == "load":
                engine = Engine(msg["gguf"], int(msg["n_ctx"]), int(msg["n_seq"]), int(msg.get("n_threads", 2)),
                                msg.get("kv_type", "f32"), msg.get("flash_attn", "off"))
                reply = {"ok": True, "n_vocab": engine.n_vocab, "meta": engine.meta()}
            elif op == "run":
                if engine is None:
                    raise RuntimeError("run before load")
                reply = {"ok": True, **engine.run(msg["requests"], int(msg["max_requests"]),
                                                  int(msg["max_tokens_per_step"]), int(msg["prefill_chunk"]),
                                                  int(msg.get("chunk_size", 1)), msg.get("prefix_cache"),
                                                  msg.get("speculative"))}
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:  # noqa: BLE001 - every failure goes back to the parent as a reply
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
