"""Request traces, `hybridqual.trace/1`: engine config + staggered requests, strictly validated (docs/trace-format.md).

Every error is a `TraceError` whose message names the field (a JSON path such as `requests[2].prompt[5]`) and,
for request fields, the request id.
"""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .trace_error import TraceError  # noqa: F401  (part of this module's interface)

SCHEMA = "hybridqual.trace/1"
MODES = ("legacy", "async")
SAMPLING_KINDS = ("greedy", "seeded")
SEED_LIMIT = 2 ** 63
MAX_ARRIVAL_STEP = 100_000   # every step up to the last arrival is run and logged: a later one is a typo, not a load
MAX_REQUESTS = 65_535        # rows = slots; also the most sequences one varlen kernel launch takes (grid z)
MAX_POSITIONS = 1 << 20      # prompt + max_new_tokens of one request, on any model: beyond it a run is a hang, not a test
MAX_ID_LENGTH = 256          # characters of a request id (ids are printed in every report line)
MIN_TEMPERATURE = 1e-6       # below it exp(logit / T) is 0 or inf for every row: the draw is not a sampler's
FIRST_ENGINE = "main"        # DESIGN §19: the engine instance every request starts on (a transfer may name it)


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
class Transfer:
    """DESIGN §19: at the end of step `step` the request (with its whole state) moves to engine instance `to`."""

    step: int
    to: str

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {"step": self.step, "to": self.to}


@dataclass(frozen=True)
class Request:
    """One request of a trace."""

    id: str
    arrival_step: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    sampling: Sampling = field(default_factory=Sampling)
    transfer: tuple[Transfer, ...] = ()      # DESIGN §19: hand-overs between engine instances, in step order

    def to_json(self) -> dict[str, Any]:
        """JSON form (transfer only when there is one, so older traces keep their bytes)."""
        out = {"id": self.id, "arrival_step": self.arrival_step, "prompt": list(self.prompt),
               "max_new_tokens": self.max_new_tokens, "stop_token_ids": list(self.stop_token_ids),
               "sampling": self.sampling.to_json()}
        if self.transfer:
            out["transfer"] = [t.to_json() for t in self.transfer]
        return out


@dataclass(frozen=True)
class PrefixCacheConfig:
    """Optional engine field `prefix_cache` (DESIGN §12): checkpoints at multiples of `block_size` prompt tokens,
    at most `capacity` of them (docs/scheduler.md §9); with `attention_block_size` (DESIGN §21) at multiples of
    lcm(block_size, attention_block_size) only."""

    block_size: int
    capacity: int
    store_decoded: bool = False      # DESIGN §17: also boundaries of generated tokens (verified state only)
    attention_block_size: int | None = None     # DESIGN §21: the KV block, when it differs from the Mamba block

    @property
    def checkpoint_block(self) -> int:
        """The granularity of stores and hits: lcm of the Mamba and attention blocks (DESIGN §21)."""
        return math.lcm(self.block_size, self.attention_block_size or self.block_size)

    def to_json(self) -> dict[str, Any]:
        """JSON form (store_decoded and attention_block_size only when set, so older traces keep their bytes)."""
        out: dict[str, Any] = {"block_size": self.block_size, "capacity": self.capacity}
        if self.store_decoded:
            out["store_decoded"] = True
        if self.attention_block_size is not None:
            out["attention_block_size"] = self.attention_block_size
        return out


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler limits: rows/slots, token budget per step, largest prefill piece, legacy or async."""

    max_requests: int
    max_tokens_per_step: int
    prefill_chunk: int
    mode: str = "legacy"
    speculative: Any = None          # oracle.speculative.SpecConfig, or None (DESIGN §13)
    prefix_cache: PrefixCacheConfig | None = None     # None: no prefix cache (the field is absent from the JSON)
    kv_tokens: int | None = None     # DESIGN §18: positions the KV cache holds over all live requests (preemption)

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        out = {"max_requests": self.max_requests, "max_tokens_per_step": self.max_tokens_per_step,
               "prefill_chunk": self.prefill_chunk, "mode": self.mode}
        if self.speculative is not None:
            out["speculative"] = self.speculative.to_json()
        if self.prefix_cache is not None:
            out["prefix_cache"] = self.prefix_cache.to_json()
        if self.kv_tokens is not None:
            out["kv_tokens"] = self.kv_tokens
        return out


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
    """An integer (Python or NumPy), not a bool: floats are never truncated to token ids."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and type(v).__name__ != "bool_"


