"""Request traces, `hybridqual.trace/1`: engine config + staggered requests, strictly validated (docs/trace-format.md).

Every error is a `TraceError` whose message names the field (a JSON path such as `requests[2].prompt[5]`) and,
for request fields, the request id.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "hybridqual.trace/1"
MODES = ("legacy", "async")
SAMPLING_KINDS = ("greedy", "seeded")
SEED_LIMIT = 2 ** 63


class TraceError(ValueError):
    """A trace is malformed; the message names the field and (for request fields) the request id."""

    def __init__(self, field_path: str, message: str, request_id: str | None = None):
        self.field = field_path
        self.request_id = request_id
        where = f"{field_path} (request {request_id!r})" if request_id is not None else field_path
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class Sampling:
    """Greedy, or seeded stochastic sampling with a temperature (docs/scheduler.md §6)."""

    kind: str = "greedy"
    temperature: float | None = None
    seed: int | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON form (only the fields the kind uses)."""
        if self.kind == "greedy":
            return {"kind": "greedy"}
        return {"kind": "seeded", "temperature": self.temperature, "seed": self.seed}


@dataclass(frozen=True)
class Request:
    """One request of a trace."""

    id: str
    arrival_step: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    sampling: Sampling = field(default_factory=Sampling)

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {"id": self.id, "arrival_step": self.arrival_step, "prompt": list(self.prompt),
                "max_new_tokens": self.max_new_tokens, "stop_token_ids": list(self.stop_token_ids),
                "sampling": self.sampling.to_json()}


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler limits: rows/slots, token budget per step, largest prefill piece, legacy or async."""

    max_requests: int
    max_tokens_per_step: int
    prefill_chunk: int
    mode: str = "legacy"

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {"max_requests": self.max_requests, "max_tokens_per_step": self.max_tokens_per_step,
                "prefill_chunk": self.prefill_chunk, "mode": self.mode}


@dataclass(frozen=True)
class Trace:
    """A validated trace: engine config and requests (in file order)."""

    engine: EngineConfig
    requests: tuple[Request, ...]
    description: str = ""

    def request(self, request_id: str) -> Request:
        """The request with this id."""
        for r in self.requests:
            if r.id == request_id:
                return r
        raise KeyError(request_id)

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        out: dict[str, Any] = {"schema": SCHEMA, "engine": self.engine.to_json(),
                               "requests": [r.to_json() for r in self.requests]}
        if self.description:
            out["description"] = self.description
        return out


# ----------------------------------------------------------------------------------------------- validation helpers

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(obj: dict, key: str, path: str, rid: str | None, lo: int, hi: int | None = None) -> int:
    v = obj[key]
    if not _is_int(v):
        raise TraceError(f"{path}.{key}", f"must be an integer, got {type(v).__name__} {v!r}", rid)
    if v < lo or (hi is not None and v >= hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
        raise TraceError(f"{path}.{key}", f"must be {bound}, got {v}", rid)
    return v


def _keys(obj: Any, path: str, rid: str | None, required: set[str], optional: set[str] = frozenset()) -> dict:
    if not isinstance(obj, dict):
        raise TraceError(path, f"must be an object, got {type(obj).__name__}", rid)
    missing = sorted(required - obj.keys())
    if missing:
        raise TraceError(f"{path}.{missing[0]}", "missing required field", rid)
    unknown = sorted(obj.keys() - required - optional)
    if unknown:
        raise TraceError(f"{path}.{unknown[0]}", "unknown field", rid)
    return obj


def _token_list(v: Any, path: str, rid: str, allow_empty: bool, vocab_size: int | None) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise TraceError(path, f"must be a list of token ids, got {type(v).__name__}", rid)
    if not v and not allow_empty:
        raise TraceError(path, "must not be empty", rid)
    for j, t in enumerate(v):
        if not _is_int(t):
            raise TraceError(f"{path}[{j}]", f"token id must be an integer, got {type(t).__name__} {t!r}", rid)
        if t < 0:
            raise TraceError(f"{path}[{j}]", f"token id must be >= 0, got {t}", rid)
        if vocab_size is not None and t >= vocab_size:
            raise TraceError(f"{path}[{j}]", f"token id {t} >= vocab_size {vocab_size}", rid)
    return tuple(v)


def _parse_sampling(v: Any, path: str, rid: str) -> Sampling:
    if not isinstance(v, dict):
        raise TraceError(path, f"must be an object, got {type(v).__name__}", rid)
    kind = v.get("kind")
    if kind not in SAMPLING_KINDS:
        raise TraceError(f"{path}.kind", f"unknown sampling kind {kind!r}; expected one of {SAMPLING_KINDS}", rid)
    if kind == "greedy":
        _keys(v, path, rid, {"kind"})
        return Sampling()
    _keys(v, path, rid, {"kind", "temperature", "seed"})
    t = v["temperature"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not (t > 0) or t == float("inf"):
        raise TraceError(f"{path}.temperature", f"must be a finite number > 0, got {t!r}", rid)
    seed = _int(v, "seed", path, rid, 0, SEED_LIMIT)
    return Sampling("seeded", float(t), seed)


def _parse_request(obj: Any, i: int, vocab_size: int | None) -> Request:
    path = f"requests[{i}]"
    if not isinstance(obj, dict):
        raise TraceError(path, f"must be an object, got {type(obj).__name__}")
    rid = obj.get("id")
    if not isinstance(rid, str) or not rid:
        raise TraceError(f"{path}.id", f"must be a non-empty string, got {rid!r}")
    _keys(obj, path, rid, {"id", "arrival_step", "prompt", "max_new_tokens"}, {"stop_token_ids", "sampling"})
    arrival = _int(obj, "arrival_step", path, rid, 0)
    prompt = _token_list(obj["prompt"], f"{path}.prompt", rid, False, vocab_size)
    max_new = _int(obj, "max_new_tokens", path, rid, 1)
    stops = _token_list(obj.get("stop_token_ids", []), f"{path}.stop_token_ids", rid, True, vocab_size)
    sampling = _parse_sampling(obj.get("sampling", {"kind": "greedy"}), f"{path}.sampling", rid)
    return Request(rid, arrival, prompt, max_new, stops, sampling)


def _parse_engine(obj: Any) -> EngineConfig:
    _keys(obj, "engine", None, {"max_requests", "max_tokens_per_step", "prefill_chunk"}, {"mode"})
    mode = obj.get("mode", "legacy")
    if mode not in MODES:
        raise TraceError("engine.mode", f"unknown mode {mode!r}; expected one of {MODES}")
    return EngineConfig(_int(obj, "max_requests", "engine", None, 1),
                        _int(obj, "max_tokens_per_step", "engine", None, 1),
                        _int(obj, "prefill_chunk", "engine", None, 1), mode)


# ----------------------------------------------------------------------------------------------------- public API

def parse_trace(obj: Any, vocab_size: int | None = None) -> Trace:
    """Validate a decoded JSON object and build a `Trace` (token ids checked against `vocab_size` if given)."""
    _keys(obj, "trace", None, {"schema", "engine", "requests"}, {"description"})
    if obj["schema"] != SCHEMA:
        raise TraceError("schema", f"expected {SCHEMA!r}, got {obj['schema']!r}")
    desc = obj.get("description", "")
    if not isinstance(desc, str):
        raise TraceError("description", f"must be a string, got {type(desc).__name__}")
    engine = _parse_engine(obj["engine"])
    reqs = obj["requests"]
    if not isinstance(reqs, list) or not reqs:
        raise TraceError("requests", "must be a non-empty list of requests")
    requests, seen = [], set()
    for i, r in enumerate(reqs):
        req = _parse_request(r, i, vocab_size)
        if req.id in seen:
            raise TraceError(f"requests[{i}].id", "duplicate request id", req.id)
        seen.add(req.id)
        requests.append(req)
    return Trace(engine, tuple(requests), desc)


def load_trace(path: str | Path, vocab_size: int | None = None) -> Trace:
    """Read and validate a `hybridqual.trace/1` JSON file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise TraceError("file", f"cannot read {path}: {e}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError("file", f"{path} is not valid JSON: {e}") from None
    return parse_trace(obj, vocab_size)


def dump_trace(trace: Trace) -> str:
    """Canonical JSON text of a trace (sorted keys, no spaces); parse_trace(json.loads(dump)) == trace."""
    return json.dumps(trace.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def check_against_model(trace: Trace, vocab_size: int, chunk_size: int) -> None:
    """Run-time checks of a trace against a model (docs/scheduler.md §1): token ids < vocab, progress guarantees."""
    e = trace.engine
    for i, r in enumerate(trace.requests):
        _token_list(list(r.prompt), f"requests[{i}].prompt", r.id, False, vocab_size)
        _token_list(list(r.stop_token_ids), f"requests[{i}].stop_token_ids", r.id, True, vocab_size)
    if e.prefill_chunk < chunk_size:
        raise TraceError("engine.prefill_chunk",
                         f"must be >= the model's chunk_size {chunk_size}, got {e.prefill_chunk}")
    need = e.max_requests - 1 + chunk_size
    if e.max_tokens_per_step < need:
        raise TraceError("engine.max_tokens_per_step", f"must be >= max_requests - 1 + chunk_size = {need} "
                         f"(so every decode row and one chunk of prefill fit a step), got {e.max_tokens_per_step}")
