"""The schedule log: one record per engine step, canonical JSON, sha256 digest (docs/scheduler.md §7).

Both sides emit this exact structure; values are strings and ints only so the canonical text is exact.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

SCHEMA = "hybridqual.schedule/1"
KINDS = ("decode", "prefill", "extra", "verify")   # verify: speculative rows (DESIGN §13)
REASONS = ("stop", "length", "transfer")          # transfer: handed to another engine instance (DESIGN §19)


@dataclass
class BatchRow:
    """One row of a step's batch: positions [pos, pos + count) of `request`, computed in `slot`."""

    row: int
    request: str
    slot: int
    kind: str
    pos: int
    count: int
    proposals: list[int] | None = None      # verify rows only: the m drafts fed after the last token

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        out = {"row": self.row, "request": self.request, "slot": self.slot, "kind": self.kind,
               "pos": self.pos, "count": self.count}
        if self.proposals is not None:
            out["proposals"] = list(self.proposals)
        return out


@dataclass
class StepRecord:
    """Everything the scheduler did at step `step` and when resolving that step's outputs."""

    step: int
    overlap: int = 0
    admit: list[dict[str, Any]] = field(default_factory=list)     # {"request", "row", "slot"}
    batch: list[BatchRow] = field(default_factory=list)
    sampled: list[dict[str, Any]] = field(default_factory=list)   # {"request", "pos", "token"}
    free: list[dict[str, Any]] = field(default_factory=list)      # {"request", "row", "slot", "reason"}
    moves: list[dict[str, Any]] = field(default_factory=list)     # {"from_row", "to_row", "request", "slot"}
    row_to_slot: list[int] = field(default_factory=list)
    verify: list[dict[str, Any]] | None = None    # {"request", "accepted"}: only in steps with verify rows
    preempt: list[dict[str, Any]] | None = None   # DESIGN §18: {"request", "row", "slot", "generated", "moves"}
    # prefix cache events (docs/scheduler.md §9); in the JSON only when the log's run had a prefix cache
    cache: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: {"hits": [], "stored": [], "evicted": []})

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        out = {"step": self.step, "overlap": self.overlap, "admit": list(self.admit),
               "batch": [b.to_json() for b in self.batch], "sampled": list(self.sampled),
               "free": list(self.free), "moves": list(self.moves), "row_to_slot": list(self.row_to_slot)}
        if self.verify is not None:
            out["verify"] = list(self.verify)
        if self.preempt is not None:
            out["preempt"] = list(self.preempt)
        return out


@dataclass
class ScheduleLog:
    """The whole log of one run."""

    mode: str
    steps: list[StepRecord] = field(default_factory=list)
    prefix_cache: bool = False      # the run had a prefix cache: every step also logs its "prefix_cache" events
    # DESIGN §19: the steps of every other engine instance (id -> records of the steps it ran); `steps` are the
    # instance "main"'s. None (absent from the JSON) without transfers, so every other log is unchanged
    instances: dict[str, list[StepRecord]] | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        steps = [s.to_json() for s in self.steps]
        if self.prefix_cache:
            for j, s in zip(steps, self.steps):
                j["prefix_cache"] = {k: list(v) for k, v in s.cache.items()}
        out = {"schema": SCHEMA, "mode": self.mode, "steps": steps}
        if self.instances is not None:
            out["instances"] = {name: [s.to_json() for s in recs] for name, recs in self.instances.items()}
        return out


def _check_value(v: Any, path: str) -> None:
    if isinstance(v, bool) or v is None or isinstance(v, float):
        raise ValueError(f"schedule log {path}: only strings and ints are allowed, got {v!r}")
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                raise ValueError(f"schedule log {path}: keys must be strings, got {k!r}")
            _check_value(x, f"{path}.{k}")
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _check_value(x, f"{path}[{i}]")
    elif not isinstance(v, (int, str)):
        raise ValueError(f"schedule log {path}: unsupported value {type(v).__name__}")


