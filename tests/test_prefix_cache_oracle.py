"""The truth's prefix cache (DESIGN §12, docs/scheduler.md §9): keys, lookup, LRU, restore == fresh prefill,
tokens == each request alone, bad input named by field, and old traces' logs untouched."""
from __future__ import annotations

import copy

import pytest
import torch

from oracle import zoo
from oracle.prefix_cache import PrefixCache, block_keys, boundaries
from oracle.scheduler import run_request_alone, run_trace
from oracle.trace import EngineConfig, PrefixCacheConfig, Request, Trace, TraceError, parse_trace
from test_scheduler_fake import FakeModel

SYS = tuple((7 * i + 3) % 60 + 1 for i in range(16))


def _trace(reqs, R=2, budget=24, P=16, B=8, M=2, mode="legacy") -> Trace:
    pc = PrefixCacheConfig(B, M) if B else None
    return Trace(EngineConfig(R, budget, P, mode, prefix_cache=pc),
                 tuple(Request(i, a, tuple(p), n) for i, a, p, n in reqs))


def _events(result, kind):
    return [(s["step"], e["request"], e["pos"]) for s in result.schedule_log.to_json()["steps"]
            for e in s["prefix_cache"][kind]]


def test_chain_keys_are_equal_exactly_for_equal_prefixes():
    a = block_keys(SYS + (1, 2), 8)
    b = block_keys(SYS[:8] + (9,) + SYS[9:], 8)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]          # same block 1, different block 2
    assert block_keys(SYS, 8)[1] == a[1]                            # the key of p depends only on prompt[0:p]
    assert block_keys((1,) * 16, 8)[0] != block_keys((1,) * 16, 8)[1]   # chained: equal blocks, different keys
    assert block_keys(SYS[:7], 8) == []


def test_a_piece_stores_every_boundary_it_passes_or_ends_on():
    assert boundaries(0, 16, 8) == [8, 16] and boundaries(8, 8, 8) == [16] and boundaries(3, 20, 8) == [8, 16]
    assert boundaries(0, 7, 8) == [] and boundaries(16, 3, 8) == []      # no boundary in (pos, pos + count]


def test_lookup_leaves_one_token_and_lru_evicts_earliest_stored_on_ties():
    c = PrefixCache(8, 2)
    c.store(SYS, 8, "a", "s8", step=0)
    c.store(SYS, 16, "a", "s16", step=0)
    assert c.lookup(SYS, step=1)[0] == 8                 # p = 16 would leave no prompt token to compute
    assert c.lookup(SYS + (5,), step=1)[0] == 16
    assert c.lookup((SYS[0] + 1,) + SYS[1:], step=1) == (0, None)
    stored, evicted = c.store(SYS[:8] + (1,) * 8, 16, "b", "x", step=1)   # both entries last used at step 1
    assert stored is not None and (evicted.owner, evicted.pos) == ("a", 8)   # tie: the earliest stored goes
    assert c.store(SYS[:8] + (1,) * 8, 16, "c", "y", step=2) == (None, None)  # exists: no store, no eviction
    assert len(c.entries) == 2


def test_restored_checkpoint_continues_like_a_fresh_prefill_of_the_whole_prompt():
    """A checkpoint is the state at p; the suffix from it is the very computation chunked prefill does (bitwise)
    and equals one whole-prompt prefill to fp64 rounding (measured max |diff| below 1e-12 on these logits)."""
    m = zoo.build("bamba", seed=0)
    prompt = list(SYS) + [5, 6, 7]
    _, at_p = m.prefill(prompt[:16])
    cache = PrefixCache(8, 1)
    cache.store(tuple(prompt), 16, "owner", at_p, step=0)
    p, entry = cache.lookup(tuple(prompt), step=1)
    restored = cache.restore(entry)
    assert p == 16 and restored.position == 16 and all(restored.k[i].shape[0] == 16 for i in restored.k)
    got, st = m.prefill(prompt[16:], restored)
    chunked, _ = m.prefill(prompt[16:], copy.deepcopy(at_p))
    whole, st_whole = m.prefill(prompt)
    assert torch.equal(got, chunked)
    diff = (got - whole[16:]).abs().max().item()
    assert diff < 1e-12, diff
    a, _ = m.decode(3, st)
    b, _ = m.decode(3, st_whole)
    assert (a - b).abs().max().item() < 1e-12


