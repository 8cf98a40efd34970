"""The bug zoo stays valid and its CI subset is killed (DESIGN §9).

Every mutant's patch must still apply exactly once to the current tree (cheap; catches a stale zoo after a
refactor), the runner must tell assertion kills from crashes, and every QUICK mutant must be KILLED by an
assertion of the suite when applied to a temporary copy (the full zoo: `python -m hybridqual.mutants --jobs 2`).
The blind judge must count only a failed check as a kill: a patch that does not import is INVALID,
a harness that dies or hangs without a failed check is a CRASH, and a stage stops at its first FAIL.
"""
from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hybridqual.mutants.blind import (CRASH, DEFAULT_MUTANT_S, INVALID, KILLED, SURVIVED, Stage, budget_window,
                                 copy_prefix, judge, rotation, run_qualify)
from hybridqual.mutants.runner import ROOT, Mutant, classify, run_one, stale_hunks
from hybridqual.mutants.zoo import MUTANTS, QUICK


def test_zoo_is_large_named_and_every_patch_applies_exactly_once():
    """≥ 20 mutants with unique names, stories and existing test files; each hunk's find text occurs once."""
    names = [m.name for m in MUTANTS]
    assert len(names) >= 20 and len(set(names)) == len(names)
    assert QUICK <= set(names), f"QUICK names unknown mutants: {sorted(QUICK - set(names))}"
    assert not [m.name for m in MUTANTS if m.name in QUICK and m.gpu_only], "QUICK must run on CPU"
    for m in MUTANTS:
        assert m.story and m.bug_class and m.tests, f"{m.name}: needs a class, a story and tests"
        for t in m.tests:
            assert (ROOT / t.split("::")[0]).exists(), f"{m.name}: test file {t} does not exist"
        assert all(find != replace for _, find, replace in m.hunks()), f"{m.name}: a hunk changes nothing"
        assert stale_hunks(m) == [], f"{m.name} is stale: {stale_hunks(m)}"


def _junit(tmp: Path, body: str) -> Path:
    p = tmp / "junit.xml"
    p.write_text(f'<testsuites><testsuite name="s">{body}</testsuite></testsuites>')
    return p


def test_runner_counts_only_assertion_failures_as_kills(tmp_path):
    """An assert failure is KILLED; an ImportError or a RuntimeError in the mutated code is a CRASH; a pass SURVIVED."""
    case = '<testcase classname="t" name="x"><{tag} message="{msg}">E   {msg}</{tag}></testcase>'
    assert classify(_junit(tmp_path, case.format(tag="failure", msg="AssertionError: tokens differ")), 1)[0] == "KILLED"
    assert classify(_junit(tmp_path, case.format(tag="failure", msg="assert 1 == 2")), 1)[0] == "KILLED"
    assert classify(_junit(tmp_path, case.format(tag="error", msg="ImportError: no module")), 1)[0] == "CRASH"
    assert classify(_junit(tmp_path, case.format(tag="failure", msg="RuntimeError: shape")), 1)[0] == "CRASH"
    assert classify(_junit(tmp_path, '<testcase classname="t" name="x"/>'), 0)[0] == "SURVIVED"


def test_a_stale_patch_is_reported_not_applied(tmp_path):
    """A mutant whose find text is absent is STALE (a defect of the zoo), never silently run unmutated."""
    ghost = Mutant("ghost", "zoo", "anchor vanished", "fastpath/engine/rows.py", "no such line\n", "x\n",
                   ("tests/test_engine_rows.py",))
    assert stale_hunks(ghost)
    assert run_one(ghost).status == "STALE"


def test_quick_mutants_are_killed_by_assertions():
    """The CI subset of the zoo, two at a time: every one KILLED (an assertion of the suite saw the defect)."""
    chosen = [m for m in MUTANTS if m.name in QUICK]
    with ThreadPoolExecutor(max_workers=2) as pool:
        outcomes = list(pool.map(run_one, chosen))
    bad = [f"{o.mutant.name}: {o.status} {o.killed_by}" for o in outcomes if o.status != "KILLED"]
    assert not bad, "mutants not killed: " + "; ".join(bad)


