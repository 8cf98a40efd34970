"""qualify's verdicts are right and honest: a legitimate near-tie flip passes the schedule check (it is compared with
the oracle's schedule replayed with the engine's tokens) while a scheduling bug beside it still fails; a runner-up
bias fails the plausibility bound; unsupported checks are SKIPs; a logit rescale that keeps every argmax fails.

The candidate engines here are the oracle itself with forced tokens (no interpreter), except the logits mutant.
"""
import copy
from dataclasses import dataclass

import pytest
import torch

import oracle
from oracle.schedule_log import digest
from oracle.trace import parse_trace
from hybridqual import adapters
from hybridqual.goldens import regen as goldens
from hybridqual.adapters import Capabilities, RunResult
from hybridqual.qualify.compare import teacher_forced_logits, top2_margin
from hybridqual.qualify.checks import check_instance, context, run_check, truth_for
from hybridqual.scenarios.plan import Instance

MODEL = goldens.MODELS / "zoo-bamba"
SEED = goldens.TRACES / "seed_compaction.json"


@pytest.fixture(scope="module")
def omodel():
    return oracle.load(MODEL, dtype=torch.float64)


def instance(obj: dict, name: str = "seed_compaction") -> Instance:
    tr = parse_trace(obj)
    return Instance(name, "test", tr, None, tr.to_json())


@pytest.fixture(scope="module")
def flip(omodel):
    return flip_case(omodel)


def flip_case(omodel) -> tuple[dict, dict, float]:
    """seed_compaction with r1's runner-up at its near tie (position 1, margin 0.0173) made r1's stop token: the
    oracle runs r1 for 3 tokens, an engine that flips the tie stops r1 after 2, so the schedule changes.
    (trace JSON, the flipping engine's forced tokens, the tie's margin)."""
    obj = copy.deepcopy(oracle.load_trace(SEED).to_json())
    truth = oracle.run_trace(omodel, parse_trace(obj), "legacy").tokens["r1"]
    req = next(r for r in parse_trace(obj).requests if r.id == "r1")
    row = teacher_forced_logits(omodel, req.prompt, truth)[1]
    runner_up = int(torch.topk(row, 2).indices[1])
    assert 0 < top2_margin(row) < 0.05 and runner_up not in truth, "premise: a near tie at r1@1 (goldens)"
    next(r for r in obj["requests"] if r["id"] == "r1")["stop_token_ids"] = [runner_up]
    return obj, {"r1": truth[:1] + [runner_up]}, top2_margin(row)


@dataclass(frozen=True)
class Forcing:
    """ForcedOracle's settings: the oracle model, the tokens it forces, whether it corrupts its log."""
    model: object
    forced: dict
    corrupt_log: bool = False


class ForcedOracle(adapters.TraceAdapter):
    """A 'correct engine whose rounding flips some near ties': the oracle scheduler with forced tokens on the main
    trace (the one-request continuation traces run plainly: after the oracle's prefix the engine agrees again)."""
    CAPABILITIES = Capabilities(("greedy", "seeded"), ("legacy", "async"), schedule_log=True,
                                compute_dtype=torch.float32)
    OPTIONS = ("settings",)

    def run_trace(self):
        main = len(self.trace.requests) > 1
        how = self.options.settings
        r = oracle.run_trace(how.model, self.trace, self.mode, forced_tokens=how.forced if main else None)
        log = r.schedule_log
        if main and how.corrupt_log:                        # a scheduling bug: a compaction moves the wrong slot
            step = next(s for s in log.steps if s.moves)
            step.moves[0]["slot"] = (step.moves[0]["slot"] + 1) % self.trace.engine.max_requests
        return RunResult(r.tokens, r.finish_reasons, log, digest(log))


def engine(omodel, forced, corrupt=False) -> adapters.Engine:
    return adapters.Engine(ForcedOracle, adapters.EngineOptions(settings=Forcing(omodel, forced, corrupt)))


def by_name(checks):
    return {c.name.split(" (")[0]: c for c in checks}


def test_a_near_tie_flip_that_stops_a_request_early_passes_tokens_and_schedule(omodel, flip):
    obj, forced, margin = flip
    inst = instance(obj)
    truth = truth_for(MODEL, inst, omodel)
    assert "trace sha256 differs" in truth.source, truth.source       # the shipped golden is for another trace
    checks = by_name(check_instance(engine(omodel, forced), MODEL, inst, ["legacy", "async"], omodel, "cpu",
                                    tau=0.05, truth=truth))
    for mode in ("legacy", "async"):
        tok, sched = checks[f"{mode}: tokens match the truth"], checks[f"{mode}: schedule log matches the oracle's"]
        assert tok.passed and "near ties: r1@1" in tok.detail, tok.detail
        assert tok.data["requests"]["r1"]["forgiven"] == 1
        assert abs(tok.data["requests"]["r1"]["min_margin"] - margin) < 1e-12
        assert sched.passed and "replayed with the engine's tokens" in sched.detail, sched.detail
        # the premise: the flip really changed the schedule, so comparing with the truth's digest would fail it
        run = engine(omodel, forced)(MODEL, inst.trace, mode).run_trace()
        assert run.digest != truth.schedule_digest[mode]
    assert checks["legacy: logits match the oracle's"].skipped           # the adapter declares no logits


