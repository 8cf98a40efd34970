"""Where a qualification's wall time goes: each moment of the run charged to one (phase, kind), exclusively.

Phases: `truth` (hybridqual.qualify.runner's truth_for: a shipped golden read, or the oracle's record computed),
`judging` (runner's check_instance), `load` (the oracle loaded: qualify.steps' load_truth), `other` (the plan,
the report, everything else). Kinds inside a phase: `pass` (one fp64 pass over the weights: OracleModel.forward,
oracle.batched.forward_segments, StreamedOracle.sequence_logits), `compute` (the comparisons and sampling:
qualify.compare's compare_tie_aware / compare_logits / top2_margin, oracle.sampling.sample), `engine` (an adapter
built and its run_trace), `host` (the rest). A region inside an engine run or inside a pass belongs to it (the
oracle engine's own passes are engine time). Host time is split by the main thread's CPU time into host work and
idle (the thread not running: waiting, or preempted). On CUDA every pass, compute and engine region is bounded by
a device synchronise, so device work is charged to the region that queued it; results are unchanged.

    tl = Timeline(sync)
    with instrument(tl, recompute_truth=True):
        tl.start()
        runner.main(argv)
        tl.close()
    tl.parts[("truth", "pass")].wall, tl.passes["truth"].count
"""
from __future__ import annotations

import functools
import inspect
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

PHASES = ("truth", "judging", "load", "other")
KINDS = ("pass", "compute", "engine", "host")
OWNING = ("pass", "engine")          # a region inside one of these belongs to it


@dataclass
class Part:
    """Wall seconds and main-thread CPU seconds charged to one (phase, kind)."""
    wall: float = 0.0
    cpu: float = 0.0


@dataclass
class Passes:
    """The fp64 passes over the weights made in one phase: how many, the sequences and tokens they served, by kind
    ("one sequence": OracleModel.forward; "batched": forward_segments; "streamed": sequence_logits)."""
    count: int = 0
    sequences: int = 0
    tokens: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, sequences: int, tokens: int) -> None:
        self.count, self.sequences, self.tokens = self.count + 1, self.sequences + sequences, self.tokens + tokens
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1


@dataclass
class InstanceTime:
    """One instance's truth or judging: wall seconds (the engine's runs in it included, also given alone) and the
    fp64 passes it made."""
    label: str
    phase: str
    wall_s: float
    engine_s: float
    passes: int


class Timeline:
    """Exclusive time per (phase, kind): a stack of open regions; each tick charges the time since the last tick
    to the region on top. `sync` waits for the device (a no-op on CPU)."""

    def __init__(self, sync: Callable[[], None] = lambda: None) -> None:
        self.sync = sync
        self.parts: dict[tuple[str, str], Part] = defaultdict(Part)
        self.passes: dict[str, Passes] = defaultdict(Passes)
        self.engine_runs = 0
        self.instances: list[InstanceTime] = []
        self.stack: list[tuple[str, str]] = [("other", "host")]
        self.wall0, self.cpu0 = time.perf_counter(), time.thread_time()
        self.t, self.c = self.wall0, self.cpu0

    def start(self) -> None:
        """Begin the timeline now (what was charged before is dropped)."""
        self.parts.clear()
        self.passes.clear()
        self.engine_runs = 0
        self.instances.clear()
        self.wall0, self.cpu0 = time.perf_counter(), time.thread_time()
        self.t, self.c = self.wall0, self.cpu0

    def _tick(self) -> None:
        t, c = time.perf_counter(), time.thread_time()
        part = self.parts[self.stack[-1]]
        part.wall += t - self.t
        part.cpu += c - self.c
        self.t, self.c = t, c

    def owned(self) -> bool:
        """Whether the region on top owns everything inside it (a pass, an engine run)."""
        return self.stack[-1][1] in OWNING

    @contextmanager
    def region(self, kind: str, phase: str | None = None) -> Iterator[bool]:
        """Charge the time inside to (phase or the enclosing phase, kind); yields whether it was opened (False:
        inside a pass or an engine run, or a compute region inside a compute region, which keep the time)."""
        top_phase, top_kind = self.stack[-1]
        if self.owned() or (kind == top_kind == "compute"):
            yield False
            return
        device = kind != "host"
        if device:
            self.sync()
        self._tick()
        self.stack.append((phase or top_phase, kind))
        try:
            yield True
        finally:
            try:
                if device:
                    self.sync()
                self._tick()
            finally:            # popped even when a signal's exception lands here (qualify's SIGTERM)
                self.stack.pop()

    def close(self) -> float:
        """Charge the time up to now; the wall seconds since the timeline began."""
        self._tick()
        return self.t - self.wall0

    def phase(self, name: str) -> dict[str, float]:
        """One phase's wall time split: passes, compute, engine, host work and idle (seconds)."""
        p = {k: self.parts.get((name, k), Part()) for k in KINDS}
        host = min(p["host"].cpu, p["host"].wall)
        return {"wall_s": sum(x.wall for x in p.values()), "passes_s": p["pass"].wall,
                "compute_s": p["compute"].wall, "engine_s": p["engine"].wall, "host_s": host,
                "idle_s": p["host"].wall - host}

    @property
    def current_phase(self) -> str:
        return self.stack[-1][0]


def _tokens(x: Any) -> int:
    try:
        return len(x)
    except TypeError:
        return 1


