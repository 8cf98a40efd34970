"""The repeatability checks (tools/qualify/repeat_checks.py): the same trace twice, and a request alone vs in the
batch, judged bitwise for an engine that declares determinism, else up to near ties of the oracle."""
from __future__ import annotations

import dataclasses

import torch

import oracle
from oracle.trace import load_trace
from hybridqual.adapters.base import Capabilities, RunResult, TraceAdapter
from hybridqual.qualify import checks
from hybridqual.scenarios import plan as scenarios

MODEL = scenarios.MODELS / "zoo-mamba2"
TRACE = load_trace(scenarios.TRACES / "slot_exhaustion.json")      # a, b, c arrive together: a runs alone


class Flaky(TraceAdapter):
    """The oracle, except that every second run (or a run of one request) changes token `POS` of request 'a' to
    the oracle's runner-up there, or to a far-off token (`NEAR` False)."""
    CAPABILITIES = Capabilities(("greedy",), ("legacy",), compute_dtype=torch.float64)
    runs, NEAR, POS, WHEN = 0, True, 1, "second"

    def run_trace(self) -> RunResult:
        type(self).runs += 1
        r = oracle.run_trace(oracle.load(self.model_path), self.trace, mode=self.mode)
        tokens = {k: list(v) for k, v in r.tokens.items()}
        change = {"second": type(self).runs % 2 == 0, "alone": len(self.trace.requests) == 1}.get(self.WHEN, False)
        if change and "a" in tokens:
            req = self.trace.request("a")
            row = oracle.load(self.model_path).prefill(list(req.prompt) + tokens["a"][:self.POS])[0][-1]
            order = row.argsort(descending=True)
            tokens["a"][self.POS] = int(order[1] if self.NEAR else order[-1])
        return RunResult(tokens, r.finish_reasons)


def _lines(cls, tau: float, caps: Capabilities | None = None):
    model = oracle.load(MODEL)
    inst = scenarios.Instance("slot_exhaustion", "file", TRACE, None, TRACE.to_json())
    if caps is not None:
        cls = type(cls.__name__, (cls,), {"CAPABILITIES": caps})
    lines = checks.check_instance(cls, MODEL, inst, ["legacy"], model, "cpu", tau)
    return {c.name: c for c in lines}


def _gap(pos: int) -> float:
    """The oracle's top-2 gap at request a's token `pos`."""
    model = oracle.load(MODEL)
    req = TRACE.request("a")
    toks = oracle.run_trace(model, TRACE, "legacy").tokens["a"]
    row = model.prefill(list(req.prompt) + toks[:pos])[0][-1]
    top = row.topk(2).values
    return float(top[0] - top[1])


def test_a_second_run_that_differs_beyond_a_near_tie_fails_and_within_one_passes():
    name = "the same trace run twice gives the same tokens"
    gap = _gap(1)
    Flaky.runs, Flaky.NEAR, Flaky.WHEN = 0, True, "second"
    assert _lines(Flaky, tau=2 * gap)[name].status == "PASS"            # a near tie under this τ
    Flaky.runs = 0
    assert _lines(Flaky, tau=gap / 2)[name].status == "FAIL"            # not a near tie
    Flaky.runs, Flaky.NEAR = 0, False
    line = _lines(Flaky, tau=2 * gap)[name]
    assert line.status == "FAIL" and "a position 1" in line.detail


def test_an_engine_declaring_determinism_is_held_to_identical_tokens():
    name = "the same trace run twice gives the same tokens"
    Flaky.runs, Flaky.NEAR, Flaky.WHEN = 0, True, "second"
    caps = dataclasses.replace(Flaky.CAPABILITIES, deterministic=True)
    line = _lines(Flaky, tau=2 * _gap(1), caps=caps)[name]
    assert line.status == "FAIL" and "bitwise" in line.detail


def test_a_request_that_differs_alone_fails_the_alone_check():
    name = "a request alone gives its tokens in the batch"
    Flaky.runs, Flaky.NEAR, Flaky.WHEN = 0, False, "alone"
    lines = _lines(Flaky, tau=1e-9)
    assert lines[name].status == "FAIL" and "a position 1" in lines[name].detail
    assert lines["the same trace run twice gives the same tokens"].status == "PASS"
    Flaky.WHEN = "never"
    assert _lines(Flaky, tau=1e-9)[name].status == "PASS"


def test_a_request_alone_keeps_only_its_own_scripted_drafts():
    """A scripted proposer names every request; the one-request trace keeps the drafts of its request only, so it
    is a valid trace (the alone check of a speculative trace runs instead of raising)."""
    from oracle.speculative import check_speculative
    from hybridqual.qualify.repeat_checks import solo_trace
    trace = load_trace(scenarios.TRACES / "prefix_spec.json")
    one = solo_trace(trace, "brief")
    assert [r.id for r in one.requests] == ["brief"] and one.requests[0].arrival_step == 0
    assert {rid for rid, _ in one.engine.speculative.proposer.proposals} <= {"brief"}
    cfg = oracle.from_hf_config(scenarios.MODELS / "zoo-bamba" / "config.json")
    check_speculative(one, cfg.vocab_size, cfg.chunk_size)