@pytest.mark.parametrize("model", ["fake", "bamba", "mamba2"])
@pytest.mark.parametrize("mode", ["legacy", "async"])
def test_cached_run_gives_each_request_its_tokens_alone_and_hits_as_predicted(model, mode):
    m = FakeModel(vocab_size=64, chunk_size=8, seed=1) if model == "fake" else zoo.build(model, seed=0)
    t = _trace([("a", 0, SYS + (5, 6, 7), 3), ("b", 3, SYS + (9,), 3),
                ("c", 4, SYS[:8] + tuple(range(1, 10)), 2)], mode=mode)
    r = run_trace(m, t)
    for req in t.requests:
        assert r.tokens[req.id] == run_request_alone(m, req)[0], req.id
    assert _events(r, "hits") == [(3, "b", 16), (4, "c", 8)]
    # a's first piece [0, 16) stores both boundaries (8 inside it, 16 at its end); c's piece [8, 17) stores 16
    assert _events(r, "stored") == [(0, "a", 8), (0, "a", 16), (4, "c", 16)]
    assert _events(r, "evicted") == [(4, "a", 16)]                  # a@8 was hit at step 4: a@16 is the LRU one
    admits = {a["request"]: a["cached_tokens"] for s in r.schedule_log.to_json()["steps"] for a in s["admit"]}
    assert admits == {"a": 0, "b": 16, "c": 8}


def test_cache_on_and_off_give_the_same_tokens_and_the_off_log_has_no_cache_keys():
    m = zoo.build("bamba", seed=0)
    reqs = [("a", 0, SYS + (5, 6, 7), 3), ("b", 3, SYS + (9,), 3)]
    on, off = run_trace(m, _trace(reqs)), run_trace(m, _trace(reqs, B=0))
    assert on.tokens == off.tokens
    for s in off.schedule_log.to_json()["steps"]:
        assert "prefix_cache" not in s and all("cached_tokens" not in a for a in s["admit"])


def _raw(pc) -> dict:
    return {"schema": "hybridqual.trace/1", "engine": {"max_requests": 1, "max_tokens_per_step": 8,
                                                       "prefill_chunk": 8, "prefix_cache": pc},
            "requests": [{"id": "a", "arrival_step": 0, "prompt": [1, 2], "max_new_tokens": 1}]}


@pytest.mark.parametrize("pc,field", [({"block_size": 0, "capacity": 1}, "engine.prefix_cache.block_size"),
                                      ({"block_size": 8, "capacity": 0}, "engine.prefix_cache.capacity"),
                                      ({"block_size": 8.0, "capacity": 1}, "engine.prefix_cache.block_size"),
                                      ({"block_size": 8, "capacity": True}, "engine.prefix_cache.capacity"),
                                      ({"block_size": 8}, "engine.prefix_cache.capacity"),
                                      ({"block_size": 8, "capacity": 1, "lru": 1}, "engine.prefix_cache.lru"),
                                      (None, "engine.prefix_cache")])
def test_malformed_prefix_cache_is_a_trace_error_naming_the_field(pc, field):
    with pytest.raises(TraceError, match="^" + field.replace(".", r"\.") + ":"):
        parse_trace(_raw(pc))


def test_block_size_off_the_chunk_grid_and_a_model_without_mamba_are_rejected():
    with pytest.raises(TraceError, match=r"^engine\.prefix_cache\.block_size: must be a positive multiple of the "
                                         r"model's chunk_size 8, got 12"):
        run_trace(zoo.build("bamba", seed=0), _trace([("a", 0, SYS, 1)], B=12))
    attn_only = zoo.build("bamba", seed=0, pattern="*")
    with pytest.raises(TraceError, match=r"^engine\.prefix_cache: the model has no Mamba layers"):
        run_trace(attn_only, _trace([("a", 0, SYS, 1)]))
    assert parse_trace(_raw({"block_size": 8, "capacity": 1})).engine.prefix_cache == PrefixCacheConfig(8, 1)
