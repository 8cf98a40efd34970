"""python -m hybridqual.mutants [--only NAME ...] [--quick] [--jobs N] [--list]: run the bug zoo, print the kill table.

    python -m hybridqual.mutants --blind [--only ...] [--jobs N] [--budget-s S] [--rotate K [--rotate-index I]]
                                    [--stages qualify pytest] [--models M ...] [--no-control]

--blind judges every mutant without its named tests (tools/mutants/blind.py): the qualify main job and qualify
over every shipped model's corpus, then the whole CPU tier; first failing stage kills. Named and blind verdicts
are kept in out/mutants/{named,blind}.json so each table can show the other's verdict.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from hybridqual.mutants.runner import ROOT, run_one
from hybridqual.mutants.zoo import MUTANTS, QUICK

RESULTS = ROOT / "out" / "mutants"


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def load_results(kind: str) -> dict[str, dict]:
    """Recorded verdicts per mutant of `kind` ("named" | "blind"); empty when none were recorded."""
    try:
        return json.loads((RESULTS / f"{kind}.json").read_text())
    except (OSError, ValueError):
        return {}


def save_results(kind: str, rows: dict[str, dict]) -> None:
    """Merge this run's verdicts into out/mutants/<kind>.json (the newest verdict per mutant wins)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    merged = {**load_results(kind), **rows}
    tmp = RESULTS / f".{kind}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(merged, indent=1, sort_keys=True))
    os.replace(tmp, RESULTS / f"{kind}.json")        # never a half-written file for a concurrent run to read


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m hybridqual.mutants", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", help="run only these mutants")
    ap.add_argument("--quick", action="store_true", help="the CI subset")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--gpu", action="store_true", help="also run GPU-only mutants (needs CUDA)")
    ap.add_argument("--list", action="store_true", help="list the zoo and exit")
    ap.add_argument("--markdown", action="store_true", help="print the zoo as a markdown table and exit")
    ap.add_argument("--blind", action="store_true", help="judge without the named tests (qualify, then CPU tier)")
    ap.add_argument("--stages", nargs="+", default=["qualify", "pytest"],
                    choices=["qualify", "qualify-main", "qualify-tp", "qualify-main-gpu", "qualify-main-cuda-fp32", "pytest",
                             "pytest-gpu"],
                    help="blind stages: qualify (main job + every model's corpus), qualify-main (main job only), "
                         "qualify-tp (the main job on the TP=2 fast path, two gloo ranks), "
                         "qualify-main-gpu (the main job on cuda with CUDA graphs, compiled kernels), "
                         "qualify-main-cuda-fp32 (the main job on cuda in fp32: the CPU main job's constants), "
                         "pytest (the whole CPU tier), pytest-gpu (the gpu tier, compiled kernels: "
                         "GPU-only mutants, with --gpu)")
    ap.add_argument("--models", nargs="+", help="blind: shipped models whose corpus qualify runs (default: all)")
    ap.add_argument("--pytest-jobs", type=int, default=2, help="blind: xdist workers of the CPU-tier stage")
    ap.add_argument("--rotate", type=int, metavar="K", help="blind: judge a rotating window of K mutants (CI)")
    ap.add_argument("--rotate-index", type=int, metavar="I", help="the window (default: days since 1970-01-01)")
    ap.add_argument("--budget-s", type=float, help="blind: judge the rotating window of mutants whose estimated cost "
                                                   "fits S seconds (without --rotate), and start none after S "
                                                   "seconds (the rest SKIPPED)")
    ap.add_argument("--start-by", type=float, metavar="S",
                    help="blind: start no mutant after S seconds (the rest SKIPPED, not counted); unlike --budget-s "
                         "it chooses no window (a machine's time limit with --only or the whole zoo)")
    ap.add_argument("--stage-timeout", type=int, default=3600, help="blind: seconds per stage before it is a CRASH")
    ap.add_argument("--report", action="store_true",
                    help="blind: judge nothing; print the recorded blind verdict of every chosen mutant "
                         "(out/mutants/blind.json: status, stage, time, commit, date) and the kill rate over them")
    ap.add_argument("--every-stage", action="store_true",
                    help="blind: run every stage even after one killed the mutant, so the table says separately "
                         "whether qualify's default plan alone (column main) and the CPU tier (column tier) kill it")
    ap.add_argument("--no-control", action="store_true",
                    help="blind: skip the unmutated control run (which must survive every stage)")
    return ap.parse_args(argv)


@contextlib.contextmanager
def _threads_per_judgement(jobs: int):
    """With jobs > 1 and OMP_NUM_THREADS unset: each judgement's subprocesses get cores / jobs torch threads (the
    jobs share the cores; docs/qualification.md), unset again afterwards."""
    if jobs <= 1 or "OMP_NUM_THREADS" in os.environ:
        yield
        return
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:      # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(max(1, cores // jobs))
    print(f"blind: OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} per judgement ({cores} cores, --jobs {jobs})",
          flush=True)
    try:
        yield
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)