class Patches:
    """Module and class attributes replaced for the run, put back in reverse order by restore()."""

    def __init__(self) -> None:
        self.undo: list[tuple[Any, str, Any]] = []
        self.wrappers: list[tuple[Callable, Callable]] = []       # (original, wrapper) of everywhere()

    def set(self, obj: Any, attr: str, value: Any) -> None:
        self.undo.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    def everywhere(self, func: Callable, wrapper: Callable) -> None:
        """Replace `func` by `wrapper` in every loaded module of the project that holds it under some name (a name
        imported with `from M import f` is its own binding)."""
        self.wrappers.append((func, wrapper))
        for mod in _project_modules():
            for attr, value in list(vars(mod).items()):
                if value is func:
                    self.set(mod, attr, wrapper)

    def restore(self) -> None:
        """Put back every replaced attribute, and the original wherever a module imported while the patches were
        on bound a wrapper."""
        for obj, attr, old in reversed(self.undo):
            setattr(obj, attr, old)
        self.undo.clear()
        back = {id(w): f for f, w in self.wrappers}
        for mod in _project_modules():
            for attr, value in list(vars(mod).items()):
                if id(value) in back:
                    setattr(mod, attr, back[id(value)])
        self.wrappers.clear()


def _project_modules() -> list[Any]:
    """The loaded modules of the project (oracle, hybridqual)."""
    return [m for n, m in list(sys.modules.items())
            if m is not None and n.split(".")[0] in ("oracle", "hybridqual", "tools")]


def _timed(tl: Timeline, kind: str, f: Callable, phase: str | None = None,
           count: Callable[..., tuple[str, int, int]] | None = None) -> Callable:
    """f inside a region of `kind`; a pass region also counts the pass (count(*args) -> (kind, sequences,
    tokens))."""
    @functools.wraps(f)
    def wrapped(*args, **kwargs):
        with tl.region(kind, phase) as opened:
            if opened and count is not None:
                tl.passes[tl.current_phase].add(*count(*args, **kwargs))
            return f(*args, **kwargs)
    return wrapped


@contextmanager
def instrument(tl: Timeline, recompute_truth: bool = True) -> Iterator[Timeline]:
    """The oracle's passes, the comparisons, the engine runs and qualify's phases timed into `tl` for the duration;
    `recompute_truth`: every loaded oracle computes the truth now (no shipped golden read), as at a model with
    none. Everything is put back on exit."""
    import oracle.batched
    import oracle.sampling
    import oracle.streamed
    from oracle.model import OracleModel
    from hybridqual.adapters.base import Engine
    from hybridqual.qualify import compare, runner, steps

    patches = Patches()
    patches.set(OracleModel, "forward", _timed(tl, "pass", OracleModel.forward,
                                               count=lambda self, tokens, *a, **k: ("one sequence", 1,
                                                                                    _tokens(tokens))))
    patches.everywhere(oracle.batched.forward_segments, _timed(
        tl, "pass", oracle.batched.forward_segments,
        count=lambda model, segments, *a, **k: ("batched", len(segments), sum(len(s.tokens) for s in segments))))
    so = oracle.streamed.StreamedOracle
    patches.set(so, "sequence_logits", _timed(
        tl, "pass", so.sequence_logits,
        count=lambda self, seqs: ("streamed", len(seqs), sum(_tokens(s) for s in seqs))))
    for f in (compare.compare_tie_aware, compare.compare_logits, compare.top2_margin, oracle.sampling.sample):
        patches.everywhere(f, _timed(tl, "compute", f))
    patches.set(Engine, "__call__", _engine_call(tl, Engine.__call__))
    patches.set(runner, "truth_for", _instance_phase(tl, runner.truth_for, "truth"))
    patches.set(runner, "check_instance", _instance_phase(tl, runner.check_instance, "judging"))
    patches.set(steps, "load_truth", _loader(tl, steps.load_truth, recompute_truth))
    try:
        yield tl
    finally:
        patches.restore()


def _instance_phase(tl: Timeline, f: Callable, phase: str) -> Callable:
    """f (truth_for or check_instance: arguments model_dir and inst) as `phase`, one InstanceTime per call."""
    timed, signature = _timed(tl, "host", f, phase=phase), inspect.signature(f)

    @functools.wraps(f)
    def wrapped(*args, **kwargs):
        given = signature.bind_partial(*args, **kwargs).arguments
        label = f"{Path(given['model_dir']).name}/{given['inst'].scenario}"
        t0, n0, e0 = time.perf_counter(), tl.passes[phase].count, tl.parts[(phase, "engine")].wall
        try:
            return timed(*args, **kwargs)
        finally:
            tl.instances.append(InstanceTime(label, phase, time.perf_counter() - t0,
                                             tl.parts[(phase, "engine")].wall - e0, tl.passes[phase].count - n0))
    return wrapped


def _engine_call(tl: Timeline, call: Callable) -> Callable:
    """Engine.__call__ timed as engine work, its adapter's run_trace too."""
    @functools.wraps(call)
    def wrapped(self, *args, **kwargs):
        with tl.region("engine"):
            adapter = call(self, *args, **kwargs)
        run = adapter.run_trace

        @functools.wraps(run)
        def timed_run(*a, **k):
            with tl.region("engine") as opened:
                tl.engine_runs += bool(opened)
                return run(*a, **k)
        adapter.run_trace = timed_run
        return adapter
    return wrapped


def _loader(tl: Timeline, load: Callable, recompute_truth: bool) -> Callable:
    """qualify.steps.load_truth in the `load` phase; with recompute_truth the oracle reads no shipped golden."""
    @functools.wraps(load)
    def wrapped(*args, **kwargs):
        with tl.region("host", "load"):
            model, why = load(*args, **kwargs)
        if recompute_truth:
            model.use_goldens = False           # hybridqual.qualify.truth_source reads it
        return model, why
    return wrapped