def _int_value(v: Any, path: str, rid: str | None, lo: int, hi: int | None = None) -> int:
    if not _is_int(v):
        raise TraceError(path, f"must be an integer, got {type(v).__name__} {v!r}", rid)
    v = int(v)
    if v < lo or (hi is not None and v >= hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
        raise TraceError(path, f"must be {bound}, got {v}", rid)
    return v


def _int(obj: dict, key: str, path: str, rid: str | None, lo: int, hi: int | None = None) -> int:
    return _int_value(obj[key], f"{path}.{key}", rid, lo, hi)


def _keys(obj: Any, path: str, rid: str | None, required: set[str], optional: set[str] = frozenset()) -> dict:
    if not isinstance(obj, dict):
        raise TraceError(path, f"must be an object, got {type(obj).__name__}", rid)
    missing = sorted(required - obj.keys())
    if missing:
        raise TraceError(f"{path}.{missing[0]}", "missing required field", rid)
    unknown = sorted(obj.keys() - required - optional, key=repr)
    if unknown:
        raise TraceError(f"{path}.{unknown[0]}", "unknown field", rid)
    return obj


def _token_list(v: Any, path: str, rid: str | None, allow_empty: bool, vocab_size: int | None) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)):
        raise TraceError(path, f"must be a list of token ids, got {type(v).__name__}", rid)
    if not v and not allow_empty:
        raise TraceError(path, "must not be empty", rid)
    if v and set(map(type, v)) == {int} and min(v) >= 0 and (vocab_size is None or max(v) < vocab_size):
        return tuple(v)       # plain in-range ints, checked in bulk (8x faster on a 32k prompt); else the loop
    out = []
    for j, t in enumerate(v):
        if not _is_int(t):
            raise TraceError(f"{path}[{j}]", f"token id must be an integer, got {type(t).__name__} {t!r}", rid)
        t = int(t)
        if t < 0:
            raise TraceError(f"{path}[{j}]", f"token id must be >= 0, got {t}", rid)
        if vocab_size is not None and t >= vocab_size:
            raise TraceError(f"{path}[{j}]", f"token id {t} >= vocab_size {vocab_size}", rid)
        out.append(t)
    return tuple(out)


def _check_sampling(s: Any, path: str, rid: str | None) -> Sampling:
    if not isinstance(s, Sampling):
        raise TraceError(path, f"must be a sampling object (oracle.trace.Sampling), got {type(s).__name__}", rid)
    if not isinstance(s.kind, str) or s.kind not in SAMPLING_KINDS:
        raise TraceError(f"{path}.kind", f"unknown sampling kind {s.kind!r}; expected one of {SAMPLING_KINDS}", rid)
    if s.kind == "greedy":
        for name in ("seed", "temperature"):            # field order as the JSON key check reports them
            if getattr(s, name) is not None:
                raise TraceError(f"{path}.{name}", "only seeded sampling takes a temperature and a seed", rid)
        return Sampling()
    seed = _int_value(s.seed, f"{path}.seed", rid, 0, SEED_LIMIT)
    t = s.temperature
    if not isinstance(t, numbers.Real) or isinstance(t, bool) or not (0 < float(t) < math.inf):
        raise TraceError(f"{path}.temperature", f"must be a finite number > 0, got {t!r}", rid)
    if float(t) < MIN_TEMPERATURE:
        raise TraceError(f"{path}.temperature", f"must be >= {MIN_TEMPERATURE:g} (below it every logit / T "
                         f"overflows: use greedy sampling), got {t!r}", rid)
    return Sampling("seeded", float(t), seed)


