"""Blind judgement of a mutant: no named tests, only what the suite runs anyway.

Stage 1 is the qualification main job (`python -m hybridqual.qualify`, its default plan) and then qualify over every
shipped model's whole scenario corpus (`--model M`); stage 2 is the whole CPU tier (`pytest -x -q -n 2`, default
markers, cheapest test files first: tools/mutants/cheap_first.py). Each runs as a subprocess in the mutant's
temporary copy of the tree with TRITON_INTERPRET=1, and the
first stage that FAILS kills the mutant. What is not a kill: a patch that does not compile or import, or whose
first failure is a NameError/ImportError/SyntaxError raised by the patched code (INVALID); a harness that dies
without reporting a failed check, or runs past its time limit (CRASH for that stage; the next stage still runs).
An engine that crashes on a trace IS a kill at qualify level: qualify reports it as a failed check.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from hybridqual.mutants.runner import CRASH_TYPES, ROOT, Mutant, NotRun, classify, mutated_copy

MODELS = ROOT / "goldens" / "models"
KILLED, SURVIVED, INVALID, CRASH, STALE, SKIPPED = "KILLED", "SURVIVED", "INVALID", "CRASH", "STALE", "SKIPPED"


@dataclass(frozen=True)
class Stage:
    """One blind stage: a qualify run (argv after `python -m hybridqual.qualify`) or the CPU tier (kind "pytest")."""
    name: str
    kind: str                               # "qualify" | "pytest"
    argv: tuple[str, ...] = ()
    timeout: int = 3600
    interpret: bool = True                  # TRITON_INTERPRET=1 (the CPU tier); False: compiled kernels (gpu tier)
    ranks: int = 1                          # > 1: qualify under torch.distributed.run with this many processes


@dataclass
class StageResult:
    """What one stage said: FAIL (a check saw the defect), PASS, INVALID, CRASH (harness died / timed out)."""
    stage: str
    status: str
    detail: str
    seconds: float


@dataclass
class BlindOutcome:
    """A mutant's blind verdict, the stage that killed it (if any) and every stage's result."""
    name: str
    status: str
    stage: str
    detail: str
    seconds: float
    stages: list[StageResult] = field(default_factory=list)


def shipped_models() -> list[str]:
    """Names of the shipped models (goldens/models/*/config.json)."""
    return sorted(p.parent.name for p in MODELS.glob("*/config.json"))


GPU_MAIN = "qualify --device cuda --graphs"     # the main job's stage on a GPU (its verdict is the "main" column too)
GPU_MAIN_FP32 = "qualify --device cuda --dtype float32"   # the CPU main job's plan and fp32 constants, compiled kernels


def default_stages(which: tuple[str, ...] = ("qualify", "pytest"), models: list[str] | None = None,
                   jobs: int = 2) -> list[Stage]:
    """`qualify-main` = the main job's default plan; `qualify` = that, then every shipped model's corpus;
    `qualify-main-gpu` = the main job on cuda with CUDA graphs (the paths only a GPU runs: graphs' pad rows, the
    one-row GEMV epilogues); `qualify-main-cuda-fp32` = the main job on cuda in fp32 (the CPU main job's dtype and
    constants, compiled kernels: the whole zoo judged in minutes); `pytest` = the whole CPU tier."""
    out: list[Stage] = []
    if "qualify" in which or "qualify-main" in which:
        out.append(Stage("qualify", "qualify"))
    if "qualify-tp" in which:            # the main job on the TP fast path: two gloo ranks (docs/tp.md)
        out.append(Stage("qualify --tp 2", "qualify", ("--tp", "2"), ranks=2))
    if "qualify-main-cuda-fp32" in which:
        out.append(Stage(GPU_MAIN_FP32, "qualify", ("--device", "cuda", "--dtype", "float32"), interpret=False))
    if "qualify-main-gpu" in which:      # the main job as a GPU user runs it: compiled kernels, bf16, CUDA graphs
        out.append(Stage(GPU_MAIN, "qualify", ("--device", "cuda", "--graphs"), interpret=False))
    if "qualify" in which:
        out += [Stage(f"qualify --model {m}", "qualify", ("--model", f"goldens/models/{m}"))
                for m in (models if models is not None else shipped_models())]
    if "pytest" in which:
        out.append(Stage("pytest", "pytest", ("-x", "-q", "-n", str(jobs))))
    if "pytest-gpu" in which:            # the gpu tier (needs CUDA): how GPU-only mutants are judged blind
        out.append(Stage("pytest -m gpu", "pytest", ("-x", "-q", "-m", "gpu", "-p", "no:xdist"), interpret=False))
    return out


def _invalid(detail: str) -> bool:
    """A failure raised by the patch itself (bad name, import, syntax), not by a check that saw a defect:
    qualify's engine-crash line starts `NameError: ...`, the runner's crash note ends `(NameError)`."""
    return any(detail.startswith(t + ":") or f"({t}" in detail for t in CRASH_TYPES)


def _failed_checks(report: Path) -> tuple[list[dict], dict | None]:
    """(failed checks, the whole report) from qualify's report.json (empty while it does not exist yet)."""
    try:
        body = json.loads(report.read_text())
    except (OSError, ValueError):
        return [], None
    bad = [c for c in body.get("checks", []) if c.get("status") == "FAIL" or c.get("ok") is False]
    return bad, body


LIVE: set[subprocess.Popen] = set()        # stages running now (each in its own process group)
COPIES: set[str] = set()                   # temporary trees in use


def stop_all() -> None:
    """Stop every stage still running and remove the copies (a blind run that is itself being stopped must not
    leave them behind)."""
    for proc in list(LIVE):
        _stop(proc)
    for tmp in list(COPIES):
        shutil.rmtree(tmp, ignore_errors=True)


def _stop(proc: subprocess.Popen) -> None:
    """Stop a stage we started (its own process group) and reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def run_qualify(stage: Stage, tree: Path, env: dict[str, str], work: Path) -> StageResult:
    """Run qualify in the copy with --fail-fast: it stops at its first failed check — that is the kill — and exits
    1 (the report's "stopped" says where); a FAIL line seen in report.json before that also stops it."""
    out = work / ("q-" + stage.name.replace(" ", "_").replace("/", "_"))
    log = work / (out.name + ".log")
    launch = ["-m", "torch.distributed.run", "--nproc_per_node", str(stage.ranks)] if stage.ranks > 1 else []
    cmd = [sys.executable, *launch, "-m", "hybridqual.qualify", "--quiet", "--fail-fast", "--out", str(out),
           *stage.argv]
    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        LIVE.add(proc)
        try:
            while proc.poll() is None:
                if time.time() - t0 > stage.timeout:
                    _stop(proc)
                    return StageResult(stage.name, CRASH, f"timeout after {stage.timeout} s", time.time() - t0)
                if _failed_checks(out / "report.json")[0]:
                    _stop(proc)            # the first FAIL is the verdict; the rest of the run is not needed
                    break
                time.sleep(1)
        finally:
            _stop(proc)
            LIVE.discard(proc)
    bad, body = _failed_checks(out / "report.json")
    took = time.time() - t0
    if bad:
        c = bad[0]
        detail = f"{c.get('trace')}: {c.get('name')}: {c.get('detail', '')}"[:400]
        return StageResult(stage.name, INVALID if _invalid(c.get("detail", "")) else "FAIL", detail, took)
    tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])[-300:]
    if proc.returncode == 0 and body is not None and body.get("passed", 0) > 0:
        return StageResult(stage.name, "PASS", f"{body.get('passed')} checks passed", took)
    return StageResult(stage.name, CRASH, f"qualify exit {proc.returncode} without a failed check: {tail}", took)


