"""The main job: run scenario instances through an engine and check it against the goldens / the oracle.

    python -m hybridqual.qualify                                   # the default plan (hybridqual.scenarios.plan.default_plan)
    python -m hybridqual.qualify --model M [--scenario NAME ...]   # every scenario instantiated for model M
    python -m hybridqual.qualify [--model M] --trace T.json ...    # these trace files (one instance each)
        [--engine NAME|module:Class] [--mode legacy async] [--device cpu|cuda]    # NAME: --engine's help lists them
        [--tau T] [--dtype bfloat16|float32] [--graphs] [--batch-invariant] [--out out/qualify] [--quiet] [--strict]
        [--oracle auto|memory|streamed] [--oracle-device cpu|cuda] [--fail-fast] [--jobs N] [--timeout S]
        [--engine-threads N]
        [--isolate | --in-process] [--skip-invalid-traces]
    torchrun --nproc_per_node 2 -m hybridqual.qualify --tp 2 ...   # tensor parallel fast path

Checks, a line each (PASS / FAIL / SKIP with its reason; tools/qualify/checks.py): tokens vs the truth
(tie-aware, τ from the engine's compute dtype unless --tau), schedule log vs the oracle's, logits vs the oracle's,
legacy == async bitwise, task accuracy. The truth is the shipped golden when its model sha256 and trace sha256
match, else the oracle (fp64) run now; the report says which. A model that does not fit in memory (or --oracle
streamed) is judged by the streamed fp64 oracle (tools/qualify/truth.py): the engine's own tokens scored
teacher-forced, one layer's weights in memory at a time. report.json and junit.xml under --out are removed
at start and rewritten after every check. Exit 0 when nothing failed and at least one check passed (--strict:
and nothing was skipped); --fail-fast stops at the first FAIL (exit 1, the report says where it stopped).
--jobs N runs instances in N worker processes (tools/qualify/jobs.py; default min(2, cores) for the default plan
on cpu, else 1); the report, its lines and --fail-fast's stop keep the plan's order. Every engine gets CPU cores //
(--jobs x --tp) threads (--engine-threads N sets them): the adapter reads EngineOptions.threads (llama.cpp's worker,
vLLM's CPU backend), torch is set to them in each --jobs worker (at most them in this process); the report header
says how many.

An adapter cannot fool or stop the judge: its RunResult is validated before any check reads it
(tools/qualify/validate.py); an adapter that raises or calls sys.exit is a FAIL line; one that runs past --timeout
(per instance, default 1800 s) or kills its own process is a FAIL line of that instance when it runs in a worker
(--jobs > 1, --isolate, and by default for an engine given as module:Class), and in this process a timeout that
Python can interrupt. Whatever ends the run (an exception, SIGTERM, SIGINT, exit), report.json is finalised with
"status": "aborted: <why>". A trace file that is malformed or does not fit the model is a FAIL line (exit 1)
unless --skip-invalid-traces makes it a SKIP. Every argument is checked before any work (exit 2, one line).
"""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch

from hybridqual import adapters
from hybridqual.adapters.base import Engine, EngineOptions, ThreadBudget
from hybridqual.goldens import regen as goldens
from hybridqual.scenarios import plan as scenarios
from hybridqual.qualify import arguments, configurations as configs
from hybridqual.qualify.arguments import argument_problem, oracle_device_problem  # noqa: F401  (re-exported)
from hybridqual.qualify.compare import tau_for
from hybridqual.qualify.checks import check_instance, dtype_name, truth_for
from hybridqual.qualify.report import Check, Progress, Report, versions
from hybridqual.qualify.steps import (RunInstance, apply_step, instance_from_file, instances_for,  # noqa: F401
                                      plan_steps, trace_family, trace_file_instance)

DEFAULT_MODEL = goldens.MODELS / "tiny-sort"


def engine_rule(args, engine: Engine):
    """The engine's step rule the corpus is instantiated under: --engine-budget, else the adapter's declared
    Capabilities.step_rule, else None (ours)."""
    from hybridqual.scenarios.step_rule import parse_step_rule
    spec = getattr(args, "engine_budget", None)
    return parse_step_rule(spec) if spec else engine.capabilities(args.device).step_rule


def engine_granularities(args, engine: Engine) -> tuple[int, ...]:
    """The engine's piece rule the corpus covers: the adapter's declared granularities and --piece-granularity."""
    return tuple(sorted({*engine.capabilities(args.device).piece_granularities, *args.piece_granularity}))


