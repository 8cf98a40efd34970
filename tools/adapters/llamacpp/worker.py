"""The llama.cpp engine process: runs in .venv-llamacpp's python, speaks JSON lines on stdin/stdout.

One request per line, one reply per line; stdout carries nothing else (llama.cpp's own log goes to stderr). Ops:
  {"op": "load", "gguf": PATH, "n_ctx": N, "n_seq": S, "n_threads": T, "kv_type": "f32"|"f16"|"bf16",
   "flash_attn": "off"|"on"|"auto"}
      -> {"ok": true, "n_vocab": V, "meta": {...}}
  {"op": "run", "requests": [...], "max_requests": S, "max_tokens_per_step": B, "prefill_chunk": C}
      -> {"ok": true, "tokens": {id: [...]}, "finish": {id: "stop"|"length"}, "logits": {id: base64 float32},
          "steps": k, "seq_ids": {id: seq}}
  {"op": "quit"}
A failure inside an op is a reply {"ok": false, "error": "..."}; a GGML_ASSERT abort kills the process, and the
parent (adapter.py) reports the death. Imports only the standard library, numpy and llama_cpp (no hybridqual).
"""
from __future__ import annotations

import base64
import ctypes
import json
import sys

import numpy as np


class Engine:
    """A llama.cpp model and context driven through the low-level API (llama_batch, llama_decode, seq ids)."""

    KV_TYPES = {"f32": 0, "f16": 1, "bf16": 30}     # ggml_type of the K/V cache (llama.cpp's default is f16)

    FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}   # llama_flash_attn_type; "auto" turns it on for the CPU

    def __init__(self, gguf: str, n_ctx: int, n_seq: int, n_threads: int, kv_type: str = "f32",
                 flash_attn: str = "off") -> None:
        import llama_cpp as lc
        self.lc = lc
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(gguf.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama_model_load_from_file failed for {gguf}")
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

    def run(self, requests: list[dict], max_requests: int, max_tokens_per_step: int, prefill_chunk: int) -> dict:
        """Continuous batching: requests join at arrival_step (counted in steps), each holds one seq id while it runs
        (the lowest free one; freed ids are reused), prompts go in pieces of <= prefill_chunk within the step's token
        budget after the running requests' decode rows; greedy from the float32 logits, lowest index on ties."""
        lc = self.lc
        n_slots = min(max_requests, self.n_seq)
        lc.llama_memory_clear(self.mem, True)
        pending = sorted(requests, key=lambda r: (r["arrival_step"], r["id"]))
        waiting: list[dict] = []
        free = list(range(n_slots))
        live: dict[str, dict] = {}          # id -> {"req", "seq", "pos", "next"}
        tokens = {r["id"]: [] for r in requests}
        logits: dict[str, list[np.ndarray]] = {r["id"]: [] for r in requests}
        finish: dict[str, str] = {}
        seq_ids: dict[str, int] = {}
        step = 0
        while pending or waiting or live:
            while pending and pending[0]["arrival_step"] <= step:
                waiting.append(pending.pop(0))
            while waiting and free:
                req = waiting.pop(0)
                seq = free.pop(0)
                lc.llama_memory_seq_rm(self.mem, seq, -1, -1)
                live[req["id"]] = {"req": req, "seq": seq, "pos": 0, "next": None}
                seq_ids[req["id"]] = seq
            rows, owners = [], []
            for rid, s in live.items():               # decode rows first: one token per generating request
                if s["next"] is not None:
                    rows.append((s["next"], s["pos"], s["seq"], True))
                    owners.append(rid)
            budget = max_tokens_per_step - len(rows)
            for rid, s in live.items():               # then prompt pieces, in admission order
                plen = len(s["req"]["prompt"])
                if s["next"] is not None or s["pos"] >= plen or budget <= 0:
                    continue
                n = min(plen - s["pos"], prefill_chunk, budget)
                for j in range(n):
                    p = s["pos"] + j
                    rows.append((s["req"]["prompt"][p], p, s["seq"], p == plen - 1))
                    owners.append(rid)
                budget -= n
            if rows:
                out = self._decode(rows)
                for (tok, pos, seq, want), rid, lg in zip(rows, owners, out):
                    s = live[rid]
                    s["pos"] = pos + 1
                    if lg is None:
                        continue
                    t = int(np.argmax(lg))             # first maximum: the lowest index on ties
                    tokens[rid].append(t)
                    logits[rid].append(lg)
                    s["next"] = t
            for rid in list(live):
                s, req = live[rid], live[rid]["req"]
                got = tokens[rid]
                if got and (got[-1] in req.get("stop_token_ids", []) or len(got) >= req["max_new_tokens"]):
                    finish[rid] = "stop" if got[-1] in req.get("stop_token_ids", []) else "length"
                    lc.llama_memory_seq_rm(self.mem, s["seq"], -1, -1)
                    free.append(s["seq"])
                    free.sort()
                    del live[rid]
            step += 1
            if step > 100_000:
                raise RuntimeError("the trace did not finish within 100000 steps")
        enc = {rid: base64.b64encode(np.stack(v).astype("<f4").tobytes()).decode() if v else ""
               for rid, v in logits.items()}
        return {"tokens": tokens, "finish": finish, "logits": enc, "steps": step, "seq_ids": seq_ids}


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
                                                  int(msg["max_tokens_per_step"]), int(msg["prefill_chunk"]))}
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:  # noqa: BLE001 - every failure goes back to the parent as a reply
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