def run_pytest(stage: Stage, tree: Path, env: dict[str, str], work: Path) -> StageResult:
    """The whole CPU tier in the copy (default markers; not the zoo's own tests, which would recurse)."""
    junit = work / "blind-junit.xml"
    cmd = [sys.executable, "-m", "pytest", *stage.argv, "-p", "no:cacheprovider", "-p", "hybridqual.mutants.no_shrink",
           "-p", "hybridqual.mutants.cheap_first", "--ignore=tests/test_mutants.py", f"--junitxml={junit}"]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    LIVE.add(proc)
    try:
        proc.wait(timeout=stage.timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        return StageResult(stage.name, CRASH, f"timeout after {stage.timeout} s", time.time() - t0)
    finally:
        LIVE.discard(proc)
    status, by = classify(junit, proc.returncode)
    took = time.time() - t0
    if status == "KILLED":
        return StageResult(stage.name, "FAIL", by, took)
    if status == "SURVIVED":
        return StageResult(stage.name, "PASS", "the CPU tier passed", took)
    return StageResult(stage.name, INVALID if _invalid(by) else CRASH, by, took)


def judge(m: Mutant | None, stages: list[Stage], name: str | None = None, every_stage: bool = False) -> BlindOutcome:
    """Judge `m` (None: the unmutated control, which must SURVIVE) by `stages` in order. every_stage: run every
    stage even after one killed it, so each stage's own verdict is known (`stage_verdicts`): whether qualify's
    default plan alone kills it — what transfers to an external engine — and, separately, the CPU tier."""
    label = name or (m.name if m is not None else "(control: no mutation)")
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix=copy_prefix(label)) as tmp:
        COPIES.add(tmp)
        try:
            return _judge_copy(m, stages, label, Path(tmp), t0, every_stage)
        finally:
            COPIES.discard(tmp)