def check_trace(adapter: Engine | type[adapters.TraceAdapter], model_dir: Path, trace_path: Path, modes: list[str],
                oracle_model, device: str, tau: float | None = None) -> list[Check]:
    """Every check for one trace file (an instance of its own); `adapter` an Engine or an adapter class (default
    options); `tau` None follows the engine's compute dtype."""
    return check_instance(adapter, Path(model_dir), instance_from_file(Path(trace_path), oracle_model.config),
                          modes, oracle_model, device, tau)


def prepare_device(device: str) -> str | None:
    """Check --device; on a GPU machine, `cpu` needs the Triton interpreter, which must be on before triton is
    imported (set here when possible). Returns an error message, or None."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        return f"--device {device!r}: not a torch device ({e})"
    if dev.type == "cuda" and not torch.cuda.is_available():
        return f"--device {device}: CUDA is not available on this machine"
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            return ("--device cpu: the fast path's Triton kernels need TRITON_INTERPRET=1 on CPU, and triton is "
                    "already imported; set TRITON_INTERPRET=1 in the environment")
        os.environ["TRITON_INTERPRET"] = "1"
    if dev.type not in ("cpu", "cuda"):
        return f"--device {device}: only cpu and cuda are supported"
    return None


def cpu_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:      # pragma: no cover - not Linux
        return os.cpu_count() or 1


def resolve_jobs(args) -> str | None:
    """Fill in --jobs (min(2, cores) for the default plan on cpu, else 1); an error message for a bad value."""
    if args.jobs is None:
        default_plan = not (args.model or args.trace)
        args.jobs = min(2, cpu_cores()) if default_plan and args.device == "cpu" and args.tp == 1 else 1
    elif args.jobs < 1:
        return f"--jobs {args.jobs}: must be at least 1"
    elif args.jobs > 1 and args.tp > 1:
        return f"--jobs {args.jobs}: not with --tp {args.tp} (the ranks already run every instance together)"
    return None


def thread_budget(args) -> ThreadBudget:
    """The threads each engine of this run may use: --engine-threads, else the cores // (--jobs x --tp), so the
    engines side by side fit the cores (args.jobs already resolved)."""
    return ThreadBudget.for_cores(cpu_cores(), args.jobs * args.tp, getattr(args, "engine_threads", None))


def serial_torch_threads(budget: ThreadBudget, current: int) -> int:
    """torch's threads for instances run in this process: the budget when given, else at most the budget (never
    more than this process was already limited to, e.g. by OMP_NUM_THREADS)."""
    return budget.threads if budget.given else min(current, budget.threads)


def threads_header(budget: ThreadBudget, engine: Engine, torch_threads: int) -> dict:
    """The report header's account of the engine threads: the budget, who reads it, torch's threads."""
    return {**budget.to_json(), "oversubscribed": budget.oversubscribed, "line": budget.describe(),
            "adapter_reads": "threads" in engine.adapter.OPTIONS, "torch_threads": torch_threads}


class FailFast(Exception):
    """Raised by the report hook at the first FAIL under --fail-fast."""


FAST_FLAGS = {"tp": "--tp", "batch_invariant": "--batch-invariant", "dtype": "--dtype", "graphs": "--graphs"}
SERVER_FLAGS = {"base_url": "--base-url", "served_model": "--served-model"}


def engine_options(args) -> EngineOptions:
    """The engine options the command line gives (--dtype, --graphs, --batch-invariant, --tp, --base-url,
    --served-model) and the run's thread budget (args.thread_budget, set by main or a --jobs worker)."""
    return EngineOptions(dtype=getattr(torch, args.dtype) if args.dtype else None, graphs=args.graphs,
                         batch_invariant=args.batch_invariant, tp=args.tp, base_url=args.base_url or None,
                         served_model=args.served_model or None, threads=getattr(args, "thread_budget", None))


