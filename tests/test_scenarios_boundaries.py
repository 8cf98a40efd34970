"""The engine-aware boundary scenarios (tools/scenarios/boundaries.py) reach what they claim, for every
chunk size, and the fast path follows the oracle through them (the fast test that kills the per-report mutants)."""
from __future__ import annotations

import pytest

import oracle
from oracle.scheduler import run_trace as oracle_run
from oracle.trace import load_trace
from hybridqual.scenarios import boundaries, plan as scenarios
from hybridqual.scenarios.edges import ScheduleModel
from hybridqual.scenarios.units import Units

CHUNKS = (4, 8, 16, 256)


def _log(trace, chunk: int, vocab: int = 96) -> dict:
    return oracle_run(ScheduleModel(vocab, chunk), trace, "legacy").schedule_log.to_json()


def _inst(name: str, chunk: int, d_conv: int = 4):
    return scenarios.instantiate_one(name, Units(chunk, 96, d_conv=d_conv))


def _last_pieces(log: dict, trace) -> dict[str, int]:
    """request -> the length of its last prefill piece."""
    plen = {r.id: len(r.prompt) for r in trace.requests}
    return {b["request"]: b["count"] for s in log["steps"] for b in s["batch"]
            if b["kind"] == "prefill" and b["pos"] + b["count"] == plen[b["request"]]}


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("d_conv", (2, 4))
def test_piece_tails_hit_every_last_piece_length_and_every_granularity(chunk, d_conv):
    inst = _inst("piece_tails", chunk, d_conv)
    log = _log(inst.trace, chunk)
    last = _last_pieces(log, inst.trace)
    assert {last[f"tail{j}"] for j in range(1, d_conv + 1)} == set(range(1, d_conv + 1))
    lens = {len(r.prompt) for r in inst.trace.requests}
    for g in boundaries.granularities(Units(chunk, 96)):
        assert g + 1 in lens and (g + 1) % g == 1                                # = 1 mod every granularity
    first = log["steps"][0]
    assert {"one_a", "one_b"} <= {b["request"] for b in first["batch"] if b["kind"] == "prefill"}   # co-batched
    freed = {f["slot"] for s in log["steps"] for f in s["free"]}
    late = [a for s in log["steps"] for a in s["admit"] if a["request"] == "one_late"]
    assert late and late[0]["slot"] in freed                                       # a reused slot


@pytest.mark.parametrize("chunk", CHUNKS)
def test_an_engines_declared_granularity_gets_a_prompt_one_past_it(chunk):
    """An adapter's piece rule (Capabilities.piece_granularities) or --piece-granularity joins the sweep."""
    plain = {len(r.prompt) for r in _inst("piece_tails", chunk).trace.requests}
    inst = scenarios.instantiate_one("piece_tails", Units(chunk, 96, granularities=(48, 100)))
    lens = {len(r.prompt) for r in inst.trace.requests}
    assert {49, 101} <= lens and not {49, 101} & plain
    assert boundaries.granularities(Units(chunk, 96, granularities=(48,))) == sorted({chunk, 16, 48, 64})


def test_engine_granularities_merge_the_adapters_rule_and_the_cli():
    from hybridqual.adapters.megatron.adapter import MegatronAdapter
    from hybridqual.adapters.fastpath import FastpathAdapter
    from hybridqual.qualify import runner
    args = runner.parse_args(["--piece-granularity", "48", "16"])
    assert runner.engine_granularities(args, FastpathAdapter) == (16, 48)
    assert runner.engine_granularities(args, MegatronAdapter) == (16, 48, 64)
    with pytest.raises(scenarios.ScenarioError, match="granularity 0"):
        scenarios.instantiate(scenarios.MODELS / "zoo-mamba2", oracle.from_hf_config(
            scenarios.MODELS / "zoo-mamba2" / "config.json"), ["piece_tails"], (0,))


@pytest.mark.parametrize("chunk", CHUNKS)
def test_cobatch_reuse_co_batches_twins_and_reuses_freed_slots_at_once(chunk):
    inst = _inst("cobatch_reuse", chunk)
    log = _log(inst.trace, chunk)
    prompts = {r.id: r.prompt for r in inst.trace.requests}
    first = [b["request"] for b in log["steps"][0]["batch"] if b["kind"] == "prefill"]
    assert {"same_a", "same_b", "same_s"} <= set(first) and prompts["same_a"] == prompts["same_b"]
    free_step = {}
    for s in log["steps"]:
        for f in s["free"]:
            free_step.setdefault(f["slot"], []).append(s["step"])
    for s in log["steps"]:
        for a in s["admit"]:
            if a["request"] in ("reuse_one", "same_t", "same_late"):   # each in a slot freed the step before
                assert s["step"] - 1 in free_step.get(a["slot"], []), (a, free_step)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_prefix_lru_store_and_last_use_orders_disagree_then_an_eviction(chunk):
    inst = _inst("prefix_lru", chunk)
    assert inst.trace.engine.prefix_cache.capacity >= 2
    log = _log(inst.trace, chunk)
    hits = {h["request"]: (s["step"], h["pos"])
            for s in log["steps"] for h in s.get("prefix_cache", {}).get("hits", [])}
    evicted = [(s["step"], e["request"]) for s in log["steps"] for e in s.get("prefix_cache", {}).get("evicted", [])]
    assert set(hits) == {"h1", "h1b", "h3b"}                          # h2b misses: X2 was the LRU entry
    assert evicted[0][1] == "s2" and hits["h1"][0] < evicted[0][0]    # X1 hit after X2's store, X2 evicted
    assert hits["h1b"][0] == hits["h3b"][0]                            # two hits admitted in one step
    plen = {r.id: len(r.prompt) for r in inst.trace.requests}
    tails = {rid: plen[rid] - hits[rid][1] for rid in hits}
    assert 1 in tails.values() and any(t < 4 - 1 for t in tails.values())   # = 1 mod the block; < d_conv - 1