def run_blind(args: argparse.Namespace, chosen: list) -> int:
    """--blind: judge `chosen` (or its rotating window) stage by stage; print verdicts next to the named ones."""
    from hybridqual.mutants.blind import (DEFAULT_MUTANT_S, KILLED, SKIPPED, BlindOutcome, budget_window,
                                          default_stages, estimated_seconds, judge, junit_of, rotation, stage_column,
                                          stage_verdicts, stop_all)

    def stopped(signum, _frame):                      # SIGTERM (CI timeout, kill PID): take the stages down too
        stop_all()
        os._exit(128 + signum)
    signal.signal(signal.SIGTERM, stopped)
    if args.rotate is not None:
        chosen = rotation(chosen, args.rotate, args.rotate_index)
    elif args.budget_s is not None:                 # the rotating window whose estimated cost fits the budget
        recorded = load_results("blind")
        chosen = budget_window(chosen, args.budget_s, args.jobs, recorded, args.rotate_index)
        est = sum(estimated_seconds(m, recorded) for m in chosen) / max(1, args.jobs)
        print(f"blind: --budget-s {args.budget_s:g}: window of {len(chosen)} mutants, estimated {est:.0f} s wall "
              f"(recorded blind times, else {DEFAULT_MUTANT_S:.0f} s each; the control run is not counted: "
              "--no-control in CI)", flush=True)
    stages = [dataclasses.replace(s, timeout=args.stage_timeout)
              for s in default_stages(tuple(args.stages), args.models, args.pytest_jobs)]
    named = load_results("named")
    day, commit, t0 = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), _commit(), time.time()
    print(f"blind: {len(chosen)} mutants, stages: {' -> '.join(s.name for s in stages)}; --jobs {args.jobs}; "
          f"commit {commit}, {day}", flush=True)
    print(f"{'mutant':36s} {'named':9s} {'blind':9s} {'main':9s} {'tier':9s} {'time':>6s}  stage: detail", flush=True)

    def one(m):
        if m is None:
            return judge(None, stages, every_stage=args.every_stage)
        if args.budget_s is not None and time.time() - t0 > args.budget_s:
            return BlindOutcome(m.name, SKIPPED, "", f"not started: --budget-s {args.budget_s:g} spent", 0.0)
        if args.start_by is not None and time.time() - t0 > args.start_by:
            return BlindOutcome(m.name, SKIPPED, "", f"not started: --start-by {args.start_by:g} passed", 0.0)
        return judge(m, stages, every_stage=args.every_stage)
    jobs = ([None] if not args.no_control else []) + list(chosen)
    outcomes, control = [], None
    with _threads_per_judgement(args.jobs), ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(one, m): m for m in jobs}
        for fut in as_completed(futures):                 # printed (and kept) as each verdict comes
            m, o = futures[fut], fut.result()
            if m is None:
                control = o
            else:
                outcomes.append(o)
            nv = named.get(o.name, {}).get("status", "-") if m is not None else "-"
            print(f"{o.name:36s} {nv:9s} {o.status:9s} {stage_column(o, 'main'):9s} {stage_column(o, 'tier'):9s} "
                  f"{o.seconds:5.0f}s  {o.stage or '-'}: {o.detail[:160]}", flush=True)
            if m is not None and o.status != SKIPPED:        # kept as it comes: a run cut short keeps its verdicts
                save_results("blind", {o.name: {"status": o.status, "stage": o.stage, "detail": o.detail[:300],
                                                "seconds": round(o.seconds), "date": day, "commit": commit,
                                                "stages": [s.name for s in stages], "by_stage": stage_verdicts(o)}})
    judged = [o for o in outcomes if o.status != SKIPPED]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "blind-junit.xml").write_text(junit_of(judged))
    killed = sum(o.status == KILLED for o in judged)
    known = [named[o.name]["status"] for o in judged if o.name in named]
    counts = {s: sum(o.status == s for o in outcomes) for s in ("KILLED", "SURVIVED", "INVALID", "CRASH", "STALE",
                                                               "SKIPPED")}
    by_stage: dict[str, int] = {}
    for o in judged:
        if o.status == KILLED:
            by_stage[o.stage] = by_stage.get(o.stage, 0) + 1
    for kind, what in (("main", "qualify's default plan alone"), ("tier", "the CPU tier")):
        ran = [stage_column(o, kind) for o in judged if stage_column(o, kind) != "-"]
        if ran:
            print(f"{what}: {ran.count(KILLED)}/{len(ran)} killed (of the mutants that stage judged)")
    print(f"blind kill rate: {killed}/{len(judged)} = {100 * killed / max(1, len(judged)):.0f}% | named kill rate "
          f"(same mutants, recorded): {sum(s == 'KILLED' for s in known)}/{len(known)} | "
          + ", ".join(f"{k} {v}" for k, v in counts.items()) + " | killed by stage: "
          + (", ".join(f"{k} {v}" for k, v in by_stage.items()) or "none")
          + f" | {time.time() - t0:.0f} s wall")
    if control is not None and control.status != "SURVIVED":
        print(f"CONTROL FAILED: the unmutated tree is {control.status} at {control.stage}: {control.detail} — "
              "no blind verdict above means anything until it passes", file=sys.stderr)
        return 1
    return 0 if judged and killed == len(judged) else 1


