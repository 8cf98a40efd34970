"""The shape line (tools/qualify/shape_checks.py): an instance's promised short last pieces are PASS when the
engine's log or facts show them, a SKIP naming what is missing or why it cannot be seen; --engine-budget."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from hybridqual.adapters.base import Capabilities, RunResult
from hybridqual.qualify import arguments, checks, runner
from hybridqual.scenarios import plan as scenarios
from hybridqual.scenarios.step_rule import StepRule
from hybridqual.scenarios.units import Units

MEGATRON = StepRule("megatron", budget_multiple=64, uses_prefill_chunk=False, chunk_aligned=False,
                    no_one_token_remainder=True, one_partial_prefill=True)


def _ctx(inst, run):
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=96))
    return checks.context(None, ".", inst.trace, model, caps=Capabilities(), label="m/piece_tails",
                          modes=("legacy",), shape=inst.shape, mode="legacy", run=run)


def _facts(pieces: dict[str, list[int]]) -> list[dict]:
    """Schedule facts with each request's pieces in its own step (what the shape line reads)."""
    facts, pos = [], {}
    for rid, counts in pieces.items():
        for n in counts:
            facts.append({"batches": [{"rows": [{"request": rid, "pos": pos.get(rid, 0), "tokens": n}]}]})
            pos[rid] = pos.get(rid, 0) + n
    return facts


def _inst():
    return scenarios.instantiate_one("piece_tails", Units(64, 96, rule=MEGATRON))


def test_the_promised_pieces_seen_in_the_engines_facts_pass():
    inst = _inst()
    want = {r.id: len(r.prompt) for r in inst.trace.requests}
    promised = inst.shape["last_pieces"]
    facts = _facts({rid: [want[rid] - n, n] for rid, n in promised.items()})
    c = checks.run_check("shape", _ctx(inst, RunResult({}, schedule_facts=facts)))
    assert c.status == "PASS" and "[2, 3, 4]" in c.detail and "rtail2 320+2" in c.detail and "[1]" in c.detail


def test_pieces_the_engine_did_not_make_are_a_skip_naming_the_missing_lengths():
    inst = _inst()
    want = {r.id: len(r.prompt) for r in inst.trace.requests}
    promised = inst.shape["last_pieces"]
    pieces = {rid: [want[rid] - n, n] for rid, n in promised.items()}
    pieces["rtail2"] = [want["rtail2"]]                       # taken whole: no 2-token last piece
    c = checks.run_check("shape", _ctx(inst, RunResult({}, schedule_facts=_facts(pieces))))
    assert c.status == "SKIP" and "[2]-token pieces" in c.detail and f"rtail2 {want['rtail2']}," in c.detail


def test_an_engine_reporting_no_pieces_is_a_skip_saying_so_and_no_shape_no_line():
    inst = _inst()
    c = checks.run_check("shape", _ctx(inst, RunResult({})))
    assert c.status == "SKIP" and "neither a schedule log nor schedule facts" in c.detail
    plain = scenarios.instantiate_one("seed_compaction", Units(8, 96))
    assert plain.shape is None and checks.run_check("shape", _ctx(plain, RunResult({}))) is None


def test_engine_budget_replaces_the_declared_rule_and_a_bad_one_is_named():
    from hybridqual.adapters import engine
    args = arguments.parse_args(["--engine-budget", "budget_multiple=64,chunk_aligned=false"])
    rule = runner.engine_rule(args, engine("megatron-rounded"))
    assert rule.budget_multiple == 64 and rule.uses_prefill_chunk and rule.name == "--engine-budget"
    assert runner.engine_rule(arguments.parse_args([]), engine("megatron-rounded")).one_partial_prefill
    assert runner.engine_rule(arguments.parse_args([]), engine("hf")) is None
    for bad, field in (("budget_multiple=0", "budget_multiple"), ("chunked=1", "chunked")):
        problem = arguments.argument_problem(arguments.parse_args(["--engine-budget", bad]), check_out=False)
        assert problem and "--engine-budget" in problem and field in problem