# A stand-in for `python -m hybridqual.qualify` (report.json as the real one writes it), so the blind judge's reading of
# qualify is tested in a second, not in the minutes a real main job takes.
FAKE_QUALIFY = """
import json, os, sys, time
out = sys.argv[sys.argv.index("--out") + 1]
os.makedirs(out, exist_ok=True)
mode = os.environ["FAKE_MODE"]
def report(checks, status="running"):
    json.dump({"status": status, "passed": sum(c["status"] == "PASS" for c in checks), "checks": checks},
              open(os.path.join(out, "report.json"), "w"))
ok = {"trace": "seed_compaction", "name": "legacy: engine runs the trace", "status": "PASS", "detail": ""}
if mode == "crash":
    raise RuntimeError("the harness itself broke")
if mode == "pass":
    report([ok], "finished"); sys.exit(0)
detail = {"fail": "request r1 position 3: oracle token 5 vs engine 7",
          "engine": "RuntimeError: row table invariant broken",
          "nameerror": "NameError: name 'chunk' is not defined"}.get(mode)
if detail:
    report([ok, dict(ok, name="legacy: tokens match the truth", status="FAIL", detail=detail)])
time.sleep(600)                         # the judge must stop us at the first FAIL (or at its timeout)
"""


@pytest.fixture
def fake_tree(tmp_path):
    tree = tmp_path / "tree"          # `python -m hybridqual.qualify` in it runs FAKE_QUALIFY
    (tree / "hybridqual" / "qualify").mkdir(parents=True)
    (tree / "hybridqual" / "__init__.py").write_text("")
    (tree / "hybridqual" / "qualify" / "__init__.py").write_text("")
    (tree / "hybridqual" / "qualify" / "__main__.py").write_text(FAKE_QUALIFY)
    return tree


@pytest.mark.parametrize("mode,status", [("fail", "FAIL"), ("engine", "FAIL"), ("nameerror", INVALID),
                                         ("crash", CRASH), ("pass", "PASS"), ("hang", CRASH)])
def test_blind_qualify_stage_kills_only_on_a_failed_check_and_stops_there(fake_tree, tmp_path, mode, status):
    """A tokens FAIL and an engine crash reported as a FAIL line kill; a NameError from the patch is INVALID; a
    harness that dies without a failed check, or hangs past the stage's limit, is a CRASH; the stage is stopped at
    its first FAIL instead of running the rest of the plan."""
    env = dict(os.environ, PYTHONPATH=str(fake_tree), FAKE_MODE=mode)
    t0 = time.time()
    # only the hang needs the short limit; the others must end on their own (a loaded machine may take seconds)
    r = run_qualify(Stage("qualify", "qualify", (), timeout=4 if mode == "hang" else 120), fake_tree, env, tmp_path)
    assert r.status == status, r
    assert time.time() - t0 < 60, "the stage was not stopped at its first failed check"


def test_blind_patch_that_does_not_import_is_invalid_not_a_kill():
    """A patch with a syntax error never reaches a stage: INVALID, before any qualify or pytest run."""
    broken = Mutant("broken_syntax", "zoo", "a patch that does not parse", "fastpath/engine/rows.py",
                    "        slot = self.free_slots.pop()\n", "        slot = self.free_slots.pop(\n",
                    ("tests/test_engine_rows.py",))
    o = judge(broken, [Stage("never", "qualify", ("--no-such-option",))])
    assert o.status == INVALID and o.stages == [], o


