"""qualify's command line cannot be fooled or stopped: arguments checked before any work, a bad trace file a FAIL
(unless --skip-invalid-traces), every FAIL's reason on the console, an adapter that raises, exits, hangs or kills
its process a FAIL line, and report.json finalised ("aborted: <why>") whatever ends the run."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridqual.qualify import runner as q

ROOT = Path(__file__).resolve().parent.parent
SEED = str(ROOT / "goldens/traces/seed_compaction.json")


def one_request_trace(path: Path, rid: str) -> str:
    engine = {"max_requests": 2, "max_tokens_per_step": 16, "prefill_chunk": 16}
    request = {"id": rid, "arrival_step": 0, "prompt": [1, 5, 9], "max_new_tokens": 2}
    path.write_text(json.dumps({"schema": "hybridqual.trace/1", "engine": engine, "requests": [request]}))
    return str(path)


@pytest.fixture
def tests_on_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


@pytest.mark.parametrize("args,words", [
    (["--tau", "-1"], "--tau -1.0: must be a finite number >= 0"),
    (["--tau", "nan"], "--tau nan: must be a finite number >= 0"),
    (["--tau", "inf"], "--tau inf: must be a finite number >= 0"),
    (["--jobs", "0"], "--jobs 0: must be at least 1"),
    (["--jobs", "-3"], "--jobs -3: must be at least 1"),
    (["--tp", "0"], "--tp 0: must be at least 1"),
    (["--timeout", "0"], "--timeout 0.0: must be a finite number of seconds > 0"),
    (["--timeout", "nan"], "--timeout nan"),
    (["--model", "zoo-bamba", "--scenario", "nosuch"], "--scenario nosuch: no such scenario; known: "),
    (["--piece-granularity", "0"], "--piece-granularity 0: must be an integer in [1, 65536]"),
    (["--piece-granularity", "16", "100000"], "--piece-granularity 100000: must be an integer in [1, 65536]"),
])
def test_bad_arguments_are_one_line_and_exit_2_before_any_work(args, words, tmp_path, capsys):
    out = tmp_path / "out"
    assert q.main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(words) and len(err.splitlines()) == 1, err
    assert not (out / "report.json").exists()
    if "--scenario" in args:
        from hybridqual.scenarios.plan import SCENARIOS
        assert all(name in err for name in SCENARIOS)


def test_an_unwritable_out_is_one_line_exit_2_without_a_traceback(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-m", "hybridqual.qualify", "--out", str(blocker / "sub")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith(f"--out {blocker / 'sub'}: not a writable folder"), p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_a_bad_trace_among_good_ones_fails_the_run_unless_skipped(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "hybridqual.trace/1", "engine": {}, "requests": []}')
    unfit = str(ROOT / "goldens/traces/stop_tokens.json")       # token ids beyond tiny-sort's vocab
    base = ["--engine", "oracle", "--mode", "legacy", "--trace", SEED, str(bad), unfit]
    assert q.main([*base, "--out", str(tmp_path / "a")]) == 1
    out = capsys.readouterr().out
    rep = report(tmp_path / "a")
    fails = {c["name"]: c["detail"] for c in rep["checks"] if c["status"] == "FAIL"}
    assert set(fails) == {"trace file is valid", "trace fits the model"}, rep["checks"]
    assert "engine.max_requests: missing required field" in fails["trace file is valid"]
    assert "vocab" in fails["trace fits the model"] and rep["status"] == "finished"
    assert "FAIL  trace file is valid:" in out and "FAIL  trace fits the model:" in out    # reasons on the console
    assert any(c["status"] == "PASS" for c in rep["checks"])                                # the good one ran
    assert q.main([*base, "--out", str(tmp_path / "b"), "--skip-invalid-traces"]) == 0
    rep = report(tmp_path / "b")
    skipped = {c["trace"]: c["detail"] for c in rep["checks"] if c["status"] == "SKIP"}
    assert rep["failed"] == 0 and "--skip-invalid-traces: " in skipped["tiny-sort/bad"], rep["checks"]
    assert "does not fit the model" in skipped["tiny-sort/stop_tokens"], rep["checks"]


def test_the_console_says_why_the_oracle_does_not_load(tmp_path, capsys):
    model = tmp_path / "no-weights"
    model.mkdir()
    (model / "config.json").write_text((ROOT / "goldens/models/zoo-bamba/config.json").read_text())
    assert q.main(["--engine", "oracle", "--model", str(model), "--out", str(tmp_path / "out")]) == 1
    out = capsys.readouterr().out
    assert "FAIL  the oracle loads: CheckpointError" in out, out
    assert q.main(["--engine", "oracle", "--model", str(model), "--out", str(tmp_path / "out"), "--quiet"]) == 1
    out = capsys.readouterr().out                    # quiet: no progress line, so the FAIL line names its instance
    assert "FAIL  no-weights: the oracle loads: CheckpointError" in out, out


# ------------------------------------------------------------------------------------------- hostile adapters

@pytest.mark.parametrize("engine,words", [
    ("broken_engines:ExitingOracle", "SystemExit: the adapter called sys.exit(0)"),
    ("broken_engines:ExitingOracle3", "SystemExit: the adapter called sys.exit(3)"),
    ("broken_engines:RaisingOracle", "RuntimeError: RaisingOracle: the engine broke"),
])
def test_an_adapter_that_exits_or_raises_in_process_is_a_fail_and_the_report_finished(tests_on_path, tmp_path,
                                                                                       engine, words):
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        a = one_request_trace(tmp_path / "a.json", "a")
        assert q.main(["--engine", engine, "--trace", a, "--mode", "legacy", "--in-process",
                       "--out", str(tmp_path / "out")]) == 1
    finally:
        sys.path.remove(str(ROOT / "tests"))
    rep = report(tmp_path / "out")
    assert rep["status"] == "finished" and rep["failed"] == 1, rep
    assert rep["checks"][0]["name"] == "legacy: engine runs the trace" and words in rep["checks"][0]["detail"]


def test_a_hang_in_process_is_a_fail_at_the_timeout(tests_on_path, tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        a = one_request_trace(tmp_path / "a.json", "a")
        t0 = time.time()
        assert q.main(["--engine", "broken_engines:HangingOracle", "--trace", a, "--mode", "legacy", "--in-process",
                       "--timeout", "1.5", "--out", str(tmp_path / "out")]) == 1
        assert time.time() - t0 < 30
    finally:
        sys.path.remove(str(ROOT / "tests"))
    [c] = report(tmp_path / "out")["checks"]
    assert c["name"] == "instance finishes within --timeout" and "within 1.5 s" in c["detail"], c


# A worker's start counts against --timeout: the engines that end on their own get a limit no loaded host's start
# reaches; only the hanging one is held to a short one.
@pytest.mark.parametrize("engine,timeout,words", [
    ("broken_engines:SelfKillingOracle", "60", "was killed by SIGKILL before finishing it"),
    ("broken_engines:HangingOracle", "4", "ran past --timeout 4 s"),
    ("broken_engines:ExitingOracle", "60", "SystemExit: the adapter called sys.exit(0)"),
])
def test_in_a_worker_a_hang_or_a_self_kill_is_a_fail_line_and_the_next_instance_runs(tests_on_path, tmp_path,
                                                                                      engine, timeout, words):
    """module:Class engines run in a worker by default: its death or its timeout is that instance's FAIL line,
    a fresh worker takes the next instance, and the report is finished."""
    a, b = one_request_trace(tmp_path / "a.json", "a"), one_request_trace(tmp_path / "b.json", "b")
    assert q.main(["--engine", engine, "--trace", a, b, "--mode", "legacy", "--timeout", timeout,
                   "--out", str(tmp_path / "out")]) == 1
    rep = report(tmp_path / "out")
    assert rep["status"] == "finished", rep
    for name in ("a", "b"):
        [c] = [c for c in rep["checks"] if c["trace"] == f"tiny-sort/{name}"]
        assert c["status"] == "FAIL" and words in c["detail"], c
    if "SelfKilling" in engine:
        assert "SelfKillingOracle: SIGKILL to my own process" in rep["checks"][0]["detail"]


@pytest.mark.parametrize("sig,words,code", [(signal.SIGTERM, "aborted: SIGTERM received", 143),
                                            (signal.SIGINT, "aborted: SIGINT (interrupted)", 130)])
def test_a_signal_finalises_the_report_as_aborted(tmp_path, sig, words, code):
    a = one_request_trace(tmp_path / "a.json", "a")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "out"
    # A shell's background job (no job control) starts with SIGINT ignored, and an ignored signal stays ignored across
    # exec, so the child would never see the SIGINT this test sends; a caught one is reset to the default there.
    caught = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        p = subprocess.Popen([sys.executable, "-m", "hybridqual.qualify", "--engine", "broken_engines:HangingOracle",
                              "--in-process", "--trace", a, "--mode", "legacy", "--out", str(out)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, caught)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:           # the instance is under way: its record is in the report
            try:
                if report(out)["instances"]:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        time.sleep(0.5)
        p.send_signal(sig)
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:       # where it is stuck: faulthandler dumps every thread on SIGABRT
            p.send_signal(signal.SIGABRT)
            _, err = p.communicate(timeout=30)
            pytest.fail(f"qualify did not end within 60 s of {sig.name}; its threads at SIGABRT:\n{err[-6000:]}")
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == code and report(out)["status"] == words.replace("aborted: ", "aborted: "), err
    assert "Traceback" not in err, err


def test_an_exception_inside_the_run_finalises_the_report_as_aborted(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("a bug in the plan")
    monkeypatch.setattr(q, "run_plan", broken)
    with pytest.raises(RuntimeError, match="a bug in the plan"):
        q.main(["--engine", "oracle", "--trace", SEED, "--out", str(tmp_path)])
    assert report(tmp_path)["status"] == "aborted: RuntimeError: a bug in the plan"