def check_request_id(rid: Any, path: str) -> str:
    """A request id: a non-empty printable string (no NUL, control, bidi or other format characters, no lone
    surrogates) of at most MAX_ID_LENGTH characters; ids are keys of every result and printed in every report."""
    if not isinstance(rid, str) or not rid:
        raise TraceError(path, f"must be a non-empty string, got {ascii(rid):.80}")
    if len(rid) > MAX_ID_LENGTH:
        raise TraceError(path, f"must be at most {MAX_ID_LENGTH} characters, got {len(rid)}")
    if not rid.isprintable():
        j, ch = next((j, c) for j, c in enumerate(rid) if not c.isprintable())
        raise TraceError(path, f"must be printable text: character {j} is {ascii(ch)} (a control, format, bidi or "
                         f"surrogate code point), in {ascii(rid):.80}")
    return rid


def model_positions(config: Any) -> int | None:
    """The model's max_position_embeddings when its config.json declares one (HybridConfig.extra), else None."""
    v = (getattr(config, "extra", None) or {}).get("max_position_embeddings")
    return v if _is_int(v) and v > 0 else None


def check_positions(prompt_len: int, max_new: int, where: str, rid: str | None,
                    max_positions: int | None = None) -> None:
    """prompt + max_new_tokens within the model's positions (max_position_embeddings when it declares one) and
    within MAX_POSITIONS on any model; the message names max_new_tokens (or the prompt when it alone is too long)."""
    limit = min(MAX_POSITIONS, max_positions) if max_positions else MAX_POSITIONS
    what = (f"the model's max_position_embeddings {max_positions}" if max_positions and max_positions <= MAX_POSITIONS
            else f"oracle.trace.MAX_POSITIONS {MAX_POSITIONS}")
    if prompt_len >= limit:
        raise TraceError(f"{where}.prompt", f"{prompt_len} tokens leave no position to generate in ({what})", rid)
    if prompt_len + max_new > limit:
        raise TraceError(f"{where}.max_new_tokens", f"{max_new} with a {prompt_len}-token prompt exceeds {what} "
                         f"(at most {limit - prompt_len})", rid)


def _parse_request(obj: Any, i: int, vocab_size: int | None) -> Request:
    path = f"requests[{i}]"
    if not isinstance(obj, dict):
        raise TraceError(path, f"must be an object, got {type(obj).__name__}")
    rid = check_request_id(obj.get("id"), f"{path}.id")
    _keys(obj, path, rid, {"id", "arrival_step", "prompt", "max_new_tokens"},
          {"stop_token_ids", "sampling", "transfer"})
    samp = obj.get("sampling", {"kind": "greedy"})
    raw = samp if not isinstance(samp, dict) else Sampling(samp.get("kind"), samp.get("temperature"), samp.get("seed"))
    req = validate_request(Request(rid, obj["arrival_step"], obj["prompt"], obj["max_new_tokens"],
                                   obj.get("stop_token_ids", []), raw, _raw_transfers(obj, path, rid)),
                           path, vocab_size)
    _keys(samp, f"{path}.sampling", rid, {"kind"} | ({"temperature", "seed"} if req.sampling.kind == "seeded"
                                                     else set()))
    return req


def _raw_transfers(obj: dict, path: str, rid: str) -> Any:
    """The JSON `transfer` list as Transfer values (checked by validate_request); absent: ()."""
    raw = obj.get("transfer", [])
    if not isinstance(raw, list):
        raise TraceError(f"{path}.transfer", f"must be a list of {{\"step\", \"to\"}} objects, got "
                         f"{type(raw).__name__}", rid)
    for j, t in enumerate(raw):
        _keys(t, f"{path}.transfer[{j}]", rid, {"step", "to"})
    return tuple(Transfer(t["step"], t["to"]) for t in raw)