def test_blind_budget_window_fits_the_budget_and_rotates():
    """--budget-s without --rotate: consecutive windows of what fits (recorded times, else the default estimate)."""
    recorded = {m.name: {"seconds": 100} for m in MUTANTS}
    w0, w1 = (budget_window(MUTANTS, 1000, 2, recorded, i) for i in (0, 1))
    assert len(w0) == len(w1) == min(20, len(MUTANTS)) and not set(w0) & set(w1)
    assert MUTANTS.index(w1[0]) == (MUTANTS.index(w0[-1]) + 1) % len(MUTANTS)
    assert len(budget_window(MUTANTS, 2 * DEFAULT_MUTANT_S, 1, {}, 0)) == 2
    recorded[w0[0].name]["seconds"] = 10_000                   # its window's first mutant alone exceeds the budget
    assert budget_window(MUTANTS, 1000, 2, recorded, 0) == []


def test_blind_rotation_is_deterministic_and_covers_the_zoo():
    """Consecutive windows of K are disjoint until they wrap, and ceil(N/K) of them cover every mutant."""
    names = [m.name for m in MUTANTS]
    k = 7
    windows = [[m.name for m in rotation(MUTANTS, k, i)] for i in range(-(-len(names) // k))]
    assert all(len(w) == k for w in windows) and rotation(MUTANTS, k, 3) == rotation(MUTANTS, k, 3)
    assert set().union(*map(set, windows)) == set(names)
    assert windows[0] != windows[1] and not set(windows[0]) & set(windows[1])


@pytest.mark.slow
def test_blind_cheap_mutant_dies_in_the_main_job_without_its_named_tests():
    """One real blind judgement: the QUICK compaction mutant, judged only by qualify on one short trace."""
    m = next(m for m in MUTANTS if m.name == "compact_slot_not_moved")
    stage = Stage("qualify (seed_compaction on tiny-sort)", "qualify",
                  ("--model", "goldens/models/tiny-sort", "--scenario", "seed_compaction", "--mode", "legacy"))
    o = judge(m, [stage])
    assert o.status == KILLED, o
    assert judge(None, [stage]).status == SURVIVED


def test_blind_copies_have_no_path_separator_so_pythonpath_entries_under_them_stay_whole():
    """The control's label "(control: no mutation)" held a ':' (os.pathsep): every PYTHONPATH entry under its copy
    split in two, and its qualify --jobs workers could not import tests/ — a CRASH of the control, not of the tree."""
    for label in ("(control: no mutation)", "pc_block_off_by_one", "a b/c;d:e" * 9):
        prefix = copy_prefix(label)
        assert prefix.startswith("hq-blind-") and os.pathsep not in prefix and "/" not in prefix, prefix
        assert len(prefix) <= len("hq-blind-") + 41
    assert copy_prefix("(control: no mutation)") == "hq-blind-_control__no_mutation_-"


def test_cheap_first_runs_measured_files_by_mean_time_keeping_each_files_tests_together():
    """The blind CPU-tier order: cheapest measured file first, unmeasured files after, a file's tests contiguous
    and in collected order (the same set of tests: only the order changes)."""
    from hybridqual.mutants.cheap_first import TIMES, cheapest_first, load_times
    ids = ["tests/test_b.py::x", "tests/test_a.py::y[1]", "tests/test_b.py::z", "tests/test_new.py::n",
           "tests/test_a.py::y[2]", "tests/test_c.py::w"]
    order = [ids[i] for i in cheapest_first(ids, {"tests/test_a.py": 3.0, "tests/test_b.py": 0.5,
                                                  "tests/test_c.py": 1.0})]
    assert order == ["tests/test_b.py::x", "tests/test_b.py::z", "tests/test_c.py::w", "tests/test_a.py::y[1]",
                     "tests/test_a.py::y[2]", "tests/test_new.py::n"]
    assert sorted(order) == sorted(ids) and cheapest_first(ids, {}) == [0, 2, 1, 4, 3, 5]   # files as collected
    times = load_times(TIMES)           # the shipped measurement names real test files
    assert times and all((ROOT / f).exists() for f in times), sorted(f for f in times if not (ROOT / f).exists())


def test_blind_gpu_stage_runs_the_gpu_tier_with_compiled_kernels_and_the_cpu_stages_interpreted():
    """GPU-only mutants are judged blind by the gpu tier: that stage drops TRITON_INTERPRET, the others keep it."""
    from hybridqual.mutants.blind import default_stages
    stages = {s.name: s for s in default_stages(("qualify-main", "pytest", "pytest-gpu"), models=[])}
    assert list(stages) == ["qualify", "pytest", "pytest -m gpu"]
    gpu = stages["pytest -m gpu"]
    assert not gpu.interpret and gpu.argv[gpu.argv.index("-m") + 1] == "gpu" and "-x" in gpu.argv
    assert stages["qualify"].interpret and stages["pytest"].interpret


def test_blind_gpu_main_job_stage_runs_qualify_on_cuda_with_graphs_compiled_and_counts_as_the_main_job():
    """The main job's GPU form judges the paths only a GPU runs (graphs' pad rows, one-row GEMV epilogues): qualify
    on cuda with CUDA graphs, without the interpreter; its verdict fills the main job's column."""
    from hybridqual.mutants.blind import GPU_MAIN, BlindOutcome, StageResult, default_stages, stage_column
    (st,) = default_stages(("qualify-main-gpu",), models=[])
    assert st.name == GPU_MAIN and st.kind == "qualify" and not st.interpret
    assert st.argv[st.argv.index("--device") + 1] == "cuda" and "--graphs" in st.argv
    o = BlindOutcome("m", "KILLED", GPU_MAIN, "x", 1.0, [StageResult(GPU_MAIN, "FAIL", "c", 1.0)])
    assert stage_column(o, "main") == "KILLED" and stage_column(o, "tier") == "-"


def test_blind_report_counts_only_recorded_kills_and_names_each_verdicts_commit(tmp_path, monkeypatch, capsys):
    """--blind --report adds up runs made at several commits; a mutant with no recorded verdict is UNJUDGED, which
    is not a kill, so the rate is below 100% and the exit code says so."""
    import hybridqual.mutants.__main__ as cli
    monkeypatch.setattr(cli, "RESULTS", tmp_path)
    a, b = MUTANTS[0].name, MUTANTS[1].name
    (tmp_path / "blind.json").write_text(json.dumps({a: {"status": "KILLED", "stage": "qualify", "seconds": 50,
                                                         "commit": "abc1234", "date": "2026-12-02 18:00 UTC"}}))
    assert cli.main(["--blind", "--report", "--only", a, b]) == 1
    out = capsys.readouterr().out
    assert "recorded blind kill rate: 1/2 = 50%" in out and "UNJUDGED" in out and "abc1234" in out, out
    assert cli.main(["--blind", "--report", "--only", a]) == 0


def test_blind_stage_columns_say_what_the_main_job_alone_and_the_tier_each_said():
    """The blind table's main / tier columns come from each stage's own result; a stage that did not
    run is '-', and an older recorded row without per-stage verdicts credits only the stage that killed."""
    from hybridqual.mutants.blind import BlindOutcome, StageResult, stage_column, stage_verdicts
    both = BlindOutcome("m", "KILLED", "pytest", "x", 1.0,
                        [StageResult("qualify", "PASS", "", 1.0), StageResult("pytest", "FAIL", "t", 1.0)])
    assert (stage_column(both, "main"), stage_column(both, "tier")) == ("SURVIVED", "KILLED")
    first = BlindOutcome("m", "KILLED", "qualify", "x", 1.0, [StageResult("qualify", "FAIL", "c", 1.0)])
    assert (stage_column(first, "main"), stage_column(first, "tier")) == ("KILLED", "-")
    row = {"status": "KILLED", "stage": "qualify", "by_stage": stage_verdicts(both)}
    assert stage_column(row, "main") == "SURVIVED"
    assert stage_column({"status": "KILLED", "stage": "qualify"}, "main") == "KILLED"
    assert stage_column({"status": "KILLED", "stage": "pytest"}, "main") == "-"