def stage_verdicts(o: BlindOutcome) -> dict[str, str]:
    """stage name -> KILLED (it failed a check) / SURVIVED (it passed) / INVALID / CRASH, for the stages that ran."""
    word = {"FAIL": KILLED, "PASS": SURVIVED}
    return {r.stage: word.get(r.status, r.status) for r in o.stages}


def stage_column(o: BlindOutcome | dict, kind: str) -> str:
    """The verdict of the main job (kind "main": the stage named "qualify", or its GPU form) or of the CPU tier (kind "tier": the
    stage named "pytest") of an outcome or a recorded row; "-" where that stage did not run (a kill by an
    earlier stage without --every-stage, or not among --stages)."""
    names = {"main": ("qualify", GPU_MAIN_FP32, GPU_MAIN), "tier": ("pytest",)}[kind]
    got = stage_verdicts(o) if isinstance(o, BlindOutcome) else o.get("by_stage")
    if got is not None:
        return next((got[n] for n in names if n in got), "-")
    return KILLED if o.get("status") == KILLED and o.get("stage") in names else "-"   # older rows: the killer only


def copy_prefix(label: str) -> str:
    """The temporary copy's name prefix: letters, digits, '_', '-' and '.' only. A ':' (os.pathsep) in the path
    splits every PYTHONPATH entry under the copy, so the control's "(control: no mutation)" once made its qualify
    --jobs workers miss tests/ (No module named 'broken_engines') and the control CRASHed (fixed in 69fe09c; docs/journal/qualification.md, History)."""
    return "hq-blind-" + re.sub(r"[^A-Za-z0-9_.-]", "_", label[:40]) + "-"


