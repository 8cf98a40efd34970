"""The schedule log: one record per engine step, canonical JSON, sha256 digest (docs/scheduler.md §7).

Both sides emit this exact structure; values are strings and ints only so the canonical text is exact.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

SCHEMA = "hybridqual.schedule/1"
KINDS = ("decode", "prefill", "extra")
REASONS = ("stop", "length")


@dataclass
class BatchRow:
    """One row of a step's batch: positions [pos, pos + count) of `request`, computed in `slot`."""

    row: int
    request: str
    slot: int
    kind: str
    pos: int
    count: int

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {"row": self.row, "request": self.request, "slot": self.slot, "kind": self.kind,
                "pos": self.pos, "count": self.count}


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

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {"step": self.step, "overlap": self.overlap, "admit": list(self.admit),
                "batch": [b.to_json() for b in self.batch], "sampled": list(self.sampled),
                "free": list(self.free), "moves": list(self.moves), "row_to_slot": list(self.row_to_slot)}


@dataclass
class ScheduleLog:
    """The whole log of one run."""

    mode: str
    steps: list[StepRecord] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {"schema": SCHEMA, "mode": self.mode, "steps": [s.to_json() for s in self.steps]}


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


@dataclass
class TraceResult:
    """Outcome of running a trace (oracle or fast path): tokens and finish reason per request, log, digest."""

    tokens: dict[str, list[int]]
    finish_reasons: dict[str, str]
    schedule_log: ScheduleLog
    digest: str
