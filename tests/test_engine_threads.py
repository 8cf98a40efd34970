"""Engine threads sized to the cores: qualify gives every engine cores // (--jobs x --tp) threads (or
--engine-threads), the llama.cpp worker is loaded with them, a vLLM server is started with them, a --jobs worker
runs torch on them, and the report header says so; bad values are refused by name."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridqual.adapters.base import DEFAULT_OPTIONS, Engine, EngineOptions, RunResult, ThreadBudget, TraceAdapter
from hybridqual.adapters.oracle import OracleAdapter
from hybridqual.qualify import runner
from oracle.trace import load_trace

ROOT = Path(__file__).resolve().parent.parent
MAMBA2 = ROOT / "goldens" / "models" / "zoo-mamba2"
SEED = "goldens/traces/seed_compaction.json"


def _budget_for(argv: list[str], cores: int, monkeypatch) -> ThreadBudget:
    monkeypatch.setattr(runner, "cpu_cores", lambda: cores)
    args = runner.parse_args(argv)
    assert runner.resolve_jobs(args) is None
    return runner.thread_budget(args)


def test_jobs_times_threads_fit_the_cores(monkeypatch):
    assert _budget_for(["--jobs", "2"], 2, monkeypatch) == ThreadBudget(1, 2, 2)
    assert _budget_for(["--jobs", "2"], 16, monkeypatch) == ThreadBudget(8, 16, 2)
    assert _budget_for(["--jobs", "3"], 16, monkeypatch).threads == 5
    assert _budget_for(["--jobs", "4"], 2, monkeypatch).threads == 1            # never 0
    assert _budget_for(["--model", "tiny-sort"], 2, monkeypatch) == ThreadBudget(2, 2, 1)   # --jobs 1: every core
    assert not _budget_for(["--jobs", "2"], 2, monkeypatch).oversubscribed
    given = _budget_for(["--jobs", "2", "--engine-threads", "4"], 2, monkeypatch)
    assert given == ThreadBudget(4, 2, 2, given=True) and given.oversubscribed
    assert "--engine-threads 4" in given.describe() and "oversubscribed: 2 x 4 > 2 cores" in given.describe()
    assert ThreadBudget(1, 2, 2).describe() == "1 thread per engine (2 cores // 2 engines side by side)"


def test_a_thread_budget_survives_the_trip_to_a_worker_and_bad_values_name_the_field():
    b = ThreadBudget(3, 16, 5, given=True)
    assert ThreadBudget.from_json(json.loads(json.dumps(b.to_json()))) == b
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"ThreadBudget\.threads"):
            ThreadBudget(bad, 2)


def test_an_adapter_that_does_not_read_threads_never_sees_them_and_is_not_refused():
    seen = {}

    class NoOptions(TraceAdapter):       # written without options: gets none, even with a budget set
        def __init__(self, model_path, trace, mode, device="cpu"):
            seen["built"] = True

    class Reads(TraceAdapter):
        OPTIONS = ("threads",)

    opts = EngineOptions(threads=ThreadBudget(1, 2, 2))
    Engine(NoOptions, opts)(MAMBA2, None, "legacy")
    assert seen["built"] and Engine(NoOptions, opts).problem() is None
    assert Engine(Reads, opts)(MAMBA2, None, "legacy").options.threads == ThreadBudget(1, 2, 2)


@pytest.mark.parametrize("value", ["0", "two", "-3", ""])
def test_bad_engine_threads_exit_2_naming_the_flag(value, tmp_path, capsys):
    if value in ("two", ""):              # argparse's own refusal names the flag
        with pytest.raises(SystemExit) as e:
            runner.main(["--engine-threads", value, "--out", str(tmp_path)])
        assert e.value.code == 2 and "--engine-threads" in capsys.readouterr().err
        return
    assert runner.main(["--engine-threads", value, "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"--engine-threads {value}: must be an integer in [1, ")


def _llama(options: EngineOptions, monkeypatch, env_threads: str | None = None):
    """A LlamaCppAdapter built as qualify builds it, on a stand-in GGUF path (nothing converted or loaded)."""
    from hybridqual.adapters.llamacpp.adapter import LlamaCppAdapter
    monkeypatch.setenv("HQ_LLAMACPP_GGUF", "/nonexistent/stand-in.gguf")
    if env_threads is None:
        monkeypatch.delenv("HQ_LLAMACPP_THREADS", raising=False)
    else:
        monkeypatch.setenv("HQ_LLAMACPP_THREADS", env_threads)
    trace = load_trace(ROOT / SEED)
    return Engine(LlamaCppAdapter, options)(MAMBA2, trace, "legacy")


def test_the_llama_cpp_worker_gets_one_thread_under_jobs_2_on_2_cores(monkeypatch):
    budget = _budget_for(["--engine", "llamacpp", "--jobs", "2"], 2, monkeypatch)
    engine = runner.configured_engine(_args_with(budget, ["--engine", "llamacpp", "--jobs", "2"]))
    monkeypatch.setenv("HQ_LLAMACPP_GGUF", "/nonexistent/stand-in.gguf")
    monkeypatch.delenv("HQ_LLAMACPP_THREADS", raising=False)
    a = engine(MAMBA2, load_trace(ROOT / SEED), "legacy")
    load = a.load_message(64, 2)
    assert load["op"] == "load" and load["n_threads"] == 1
    assert a.threads.describe() == ("1 thread (qualify's budget: 1 thread per engine (2 cores // 2 engines side by "
                                    "side))")


def _args_with(budget: ThreadBudget, argv: list[str]):
    args = runner.parse_args(argv)
    args.thread_budget = budget
    return args


def test_llama_cpp_threads_env_overrides_the_budget_and_a_bad_one_is_named(monkeypatch):
    a = _llama(EngineOptions(threads=ThreadBudget(1, 2, 2)), monkeypatch, env_threads="3")
    assert a.load_message(64, 1)["n_threads"] == 3 and "HQ_LLAMACPP_THREADS" in a.threads.source
    no_budget = _llama(DEFAULT_OPTIONS, monkeypatch)         # outside qualify: this process's cores
    assert no_budget.load_message(64, 1)["n_threads"] == len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=r"HQ_LLAMACPP_THREADS='x': must be an integer >= 1"):
        _llama(DEFAULT_OPTIONS, monkeypatch, env_threads="x")
    from hybridqual.adapters.llamacpp.adapter import LlamaCppAdapter
    monkeypatch.setenv("HQ_LLAMACPP_THREADS", "0")
    assert "HQ_LLAMACPP_THREADS='0'" in LlamaCppAdapter.options_problem(EngineOptions())
    with pytest.raises(ValueError, match="HQ_LLAMACPP_THREADS='0'"):
        runner.configured_engine(runner.parse_args(["--engine", "llamacpp"]))


def test_a_vllm_server_is_started_on_the_budget_unbound():
    from hybridqual.adapters.vllm.server import thread_env
    opts = EngineOptions(threads=ThreadBudget(1, 2, 2))
    assert dict(thread_env(opts, environ={})) == {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    assert thread_env(DEFAULT_OPTIONS, environ={}) == ()
    users = {"OMP_NUM_THREADS": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-3"}
    assert thread_env(opts, environ=users) == ()               # the user's own settings stand


class TorchThreadsSeen(OracleAdapter):
    """The oracle as an engine that reads the budget and FAILs its instance unless torch runs on exactly it."""
    OPTIONS = ("threads",)

    def run_trace(self) -> RunResult:
        got, want = torch.get_num_threads(), self.options.threads
        if want is None or got != want.threads:
            raise RuntimeError(f"torch runs {got} threads; the budget is {want}")
        return super().run_trace()


def _two_cores() -> None:
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_the_report_header_states_the_threads_and_a_worker_runs_on_them(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT / "tests"),
                                                                              os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "hybridqual.qualify", "--engine", "test_engine_threads:TorchThreadsSeen",
                        "--mode", "legacy", "--trace", SEED, "--jobs", "2", "--out", str(tmp_path), "--quiet"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, preexec_fn=_two_cores)
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    t = report["engine_threads"]
    assert (t["threads"], t["cores"], t["jobs"], t["given"], t["oversubscribed"]) == (1, 2, 2, False, False)
    assert t["adapter_reads"] is True and t["torch_threads"] == 1
    assert t["line"] == "1 thread per engine (2 cores // 2 engines side by side)"
    assert report["failed"] == 0 and report["passed"] > 0