def _check_transfers(ts: Any, arrival: int, where: str, rid: str) -> tuple[Transfer, ...]:
    """DESIGN §19: Transfer values at strictly increasing steps >= the arrival step, each to an engine id (a
    printable string, as request ids are) other than the instance the request is on by then."""
    if not isinstance(ts, (tuple, list)):
        raise TraceError(where, f"must be a list of transfers, got {type(ts).__name__}", rid)
    out, on, last = [], FIRST_ENGINE, arrival - 1
    for j, t in enumerate(ts):
        if not isinstance(t, Transfer):
            raise TraceError(f"{where}[{j}]", f"must be an oracle.trace.Transfer, got {type(t).__name__}", rid)
        step = _int_value(t.step, f"{where}[{j}].step", rid, 0, MAX_ARRIVAL_STEP + MAX_POSITIONS)
        if step <= last:
            bound = f"> {last} (the previous transfer's step)" if j else f">= the arrival step {arrival}"
            raise TraceError(f"{where}[{j}].step", f"must be {bound}, got {step}", rid)
        to = t.to
        if not isinstance(to, str) or not to or len(to) > MAX_ID_LENGTH or not to.isprintable():
            raise TraceError(f"{where}[{j}].to", f"must be an engine id: a non-empty printable string of at most "
                             f"{MAX_ID_LENGTH} characters, got {ascii(to):.80}", rid)
        if to == on:
            raise TraceError(f"{where}[{j}].to", f"the request is already on engine {on!r} at step {step}", rid)
        out.append(Transfer(step, to))
        on, last = to, step
    return tuple(out)


def check_transfer_engine(engine: EngineConfig, requests: Any) -> None:
    """A trace with transfers (DESIGN §19) uses none of speculative, prefix_cache, kv_tokens: the error names the
    first request's transfer field."""
    for i, r in enumerate(requests):
        if r.transfer and (engine.speculative is not None or engine.prefix_cache is not None
                           or engine.kv_tokens is not None):
            raise TraceError(f"requests[{i}].transfer", "state transfer (DESIGN §19) is not combined with "
                             "engine.speculative, engine.prefix_cache or engine.kv_tokens", r.id)


def transfer_at(req: Request, step: int) -> Transfer | None:
    """The request's transfer at the end of `step`, if any."""
    return next((t for t in req.transfer if t.step == step), None)


def transfer_engines(trace: "Trace") -> list[str]:
    """The engine instances a trace runs on: FIRST_ENGINE, then every transfer target in sorted order."""
    return [FIRST_ENGINE] + sorted({t.to for r in trace.requests for t in r.transfer} - {FIRST_ENGINE})


def _parse_engine(obj: Any) -> EngineConfig:
    _keys(obj, "engine", None, {"max_requests", "max_tokens_per_step", "prefill_chunk"}, {"mode", "speculative", "prefix_cache",
                                                                                          "kv_tokens"})
    spec = None
    if "speculative" in obj:
        from .speculative import parse_speculative
        spec = parse_speculative(obj["speculative"])
    pc = obj.get("prefix_cache")
    if "prefix_cache" in obj:                                                  # null is not "absent"
        _keys(pc, "engine.prefix_cache", None, {"block_size", "capacity"}, {"store_decoded", "attention_block_size"})
        pc = PrefixCacheConfig(pc["block_size"], pc["capacity"], pc.get("store_decoded", False),
                               pc.get("attention_block_size"))                               # checked below
    return validate_engine_config(EngineConfig(obj["max_requests"], obj["max_tokens_per_step"],
                                               obj["prefill_chunk"], obj.get("mode", "legacy"), spec,
                                               prefix_cache=pc, kv_tokens=obj.get("kv_tokens")))


# ------------------------------------------------------------------------------------- the one shared validator

def validate_request(req: Any, where: str = "request", vocab_size: int | None = None,
                     max_positions: int | None = None) -> Request:
    """Check every field of a request (parsed from JSON or built by hand) and return it normalised (Python ints,
    tuples, float temperature); the one check shared by parse_trace, run_trace and both streaming add_requests.
    `max_positions`: the model's max_position_embeddings, if it declares one (check_positions)."""
    if not isinstance(req, Request):
        raise TraceError(where, f"must be an oracle.trace.Request, got {type(req).__name__}")
    rid = check_request_id(req.id, f"{where}.id")
    arrival = _int_value(req.arrival_step, f"{where}.arrival_step", rid, 0, MAX_ARRIVAL_STEP + 1)
    prompt = _token_list(req.prompt, f"{where}.prompt", rid, False, vocab_size)
    max_new = _int_value(req.max_new_tokens, f"{where}.max_new_tokens", rid, 1)
    check_positions(len(prompt), max_new, where, rid, max_positions)
    stops = _token_list(req.stop_token_ids, f"{where}.stop_token_ids", rid, True, vocab_size)
    sampling = _check_sampling(req.sampling, f"{where}.sampling", rid)
    transfer = _check_transfers(req.transfer, arrival, f"{where}.transfer", rid)
    return Request(rid, arrival, prompt, max_new, stops, sampling, transfer)


