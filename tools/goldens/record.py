"""A golden's identity and integrity: its schema, the hashes that tie it to one model folder and one trace, and the
hash of its own content.

    problems = check_golden(record, trace, vocab_size)    # [] for a sound golden of this trace; else what is wrong

A golden (`hybridqual.golden/2`) is a JSON object with exactly these fields:
  schema "hybridqual.golden/2"; model, trace, oracle_dtype: strings; model_sha256, trace_sha256: 64 hex digits;
  requests: {request id: {tokens: [int], finish_reason: "stop" | "length", margins: [number] (one per token)}};
  schedule_digest: {"legacy": 64 hex, "async": 64 hex}; content_sha256: sha256 of the canonical JSON of every
  other field (`content_sha256(record)`), so a hand edit, a truncated copy or a zeroed digest is found.
qualify uses a golden only when every check passes and its model and trace hashes match; otherwise it says why and
recomputes the truth from the oracle.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

SCHEMA = "hybridqual.golden/2"
MARGIN_DECIMALS = 4
CONTENT = "content_sha256"
FIELDS = {"schema": str, "model": str, "model_sha256": str, "trace": str, "trace_sha256": str, "oracle_dtype": str,
          "requests": dict, "schedule_digest": dict, CONTENT: str}
REQUEST_FIELDS = {"tokens": list, "finish_reason": str, "margins": list}


def sha256_file(path: Path) -> str:
    """sha256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def model_sha256(folder: Path) -> str:
    """sha256 over config.json and every *.safetensors file of a model folder, in name order."""
    h = hashlib.sha256()
    for p in sorted([folder / "config.json", *folder.glob("*.safetensors")]):
        h.update(p.name.encode()); h.update(sha256_file(p).encode())
    return h.hexdigest()


def trace_sha256(trace) -> str:
    """sha256 of the canonical dump of a Trace: what a golden's "trace_sha256" is."""
    from oracle.trace import dump_trace
    return hashlib.sha256(dump_trace(trace).encode()).hexdigest()


def content_sha256(record: dict) -> str:
    """sha256 of the canonical JSON (sorted keys, no spaces) of every field but content_sha256 (and the "source"
    note qualify adds in memory)."""
    body = {k: v for k, v in record.items() if k not in (CONTENT, "source")}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(record: dict) -> dict:
    """The record with its content_sha256 set (what regen writes)."""
    record[CONTENT] = content_sha256(record)
    return record


def _digest_problem(v, where: str) -> str | None:
    if not isinstance(v, str) or len(v) != 64 or any(c not in "0123456789abcdef" for c in v):
        return f"{where}: not a sha256 (64 lowercase hex digits): {ascii(v)[:70]}"
    if set(v) == {"0"}:
        return f"{where}: zeroed"
    return None


def _int(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def check_golden(record, trace=None, vocab_size: int | None = None) -> list[str]:
    """What is wrong with a golden record ([] when nothing): its schema (every field present, of its type, nothing
    else), its digests (well-formed, not zeroed), its content hash, and with `trace` / `vocab_size` its requests
    (exactly the trace's ids, token ids in the vocab, the finish rule)."""
    if not isinstance(record, dict):
        return [f"not a JSON object ({type(record).__name__})"]
    bad = []
    for k, typ in FIELDS.items():
        if k not in record:
            bad.append(f"{k}: missing")
        elif not isinstance(record[k], typ):
            bad.append(f"{k}: must be a {typ.__name__}, got {type(record[k]).__name__}")
    bad += [f"{ascii(k)[:40]}: unknown field" for k in record if k not in FIELDS and k != "source"]
    if bad:
        return bad
    if record["schema"] != SCHEMA:
        return [f"schema: {ascii(record['schema'])[:40]}, expected {SCHEMA!r}"]
    for k in ("model_sha256", "trace_sha256"):
        bad.append(_digest_problem(record[k], k))
    sd = record["schedule_digest"]
    if set(sd) != {"legacy", "async"}:
        bad.append(f"schedule_digest: keys {sorted(map(str, sd))}, expected ['async', 'legacy']")
    else:
        bad += [_digest_problem(sd[m], f"schedule_digest.{m}") for m in ("legacy", "async")]
    for rid, g in record["requests"].items():
        where = f"requests[{rid!r}]"
        if not isinstance(g, dict) or set(g) != set(REQUEST_FIELDS):
            bad.append(f"{where}: must have exactly the fields {sorted(REQUEST_FIELDS)}")
            continue
        toks, margins = g["tokens"], g["margins"]
        if not isinstance(toks, list) or not all(_int(t) and t >= 0 for t in toks):
            bad.append(f"{where}.tokens: must be a list of token ids (ints >= 0)")
        elif vocab_size is not None and any(t >= vocab_size for t in toks):
            bad.append(f"{where}.tokens: a token id >= vocab_size {vocab_size}")
        if g["finish_reason"] not in ("stop", "length"):
            bad.append(f"{where}.finish_reason: must be 'stop' or 'length'")
        if not isinstance(margins, list) or not all(isinstance(m, (int, float)) and not isinstance(m, bool)
                                                    and math.isfinite(m) and m >= 0 for m in margins):
            bad.append(f"{where}.margins: must be a list of finite numbers >= 0")
        elif isinstance(toks, list) and len(margins) != len(toks):
            bad.append(f"{where}.margins: {len(margins)} margins for {len(toks)} tokens")
    bad = [b for b in bad if b]
    if not bad and record[CONTENT] != content_sha256(record):
        bad.append(f"{CONTENT}: does not match the content (edited, truncated or corrupted since it was written)")
    if bad or trace is None:
        return bad
    want = [r.id for r in trace.requests]
    if set(record["requests"]) != set(want):
        extra = sorted(set(record["requests"]) - set(want))
        missing = [r for r in want if r not in record["requests"]]
        return [f"requests: not the trace's request ids (extra {extra[:5]}, missing {missing[:5]})"]
    from hybridqual.qualify.validate import finish_problem
    for req in trace.requests:
        g = record["requests"][req.id]
        why = finish_problem(g["tokens"], req, g["finish_reason"])
        if why:
            bad.append(f"requests[{req.id!r}] {why}")
    return bad