def configured_engine(args) -> Engine:
    """The --engine adapter with the command line's options; a ValueError naming the flags it does not take."""
    cls = adapters.resolve(args.engine)
    options = engine_options(args)
    unread = [f for f in options.set_fields() if f not in cls.OPTIONS]
    for flags, only in ((FAST_FLAGS, "the fastpath engine only"),
                        (SERVER_FLAGS, "a server engine (--engine openai) only")):
        bad = [flags[f] for f in unread if f in flags]
        if bad and not any(f in cls.OPTIONS for f in flags):
            raise ValueError(f"{' / '.join(flags.values())} apply to {only}")
        if bad:
            raise ValueError(f"{bad[0]}: --engine {args.engine} does not take it (it takes "
                             f"{', '.join(FAST_FLAGS.get(f) or SERVER_FLAGS.get(f) or f for f in cls.OPTIONS)})")
    engine = Engine(cls, options)
    problem = engine.problem()          # the adapter's own refusal (e.g. a bad $HQ_LLAMACPP_THREADS)
    if problem:
        raise ValueError(problem)
    return engine


def build_plan(args, engine: Engine | None = None) -> list[tuple[Path, list[str] | None, list[Path] | None,
                                                                  str | None]]:
    """(model folder, scenario names or None = all, trace files or None, configuration or None = the default) per
    entry, from the arguments; the main job adds the engine's declared configurations
    (tools/qualify/configurations.py)."""
    engine = engine or Engine(adapters.FastpathAdapter)
    main_job = not (args.trace or args.model)
    if args.trace:
        base = [(args.model or DEFAULT_MODEL, None, list(args.trace))]
    elif args.model:
        base = [(args.model, args.scenario, None)]
    elif engine.plan_models():          # the engine's own default plan: each of its models' whole corpus
        base = [(goldens.MODELS / m, None, None) for m in engine.plan_models()]
    else:
        base = scenarios.main_job_plan()
    names = configs.chosen(getattr(args, "configuration", None), engine, main_job)
    return configs.plan(base, names, engine, main_job)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """qualify's arguments (hybridqual.qualify.arguments), with this module's usage as the help text."""
    return arguments.parse_args(argv, __doc__)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = argument_problem(args, check_out=int(os.environ.get("RANK", "0")) == 0)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if args.tp < 1 or (args.tp > 1 and int(os.environ.get("WORLD_SIZE", "1")) != args.tp):
        print(f"--tp {args.tp}: needs torchrun --nproc_per_node {args.tp} (WORLD_SIZE="
              f"{os.environ.get('WORLD_SIZE', 'unset')})", file=sys.stderr)
        return 2
    rank0 = int(os.environ.get("RANK", "0")) == 0
    os.environ["HYBRIDQUAL_QUALIFY_OUT"] = str(args.out)    # where an engine keeps its own files (a server's log)
    if not rank0:   # every rank runs the same instances; only rank 0 reports
        sys.stdout = open(os.devnull, "w")
    for m in ([args.model] if args.model else []):
        if not (m / "config.json").exists():
            print(f"--model {m}: no config.json there", file=sys.stderr)
            return 2
    if args.scenario and not args.model:
        print("--scenario needs --model (the default plan names its own scenarios)", file=sys.stderr)
        return 2
    problem = resolve_jobs(args)
    if not problem:
        args.thread_budget = thread_budget(args)
    problem = problem or prepare_device(args.device)
    problem = problem or oracle_device_problem(args.oracle_device)
    try:
        engine = configured_engine(args)
        problem = problem or configs.problem(args.configuration, engine)
    except ValueError as e:
        problem = problem or str(e)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if args.isolate is None:        # an engine from outside the project runs where its death cannot end the run
        args.isolate = ":" in args.engine and args.tp == 1
    return run(args, engine, rank0)


class Aborted(BaseException):
    """SIGTERM (or another stop signal) while the run was under way: the report is finalised as aborted."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name} received")


class InstanceTimeout(BaseException):
    """An in-process instance ran past --timeout (raised by the alarm; not an Exception, so no check catches it)."""


def _raise_aborted(signum, frame):
    raise Aborted(signum)


def _stop_signals(handler):
    """Install `handler` for SIGTERM (main thread only); returns what to restore."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    old = {}
    for sig in (signal.SIGTERM,):
        old[sig] = signal.signal(sig, handler)
    return old


