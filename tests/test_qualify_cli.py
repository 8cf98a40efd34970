"""The main job's command line: it passes on the shipped model, reports as it goes (stale reports removed, skips
counted apart from passes, versions and τ recorded), refuses bad arguments by name, and runs under torchrun."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SEED = "goldens/traces/seed_compaction.json"


def qualify(*args, launcher=(sys.executable, "-m")):
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    return subprocess.run([*launcher, "hybridqual.qualify", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)


def test_qualify_passes_and_writes_json_and_junit(tmp_path):
    p = qualify("--trace", SEED, "--out", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["failed"] == 0 and report["passed"] == 11 and report["skipped"] == 0, report["checks"]
    assert sum("argmax" in c["name"] for c in report["checks"]) == 2       # the greedy-argmax line, per mode
    assert report["status"] == "finished" and report["tau"] == 1e-3 and "float32" in report["tau_source"]
    assert {"hybridqual", "torch", "triton", "transformers", "engine"} <= set(report["versions"])
    assert report["instances"][0]["truth"].startswith("golden seed_compaction.json")
    assert "<testsuite" in (tmp_path / "junit.xml").read_text()
    assert "11/11 checks passed" in p.stdout
    for mode in ("legacy", "async"):          # a progress line as each trace × mode starts and ends
        assert f"▶ tiny-sort/seed_compaction · {mode}" in p.stdout
        assert f"■ tiny-sort/seed_compaction · {mode} done in" in p.stdout


def test_a_trace_that_does_not_fit_is_a_reported_skip_and_a_stale_report_is_removed(tmp_path):
    """With --skip-invalid-traces (without it such a trace is a FAIL: tests/test_judge_cli.py)."""
    (tmp_path / "report.json").write_text('{"stale": true, "failed": 0, "passed": 99}')
    p = qualify("--engine", "oracle", "--trace", "goldens/traces/stop_tokens.json", "--out", str(tmp_path),
                "--skip-invalid-traces")
    assert p.returncode == 1, p.stdout + p.stderr                  # nothing ran: not a pass
    report = json.loads((tmp_path / "report.json").read_text())
    assert "stale" not in report and report["status"] == "finished"
    assert (report["passed"], report["failed"], report["skipped"], report["ran"]) == (0, 0, 1, 0)
    [c] = report["checks"]
    assert c["status"] == "SKIP" and "does not fit the model" in c["detail"] and "vocab" in c["detail"]
    assert "SKIP  scenario runs on this model" in p.stdout and "0/1 checks passed, 0 failed, 1 skipped" in p.stdout


def test_quiet_prints_only_the_summary(tmp_path):
    p = qualify("--engine", "oracle", "--mode", "legacy", "--trace", SEED, "--out", str(tmp_path), "--quiet")
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 2 and "checks passed" in lines[-1], p.stdout


def test_report_is_on_disk_after_every_check_and_skips_are_not_passes(tmp_path):
    from hybridqual.qualify.report import Check, Report
    (tmp_path / "junit.xml").write_text("stale")
    r = Report(tmp_path, {"engine": "x"})
    read = lambda: json.loads((tmp_path / "report.json").read_text())   # noqa: E731
    assert read()["status"] == "running" and read()["checks"] == [] and "stale" not in (tmp_path / "junit.xml").read_text()
    r.add(Check.of("m/t", "a", True, "fine"))
    assert (read()["passed"], read()["ran"]) == (1, 1)
    r.add(Check.skip("m/t", "b", "the adapter cannot"))
    body = read()
    assert (body["passed"], body["skipped"], body["failed"], body["ran"]) == (1, 1, 0, 1)
    assert body["checks"][1]["status"] == "SKIP" and body["checks"][1]["detail"] == "skipped: the adapter cannot"
    assert '<skipped message="skipped: the adapter cannot"' in (tmp_path / "junit.xml").read_text()
    r.add(Check.of("m/t", "c", False, "broken"))
    assert read()["failed"] == 1 and r.finish() == {"passed": 1, "failed": 1, "skipped": 1}
    assert read()["status"] == "finished"


@pytest.mark.parametrize("args,words", [
    (["--model", "no/such/folder"], "--model no/such/folder: no config.json"),
    (["--engine", "nosuch"], "--engine 'nosuch'"),
    (["--tp", "2"], "--tp 2: needs torchrun"),
    (["--device", "nosuch"], "--device 'nosuch'"),
    (["--engine", "hf", "--graphs"], "apply to the fastpath engine only"),
    (["--scenario", "seed_compaction"], "--scenario needs --model"),
])
def test_qualify_refuses_bad_arguments_naming_them(args, words, tmp_path):
    p = qualify(*args, "--out", str(tmp_path))
    assert p.returncode == 2 and words in p.stderr, p.stderr


def one_request_trace(path: Path, rid: str) -> str:
    """A one-request trace file for the shipped tiny model."""
    engine = {"max_requests": 2, "max_tokens_per_step": 16, "prefill_chunk": 16}
    request = {"id": rid, "arrival_step": 0, "prompt": [1, 5, 9], "max_new_tokens": 2}
    path.write_text(json.dumps({"schema": "hybridqual.trace/1", "engine": engine, "requests": [request]}))
    return str(path)


def test_jobs_report_in_plan_order_and_fail_fast_stops_at_the_first_fail_in_that_order(tmp_path, monkeypatch,
                                                                                        capsys):
    """--jobs 2: the later instance fails first (its worker is 1 s quicker), yet the report, the lines and the stop
    follow the plan's order: the first instance's FAIL, nothing of the second."""
    from hybridqual.qualify import runner as q
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    slow, fast = one_request_trace(tmp_path / "slow.json", "slow"), one_request_trace(tmp_path / "fast.json", "fast")
    assert q.main(["--engine", "broken_engines:SlowWrongOracle", "--trace", slow, fast, "--mode", "legacy",
                   "--jobs", "2", "--fail-fast", "--out", str(tmp_path / "out")]) == 1
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["jobs"] == 2 and [i["scenario"] for i in report["instances"]] == ["slow"], report["instances"]
    assert [(c["trace"], c["status"]) for c in report["checks"]] == [("tiny-sort/slow", "FAIL")], report["checks"]
    assert report["stopped"].startswith("--fail-fast: stopped at the first FAIL (tiny-sort/slow: legacy: tokens")
    assert "tiny-sort 1/2] slow" in out and "fast" not in out.replace("--fail-fast", ""), out
    assert q.main(["--jobs", "0", "--out", str(tmp_path / "bad")]) == 2
    assert "--jobs 0: must be at least 1" in capsys.readouterr().err


def test_a_worker_that_dies_is_a_fail_line_carrying_its_exit_code_and_stderr(tmp_path, monkeypatch):
    """--jobs 2: a worker process that ends mid-instance makes that instance a FAIL line naming the worker's exit
    code and the end of its stderr; a fresh worker runs the next instance, and the report is finished."""
    from hybridqual.qualify import runner as q
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    a, b = one_request_trace(tmp_path / "a.json", "a"), one_request_trace(tmp_path / "b.json", "b")
    assert q.main(["--engine", "broken_engines:DyingWorker", "--trace", a, b, "--mode", "legacy", "--jobs", "2",
                   "--out", str(tmp_path / "out")]) == 1
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["status"] == "finished" and report["failed"] == 2, report
    for c, name in zip(report["checks"], ("a", "b")):
        msg = c["detail"]
        assert c["trace"] == f"tiny-sort/{name}" and c["status"] == "FAIL", c
        assert "exited (code 3) before finishing it" in msg and "DyingWorker: ending this process on purpose" in msg


@pytest.mark.tp          # the tp tier (`pytest -m tp`); the default tier's TP check is test_tp.py's gloo TP=2 == TP=1
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_qualify_tp2_under_torchrun_matches_goldens(tmp_path):
    p = qualify("--tp", "2", "--trace", SEED, "--mode", "legacy", "--out", str(tmp_path),
                launcher=("torchrun", "--nproc_per_node", "2", "-m"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert json.loads((tmp_path / "report.json").read_text())["failed"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_default_plan_qualifies_on_cuda_in_bf16_with_graphs(tmp_path):
    """τ follows the bf16 compute dtype, so the zoo and the tiny model qualify on the GPU by default."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-m", "hybridqual.qualify", "--device", "cuda", "--graphs", "--out", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    report = json.loads((tmp_path / "report.json").read_text())
    assert p.returncode == 0 and report["failed"] == 0, p.stdout[-5000:] + p.stderr[-3000:]
    import torch
    from hybridqual.qualify.compare import TAU
    assert "bfloat16" in report["tau_source"] and report["tau"] == TAU[torch.bfloat16]