def validate_engine_config(ec: Any, where: str = "engine") -> EngineConfig:
    """Check an engine config (parsed or built by hand): limits are ints >= 1, max_requests <= MAX_REQUESTS, the
    mode known; returns it normalised."""
    if not isinstance(ec, EngineConfig):
        raise TraceError(where, f"must be an oracle.trace.EngineConfig, got {type(ec).__name__} {ec!r:.80}")
    if not isinstance(ec.mode, str) or ec.mode not in MODES:
        raise TraceError(f"{where}.mode", f"unknown mode {ec.mode!r}; expected one of {MODES}")
    return EngineConfig(_int_value(ec.max_requests, f"{where}.max_requests", None, 1, MAX_REQUESTS + 1),
                        _int_value(ec.max_tokens_per_step, f"{where}.max_tokens_per_step", None, 1),
                        _int_value(ec.prefill_chunk, f"{where}.prefill_chunk", None, 1), ec.mode,
                        ec.speculative, prefix_cache=_check_prefix_cache(ec.prefix_cache, f"{where}.prefix_cache"),
                        kv_tokens=_check_kv_tokens(ec, where))


def _check_kv_tokens(ec: EngineConfig, where: str) -> int | None:
    """None, or the KV budget of DESIGN §18 (an int >= 1; not combined with speculation or a prefix cache)."""
    if ec.kv_tokens is None:
        return None
    kv = _int_value(ec.kv_tokens, f"{where}.kv_tokens", None, 1)
    if ec.speculative is not None or ec.prefix_cache is not None:
        raise TraceError(f"{where}.kv_tokens", "preemption (DESIGN §18) is not combined with speculative or "
                         "prefix_cache")
    return kv


def _check_prefix_cache(pc: Any, where: str) -> PrefixCacheConfig | None:
    """None, or a PrefixCacheConfig whose block_size and capacity are ints >= 1 (normalised); an
    attention_block_size (DESIGN §21) is an int >= 1 that divides block_size or is a multiple of it."""
    if pc is None:
        return None
    if not isinstance(pc, PrefixCacheConfig):
        raise TraceError(where, f"must be an oracle.trace.PrefixCacheConfig or absent, got {type(pc).__name__}")
    if not isinstance(pc.store_decoded, bool):
        raise TraceError(f"{where}.store_decoded", f"must be true or false, got {pc.store_decoded!r}")
    block = _int_value(pc.block_size, f"{where}.block_size", None, 1)
    attn = pc.attention_block_size
    if attn is not None:
        attn = _int_value(attn, f"{where}.attention_block_size", None, 1)
        if block % attn and attn % block:
            raise TraceError(f"{where}.attention_block_size", f"{attn} must divide block_size {block} or be a "
                             "multiple of it (DESIGN §21)")
    return PrefixCacheConfig(block, _int_value(pc.capacity, f"{where}.capacity", None, 1), pc.store_decoded, attn)


def check_prefix_cache_against_model(ec: EngineConfig, chunk_size: int, n_mamba_layers: int | None,
                                     where: str = "engine") -> None:
    """A prefix cache needs block_size a multiple of the model's chunk_size (a resume point is a chunk boundary)
    and a model with Mamba layers (n_mamba_layers None: unknown, e.g. a test stand-in; not checked)."""
    pc = _check_prefix_cache(ec.prefix_cache, f"{where}.prefix_cache")
    if pc is None:
        return
    if pc.block_size % chunk_size:
        raise TraceError(f"{where}.prefix_cache.block_size",
                         f"must be a positive multiple of the model's chunk_size {chunk_size}, got {pc.block_size}")
    if n_mamba_layers == 0:
        raise TraceError(f"{where}.prefix_cache", "the model has no Mamba layers: a hybrid prefix cache "
                         "checkpoints Mamba state (an attention-only model needs none of this)")


