"""bench qualify (tools/bench/qualify.py): timing a qualification changes none of its verdicts, the parts of its
split add up to the run's wall time, and the fp64 passes it counts are the ones the plan requires (derived here
from the oracle's own schedule logs). One tiny model, one scenario, the oracle engine, CPU."""
import json
import os

import pytest
import torch

import oracle
import oracle.batched
import oracle.scheduler
from oracle.model import OracleModel
from oracle.trace import parse_trace
from hybridqual.bench import qualify as bench
from hybridqual.goldens import regen as goldens
from hybridqual.qualify import compare, runner

MODEL = goldens.MODELS / "tiny-sort"
SCENARIO = "stop_tokens"            # no shipped golden for tiny-sort: plain qualify computes the truth too
ARGS = ["--model", str(MODEL), "--engine", "oracle", "--scenario", SCENARIO, "--mode", "legacy"]
PARTS_SLACK_S = 0.05                # the parts are charged inside the qualify call the wall time brackets


def _in_process(f, *a):
    """f(*a) with os.environ as it was before (qualify sets HYBRIDQUAL_QUALIFY_OUT)."""
    env = dict(os.environ)
    try:
        return f(*a)
    finally:
        os.environ.clear()
        os.environ.update(env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(plain qualify's report, the bench's figures, the bench's qualify report) of the same subset."""
    tmp = tmp_path_factory.mktemp("bench_qualify")
    plain = _in_process(runner.main, [*ARGS, "--jobs", "1", "--in-process", "--quiet", "--out", str(tmp / "plain")])
    assert plain == 0
    rc = _in_process(bench.main, [*ARGS, "--probe-mib", "16", "--qualify-out", str(tmp / "bench"),
                                  "--out", str(tmp / "b.json"), "--summary", str(tmp / "b.txt")])
    assert rc == 0
    return (json.loads((tmp / "plain" / "report.json").read_text()), json.loads((tmp / "b.json").read_text()),
            json.loads((tmp / "bench" / "report.json").read_text()))


def _verdicts(report: dict) -> list[tuple]:
    """Each line's verdict and what it says, without its timings."""
    return [(c["trace"], c["name"], c["status"], c["detail"],
             json.dumps({k: v for k, v in c["data"].items() if "second" not in k}, sort_keys=True))
            for c in report["checks"]]


def test_bench_leaves_every_verdict_as_qualify_gives_it(runs):
    plain, figures, timed = runs
    assert _verdicts(timed) == _verdicts(plain)
    assert [i["truth"] for i in timed["instances"]] == [i["truth"] for i in plain["instances"]]
    assert figures["verdicts"] == {k: plain[k] for k in ("passed", "failed", "skipped")}


def test_bench_puts_back_everything_it_timed(runs):
    import hybridqual.qualify.steps as steps
    from hybridqual.adapters.base import Engine
    from hybridqual.qualify import truth as truth_mod
    assert oracle.scheduler.forward_segments is oracle.batched.forward_segments
    assert getattr(oracle.batched.forward_segments, "__wrapped__", None) is None
    for f in (OracleModel.forward, Engine.__call__, compare.compare_tie_aware, runner.truth_for,
              runner.check_instance, steps.load_truth):
        assert getattr(f, "__wrapped__", None) is None, f
    assert steps.load_truth is truth_mod.load_truth


def test_split_parts_add_up_to_the_wall_time(runs):
    _, b, _ = runs
    assert b["wall_s"] > 0
    assert abs(b["parts_sum_s"] - b["wall_s"]) <= PARTS_SLACK_S + 0.01 * b["wall_s"], (b["parts_sum_s"], b["wall_s"])
    for phase in (b["truth_phase"], b["judging"]):
        parts = [phase[k] for k in ("passes_s", "compute_s", "host_s", "idle_s")]
        assert min(parts) >= 0
        assert sum(parts) == pytest.approx(phase["wall_s"], abs=1e-9)
    assert b["truth_phase"]["passes_s"] > 0 and b["engine_s"] > 0 and b["engine_runs"] >= 1


def _steps_with_rows(result) -> int:
    return sum(1 for s in result.schedule_log.steps if s.batch)


def test_pass_counts_are_the_plans(runs):
    """The truth (goldens.golden_for_trace) runs the oracle scheduler in both modes, one pass per step that has
    rows, then one teacher-forced pass per request; the judging scores every request's tokens in one batched
    pass. Counted from the oracle's schedule logs, not from the bench's own counters."""
    plain, b, _ = runs
    trace = parse_trace(plain["instances"][0]["concrete"])
    model = oracle.load(MODEL, dtype=torch.float64)
    want_truth = sum(_steps_with_rows(oracle.run_trace(model, trace, mode=m)) for m in ("legacy", "async"))
    want_truth += len(trace.requests)
    scored = [r for r in trace.requests if oracle.run_trace(model, trace, mode="legacy").tokens[r.id]]
    assert len(scored) >= 2                     # so that the judging batches them
    assert b["truth_phase"]["passes"] == want_truth
    assert b["judging"]["passes"] == 1 and b["judging"]["passes_by_kind"] == {"batched": 1}
    assert b["judging"]["sequences"] == len(scored)
    assert [(i["phase"], i["passes"]) for i in b["instances"]] == [("truth", want_truth), ("judging", 1)]
    w = b["weights_fp64_bytes"]
    assert b["truth_phase"]["floor_s"] == pytest.approx(w * want_truth / (b["copy"]["gb_per_s"] * 1e9))


@pytest.mark.parametrize("extra, flag", [(["--probe-mib", "0"], "--probe-mib"),
                                         (["--device", "tpu"], "--device"),
                                         (["--out", "/nonexistent/dir/b.json"], "--out")])
def test_bad_argument_is_exit_2_naming_its_flag(extra, flag, capsys):
    assert bench.main([*ARGS, *extra]) == 2
    assert capsys.readouterr().err.startswith(flag)


def test_a_folder_without_config_is_refused_by_name(tmp_path, capsys):
    assert bench.main(["--model", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("--model")


def _bench(tmp, name: str, argv: list[str]) -> tuple[dict, dict]:
    """(the bench's figures, its qualify report) of one bench run."""
    rc = _in_process(bench.main, [*argv, "--probe-mib", "16", "--qualify-out", str(tmp / name),
                                  "--out", str(tmp / f"{name}.json")])
    assert rc == 0
    return json.loads((tmp / f"{name}.json").read_text()), json.loads((tmp / name / "report.json").read_text())


@pytest.mark.slow
def test_truth_golden_reads_the_shipped_golden_and_now_recomputes_it(tmp_path):
    """seed_compaction has a shipped golden for tiny-sort: --truth golden reads it (no pass in the truth phase),
    --truth now has the oracle compute it, with the same verdicts."""
    argv = ["--model", str(MODEL), "--engine", "oracle", "--scenario", "seed_compaction", "--mode", "legacy"]
    golden, g_report = _bench(tmp_path, "golden", [*argv, "--truth", "golden"])
    now, n_report = _bench(tmp_path, "now", argv)
    assert golden["truth_phase"]["passes"] == 0 and g_report["instances"][0]["truth"].startswith("golden ")
    assert now["truth_phase"]["passes"] > 0 and "computed now" in n_report["instances"][0]["truth"]
    assert [v[:3] for v in _verdicts(g_report)] == [v[:3] for v in _verdicts(n_report)]


@pytest.mark.slow
def test_bench_leaves_the_fast_paths_verdicts_as_qualify_gives_them(tmp_path):
    """The same as the oracle engine's case with the fast path (Triton interpreter) as the engine."""
    argv = ["--model", str(MODEL), "--scenario", SCENARIO, "--mode", "legacy"]
    plain = _in_process(runner.main, [*argv, "--jobs", "1", "--in-process", "--quiet", "--out", str(tmp_path / "p")])
    assert plain == 0
    figures, timed = _bench(tmp_path, "timed", argv)
    assert _verdicts(timed) == _verdicts(json.loads((tmp_path / "p" / "report.json").read_text()))
    assert figures["engine_runs"] >= 1 and figures["judging"]["passes"] >= 1


class _Clock:
    """A fake perf_counter / thread_time: wall moves when the test says, the thread's CPU at half its pace."""
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def thread_time(self) -> float:
        return self.now / 2


def test_timeline_charges_each_moment_once_to_the_innermost_region(monkeypatch):
    """Exclusive time: a phase's host time stops while a pass runs inside it; a compute region inside a pass and
    everything inside an engine run stay with the pass / the engine (no compute charged); a
    device region is bounded by syncs; host time splits by the thread's CPU into host work and idle."""
    from hybridqual.bench import timeline
    clock, syncs = _Clock(), []
    monkeypatch.setattr(timeline, "time", clock)
    tl = timeline.Timeline(lambda: syncs.append(clock.now))
    tl.start()
    clock.now = 1.0
    with tl.region("host", "truth"):
        clock.now = 3.0
        with tl.region("pass") as opened:
            assert opened
            clock.now = 7.0
            with tl.region("compute") as inner:
                assert not inner
                clock.now = 8.0
            clock.now = 10.0
        with tl.region("engine"):
            clock.now = 12.0
            with tl.region("pass") as inner:
                assert not inner
                clock.now = 15.0
        clock.now = 16.0
    assert tl.close() == 16.0
    assert syncs == [3.0, 10.0, 10.0, 15.0]
    truth = tl.phase("truth")
    assert (truth["passes_s"], truth["compute_s"], truth["engine_s"]) == (7.0, 0.0, 5.0)
    assert truth["wall_s"] == 15.0 and truth["host_s"] + truth["idle_s"] == 3.0
    assert truth["host_s"] == pytest.approx(1.5)
    assert tl.phase("other")["wall_s"] == 1.0