def test_a_scheduling_bug_beside_a_forgiven_near_tie_still_fails(omodel, flip):
    obj, forced, _ = flip
    checks = by_name(check_instance(engine(omodel, forced, corrupt=True), MODEL, instance(obj), ["legacy"], omodel,
                                    "cpu", tau=0.05))
    assert checks["legacy: tokens match the truth"].passed
    sched = checks["legacy: schedule log matches the oracle's"]
    assert not sched.ok and "first difference" in sched.detail and "moves" in sched.detail, sched.detail


def biased(omodel, req, tau):
    """An engine that takes the runner-up wherever the oracle's margin is <= tau (a bias, not rounding)."""
    out, (logits, state) = [], omodel.prefill(list(req.prompt))
    row = logits[-1]
    while True:
        top = torch.topk(row.double(), 2)
        tok = int(top.indices[1] if float(top.values[0] - top.values[1]) <= tau else top.indices[0])
        out.append(tok)
        if tok in req.stop_token_ids or len(out) == req.max_new_tokens:
            return out
        row, state = omodel.decode(tok, state)


def test_an_engine_that_takes_the_runner_up_at_every_close_call_fails_the_near_tie_bound(omodel):
    tau = 0.1
    trace = oracle.load_trace(SEED)
    forced = {r.id: biased(omodel, r, tau) for r in trace.requests}
    checks = by_name(check_instance(engine(omodel, forced), MODEL, instance(trace.to_json()), ["legacy"], omodel,
                                    "cpu", tau=tau))
    tok = checks["legacy: tokens match the truth"]
    assert tok.data["forgiven"] >= 3 and not tok.ok, tok.detail
    assert "implausible near-tie rate" in tok.detail and "float32" in tok.detail, tok.detail
    assert checks["legacy: schedule log matches the oracle's"].passed     # its schedule is right for its tokens


class GreedyOnly(adapters.StepAdapter):
    """A user adapter that declares nothing: greedy, legacy only; constructing it is an error (must not run)."""

    def __init__(self, *a, **k):
        raise AssertionError("an unsupported trace must be skipped before the engine is built")


def test_unsupported_sampling_and_modes_are_skips_with_reasons_not_failures(omodel):
    obj = copy.deepcopy(oracle.load_trace(SEED).to_json())
    obj["requests"][2]["sampling"] = {"kind": "seeded", "temperature": 1.0, "seed": 7}
    checks = check_instance(GreedyOnly, MODEL, instance(obj), ["legacy", "async"], omodel, "cpu")
    assert [c.status for c in checks] == ["SKIP"] * 3, [(c.name, c.detail) for c in checks]
    legacy, async_, equal = checks
    assert "seeded used by r2" in legacy.detail and "mode 'async'" in async_.detail
    assert equal.name == "async == legacy, bitwise" and equal.detail.startswith("skipped:")
    assert all(c.ok and not c.passed for c in checks)                     # skipped: neither failed nor passed


def test_task_accuracy_on_a_model_that_cannot_do_the_task_is_skipped_not_vacuous(omodel):
    trace = oracle.load_trace(goldens.TRACES / "task_burst.json")
    truth = truth_for(MODEL, instance(trace.to_json(), "task_burst"), omodel)
    runs = {"legacy": RunResult(dict(truth.tokens))}
    c = run_check("task", context(None, MODEL, trace, omodel, truth=truth, label="zoo-bamba/task_burst",
                                  caps=Capabilities(), runs=runs))
    assert c.skipped and "cannot do the task" in c.detail


SMALL = {"schema": "hybridqual.trace/1", "engine": {"max_requests": 2, "max_tokens_per_step": 16, "prefill_chunk": 16},
         "requests": [{"id": "a", "arrival_step": 0, "prompt": [0, 5, 9], "max_new_tokens": 3},
                      {"id": "b", "arrival_step": 1, "prompt": [7, 0], "max_new_tokens": 2}]}


def test_logits_check_fails_a_fastpath_whose_logits_are_scaled_by_1_01(omodel, monkeypatch):
    from fastpath.model import FastModel
    inst = instance(SMALL, "small")        # (the unmutated fast path passes this check: test_qualify_cli)
    forward = FastModel.forward
    monkeypatch.setattr(FastModel, "forward", lambda self, b, bank: forward(self, b, bank) * 1.01)
    bad = by_name(check_instance(adapters.FastpathAdapter, MODEL, inst, ["legacy"], omodel, "cpu"))
    assert bad["legacy: tokens match the truth"].passed                   # ×1.01 keeps every argmax ...
    lg = bad["legacy: logits match the oracle's"]
    assert not lg.ok and "max|Δlogit|" in lg.detail, lg.detail          # ... and still fails here


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_scheduling_defect_still_fails_on_cuda_in_bf16_with_graphs(monkeypatch):
    """The bf16 τ forgives rounding flips, not a compaction that forgets to move the slot mapping."""
    from broken_engines import compact_without_moving_slots
    from fastpath.engine.rows import RowTable
    tiny = goldens.MODELS / "tiny-sort"
    om = oracle.load(tiny, dtype=torch.float64)
    cls = adapters.Engine(adapters.FastpathAdapter, adapters.EngineOptions(graphs=True))
    inst = instance(oracle.load_trace(SEED).to_json())
    good = check_instance(cls, tiny, inst, ["legacy", "async"], om, "cuda")
    assert all(c.ok for c in good), [(c.name, c.detail) for c in good if not c.ok]
    monkeypatch.setattr(RowTable, "compact", compact_without_moving_slots)
    bad = by_name(check_instance(cls, tiny, inst, ["legacy"], om, "cuda"))
    assert not bad["legacy: schedule log matches the oracle's"].ok or not bad["legacy: tokens match the truth"].ok
