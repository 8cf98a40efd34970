"""qualify's plan as typed steps, in report order: what to say, a line of the plan itself, an oracle loaded, a
bad-input exit, or an instance to run (with the spec a --jobs worker rebuilds it from).

    for step in plan_steps(args, plan): ...      # Say | PlanLine | OracleLoaded | Exit | RunInstance

The serial run (hybridqual.qualify.runner) and the parallel one (hybridqual.qualify.jobs) walk the same steps and
apply the non-instance ones with the same `apply_step`.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Union

from hybridqual.scenarios import plan as scenarios
from hybridqual.qualify import configurations as configs
from hybridqual.qualify.report import Check, Progress, Report
from hybridqual.qualify.truth import load_truth


@dataclass(frozen=True)
class Say:
    """A progress line."""
    line: str


@dataclass(frozen=True)
class PlanLine:
    """A line of the plan itself (a model folder missing, the oracle not loading, a bad trace file): printed and
    reported."""
    check: Check


@dataclass(frozen=True)
class OracleLoaded:
    """The truth of one model folder is loaded: how, for the report's header."""
    model: str
    how: str


@dataclass(frozen=True)
class Exit:
    """Bad input found while planning: stop with this exit code and message."""
    code: int
    message: str


@dataclass(frozen=True)
class InstanceSpec:
    """What a --jobs worker needs to rebuild an instance (instantiation is deterministic): its model folder, its
    place in the model's list, its scenario or trace file, and its configuration when not the default."""
    model: str
    i: int
    n: int
    scenario: str | None = None
    trace_file: str | None = None
    configuration: str | None = None

    def to_json(self) -> dict:
        """The worker task's fields (only those set)."""
        return {"model": self.model, "i": self.i, "n": self.n,
                **{k: v for k, v in (("trace_file", self.trace_file), ("scenario", self.scenario),
                                     ("configuration", self.configuration)) if v is not None}}

    @classmethod
    def from_json(cls, task: dict) -> "InstanceSpec":
        return cls(task["model"], task["i"], task["n"], task.get("scenario"), task.get("trace_file"),
                   task.get("configuration"))


@dataclass(frozen=True)
class RunInstance:
    """An instance to run: its model folder, the instance, the oracle model judging it, and its spec."""
    model_dir: Path
    inst: object            # hybridqual.scenarios.plan.Instance
    oracle_model: object
    spec: InstanceSpec

    @property
    def label(self) -> str:
        return configs.label(self.model_dir, self.inst.scenario, self.spec.configuration)


Step = Union[Say, PlanLine, OracleLoaded, Exit, RunInstance]


def trace_family(trace) -> str:
    """A trace file's family: the engine feature it exercises (prefix_cache, speculative, preemption, transfer),
    else "trace file"."""
    if any(r.transfer for r in trace.requests):
        return "transfer"
    if trace.engine.prefix_cache is not None:
        return "prefix_cache"
    if trace.engine.speculative is not None:
        return "speculative"
    return "preemption" if trace.engine.kv_tokens is not None else "trace file"


def instance_from_file(path: Path, config) -> scenarios.Instance:
    """A trace file as one instance (scenario = file stem); a TraceError for a malformed file, a skip (with the
    reason) when it does not fit the model."""
    import oracle
    from oracle.trace import TraceError, check_against_model
    trace = oracle.load_trace(path)
    family = trace_family(trace)
    try:
        check_against_model(trace, config.vocab_size, config.chunk_size)
    except TraceError as e:
        return scenarios.Instance(path.stem, family, None, f"does not fit the model: {e}", trace.to_json())
    return scenarios.Instance(path.stem, family, trace, None, trace.to_json())


