"""qualify judges a model that does not fit in memory with the streamed fp64 oracle (tools/qualify/truth.py): the
engine's own tokens scored teacher-forced, the schedule replayed with them. Forced on a zoo model, its verdicts are
the in-memory truth's, check for check; broken engines still FAIL; a model too big for memory streams by itself.
"""
import copy
import functools
import json

import pytest
import torch

import oracle
import oracle.streamed as streamed
from oracle.trace import parse_trace
from hybridqual import adapters
from hybridqual.goldens import regen as goldens
from hybridqual.qualify import runner as qualify
from hybridqual.qualify.checks import check_instance, context, run_check, truth_for
from hybridqual.qualify.truth import Truth
from hybridqual.qualify.truth import ScheduleOnly, StreamedTruth, load_truth
from hybridqual.scenarios.plan import Instance

from test_qualify_verdicts import Forcing, ForcedOracle, biased, engine, flip_case as verdicts_flip_case   # noqa: E402  (the oracle-with-forced-tokens engines)

MODEL = goldens.MODELS / "zoo-bamba"
SEED = goldens.TRACES / "seed_compaction.json"


@pytest.fixture(scope="module")
def omodel():
    return oracle.load(MODEL, dtype=torch.float64)


@pytest.fixture(scope="module")
def stream():
    return StreamedTruth(MODEL, why="--oracle streamed", use_goldens=False)


def instance(obj: dict, name: str) -> Instance:
    tr = parse_trace(obj)
    return Instance(name, "test", tr, None, tr.to_json())


def flip_case(omodel):
    """test_qualify_verdicts' near-tie flip (r1's runner-up at r1@1 made its stop token), judged with τ = 0.05."""
    obj, forced, _ = verdicts_flip_case(omodel)
    return obj, forced, 0.05


def verdicts(checks):
    return [(c.name, c.status) for c in checks]


@pytest.mark.parametrize("case", ["exact", "near_tie_flip", "scheduling_bug", "runner_up_bias"])
def test_streamed_truth_gives_the_in_memory_verdicts(omodel, stream, case):
    obj, forced, tau = copy.deepcopy(oracle.load_trace(SEED).to_json()), {}, 1e-3
    if case in ("near_tie_flip", "scheduling_bug"):
        obj, forced, tau = flip_case(omodel)
    if case == "runner_up_bias":
        tau = 0.1
        forced = {r.id: biased(omodel, r, tau) for r in parse_trace(obj).requests}
    inst = instance(obj, f"streamed_{case}")
    cand = engine(omodel, forced, corrupt=case == "scheduling_bug")
    mem = check_instance(cand, MODEL, inst, ["legacy", "async"], omodel, "cpu", tau=tau)
    st = check_instance(cand, MODEL, inst, ["legacy", "async"], stream, "cpu", tau=tau)
    assert verdicts(st) == verdicts(mem), [(c.name, c.detail) for c in st]
    want = {"exact": "PASS", "near_tie_flip": "PASS", "scheduling_bug": "FAIL", "runner_up_bias": "PASS"}[case]
    assert {c.status for c in st if "schedule log" in c.name} == {want}
    if case == "runner_up_bias":
        assert any(not c.ok and "implausible near-tie rate" in c.detail for c in st)
    if case == "near_tie_flip":
        tok = next(c for c in st if c.name.startswith("legacy: tokens"))
        assert "near ties: r1@1" in tok.detail and tok.data["requests"]["r1"]["forgiven"] == 1
    assert "streamed fp64 oracle" in truth_for(MODEL, inst, stream).source


def test_streamed_truth_ignores_shipped_goldens_when_forced_and_uses_them_in_auto(stream):
    inst = instance(oracle.load_trace(SEED).to_json(), "seed_compaction")
    assert truth_for(MODEL, inst, stream).streamed
    auto = StreamedTruth(MODEL, why="model does not fit: test", use_goldens=True)
    assert truth_for(MODEL, inst, auto).source.startswith("golden seed_compaction.json")


def test_task_check_under_streamed_truth_uses_only_proven_outputs():
    trace = oracle.load_trace(goldens.TRACES / "task_burst.json")
    runs = {"legacy": adapters.RunResult({r.id: [0] for r in trace.requests})}
    truth = Truth("streamed", streamed=True)
    c = run_check("task", context(None, "x", trace, None, truth=truth, label="x/task_burst",
                                  caps=adapters.Capabilities(), runs=runs))
    assert c.skipped and "streamed truth" in c.detail


def test_schedule_only_replay_equals_the_oracle_schedule_for_its_tokens(omodel):
    trace = oracle.load_trace(SEED)
    for mode in ("legacy", "async"):
        real = oracle.run_trace(omodel, trace, mode)
        replay = oracle.run_trace(ScheduleOnly(omodel.config), trace, mode, forced_tokens=real.tokens)
        assert replay.digest == real.digest and replay.tokens == real.tokens


