"""The adapter protocol: what `qualify` and `replay` need from an engine (`Adapter`, `Capabilities`, `RunResult`).

An adapter's contract (request fields in, tokens and finish reasons out) is docs/api.md, "Adapters".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch


def installed_version(dist: str) -> str:
    """The installed distribution's version, or "(not installed)" (a checkout used through PYTHONPATH)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return "(not installed)"


@dataclass(frozen=True)
class MeasuredPrecision:
    """A compute precision that is no torch dtype (a quantized model, e.g. a q8_0 GGUF), declared as
    Capabilities.compute_dtype with the judging constants measured for it (compare.TAU etc.; docs/api.md)."""
    name: str
    tau: float             # near-tie threshold on the oracle's logit gap (>= 2x the largest measured |Δlogit|)
    logits_c: float        # the logits check's c (max|Δlogit| <= c * max(1, std(oracle row)))
    top_k: int             # the near-tie rule's rank bound
    measured_err: float    # the largest |Δlogit| measured (the tie_bound's E)

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Capabilities:
    """What an adapter supports; qualify skips (with the reason) every check outside it."""
    sampling_kinds: tuple[str, ...] = ("greedy",)
    modes: tuple[str, ...] = ("legacy",)          # an engine claims "async" only if it has a distinct async mode
    schedule_log: bool = False                    # run_trace returns a schedule log (oracle.schedule_log format)
    logits: bool = False                          # run_trace returns the logits row of every sampled position
    compute_dtype: torch.dtype | MeasuredPrecision | None = None  # picks τ and the logits tolerance; None: float32
    prefix_cache_reporting: bool = False          # DESIGN §12: run_trace returns RunResult.prefix_cache (and a log,
                                                  # if any, records hits/stores/evictions)
    speculation_reporting: bool = False           # for later (DESIGN §13): the log records proposals/acceptance
    batch_invariant: bool = False                 # a request's tokens and logits do not depend on what shares its
                                                  # steps: each request run alone must give the same bits
    piece_granularities: tuple[int, ...] = ()     # the engine's own piece rule: the block sizes / budget roundings its
                                                  # scheduler cuts prefill at; the engine-aware scenarios put prompts
                                                  # = 1 mod each (tools/scenarios/boundaries.py) beside the defaults
    notes: tuple[tuple[str, str], ...] = ()       # (capability, why it is missing), quoted in skip reasons

    def why_not(self, what: str, default: str) -> str:
        """The adapter's own reason for lacking `what`, else `default`."""
        return dict(self.notes).get(what, default)


@dataclass(frozen=True)
class Configuration:
    """An optional configuration of an engine (a kernel backend, a rollback method, a batch-invariant mode) that
    qualify's main job runs beside the default one, on the shipped instances that reach its code."""
    name: str                        # what `qualify --configuration NAME` and the report call it
    reach: tuple[str, ...]           # "model/scenario" or "model/trace-file-name" of the shipped corpus
    why: str = ""                    # the code it runs that the default configuration does not


@dataclass
class RunResult:
    """What qualify compares: tokens and finish reasons per request, and the schedule log / logits when available."""
    tokens: dict[str, list[int]]
    finish_reasons: dict[str, str] = field(default_factory=dict)
    schedule_log: object | None = None   # oracle.schedule_log.ScheduleLog (has .to_json()) when the engine logs
    digest: str | None = None
    logits: dict[str, torch.Tensor] | None = None   # request id -> [len(tokens), vocab], the row each token came from
    # prefix-cache facts (DESIGN §12; docs/api.md): a hybridqual.qualify.prefix_checks.CacheEvents, or its JSON form
    # {"admit": [{"request", "cached_tokens"}], "steps": [{"stored": [{"request", "pos"}], "evicted": [...]}]}
    # ("steps" optional); None: the engine reports nothing, and the policy check is a SKIP
    prefix_cache: object | None = None
    # an engine's own per-step schedule facts (JSON; e.g. Megatron's, tools/adapters/megatron/schedule_facts.py), shown in the
    # report and checked by the adapter's `facts_check(label, mode, trace, run, oracle_model)` classmethod if any
    schedule_facts: list | None = None
    # the tokens a streaming client received, per request id, in delivery order (None: the engine does not stream);
    # when given they must equal `tokens` (tools/qualify/validate.py)
    streamed: dict[str, list[int]] | None = None


class Adapter:
    """Base class of engine adapters; see the module docstring."""
    max_steps = 100_000
    CAPABILITIES = Capabilities()

    def __init__(self, model_path: Path, trace, mode: str, device: str = "cpu") -> None:
        self.model_path, self.trace, self.mode, self.device = Path(model_path), trace, mode, device

    @classmethod
    def capabilities(cls, device: str) -> Capabilities:
        """The capabilities on `device` (override when, e.g., the compute dtype depends on it)."""
        return cls.CAPABILITIES

    @classmethod
    def version(cls) -> str:
        """A version string for the report: the adapter's class and its top-level package's version if known."""
        from importlib.metadata import PackageNotFoundError, version
        pkg = cls.__module__.split(".")[0]
        try:
            return f"{cls.__module__}.{cls.__qualname__} ({pkg} {version(pkg)})"
        except (PackageNotFoundError, ValueError):
            return f"{cls.__module__}.{cls.__qualname__}"

    @classmethod
    def configurations(cls) -> tuple[Configuration, ...]:
        """The optional configurations this engine supports (none by default); `configured` builds each."""
        return ()

    @classmethod
    def configured(cls, name: str) -> type["Adapter"]:
        """The adapter class running configuration `name` (one of `configurations()`); a ValueError naming the
        known ones otherwise."""
        known = [c.name for c in cls.configurations()]
        raise ValueError(f"--configuration {name}: the engine declares no such configuration (it declares "
                         f"{', '.join(known) or 'none'})")

    def add_request(self, request) -> None:
        raise NotImplementedError

    def step(self) -> dict[str, list[int]]:
        raise NotImplementedError

    def done(self) -> bool:
        raise NotImplementedError

    def run_trace(self) -> RunResult:
        """Drive add_request/step/done through the trace's arrivals."""
        pending = sorted(self.trace.requests, key=lambda r: (r.arrival_step, r.id))
        out: dict[str, list[int]] = {r.id: [] for r in pending}
        k = 0
        while pending or not self.done():
            while pending and pending[0].arrival_step <= k:
                self.add_request(pending.pop(0))
            for rid, toks in self.step().items():
                out[rid].extend(toks)
            k += 1
            if k > self.max_steps:
                raise RuntimeError(f"engine did not finish the trace within {self.max_steps} steps")
        return RunResult(tokens=out)


def cache_facts(trace, result):
    """The prefix-cache facts of a run whose schedule log carries them (ours and the oracle's), else None."""
    if trace.engine.prefix_cache is None:
        return None
    from hybridqual.qualify.prefix_checks import events_from_log
    return events_from_log(result.schedule_log)