def report_blind(chosen: list) -> int:
    """--blind --report: the recorded blind verdicts of `chosen` in zoo order, each with the commit and date it was
    judged at (runs at several commits add up here; a mutant never judged is UNJUDGED and not a kill)."""
    rec = load_results("blind")
    from hybridqual.mutants.blind import stage_column
    print(f"{'mutant':40s} {'blind':9s} {'main':9s} {'tier':9s} {'time':>6s} {'commit':8s} {'date (UTC)':17s} "
          "stage: detail")
    counts: dict[str, int] = {}
    for m in chosen:
        r = rec.get(m.name, {})
        st = r.get("status", "UNJUDGED")
        counts[st] = counts.get(st, 0) + 1
        print(f"{m.name:40s} {st:9s} {stage_column(r, 'main'):9s} {stage_column(r, 'tier'):9s} "
              f"{r.get('seconds', 0):5.0f}s {r.get('commit', '-'):8s} {r.get('date', '-'):17s} "
              f"{r.get('stage') or '-'}: {str(r.get('detail', ''))[:120]}")
    killed = counts.get("KILLED", 0)
    commits = sorted({rec[m.name].get("commit", "?") for m in chosen if m.name in rec})
    print(f"recorded blind kill rate: {killed}/{len(chosen)} = {100 * killed / max(1, len(chosen)):.0f}% | "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + f" | judged at commits {', '.join(commits)}")
    return 0 if chosen and killed == len(chosen) else 1


def argument_problem(args: argparse.Namespace) -> str | None:
    """The first bad value among the counts, times and names (one line naming the flag), or None; no work done."""
    names = {m.name for m in MUTANTS}
    unknown = [n for n in args.only or [] if n not in names]
    if unknown:
        return f"--only {unknown[0]}: no such mutant (known: {', '.join(sorted(names))})"
    for flag, value, low in (("--jobs", args.jobs, 1), ("--pytest-jobs", args.pytest_jobs, 1),
                             ("--rotate", args.rotate, 1), ("--rotate-index", args.rotate_index, 0),
                             ("--stage-timeout", args.stage_timeout, 1)):
        if value is not None and value < low:
            return f"{flag} {value}: must be at least {low}"
    for flag, value in (("--budget-s", args.budget_s), ("--start-by", args.start_by)):
        if value is not None and not (value > 0 and value != float("inf")):
            return f"{flag} {value}: must be a finite number of seconds > 0"
    from hybridqual.mutants.blind import shipped_models
    shipped = shipped_models()
    bad = [m for m in args.models or [] if m not in shipped]
    if bad:
        return f"--models {bad[0]}: not a shipped model (known: {', '.join(shipped)})"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = argument_problem(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    chosen = [m for m in MUTANTS if (not args.only or m.name in args.only) and (not args.quick or m.name in QUICK)
              and (args.gpu or not m.gpu_only)]
    if args.only:                                   # in the order asked for (most interesting first)
        chosen.sort(key=lambda m: args.only.index(m.name))
    if args.markdown:
        print("| mutant | class | story | file | expected killer(s) |\n|---|---|---|---|---|")
        for m in MUTANTS:
            tests = ", ".join(t.replace("tests/", "").replace(".py::", "::") for t in m.tests)
            gpu = " (gpu only)" if m.gpu_only else ""
            print(f"| `{m.name}`{gpu} | {m.bug_class} | {m.story} | {m.file} | {tests} |")
        return 0
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:34s} {m.bug_class:22s} {'gpu ' if m.gpu_only else ''}{m.story}")
        return 0
    if args.blind and args.report:
        return report_blind(chosen)
    if args.blind:
        return run_blind(args, chosen)
    print(f"{'mutant':34s} {'class':22s} {'status':9s} {'time':>6s}  killed by")
    outcomes, t0 = [], time.time()
    day, commit = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), _commit()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for o in pool.map(run_one, chosen):
            outcomes.append(o)
            print(f"{o.mutant.name:34s} {o.mutant.bug_class:22s} {o.status:9s} {o.seconds:5.0f}s  {o.killed_by}",
                  flush=True)
            save_results("named", {o.mutant.name: {"status": o.status, "by": o.killed_by, "seconds": round(o.seconds),
                                                   "date": day, "commit": commit}})
    killed = sum(o.status == "KILLED" for o in outcomes)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("KILLED", "SURVIVED", "CRASH", "STALE")}
    print(f"kill rate: {killed}/{len(outcomes)} = {100 * killed / max(1, len(outcomes)):.0f}%"
          f" (crashes and stale patches do not count as kills) | "
          + ", ".join(f"{k} {v}" for k, v in counts.items())
          + f" | {time.time() - t0:.0f} s wall, --jobs {args.jobs}")
    return 0 if outcomes and killed == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