def canonical_json(log: ScheduleLog | dict[str, Any]) -> str:
    """Canonical text: sorted keys, no spaces, ASCII; rejects floats, booleans and nulls."""
    obj = log.to_json() if isinstance(log, ScheduleLog) else log
    _check_value(obj, "log")
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def digest(log: ScheduleLog | dict[str, Any]) -> str:
    """Lowercase hex sha256 of the canonical JSON of the whole log (the schedule digest)."""
    return hashlib.sha256(canonical_json(log).encode("utf-8")).hexdigest()


def from_json(obj: dict[str, Any]) -> ScheduleLog:
    """Rebuild a ScheduleLog from its JSON form (e.g. json.loads of canonical_json); rejects other schemas."""
    if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
        raise ValueError(f"schedule log schema: expected {SCHEMA!r}")
    inst = obj.get("instances")
    return ScheduleLog(obj["mode"], _records(obj["steps"]), any("prefix_cache" in s for s in obj["steps"]),
                       None if inst is None else {name: _records(recs) for name, recs in inst.items()})


def _records(objs: list[dict[str, Any]]) -> list[StepRecord]:
    """StepRecords from their JSON forms."""
    steps = []
    for s in objs:
        batch = [BatchRow(b["row"], b["request"], b["slot"], b["kind"], b["pos"], b["count"], b.get("proposals"))
                 for b in s["batch"]]
        steps.append(StepRecord(s["step"], s["overlap"], list(s["admit"]), batch, list(s["sampled"]),
                                list(s["free"]), list(s["moves"]), list(s["row_to_slot"]), s.get("verify"),
                                s.get("preempt")))
        if "prefix_cache" in s:
            steps[-1].cache = {k: list(v) for k, v in s["prefix_cache"].items()}
    return steps


def _first_diff(a: Any, b: Any, path: str) -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(a.keys() | b.keys()):
            if k not in a or k not in b:
                return f"{path}.{k}: present on one side only"
            d = _first_diff(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            d = _first_diff(x, y, f"{path}[{i}]")
            if d:
                return d
        return None if len(a) == len(b) else f"{path}: length {len(a)} != {len(b)}"
    return None if a == b else f"{path}: {a!r} != {b!r}"


def first_difference(a: ScheduleLog | dict[str, Any], b: ScheduleLog | dict[str, Any]) -> str | None:
    """The first differing field of two logs as 'steps[k].batch[i].slot: 1 != 2' (steps in order), or None."""
    ja = a.to_json() if isinstance(a, ScheduleLog) else a
    jb = b.to_json() if isinstance(b, ScheduleLog) else b
    for key in ("schema", "mode"):
        if ja.get(key) != jb.get(key):
            return f"{key}: {ja.get(key)!r} != {jb.get(key)!r}"
    return (_first_diff(ja["steps"], jb["steps"], "steps")
            or _first_diff(ja.get("instances"), jb.get("instances"), "instances"))


def verify_rows(log: ScheduleLog | dict) -> list[dict[str, Any]]:
    """Every verify row of a log: {step, request, pos, proposals, accepted, emitted} (emitted = the tokens that
    row appended, in order)."""
    j = log.to_json() if isinstance(log, ScheduleLog) else log
    out = []
    for s in j["steps"]:
        acc = {v["request"]: v["accepted"] for v in s.get("verify", [])}
        for b in s["batch"]:
            if b["kind"] != "verify":
                continue
            if b["request"] not in acc:
                raise AssertionError(f"step {s['step']}: verify row of {b['request']} has no accepted count")
            emitted = [x["token"] for x in s["sampled"] if x["request"] == b["request"]]
            out.append({"step": s["step"], "request": b["request"], "pos": b["pos"], "proposals": b["proposals"],
                        "accepted": acc[b["request"]], "emitted": emitted})
    return out


@dataclass
class TraceResult:
    """Outcome of running a trace (oracle or fast path): tokens and finish reason per request, log, digest."""

    tokens: dict[str, list[int]]
    finish_reasons: dict[str, str]
    schedule_log: ScheduleLog
    digest: str