def test_streamed_prefill_decode_recompute_the_in_memory_logits(omodel, stream):
    a, sa = omodel.prefill([3, 1, 4])
    b, sb = stream.prefill([3, 1, 4])
    torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    torch.testing.assert_close(stream.decode(1, sb)[0], omodel.decode(1, sa)[0], rtol=0, atol=1e-12)


def test_auto_streams_a_model_that_does_not_fit_and_memory_refuses(monkeypatch):
    monkeypatch.setattr(streamed, "available_memory_bytes", lambda: 1000)
    model, how = load_truth(MODEL, "auto")
    assert isinstance(model, StreamedTruth) and how.startswith("streamed fp64 oracle (model does not fit: oracle."
                                                               "load in float64 needs")
    with pytest.raises(oracle.CheckpointError, match="needs"):
        load_truth(MODEL, "memory")


COMPACT = {"schema": "hybridqual.trace/1", "engine": {"max_requests": 2, "max_tokens_per_step": 16,
                                                      "prefill_chunk": 16},
           "requests": [{"id": "a", "arrival_step": 0, "prompt": [0, 5, 9], "max_new_tokens": 1},
                        {"id": "b", "arrival_step": 0, "prompt": [7, 2, 3], "max_new_tokens": 4}]}


def test_qualify_cli_streams_when_the_model_does_not_fit_and_a_broken_compaction_fails(tmp_path, monkeypatch):
    """End to end on the fast path (one interpreter run): the header and the instance say the truth is streamed and
    why; a compaction that forgets the slot mapping (tests/broken_engines.py) fails under it. (The unbroken fast path
    passing under streamed truth: hybridqual.qualify --oracle streamed, docs/qualification.md.)"""
    from broken_engines import compact_without_moving_slots
    from fastpath.engine.rows import RowTable
    trace = tmp_path / "compact.json"
    trace.write_text(json.dumps(COMPACT))
    monkeypatch.setattr(streamed, "available_memory_bytes", lambda: 1000)
    monkeypatch.setattr(RowTable, "compact", compact_without_moving_slots)
    out = tmp_path / "bad"
    assert qualify.main(["--model", str(MODEL), "--trace", str(trace), "--mode", "legacy", "--quiet",
                         "--out", str(out)]) == 1
    rep = json.loads((out / "report.json").read_text())
    assert rep["oracle"][str(MODEL)].startswith("streamed fp64 oracle (model does not fit: oracle.load in float64")
    assert rep["instances"][0]["truth"].startswith("streamed fp64 oracle (model does not fit:")
    sched = next(c for c in rep["checks"] if "schedule log" in c["name"])
    assert sched["status"] == "FAIL" and "moves" in sched["detail"], sched


@functools.lru_cache(maxsize=None)
def tiny_oracle():
    return oracle.load(MODEL)


class CorruptLogOracle(ForcedOracle):
    """A qualify --engine target: the oracle scheduler whose log moves the wrong slot at the first compaction."""

    def __init__(self, model_path, trace, mode, device="cpu"):
        super().__init__(model_path, trace, mode, device,
                         adapters.EngineOptions(settings=Forcing(tiny_oracle(), {}, corrupt_log=True)))


def test_fail_fast_stops_at_the_first_fail_and_says_so(tmp_path, capsys):
    out = tmp_path / "ff"
    args = ["--engine", "test_qualify_streamed:CorruptLogOracle", "--model", str(MODEL), "--trace", str(SEED),
            str(SEED), "--mode", "legacy", "async", "--out", str(out)]
    assert qualify.main(args + ["--fail-fast"]) == 1
    rep = json.loads((out / "report.json").read_text())
    assert [c["status"] for c in rep["checks"]] == ["PASS", "FAIL"], rep["checks"]       # tokens, then the schedule
    assert rep["status"] == "finished" and rep["stopped"].startswith("--fail-fast: stopped at the first FAIL")
    assert "(stopped early: --fail-fast)" in capsys.readouterr().out
    assert qualify.main(args) == 1                                                     # without: every check runs
    assert len(json.loads((out / "report.json").read_text())["checks"]) > 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("how", ["memory", "streamed"])
def test_the_fp64_oracle_on_cuda_gives_the_cpu_verdicts(omodel, how):
    """--oracle-device cuda, in memory and streamed: the same check lines as the CPU fp64 truth on a near-tie flip."""
    obj, forced, tau = flip_case(omodel)
    inst, cand = instance(obj, "streamed_cuda"), engine(omodel, forced)
    truth, desc = load_truth(MODEL, how, "cuda")
    assert "on cuda" in desc
    cpu = check_instance(cand, MODEL, inst, ["legacy", "async"], omodel, "cpu", tau=tau)
    gpu = check_instance(cand, MODEL, inst, ["legacy", "async"], truth, "cpu", tau=tau)
    assert verdicts(gpu) == verdicts(cpu), [(c.name, c.detail) for c in gpu]
