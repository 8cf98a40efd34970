"""An engine's step rule (tools/scenarios/step_rule.py) and piece_tails instantiated from it (tools/scenarios/tails.py):
the rule's schedule is our scheduler's where the rule is ours, Megatron's piece rule where declared so, and the
instantiated prompts end with last pieces of 1..d_conv tokens under any rule, at any chunk size."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from oracle.trace import parse_trace
from hybridqual.scenarios import plan as scenarios
from hybridqual.scenarios.step_rule import (OURS, Piece, StepRule, legacy_pieces, observed_pieces, parse_step_rule,
                                            simulate)
from hybridqual.scenarios.tails import split_tails
from hybridqual.scenarios.units import ScenarioError, Units, request, trace

MEGATRON = StepRule("megatron", budget_multiple=64, uses_prefill_chunk=False, chunk_aligned=False,
                    no_one_token_remainder=True, one_partial_prefill=True)
LENGTH_ONLY = ("piece_tails", "piece_budget", "piece_chunk", "chunked_prefill", "slot_exhaustion", "seed_compaction",
               "request_order", "decode_buckets", "cobatch_reuse", "task_burst_short")


def _tr(budget: int, prompts: list[int], arrivals: list[int] | None = None, R: int = 3, P: int = 16):
    reqs = [request(f"r{i}", (arrivals or [0] * len(prompts))[i], [3] * n, 2) for i, n in enumerate(prompts)]
    return parse_trace(trace("", R, budget, P, "legacy", reqs))


@pytest.mark.parametrize("chunk", (4, 8, 64))
@pytest.mark.parametrize("name", LENGTH_ONLY)
def test_the_rule_simulator_under_our_rule_gives_the_oracle_schedulers_pieces(name, chunk):
    inst = scenarios.instantiate_one(name, Units(chunk, 96))
    if inst.trace is None:
        pytest.skip(inst.skip_reason)
    assert legacy_pieces(OURS, inst.trace, chunk) == simulate(OURS, inst.trace, chunk, "legacy")


def test_megatrons_rule_rounds_the_budget_and_never_leaves_a_one_token_remainder():
    """Hand-derived from Megatron's schedule_chunked_prefill: chunk = min(rest, budget left), one shorter when that
    would leave 1 token, deferred when that one shorter is 0 (0.19.2 dynamic_engine.py:1969-1976, and Megatron's run
    of piece_tails on zoo-bamba: rfill1_0 63 alone, then rtail1's 2 tokens whole); the budget 40 is rounded to 64; a
    prompt is partly added only at the queue's head."""
    got = legacy_pieces(MEGATRON, _tr(40, [65]), 8)
    assert got["r0"] == [Piece(0, 0, 63), Piece(1, 63, 2)]
    got = legacy_pieces(MEGATRON, _tr(40, [63, 2, 5]), 8)     # 63 whole; r1 would get 1 and leave 1: it waits
    assert got == {"r0": [Piece(0, 0, 63)], "r1": [Piece(1, 0, 2)], "r2": [Piece(1, 0, 5)]}
    got = legacy_pieces(MEGATRON, _tr(40, [63, 5]), 8)        # a 1-token cut leaving 4 is made
    assert got["r1"] == [Piece(0, 0, 1), Piece(1, 1, 4)]
    got = legacy_pieces(MEGATRON, _tr(64, [3, 130], [0, 1]), 8)   # r0's decode row takes one token of the budget
    assert got["r1"] == [Piece(1, 0, 63), Piece(2, 63, 64), Piece(3, 127, 3)]   # r0 finished: the whole 64


def _rules():
    """Budget-only rules (a piece cap, or a rule against one-token remainders, under which no split prompt ends
    with 1 token and the shape says so), chunked rules, ours and Megatron's."""
    capped = st.builds(StepRule, name=st.just("capped"), budget_multiple=st.sampled_from([1, 16, 64, 256]),
                       decode_takes_budget=st.booleans(), uses_prefill_chunk=st.booleans(),
                       chunk_aligned=st.just(False), fixed_piece=st.sampled_from([None, 32, 48, 512]),
                       one_partial_prefill=st.booleans())
    budget_only = st.builds(StepRule, name=st.just("budget-only"), budget_multiple=st.sampled_from([1, 16, 64, 256]),
                            decode_takes_budget=st.booleans(), uses_prefill_chunk=st.booleans(),
                            chunk_aligned=st.just(False), no_one_token_remainder=st.booleans(),
                            one_partial_prefill=st.booleans())
    chunked = st.builds(StepRule, name=st.just("chunked"), budget_multiple=st.sampled_from([1, 64]),
                        decode_takes_budget=st.booleans(), uses_prefill_chunk=st.just(True),
                        chunk_aligned=st.just(True), one_partial_prefill=st.booleans())
    return st.one_of(capped, budget_only, chunked, st.just(OURS), st.just(MEGATRON))


@settings(max_examples=80, deadline=None, derandomize=True)
@given(rule=_rules(), chunk=st.sampled_from([8, 64, 128, 256]), d_conv=st.sampled_from([2, 3, 4]))
def test_piece_tails_prompts_end_with_every_last_piece_one_to_d_conv_under_the_declared_rule(rule, chunk, d_conv):
    inst = scenarios.instantiate_one("piece_tails", Units(chunk, 96, d_conv=d_conv, rule=rule))
    shape = inst.shape
    never = [1] if rule.no_one_token_remainder else []       # the rule's own promise: no 1-token remainder
    assert shape["unreachable"] == never and shape["rule"] == rule.describe()
    assert set(shape["last_pieces"].values()) == set(range(1, d_conv + 1)) - set(never)
    prompts = {r.id: len(r.prompt) for r in inst.trace.requests}
    modes = ("legacy", "async") if rule == OURS else ("legacy",)
    for mode in modes:                      # recomputed on the parsed trace: the promise holds in every mode
        tails = split_tails(simulate(rule, inst.trace, chunk, mode), prompts)
        assert all(tails[rid] == n for rid, n in shape["last_pieces"].items()), mode


@pytest.mark.parametrize("chunk", (8, 64, 128, 256))
def test_under_megatrons_rule_short_pieces_come_from_groups_arriving_into_an_idle_engine(chunk):
    """Only the appended groups are promised: at chunk 8 the scenario's own mod64 ends 63 + 2 in the legacy
    schedule, but it arrives into a busy engine and Megatron's async run cut it 38 + 27."""
    inst = scenarios.instantiate_one("piece_tails", Units(chunk, 96, rule=MEGATRON))
    last = inst.shape["last_pieces"]
    assert last == {f"rtail{j}": j for j in range(2, 5)} and inst.shape["unreachable"] == [1]
    reqs = {r.id: r for r in inst.trace.requests}
    pieces = simulate(MEGATRON, inst.trace, chunk)
    for j in range(2, 5):                   # nothing else is live when a group arrives
        at = reqs[f"rtail{j}"].arrival_step
        earlier = [r for r in inst.trace.requests if r.arrival_step < at]
        assert all(pieces[r.id][-1].step + r.max_new_tokens < at for r in earlier)


def test_an_unreachable_length_is_named():
    """Under a cap of 32 with no one-token remainders no split prompt ends with 1 token (a cut never leaves one):
    the shape names 1 as unreachable instead of promising it."""
    rule = StepRule("capped", chunk_aligned=False, uses_prefill_chunk=False, fixed_piece=32,
                    no_one_token_remainder=True)
    inst = scenarios.instantiate_one("piece_tails", Units(256, 96, d_conv=2, rule=rule))
    assert inst.shape["unreachable"] == [1] and 1 not in inst.shape["last_pieces"].values()


def test_our_rule_leaves_piece_tails_as_it_was():
    inst = scenarios.instantiate_one("piece_tails", Units(8, 96))
    assert not any(r.id.startswith("rtail") for r in inst.trace.requests)
    assert set(inst.shape["last_pieces"]) >= {f"tail{j}" for j in range(1, 5)}


def test_parse_step_rule_reads_fields_and_names_a_bad_one():
    r = parse_step_rule("budget_multiple=64, chunk_aligned=false, uses_prefill_chunk=no, attention_block=16")
    assert (r.budget_multiple, r.chunk_aligned, r.uses_prefill_chunk, r.attention_block) == (64, False, False, 16)
    assert r.name == "--engine-budget" and r.budget(100) == 128 and r.cache_block(8) == 16
    for bad, field in (("budget_multiplier=64", "budget_multiplier"), ("chunk_aligned=maybe", "chunk_aligned"),
                       ("budget_multiple=0", "budget_multiple"), ("fixed_piece=x", "fixed_piece")):
        with pytest.raises(ScenarioError, match=field):
            parse_step_rule(bad)


def test_observed_pieces_read_a_schedule_log_and_schedule_facts():
    tr = _tr(64, [5, 70])

    class Run:
        schedule_log = {"steps": [{"step": 0, "batch": [{"kind": "prefill", "request": "r1", "pos": 0, "count": 64}]},
                                  {"step": 1, "batch": [{"kind": "prefill", "request": "r1", "pos": 64, "count": 6},
                                                        {"kind": "decode", "request": "r0", "pos": 5, "count": 1}]}]}
        schedule_facts = None
    assert observed_pieces(tr, Run())["r1"] == [Piece(0, 0, 64), Piece(1, 64, 6)]

    class Facts:
        schedule_log = None
        schedule_facts = [{"batches": [{"rows": [{"request": "r1", "pos": 0, "tokens": 63}]}]},
                          {"batches": [{"rows": [{"request": "r1", "pos": 63, "tokens": 7},
                                                 {"request": "r0", "pos": 5, "tokens": 1}]}]}]
    assert observed_pieces(tr, Facts()) == {"r0": [], "r1": [Piece(0, 0, 63), Piece(1, 63, 7)]}

    class Nothing:
        schedule_log = schedule_facts = None
    assert observed_pieces(tr, Nothing()) is None


@pytest.mark.parametrize("chunk", (8, 64, 128, 256))
def test_megatrons_declared_rule_gives_piece_tails_every_short_last_piece(chunk):
    """The rule the Megatron adapter declares (its max_tokens rounding; no prefill_chunk) gives 2..d_conv; a
    1-token last piece is named unreachable (Megatron never cuts a prompt to leave, or to take, one token)."""
    from hybridqual.adapters.megatron.adapter import MegatronRoundedAdapter
    rule = MegatronRoundedAdapter.capabilities("cpu").step_rule
    assert rule.budget(4 * chunk + 8) % 64 == 0 and not rule.uses_prefill_chunk
    inst = scenarios.instantiate_one("piece_tails", Units(chunk, 96, rule=rule))
    assert set(inst.shape["last_pieces"].values()) == {2, 3, 4} and inst.shape["unreachable"] == [1]


def test_prefix_lru_hits_land_on_the_engines_cache_blocks():
    rule = StepRule("blocks", mamba_block=16, attention_block=32)
    inst = scenarios.instantiate_one("prefix_lru", Units(8, 96, rule=rule))
    assert inst.trace.engine.prefix_cache.block_size == 32
    assert len(inst.trace.request("h1").prompt) == 32 + 1             # a hit then a 1-token suffix
    ours = scenarios.instantiate_one("prefix_lru", Units(8, 96))
    assert ours.trace.engine.prefix_cache.block_size == 8


def test_facts_without_rows_are_no_pieces():
    """Facts of another shape (per-request counts, a list) say nothing about pieces: None, never a wrong verdict."""
    tr = _tr(64, [5, 70])

    class Counts:
        schedule_log = None
        schedule_facts = [{"speculation": {"r0": [1, 0]}}, ["not", "a", "dict"], {"batches": [{"rows": [{"x": 1}]}]}]
    assert observed_pieces(tr, Counts()) is None