def test_prefix_lru_kills_a_cache_that_does_not_touch_on_hit():
    """An LRU that orders by store only (no touch on a hit) evicts X1 and changes the hits: the scenario tells."""
    from oracle import prefix_cache as opc
    inst = _inst("prefix_lru", 8)
    want = _log(inst.trace, 8)
    real = opc.PrefixCache.lookup

    def no_touch(self, prompt, step):
        keep = {k: e.last_use for k, e in self.entries.items()}
        out = real(self, prompt, step)
        for k, e in self.entries.items():
            e.last_use = keep[k]
        return out
    opc.PrefixCache.lookup = no_touch
    try:
        got = _log(inst.trace, 8)
    finally:
        opc.PrefixCache.lookup = real
    assert got != want


def test_spec_accept_hits_every_acceptance_boundary_with_compaction():
    """The shipped spec_accept on its model: full acceptance of 1, 2 and 3 drafts, rejection at the last draft of
    1, 2 and 3, zero drafts right after accepting, and a verify row that rejected its last draft moved in its step."""
    from hybridqual.paths import MODELS, TRACES
    trace = load_trace(TRACES / "spec_accept.json")
    from oracle.trace import dump_trace, parse_trace
    made = parse_trace(boundaries.spec_accept_trace(boundaries.spec_accept_greedy(MODELS / boundaries.SPEC_MODEL)))
    assert dump_trace(made) == (TRACES / "spec_accept.json").read_text().strip()    # the tool's output, unedited
    log = oracle_run(oracle.load(MODELS / boundaries.SPEC_MODEL), trace, "legacy").schedule_log.to_json()
    full, last_rejected, zero_after, moved_rejecting = set(), set(), False, False
    prev_accept: dict[str, bool] = {}
    for s in log["steps"]:
        m = {b["request"]: b["count"] - 1 for b in s["batch"] if b["kind"] == "verify"}
        moved = {x["request"] for x in s["moves"]}
        for v in s.get("verify") or []:
            rid, a = v["request"], v["accepted"]
            if a == m[rid]:
                full.add(a)
            elif a == m[rid] - 1:
                last_rejected.add(m[rid])
                moved_rejecting |= rid in moved
        for b in s["batch"]:
            if b["kind"] == "decode" and prev_accept.get(b["request"]):
                zero_after = True
        prev_accept = {v["request"]: v["accepted"] > 0 for v in s.get("verify") or []}
    assert full >= {1, 2, 3} and last_rejected >= {1, 2, 3} and zero_after and moved_rejecting


@pytest.mark.parametrize("mode", ["legacy", "async"])
def test_spec_device_has_decode_loop_rows_where_the_oldest_match_differs_and_seeded_rows_accept(mode):
    """The shipped spec_device on its model: verify rows in steps without prefill (where device drafts run) whose
    oldest earlier match would propose otherwise, and seeded rows that accept drafts there (their later positions
    are sampled under their own keys); the logged proposals are the most recent match's."""
    from hybridqual.paths import MODELS, TRACES
    from oracle.speculative import ngram_propose
    import re
    from oracle.trace import dump_trace, parse_trace
    trace = load_trace(TRACES / "spec_device.json")
    seed = int(re.search(r"candidate (\d+)", trace.description).group(1))
    assert dump_trace(parse_trace(boundaries.spec_device_trace(seed))) == (TRACES / "spec_device.json").read_text().strip()
    assert trace.engine.speculative.proposer.kind == "ngram"
    result = oracle_run(oracle.load(MODELS / boundaries.SPEC_MODEL), trace, mode)
    rows = boundaries.decode_loop_verifies(trace, result)
    assert rows and all(ngram_propose(v["history"], boundaries.DEVICE_K, *boundaries.DEVICE_N)[:len(v["proposals"])]
                        == v["proposals"] for v in rows)
    got = boundaries.spec_device_conditions(trace, result)
    assert got["oldest_differs"] >= 2 and got["seeded_accepting"] >= 3, got