def check_engine_against_model(ec: EngineConfig, chunk_size: int, where: str = "engine") -> EngineConfig:
    """An engine config that can always make progress with this model (docs/scheduler.md §1): prefill_chunk >=
    chunk_size, and every decode row plus one chunk of prefill fit a step."""
    ec = validate_engine_config(ec, where)
    if ec.prefill_chunk < chunk_size:
        raise TraceError(f"{where}.prefill_chunk",
                         f"must be >= the model's chunk_size {chunk_size}, got {ec.prefill_chunk}")
    need = ec.max_requests - 1 + chunk_size
    if ec.max_tokens_per_step < need:
        raise TraceError(f"{where}.max_tokens_per_step", f"must be >= max_requests - 1 + chunk_size = {need} "
                         f"(so every decode row and one chunk of prefill fit a step), got {ec.max_tokens_per_step}")
    return ec


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
    check_transfer_engine(engine, requests)
    return Trace(engine, tuple(requests), desc)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise TraceError(k, "duplicate key in a JSON object (which one counts would be a guess)")
        out[k] = v
    return out


def load_trace(path: str | Path, vocab_size: int | None = None) -> Trace:
    """Read and validate a `hybridqual.trace/1` JSON file (unreadable, undecodable or non-JSON: TraceError "file")."""
    if not isinstance(path, (str, Path)):
        raise TraceError("file", f"path must be a str or pathlib.Path, got {type(path).__name__}")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise TraceError("file", f"cannot read {path}: {e}") from None
    except UnicodeDecodeError as e:
        raise TraceError("file", f"{path} is not UTF-8 text: {e}") from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except TraceError as e:
        raise TraceError("file", f"{path}: {e}") from None
    except (ValueError, RecursionError) as e:          # JSONDecodeError, over-long integers, absurd nesting
        raise TraceError("file", f"{path} is not valid JSON: {e}") from None
    return parse_trace(obj, vocab_size)


def dump_trace(trace: Trace) -> str:
    """Canonical JSON text of a trace (sorted keys, no spaces); parse_trace(json.loads(dump)) == trace."""
    return json.dumps(trace.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def check_against_model(trace: Trace, vocab_size: int, chunk_size: int, max_positions: int | None = None) -> Trace:
    """Run-time checks of a trace (parsed or built by hand) against a model (docs/scheduler.md §1): every field
    as parse_trace checks it, token ids < vocab, progress guarantees, prompt + max_new_tokens within the model's
    positions (`max_positions`: its max_position_embeddings, None when undeclared); returns the trace normalised."""
    if not isinstance(trace, Trace):
        raise TraceError("trace", f"must be an oracle.trace.Trace, got {type(trace).__name__}")
    if not isinstance(trace.description, str):
        raise TraceError("description", f"must be a string, got {type(trace.description).__name__}")
    engine = check_engine_against_model(trace.engine, chunk_size)
    if not isinstance(trace.requests, (tuple, list)):      # may be empty here: streaming starts with none
        raise TraceError("requests", f"must be a tuple of requests, got {type(trace.requests).__name__}")
    requests, seen = [], set()
    for i, r in enumerate(trace.requests):
        r = validate_request(r, f"requests[{i}]", vocab_size, max_positions)
        if r.id in seen:
            raise TraceError(f"requests[{i}].id", "duplicate request id", r.id)
        seen.add(r.id)
        requests.append(r)
    out = Trace(engine, tuple(requests), trace.description)
    check_transfer_engine(engine, requests)
    for i, r in enumerate(requests):                        # DESIGN §18: a request alone always fits the KV budget
        if engine.kv_tokens is not None and len(r.prompt) + r.max_new_tokens > engine.kv_tokens:
            raise TraceError(f"requests[{i}].max_new_tokens", f"prompt + max_new_tokens = "
                             f"{len(r.prompt) + r.max_new_tokens} exceeds engine.kv_tokens {engine.kv_tokens}", r.id)
    if engine.speculative is not None:                      # DESIGN §13: budget, scripted ids, draft vocab
        from .speculative import check_speculative
        check_speculative(out, vocab_size, chunk_size)
    return out