def _judge_copy(m: Mutant | None, stages: list[Stage], label: str, tmp: Path, t0: float,
                every_stage: bool = False) -> BlindOutcome:
    """judge() inside its temporary directory."""
    try:
        tree, env = mutated_copy(m, Path(tmp))
    except NotRun as e:
        return BlindOutcome(label, e.status, "import" if e.status != STALE else "", e.detail, time.time() - t0)
    results: list[StageResult] = []
    for st in stages:
        st_env = env if st.interpret else {k: v for k, v in env.items() if k != "TRITON_INTERPRET"}
        r = (run_qualify if st.kind == "qualify" else run_pytest)(st, tree, st_env, Path(tmp))
        results.append(r)
        if r.status == INVALID or (r.status == "FAIL" and not every_stage):
            status = KILLED if r.status == "FAIL" else INVALID
            return BlindOutcome(label, status, st.name, r.detail, time.time() - t0, results)
    failed = [r for r in results if r.status == "FAIL"]
    if failed:                                       # every_stage: the first stage that failed is the kill
        return BlindOutcome(label, KILLED, failed[0].stage, failed[0].detail, time.time() - t0, results)
    crashed = [r for r in results if r.status == CRASH]
    status = CRASH if crashed else SURVIVED
    return BlindOutcome(label, status, crashed[0].stage if crashed else "",
                        crashed[0].detail if crashed else "every stage passed", time.time() - t0, results)


def rotation(mutants: list[Mutant], k: int, index: int | None = None) -> list[Mutant]:
    """A deterministic rotating subset of k mutants: window `index` (default: days since 1970-01-01 UTC) of the
    zoo in its listed order, wrapping around, so consecutive CI days judge consecutive windows."""
    if not mutants or k <= 0:
        return []
    k = min(k, len(mutants))
    index = int(time.time() // 86400) if index is None else index
    start = (index * k) % len(mutants)
    return [mutants[(start + i) % len(mutants)] for i in range(k)]


DEFAULT_MUTANT_S = 600.0       # estimated blind cost of a mutant with no recorded time (see budget_window)


def estimated_seconds(m: Mutant, recorded: dict[str, dict], default: float = DEFAULT_MUTANT_S) -> float:
    """A mutant's blind cost: its last recorded blind time (out/mutants/blind.json), else `default`."""
    secs = recorded.get(m.name, {}).get("seconds")
    return float(secs) if isinstance(secs, (int, float)) and secs > 0 else default


def budget_window(mutants: list[Mutant], budget_s: float, jobs: int, recorded: dict[str, dict],
                  index: int | None = None, default: float = DEFAULT_MUTANT_S) -> list[Mutant]:
    """The rotating subset that fits `budget_s` of wall time on `jobs` workers: window `index` (default: days since
    1970-01-01 UTC) of size k = budget × jobs / median estimated cost starts at (index · k) mod N; from there mutants
    are taken in zoo order (wrapping) while the sum of their estimated costs fits budget × jobs. Consecutive
    indices give consecutive windows, so the zoo is covered in about N / k runs."""
    if not mutants or budget_s <= 0:
        return []
    costs = [estimated_seconds(m, recorded, default) for m in mutants]
    room = budget_s * max(1, jobs)
    k = max(1, min(len(mutants), int(room // sorted(costs)[len(costs) // 2])))
    index = int(time.time() // 86400) if index is None else index
    start, out, used = (index * k) % len(mutants), [], 0.0
    for i in range(len(mutants)):
        j = (start + i) % len(mutants)
        if used + costs[j] > room:
            break
        out.append(mutants[j])
        used += costs[j]
    return out


def junit_of(outcomes: list[BlindOutcome]) -> str:
    """JUnit XML of a blind run: a mutant that was not killed is a failure."""
    suite = ET.Element("testsuite", name="hybridqual.mutants.blind", tests=str(len(outcomes)),
                       failures=str(sum(o.status != KILLED for o in outcomes)))
    for o in outcomes:
        case = ET.SubElement(suite, "testcase", classname="blind", name=o.name, time=f"{o.seconds:.1f}")
        if o.status != KILLED:
            ET.SubElement(case, "failure", message=f"{o.status}: {o.detail}"[:500])
    return ET.tostring(suite, encoding="unicode")
