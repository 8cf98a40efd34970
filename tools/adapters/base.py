"""The adapter protocol: what `qualify` and `replay` need from an engine.

`TraceAdapter` (whole trace: `run_trace() -> RunResult`) and `StepAdapter` (add_request / step / done, driven by
its `run_trace`), configured by an `EngineOptions` value; `Engine` binds a class to its options; `Capabilities`
say what it can do. `Adapter` is the former name of `StepAdapter`.

An adapter's contract (request fields in, tokens and finish reasons out) is docs/api.md, "Adapters".
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import ClassVar

import torch

from hybridqual.scenarios.step_rule import StepRule


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
    state_dtype: str = "float32"                  # DESIGN §20: the recurrent state's declared dtype; a reduced one is
                                                  # judged by constants measured for it (compute_dtype a
                                                  # MeasuredPrecision: hybridqual.adapters.state_precision)
    kv_dtype: str = "float32"                     # DESIGN §20: the attention K/V cache's declared dtype (e.g.
                                                  # llama.cpp's q8_0); a reduced one is judged by constants measured
                                                  # for it (compute_dtype a MeasuredPrecision)
    prefix_cache_reporting: bool = False          # DESIGN §12: run_trace returns RunResult.prefix_cache (and a log,
                                                  # if any, records hits/stores/evictions)
    speculation_reporting: bool = False           # for later (DESIGN §13): the log records proposals/acceptance
    batch_invariant: bool = False                 # a request's tokens and logits do not depend on what shares its
                                                  # steps: each request run alone must give the same bits
    piece_granularities: tuple[int, ...] = ()     # the engine's own piece rule: the block sizes / budget roundings its
                                                  # scheduler cuts prefill at; the engine-aware scenarios put prompts
                                                  # = 1 mod each (tools/scenarios/boundaries.py) beside the defaults
    deterministic: bool = False                   # the same trace run twice gives the same bits (tokens, logits);
                                                  # else the repeat check allows near ties and the declared precision
    step_rule: StepRule | None = None             # how the engine forms a step (budget rounding, pieces, cache
                                                  # blocks): piece_tails is instantiated under it; None: unknown
                                                  # (qualify --engine-budget sets one; else ours is assumed)
    state_transfer: bool = False                  # DESIGN §19: runs a trace whose requests move between engine
                                                  # instances (request field `transfer`); else qualify SKIPs it
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
    # report and checked by the adapter's `facts_check(ctx)` hook (TraceAdapter) if it has one
    schedule_facts: list | None = None
    # the tokens a streaming client received, per request id, in delivery order (None: the engine does not stream);
    # when given they must equal `tokens` (tools/qualify/validate.py)
    streamed: dict[str, list[int]] | None = None


@dataclass(frozen=True)
class ThreadBudget:
    """The CPU threads one engine may use, so that the engines a run puts side by side fit the cores it has
    (--jobs x threads <= cores): computed once by qualify (`for_cores`) or given by the user (--engine-threads)."""
    threads: int                 # threads one engine (its process, or its worker process) may run
    cores: int                   # the cores the run has (os.sched_getaffinity)
    jobs: int = 1                # engines side by side (qualify's --jobs x --tp)
    given: bool = False          # set by --engine-threads, not computed

    def __post_init__(self) -> None:
        for name in ("threads", "cores", "jobs"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ThreadBudget.{name}: {v!r}; must be an integer >= 1")

    @classmethod
    def for_cores(cls, cores: int, jobs: int, given: int | None = None) -> "ThreadBudget":
        """`given` threads, else cores // jobs (at least 1)."""
        if given is not None:
            return cls(given, cores, jobs, True)
        return cls(max(1, cores // max(1, jobs)), cores, jobs)

    @property
    def oversubscribed(self) -> bool:
        return self.threads * self.jobs > self.cores

    def describe(self) -> str:
        """One line for the report: the threads and where they come from."""
        why = (f"--engine-threads {self.threads}" if self.given else
               f"{self.cores} cores // {self.jobs} engine{'s' if self.jobs > 1 else ''} side by side")
        over = (f"; oversubscribed: {self.jobs} x {self.threads} > {self.cores} cores" if self.oversubscribed
                else "")
        return f"{self.threads} thread{'s' if self.threads > 1 else ''} per engine ({why}{over})"

    def to_json(self) -> dict:
        return {"threads": self.threads, "cores": self.cores, "jobs": self.jobs, "given": self.given}

    @classmethod
    def from_json(cls, d: dict) -> "ThreadBudget":
        return cls(int(d["threads"]), int(d["cores"]), int(d["jobs"]), bool(d["given"]))


@dataclass(frozen=True)
class EngineOptions:
    """How a run configures an engine, as values (qualify's --dtype, --graphs, --batch-invariant, --tp,
    --configuration, --base-url, --served-model): passed to the adapter's constructor and class hooks, never set on
    a class. An adapter reads the fields it lists in `OPTIONS`; a run setting any other field is refused
    (`TraceAdapter.options_problem`), so an adapter that reads none always gets the defaults."""
    dtype: torch.dtype | None = None     # compute dtype (None: the adapter's default for the device)
    graphs: bool = False                 # CUDA graphs
    batch_invariant: bool = False        # the engine's batch-invariant mode
    tp: int = 1                          # tensor-parallel ranks (under torchrun)
    configuration: str | None = None     # one of the adapter's declared configurations (None: its defaults)
    base_url: str | None = None          # a server engine's address (http://HOST:PORT)
    served_model: str | None = None      # the name a server serves the model under (None: the only one it lists)
    settings: object | None = None       # the adapter's own frozen settings dataclass (e.g. the OpenAI adapter's
                                         # ServerSettings); None: its defaults
    threads: ThreadBudget | None = None  # the CPU threads the engine may use (qualify sets it for every run; an
                                         # adapter listing "threads" in OPTIONS gets it, others never see it and are
                                         # never refused for it); None: the engine's own default

    def replace(self, **changes) -> "EngineOptions":
        """These options with `changes` (field names checked by dataclasses.replace)."""
        return replace(self, **changes)

    def set_fields(self) -> tuple[str, ...]:
        """The fields that differ from the defaults, in declaration order."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name) != f.default)


DEFAULT_OPTIONS = EngineOptions()


class TraceAdapter:
    """The whole-trace protocol: `Adapter(model_path, trace, mode, device, options=...)`, then `run_trace()` once.

    Class hooks (each with a default; override what the engine has): `capabilities(device, options)`,
    `version(options)`, `configurations()`, `configure(name, options)`, `options_problem(options)` and
    `facts_check(ctx)` (an extra qualify line over the engine's own schedule facts). Options other than the
    defaults are passed only to adapters that list the fields in `OPTIONS`, so an adapter written without options
    (`__init__(model_path, trace, mode, device)`, `capabilities(device)`, `version()`) keeps working.
    """
    CAPABILITIES: ClassVar[Capabilities] = Capabilities()
    OPTIONS: ClassVar[tuple[str, ...]] = ()          # the EngineOptions fields this adapter reads

    def __init__(self, model_path: Path, trace, mode: str, device: str = "cpu",
                 options: EngineOptions = DEFAULT_OPTIONS) -> None:
        self.model_path, self.trace, self.mode, self.device = Path(model_path), trace, mode, device
        self.options = options

    @classmethod
    def capabilities(cls, device: str, options: EngineOptions = DEFAULT_OPTIONS) -> Capabilities:
        """The capabilities on `device` with `options` (override when, e.g., the compute dtype depends on them)."""
        return cls.CAPABILITIES

    @classmethod
    def version(cls, options: EngineOptions = DEFAULT_OPTIONS) -> str:
        """A version string for the report: the adapter's class and its top-level package's version if known."""
        from importlib.metadata import PackageNotFoundError, version
        pkg = cls.__module__.split(".")[0]
        try:
            return f"{cls.__module__}.{cls.__qualname__} ({pkg} {version(pkg)})"
        except (PackageNotFoundError, ValueError):
            return f"{cls.__module__}.{cls.__qualname__}"

    @classmethod
    def configurations(cls) -> tuple[Configuration, ...]:
        """The optional configurations this engine supports (none by default); `configure` selects one."""
        return ()

    @classmethod
    def configure(cls, name: str, options: EngineOptions = DEFAULT_OPTIONS) -> EngineOptions:
        """The options running configuration `name` (one of `configurations()`); a ValueError naming the known
        ones otherwise."""
        known = [c.name for c in cls.configurations()]
        if name not in known:
            raise ValueError(f"--configuration {name}: the engine declares no such configuration (it declares "
                             f"{', '.join(known) or 'none'})")
        return options.replace(configuration=name)

    @classmethod
    def options_problem(cls, options: EngineOptions) -> str | None:
        """Why this adapter cannot run with `options` (a field set that it does not read), or None."""
        extra = [f for f in options.set_fields() if f not in cls.OPTIONS and f not in ("configuration", "threads")]
        if extra:
            return (f"{cls.__qualname__} takes no {', '.join(extra)} option (it reads "
                    f"{', '.join(cls.OPTIONS) or 'none'})")
        return None

    @classmethod
    def plan_models(cls) -> tuple[str, ...]:
        """The shipped models (goldens/models names) of this engine's default plan when it cannot run the main
        job's (e.g. attention head_dim below what its kernels accept); () = the main job's plan."""
        return ()

    @classmethod
    def facts_check(cls, ctx):
        """qualify's extra line over the engine's own `RunResult.schedule_facts` (a hybridqual.qualify.report.Check,
        or None for no line); `ctx` is the hybridqual.qualify.context.CheckContext of the run being judged."""
        return None

    def run_trace(self) -> RunResult:
        """Run the whole trace (every request from its arrival_step on) and return what qualify compares."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement run_trace()")


class StepAdapter(TraceAdapter):
    """The step-driven protocol: `add_request(request)`, `step() -> {request id: new tokens}` and `done()`;
    `run_trace` drives them through the trace's arrivals (a request is added before the (arrival_step + 1)-th
    `step()` call), at most `max_steps` steps."""
    max_steps: ClassVar[int] = 100_000

    def add_request(self, request) -> None:
        raise NotImplementedError(f"{type(self).__qualname__} must implement add_request(request)")

    def step(self) -> dict[str, list[int]]:
        raise NotImplementedError(f"{type(self).__qualname__} must implement step()")

    def done(self) -> bool:
        raise NotImplementedError(f"{type(self).__qualname__} must implement done()")

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


# The protocol's former single base class: an adapter written to it (step-driven, or overriding run_trace) is a
# StepAdapter and keeps working unchanged.
Adapter = StepAdapter


@dataclass(frozen=True)
class Engine:
    """An adapter class with the options a run gives it (what qualify and replay hold): builds one adapter per
    (instance, mode) and answers the class hooks for those options. Default options are not passed on, so an
    adapter written without options works unchanged."""
    adapter: type[TraceAdapter]
    options: EngineOptions = DEFAULT_OPTIONS

    def _given(self) -> dict:
        opts = self.options if "threads" in self.adapter.OPTIONS else self.options.replace(threads=None)
        return {} if opts == DEFAULT_OPTIONS else {"options": opts}

    def __call__(self, model_path: Path, trace, mode: str, device: str = "cpu") -> TraceAdapter:
        return self.adapter(model_path, trace, mode, device, **self._given())

    def capabilities(self, device: str) -> Capabilities:
        return self.adapter.capabilities(device, **self._given())

    def version(self) -> str:
        return self.adapter.version(**self._given())

    def configurations(self) -> tuple[Configuration, ...]:
        return self.adapter.configurations()

    def configured(self, name: str) -> "Engine":
        """This engine in declared configuration `name` (a ValueError naming the known ones otherwise)."""
        return Engine(self.adapter, self.adapter.configure(name, self.options))

    def facts_check(self, ctx):
        return self.adapter.facts_check(ctx)

    def plan_models(self) -> tuple[str, ...]:
        return self.adapter.plan_models()

    def problem(self) -> str | None:
        """Why the adapter cannot run with these options, or None."""
        return self.adapter.options_problem(self.options)


def as_engine(adapter: "Engine | type[TraceAdapter]") -> Engine:
    """An Engine as is, an adapter class with the default options."""
    return adapter if isinstance(adapter, Engine) else Engine(adapter)


def cache_facts(trace, result):
    """The prefix-cache facts of a run whose schedule log carries them (ours and the oracle's), else None."""
    if trace.engine.prefix_cache is None:
        return None
    from hybridqual.qualify.prefix_checks import events_from_log
    return events_from_log(result.schedule_log)