def run(args, engine: Engine, rank0: bool) -> int:
    """Run the plan, reporting as it goes; the exit code."""
    caps = engine.capabilities(args.device)
    args.granularities = engine_granularities(args, engine)
    args.step_rule = engine_rule(args, engine)
    args.greedy_only = "seeded" not in caps.sampling_kinds        # seeded scenarios run in their greedy form
    tau = args.tau if args.tau is not None else tau_for(caps.compute_dtype)
    tau_source = "--tau" if args.tau is not None else \
        f"compare.TAU for the engine's compute dtype {dtype_name(caps.compute_dtype)}"
    try:
        plan = build_plan(args, engine)
    except scenarios.ScenarioError as e:          # a declared configuration whose reach is not in the corpus
        print(f"the engine's configurations: {e}", file=sys.stderr)
        return 2
    budget = args.thread_budget = getattr(args, "thread_budget", None) or thread_budget(args)
    torch_before = torch.get_num_threads()
    in_workers = args.jobs > 1 or bool(args.isolate)
    torch_threads = budget.threads if in_workers else serial_torch_threads(budget, torch_before)
    header = {"engine": args.engine, "device": args.device, "modes": args.mode,
              "models": list(dict.fromkeys(str(m) for m, *_ in plan)), "tau": tau, "tau_source": tau_source,
              "configurations": list(dict.fromkeys(c or configs.DEFAULT for *_, c in plan)),
              "capabilities": {k: str(v) for k, v in asdict(caps).items()}, "versions": versions(engine),
              "jobs": args.jobs, "piece_granularities": list(args.granularities),
              "step_rule": args.step_rule.describe() if args.step_rule is not None else None,
              "engine_threads": threads_header(budget, engine, torch_threads)}
    report = Report(args.out if rank0 else None, header)
    progress = Progress(args.quiet)
    print(f"hybridqual qualify: engine={args.engine} ({header['versions']['engine']}) device={args.device} "
          f"modes={','.join(args.mode)} τ={tau:g} [{tau_source}]" + (f" tp={args.tp}" if args.tp > 1 else "")
          + (" batch-invariant" if args.batch_invariant else "")
          + f"; engine threads: {budget.describe()}, torch {torch_threads} per {'worker' if in_workers else 'process'}"
          + ("" if header["engine_threads"]["adapter_reads"] else " (the adapter does not read them)"), flush=True)
    def on_check(c: Check) -> None:
        report.add(c)
        if args.quiet and c.status == "FAIL":       # no progress line names the instance: this line does
            print(f"    FAIL  {c.trace}: {c.name}: {c.detail}", flush=True)
        if args.fail_fast and c.status == "FAIL":
            raise FailFast(f"{c.trace}: {c.name}")
    counters = {"ran": 0, "skipped": 0, "families": set()}
    restore = _stop_signals(_raise_aborted)
    torch.set_num_threads(torch_before if in_workers else torch_threads)   # workers set their own (jobs.py)
    try:
        code = run_plan(args, plan, engine, tau, report, progress, on_check, counters)
    except FailFast as stop:
        report.header["stopped"] = f"--fail-fast: stopped at the first FAIL ({stop}); later checks did not run"
        print(report.header["stopped"], flush=True)
        code = None
    except KeyboardInterrupt:
        return aborted(report, "SIGINT (interrupted)", 130)
    except Aborted as e:
        return aborted(report, str(e), 128 + e.signum)
    except SystemExit as e:
        aborted(report, f"exit with code {e.code!r} inside qualify", None)
        raise
    except BaseException as e:
        aborted(report, f"{type(e).__name__}: {e}", None)
        raise
    finally:
        for sig, h in restore.items():
            signal.signal(sig, h)
        torch.set_num_threads(torch_before)
    if code is not None:           # bad input found on the way (a step's exit): the report says so
        report.abort(f"bad input (exit {code})")
        return code
    counts = report.finish()
    if not rank0:
        return 0 if counts["passed"] and not counts["failed"] else 1
    total = sum(counts.values())
    print(f"{counts['passed']}/{total} checks passed, {counts['failed']} failed, {counts['skipped']} skipped "
          f"({total - counts['skipped']} of {total} ran); {counters['ran']} instances ran, {counters['skipped']} "
          f"skipped; families: {', '.join(sorted(counters['families'])) or 'none'}; {time.time() - report.t0:.0f} s"
          + (" (stopped early: --fail-fast)" if "stopped" in report.header else "")
          + f"; report in {args.out}/report.json and junit.xml")
    bad = counts["failed"] or not counts["passed"] or (args.strict and counts["skipped"])
    return 1 if bad else 0