def trace_file_instance(path: Path, config, model_dir: Path, skip_invalid: bool):
    """instance_from_file for the plan: a malformed trace file, or one that does not fit the model, is a FAIL
    Check (a SKIP with --skip-invalid-traces) instead of an instance."""
    from oracle.trace import TraceError
    label = f"{Path(model_dir).name}/{Path(path).stem}"
    try:
        inst = instance_from_file(Path(path), config)
    except (TraceError, OSError, ValueError) as e:
        why = f"{path}: {e}"
        name = "trace file is valid"
    else:
        if inst.trace is not None or skip_invalid:
            return inst
        why, name = f"{path}: {inst.skip_reason}", "trace fits the model"
    if skip_invalid:
        return Check.skip(label, name, f"--skip-invalid-traces: {why}")
    return Check.of(label, name, False, why + " (pass --skip-invalid-traces to skip such files)")


def instances_for(model_dir: Path, config, names: list[str] | None, label: str,
                  granularities: tuple[int, ...] = (), rule=None, greedy_only: bool = False) -> list:
    """Scenario instances for one model, one scenario at a time so a builder error is a reported FAIL, not a crash;
    `granularities`: the engine's piece rule (hybridqual.qualify.runner.engine_granularities); `rule`: its step
    rule (hybridqual.qualify.runner.engine_rule); `greedy_only`: an engine without seeded sampling gets each
    scenario's greedy form (hybridqual.scenarios.plan.greedy_form) instead of a skipped instance."""
    error = getattr(scenarios, "ScenarioError", ValueError)
    out = []
    for name in names if names is not None else list(scenarios.SCENARIOS):
        try:
            out += scenarios.instantiate(model_dir, config, [name], granularities, rule, greedy_only)
        except error as e:
            out.append(Check.of(label, f"scenario {name} instantiates", False, str(e)))
    return out


def plan_steps(args, plan) -> Iterator[Step]:
    """The plan as steps in report order, computing only what decides them (the truth's loading, instantiation)."""
    from oracle.checkpoint import CheckpointError
    from oracle.trace import TraceError
    truths: dict[Path, tuple] = {}
    for model_dir, names, files, configuration in plan:
        if not (model_dir / "config.json").exists():
            yield PlanLine(Check.of(str(model_dir), "model folder exists", False, "no config.json there"))
            continue
        if model_dir not in truths:
            try:
                truths[model_dir] = load_truth(model_dir, args.oracle, args.oracle_device)
            except (CheckpointError, ValueError) as e:
                yield PlanLine(Check.of(model_dir.name, "the oracle loads", False, f"{type(e).__name__}: {e}"))
                continue
            yield OracleLoaded(str(model_dir), truths[model_dir][1])
            yield Say(f"[{model_dir.name}] truth: {truths[model_dir][1]}")
        oracle_model = truths[model_dir][0]
        if files is not None:       # a bad trace file is a FAIL line (a SKIP with --skip-invalid-traces), the rest run
            insts = [trace_file_instance(p, oracle_model.config, model_dir, args.skip_invalid_traces) for p in files]
        else:
            try:
                insts = instances_for(model_dir, oracle_model.config, names, model_dir.name,
                                      getattr(args, "granularities", ()), getattr(args, "step_rule", None),
                                      getattr(args, "greedy_only", False))
            except (TraceError, OSError, ValueError) as e:
                yield Exit(2, f"--scenario: {e}")
                return
        for i, inst in enumerate(insts, 1):
            if isinstance(inst, Check):           # a scenario that failed to instantiate, a bad trace file
                yield PlanLine(inst)
                continue
            spec = InstanceSpec(str(model_dir), i, len(insts),
                                scenario=None if files is not None else inst.scenario,
                                trace_file=str(files[i - 1]) if files is not None else None,
                                configuration=configuration)
            yield RunInstance(model_dir, inst, oracle_model, spec)


def apply_step(step: Step, report: Report, progress: Progress, on_check) -> int | None:
    """A step other than an instance, in order; the exit code of an Exit."""
    if isinstance(step, Say):
        progress.say(step.line)
    elif isinstance(step, PlanLine):        # a line of the plan itself (the oracle loads, a bad trace): printed too
        progress.check(step.check)
        on_check(step.check)
    elif isinstance(step, OracleLoaded):
        report.header.setdefault("oracle", {})[step.model] = step.how
    elif isinstance(step, Exit):
        print(step.message, file=sys.stderr)
        return step.code
    return None
