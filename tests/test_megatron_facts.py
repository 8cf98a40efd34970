"""Megatron's schedule facts check (tools/adapters/megatron/schedule_facts.py) on facts shaped as the adapter records them
(default tier: pure Python, no Megatron). The facts below are the ones Megatron 0.19.2 produced on the compaction
trace of test_megatron_engine (zoo-bamba, legacy); the engine-tier run checks the live ones."""
from __future__ import annotations

import copy

from oracle.trace import parse_trace
from hybridqual.adapters.megatron.schedule_facts import problems, summary

TRACE = parse_trace({"schema": "hybridqual.trace/1", "description": "compaction",
                     "engine": {"max_requests": 3, "max_tokens_per_step": 64, "mode": "legacy", "prefill_chunk": 64},
                     "requests": [{"id": "a", "arrival_step": 0, "prompt": [5, 17, 29, 41], "max_new_tokens": 2},
                                  {"id": "b", "arrival_step": 0, "prompt": [7, 19, 31], "max_new_tokens": 5},
                                  {"id": "c", "arrival_step": 0, "prompt": [9, 21, 33, 45, 57],
                                   "max_new_tokens": 5}]})
TOKENS = {"a": [42, 19], "b": [53, 35, 67, 24, 62], "c": [95, 45, 62, 23, 35]}


def _row(req, slot, pos, n, m):
    return {"request": req, "slot": slot, "pos": pos, "tokens": n, "mamba_slot": m}


def _step(rows, padded, finished=()):
    return {"batches": [{"rows": rows, "padded_tokens": padded}], "finished": list(finished), "active": [],
            "cuda_graph": None, "waiting": 0, "paused": 0, "evicted": 0}


FACTS = [_step([_row("a", 0, 0, 4, 2), _row("b", 1, 0, 3, 1), _row("c", 2, 0, 5, 0)], 64),
         _step([_row("a", 0, 4, 1, 2), _row("b", 1, 3, 1, 1), _row("c", 2, 5, 1, 0)], 3, ["a"])] + [
         _step([_row("c", 0, 6 + k, 1, 0), _row("b", 1, 4 + k, 1, 1)], 3, ["c", "b"] if k == 2 else [])
         for k in range(3)]


def test_facts_of_megatrons_compaction_run_are_consistent_and_summarised():
    assert problems(TRACE, TOKENS, FACTS) == []
    line = summary(FACTS, TRACE)
    assert "row moves c row2→row0@s2" in line and "Mamba slots a:2 b:1 c:0" in line
    assert "prefill pieces a 0+4@s0, b 0+3@s0, c 0+5@s0" in line and "finished a@s1, c@s4, b@s4" in line


def test_moved_row_without_its_mamba_slot_is_a_problem():
    """What compact_slot_not_moved looks like in the facts: c lands in row 0 still pointing at a's slot 2."""
    bad = copy.deepcopy(FACTS)
    for s in bad[2:]:
        s["batches"][0]["rows"][0]["mamba_slot"] = 2
    got = problems(TRACE, TOKENS, bad)
    assert len(got) == 1 and got[0].startswith("c: its Mamba state slot changed"), got


def test_gap_in_a_prompt_and_a_start_past_zero_are_problems():
    gap = copy.deepcopy(FACTS)
    gap[0]["batches"][0]["rows"][2]["tokens"] = 3           # c's prefill stops at 3 of 5; its decode starts at 5
    assert any("c: step 1 row starts at 5, expected 3" in p for p in problems(TRACE, TOKENS, gap))
    late = copy.deepcopy(FACTS)
    late[0]["batches"][0]["rows"][1].update(pos=16, tokens=3)
    assert any("b: first row starts at position 16 with prefix caching off" in p
               for p in problems(TRACE, TOKENS, late))


def test_duplicate_rows_and_double_finishes_are_problems():
    dup = copy.deepcopy(FACTS)
    dup[1]["batches"][0]["rows"][1]["mamba_slot"] = 2
    dup[4]["finished"].append("a")
    got = problems(TRACE, TOKENS, dup)
    assert any("not distinct within a batch" in p for p in got)
    assert any("a: finished 2 times" in p for p in got)


def test_megatron_graphs_refuses_cpu_by_capability_with_the_reason():
    """megatron-graphs on CPU: no mode is declared, so every run is a SKIP naming why (no CUDA device)."""
    import pytest
    import torch
    from hybridqual.adapters.megatron.adapter import MegatronGraphsAdapter
    from hybridqual.adapters.megatron.mapping import UnsupportedConfig
    caps = MegatronGraphsAdapter.capabilities("cpu")
    assert caps.modes == () and "no CUDA device" in caps.why_not("legacy", "")
    if torch.cuda.is_available():
        assert MegatronGraphsAdapter.capabilities("cuda").modes == ("legacy", "async")
    with pytest.raises(UnsupportedConfig, match="device: megatron-graphs captures CUDA graphs"):
        MegatronGraphsAdapter("goldens/models/zoo-bamba", TRACE, "legacy", "cpu")


def test_an_evicted_request_may_restart_from_zero_in_another_slot_only_when_evictions_are_counted():
    trace = parse_trace({"schema": "hybridqual.trace/1", "description": "eviction",
                         "engine": {"max_requests": 2, "max_tokens_per_step": 64, "mode": "legacy",
                                    "prefill_chunk": 64},
                         "requests": [{"id": "b", "arrival_step": 0, "prompt": [7, 19, 31], "max_new_tokens": 2}]})
    facts = [_step([_row("b", 0, 0, 3, 1)], 64), _step([_row("b", 0, 3, 1, 1)], 1),
             _step([_row("b", 1, 0, 3, 0)], 64), _step([_row("b", 1, 3, 1, 0)], 1, ["b"])]
    tokens = {"b": [53, 35]}
    assert any("row starts at 0, expected 4" in p for p in problems(trace, tokens, facts))
    facts[1]["evicted"] = 1
    assert problems(trace, tokens, facts) == []