def aborted(report: Report, why: str, code: int | None) -> int | None:
    """Finalise the report as aborted (status "aborted: <why>") and say so; the exit code to return."""
    report.abort(why)
    print(f"qualify aborted: {why}; report in {report.out}/report.json (status aborted, {len(report.checks)} checks "
          "recorded)", file=sys.stderr, flush=True)
    return code


def run_instance(args, engine: Engine, tau, step: RunInstance, progress: Progress, on_instance,
                 on_check) -> tuple[bool, str]:
    """One instance: its truth, then every check; (it ran — not skipped —, its family). `engine` is already the
    configuration's (configurations.Engines); the step's spec names the configuration in the report."""
    model_dir, inst, oracle_model, configuration = step.model_dir, step.inst, step.oracle_model, step.spec.configuration
    progress.say(f"[{model_dir.name} {step.spec.i}/{step.spec.n}] {inst.scenario} ({inst.family})"
                 + (f" [configuration {configuration}]" if configuration else ""))
    info = {"model": str(model_dir), "scenario": inst.scenario, "family": inst.family,
            "skip_reason": inst.skip_reason, "concrete": inst.concrete,
            **({"configuration": configuration} if configuration else {})}
    truth = None
    if inst.trace is not None:
        truth = truth_for(model_dir, inst, oracle_model)
        info["truth"] = truth.source
        progress.say(f"  truth: {truth.source}")
        if truth.golden_rejected and progress.quiet:      # said even under --quiet: the goldens are broken
            print(f"  [{model_dir.name}/{inst.scenario}] {truth.golden_rejected}; truth recomputed from the "
                  "oracle", file=sys.stderr, flush=True)
    on_instance(info)
    if args.tau is None:        # a configuration that declares another precision is judged with its τ (DESIGN §20)
        tau = tau_for(engine.capabilities(args.device).compute_dtype)
    checks = check_instance(engine, model_dir, inst, args.mode, oracle_model, args.device, tau,
                            progress, on_check, truth, step.label)
    return not (inst.trace is None or all(c.skipped for c in checks)), inst.family


def count(counters: dict, ran: bool, family: str) -> None:
    """One finished instance in the summary's counters."""
    if ran:
        counters["ran"] += 1
        counters["families"].add(family)
    else:
        counters["skipped"] += 1


def run_plan(args, plan, engine: Engine, tau, report: Report, progress: Progress, on_check,
             counters: dict) -> int | None:
    """Every (model, instance) of the plan through check_instance, in this process or (--jobs > 1) in worker
    processes (tools/qualify/jobs.py, same order); None when done, an exit code on bad input."""
    if args.jobs > 1 or args.isolate:
        from hybridqual.qualify.jobs import run_parallel
        return run_parallel(args, plan_steps(args, plan), report, progress, on_check, counters, count, cpu_cores())
    engine_for = configs.Engines(engine)
    for step in plan_steps(args, plan):
        if not isinstance(step, RunInstance):
            code = apply_step(step, report, progress, on_check)
            if code is not None:
                return code
            continue
        try:
            with deadline(args.timeout):
                count(counters, *run_instance(args, engine_for(step.spec.configuration), tau, step, progress,
                                              report.instance, on_check))
        except InstanceTimeout:
            c = timeout_check(step.label, args.timeout, "stopped by an alarm in this process")
            progress.check(c)
            on_check(c)
            count(counters, True, step.inst.family)
    return None


def timeout_check(label: str, seconds: float, how: str) -> Check:
    """The FAIL line of an instance that ran past --timeout."""
    return Check.of(label, "instance finishes within --timeout", False,
                    f"the engine did not finish the instance within {seconds:g} s (--timeout); {how}")


class deadline:
    """`with deadline(s):` raises InstanceTimeout in this (main) thread after s seconds (SIGALRM; a no-op off the
    main thread or without setitimer). Python-level hangs are interrupted; a hang inside C code is not (run the
    instance in a worker process, --isolate, for those)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.armed = (hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
                      and math.isfinite(seconds) and seconds > 0)

    def _fire(self, signum, frame):
        raise InstanceTimeout()

    def __enter__(self):
        if self.armed:
            self.old = signal.signal(signal.SIGALRM, self._fire)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, *exc):
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.old)
        return False


def finish_distributed() -> None:
    """Under torchrun: wait for every rank, then tear the process group down (a rank exiting while gloo's threads
    still run aborts the process)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        rc = main()
    finally:
        finish_distributed()
    sys.exit(rc)