def test_oldest_match_is_the_other_end_of_the_same_lookup():
    toks = [3, 4, 5, 9, 3, 4, 6, 8, 3, 4]
    assert boundaries.oldest_match(toks, 2, 1, 2) == [5, 9]
    from oracle.speculative import ngram_propose
    assert ngram_propose(toks, 2, 1, 2) == [6, 8]
    assert boundaries.oldest_match([1, 2, 3], 3, 1, 2) == ngram_propose([1, 2, 3], 3, 1, 2) == []


@pytest.mark.parametrize("name", ["piece_tails", "cobatch_reuse"])
def test_boundary_scenarios_through_the_engine_equal_the_oracle(name):
    """piece_tails and cobatch_reuse on the shipped zoo-mamba2 (plain-torch kernels, both modes): tokens and the
    schedule log equal the fp64 oracle's."""
    import fastpath
    from fastpath.options import FastOptions
    model_dir = scenarios.MODELS / "zoo-mamba2"
    cfg = oracle.from_hf_config(model_dir / "config.json")
    trace = scenarios.instantiate(model_dir, cfg, [name])[0].trace
    want_model = oracle.load(model_dir)
    eng = fastpath.Engine.from_pretrained(model_dir, trace.engine, max_len=128, options=FastOptions(backend="torch"))
    for mode in ("legacy", "async"):
        got, want = eng.run_trace(trace, mode), oracle_run(want_model, trace, mode)
        assert got.tokens == want.tokens, mode
        assert got.schedule_log.to_json() == want.schedule_log.to_json(), mode


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("mode", ("legacy", "async"))
def test_decode_buckets_walks_every_decode_row_count_with_slot_zero_live_to_the_end(chunk, mode):
    """Decode-only steps of every row count 1..8 (so buckets of 1, 2, 4, 8 pad 3, 5, 6, 7 rows), slot 0 held by d0
    in every step, compactions with moves, and the late request admitted into a freed slot."""
    inst = _inst("decode_buckets", chunk)
    log = oracle_run(ScheduleModel(96, chunk), inst.trace, mode).schedule_log.to_json()
    decode_only = [len(s["batch"]) for s in log["steps"]
                   if s["batch"] and all(b["kind"] in ("decode", "extra") for b in s["batch"])]
    assert set(decode_only) == set(range(1, boundaries.DECODE_ROWS + 1)), decode_only
    assert all(b["request"] == "d0" for s in log["steps"] for b in s["batch"] if b["slot"] == 0)
    assert log["steps"][-1]["batch"][0]["request"] == "d0"
    assert sum(len(s["moves"]) for s in log["steps"]) >= 3
    late = next(b for s in log["steps"] for b in s["batch"] if b["request"] == "late")
    assert late["slot"] != 0 and late["kind"] == "prefill"


def test_decode_buckets_through_padded_decode_buckets_equal_the_oracle():
    """decode_buckets on the shipped zoo-bamba with decode steps padded to buckets (pad_decode: the shapes CUDA
    graphs replay, run eagerly; plain-torch kernels, both modes): tokens and schedule log equal the fp64 oracle's."""
    import fastpath
    from fastpath.options import FastOptions
    model_dir = scenarios.MODELS / "zoo-bamba"
    cfg = oracle.from_hf_config(model_dir / "config.json")
    trace = scenarios.instantiate(model_dir, cfg, ["decode_buckets"])[0].trace
    want_model = oracle.load(model_dir)
    eng = fastpath.Engine.from_pretrained(model_dir, trace.engine, max_len=64, options=FastOptions(backend="torch"),
                                          pad_decode=True)
    for mode in ("legacy", "async"):
        got, want = eng.run_trace(trace, mode), oracle_run(want_model, trace, mode)
        assert got.tokens == want.tokens, mode
        assert got.schedule_log.to_json() == want.schedule_log.to_json(), mode


@pytest.mark.parametrize("chunk", CHUNKS)
def test_long_context_has_a_short_piece_past_the_split_key_boundary(chunk):
    """long_context's second piece has <= 256 queries (the pieces split-key attention takes) and its context end
    passes LONG_KEYS keys; a model with fewer positions skips it with the reason."""
    from fastpath.kernels.attention import SPLIT_MAX_QUERIES, SPLIT_MIN_KEYS
    assert boundaries.LONG_KEYS == SPLIT_MIN_KEYS and boundaries.LONG_TAIL <= SPLIT_MAX_QUERIES   # still our boundary
    inst = _inst("long_context", chunk)
    log = _log(inst.trace, chunk)
    pieces = [b for s in log["steps"] for b in s["batch"] if b["kind"] == "prefill"]
    last = pieces[-1]
    assert len(pieces) == 2 and last["count"] <= 256 and last["pos"] + last["count"] > boundaries.LONG_KEYS
    short = scenarios.instantiate_one("long_context", Units(chunk, 96, positions=256))
    assert short.trace is None and "max_position_embeddings 256" in short.skip_reason
