"""The fast path's prefix cache (DESIGN §12, docs/engine.md "Prefix cache"): checkpoints in the bank's pool
slots, cache on == cache off bitwise (tokens and logits), the engine's cache events == the oracle's, the
qualification checks (an inert cache fails them), bad input named by field."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastpath import Engine, FastModel  # noqa: E402
from fastpath.batch_invariant import BatchInvariantEngine, BatchInvariantModel, run_recording_logits  # noqa: E402
from fastpath.engine.prefix_cache import block_keys  # noqa: E402
from oracle import zoo  # noqa: E402
from oracle.model import OracleModel  # noqa: E402
from oracle.scheduler import run_trace as oracle_run_trace  # noqa: E402
from oracle.trace import EngineConfig, PrefixCacheConfig, Request, Trace, TraceError, load_trace  # noqa: E402
from hybridqual.qualify.prefix_checks import engine_runner, prefix_cache_checks  # noqa: E402

SYS = tuple(16 + (7 * i + 3) % 48 for i in range(16))
HYBRID = dict(pattern="M*", hidden_size=16, mamba_n_heads=2, mamba_n_groups=1, n_attn_heads=2, n_kv_heads=1)
GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = Path(__file__).resolve().parents[1]
PREFIX_TRACES = sorted((ROOT / "goldens" / "traces").glob("prefix_*.json"))


def _weights(device="cpu", dtype=torch.float32, cls=FastModel):
    cfg = zoo.tiny_config("bamba", **HYBRID)
    w = zoo.random_weights(cfg, seed=3)
    return cfg, w, cls(cfg, w, device, dtype)


@pytest.fixture(scope="module")
def hybrid():
    cfg, w, fast = _weights()
    return OracleModel(cfg, w, dtype=torch.float64), fast


def _trace(reqs, R=2, budget=24, P=8, B=8, M=2, mode="legacy") -> Trace:
    return Trace(EngineConfig(R, budget, P, mode, prefix_cache=PrefixCacheConfig(B, M) if B else None),
                 tuple(Request(i, a, tuple(p), n) for i, a, p, n in reqs))


def _max_len(t: Trace) -> int:
    return max(len(r.prompt) + r.max_new_tokens for r in t.requests)


def _hits(result) -> dict[str, int]:
    return {a["request"]: a["cached_tokens"] for s in result.schedule_log.to_json()["steps"] for a in s["admit"]}


def _same_logits(on: dict, off: dict) -> None:
    assert sorted(on) == sorted(off)
    bad = {k: (on[k] - off[k]).abs().max().item() for k in on if not torch.equal(on[k], off[k])}
    assert not bad, f"logits rows differ cache on vs off: {bad}"


def test_cache_on_equals_cache_off_bitwise_tokens_and_logits(hybrid):
    """Requests one after another (same step shapes on/off), prefill_chunk = block_size (same piece ends): the hit
    resumes at 16 from the checkpoint; tokens and every sampled logits row are bitwise those of the cold run."""
    _, fast = hybrid
    reqs = [("a", 0, SYS + (20, 21, 22), 2), ("b", 5, SYS + (40,), 2)]
    on_t, off_t = _trace(reqs, R=1, budget=16), _trace(reqs, R=1, budget=16, B=0)
    on, on_rows = run_recording_logits(Engine(fast, on_t.engine, max_len=_max_len(on_t)), on_t, "legacy")
    off, off_rows = run_recording_logits(Engine(fast, off_t.engine, max_len=_max_len(off_t)), off_t, "legacy")
    assert _hits(on) == {"a": 0, "b": 16}
    assert on.tokens == off.tokens
    _same_logits(on_rows, off_rows)


def test_cache_on_equals_cache_off_bitwise_in_batch_invariant_mode_while_the_owner_runs():
    """Hits while the owner still decodes, two hitters admitted together: batch-invariant kernels make every row's
    bits independent of the batch, so cache on == off bitwise for every request, async too."""
    _, _, fast = _weights(cls=BatchInvariantModel)
    reqs = [("a", 0, SYS + (20, 21, 22), 2), ("b", 2, SYS + (40,), 1), ("c", 2, SYS[:12], 1)]
    rows = {}
    for B in (8, 0):
        t = _trace(reqs, R=3, budget=40, B=B, mode="async")
        rows[B] = run_recording_logits(BatchInvariantEngine(fast, t.engine, max_len=_max_len(t)), t, "async")
    (on, on_rows), (off, off_rows) = rows[8], rows[0]
    assert _hits(on) == {"a": 0, "b": 16, "c": 8}
    assert on.tokens == off.tokens
    _same_logits(on_rows, off_rows)


def _follows_oracle(engine: Engine, oracle_model, trace: Trace, mode: str) -> None:
    got, want = engine.run_trace(trace, mode), oracle_run_trace(oracle_model, trace, mode)
    g, w = got.schedule_log.to_json()["steps"], want.schedule_log.to_json()["steps"]
    for a, b in zip(g, w):
        assert a == b, f"{mode}: schedule log differs at step {b['step']}"
    assert len(g) == len(w) and got.tokens == want.tokens


def _close_to_cold(fast, trace: Trace, mode: str) -> None:
    """Tokens are a blunt check on a tiny random model (a wrong state can keep the argmax): every sampled logits row
    with the cache must match the same engine's cold run (cache field removed). Same fp32 kernels; only the batch
    composition differs, which moves rows by < 2e-6 (measured); a wrong restored state moved them by ~0.9."""
    from hybridqual.qualify.prefix_checks import without_cache
    off = without_cache(trace)
    _, on_rows = run_recording_logits(Engine(fast, trace.engine, max_len=_max_len(trace)), trace, mode)
    _, off_rows = run_recording_logits(Engine(fast, off.engine, max_len=_max_len(trace)), off, mode)
    assert sorted(on_rows) == sorted(off_rows)
    for k in on_rows:
        assert torch.allclose(on_rows[k], off_rows[k], rtol=0, atol=1e-4), (k, (on_rows[k] - off_rows[k]).abs().max())


@pytest.mark.parametrize("path", PREFIX_TRACES, ids=[p.stem for p in PREFIX_TRACES])
def test_prefix_traces_follow_the_oracle_on_the_torch_stand_ins(hybrid, path):
    """The corpus prefix traces, both modes, on the plain-torch kernels (fast; the Triton run is the corpus test of
    test_engine_trace.py): cache events, pieces and tokens equal the oracle's."""
    oracle_model, fast = hybrid
    trace = load_trace(path)
    eng = Engine(fast.with_options(backend="torch"), trace.engine, max_len=_max_len(trace))
    for mode in ("legacy", "async"):
        _follows_oracle(eng, oracle_model, trace, mode)
    _close_to_cold(fast.with_options(backend="torch"), trace, "async")


def test_hit_admitted_without_a_piece_survives_the_eviction_of_its_entry(hybrid):
    """'late' hits the 16-block at step 2 but the budget leaves it no piece until step 4, while 'long' stores a
    block every step and (capacity 1) evicts the entry 'late' hit: the copy made at admission is what it resumes
    from, not the pool slot as it is when its first piece runs."""
    oracle_model, fast = hybrid
    long = tuple(16 + (5 * i + 1) % 48 for i in range(32))
    t = _trace([("long", 0, long, 2), ("late", 2, long[:16] + (50, 51, 52), 2)], budget=9, M=1)
    torch_fast = fast.with_options(backend="torch")
    eng = Engine(torch_fast, t.engine, max_len=_max_len(t))
    _follows_oracle(eng, oracle_model, t, "legacy")
    steps = eng.log.to_json()["steps"]
    assert steps[2]["admit"][0]["cached_tokens"] == 16 and [b["request"] for b in steps[2]["batch"]] == ["long"]
    assert steps[2]["prefix_cache"]["evicted"] == [{"request": "long", "pos": 16}]
    _close_to_cold(torch_fast, t, "legacy")


def test_checkpoints_live_in_the_bank_pool_which_never_moves(hybrid):
    oracle_model, fast = hybrid
    t = _trace([("a", 0, SYS + (20,), 2), ("b", 3, SYS + (41,), 2), ("c", 4, SYS[:8] + (30,) * 8 + (31,), 2)],
               M=1)
    eng = Engine(fast.with_options(backend="torch"), t.engine, max_len=_max_len(t))
    bank, R = eng.bank, t.engine.max_requests
    assert bank.conv_state.shape[1] == bank.ssm_state.shape[1] == bank.k_cache.shape[1] == R + 1
    ptrs = bank.data_ptrs()
    restored = []
    original = eng.prefix.admit

    def admit(st, slot, rec, step):             # after a hit, the slot holds exactly the checkpoint
        original(st, slot, rec, step)
        p = rec.admit[-1]["cached_tokens"]
        if p:
            e = next(e for e in eng.prefix.entries.values() if e.pos == p)
            src = bank.pool_slot(e.index)
            assert torch.equal(bank.conv_state[:, slot], bank.conv_state[:, src])
            assert torch.equal(bank.ssm_state[:, slot], bank.ssm_state[:, src])
            assert torch.equal(bank.k_cache[:, slot, :p], bank.k_cache[:, src, :p])
            restored.append((st.req.id, p))
    eng.prefix.admit = admit
    got = eng.run_trace(t)
    want = oracle_run_trace(oracle_model, t)
    assert got.tokens == want.tokens and got.digest == want.digest
    assert restored == [("b", 16)]             # capacity 1: a's 16-block evicted its 8-block, so c misses
    _close_to_cold(fast.with_options(backend="torch"), t, "legacy")   # b's KV [0, 16) and state really are a's
    assert bank.data_ptrs() == ptrs and all(s < R for s in got.schedule_log.to_json()["steps"][-1]["row_to_slot"])
    assert eng.prefix.evictions >= 1


def test_lookup_always_leaves_a_prompt_token_to_compute(hybrid):
    _, fast = hybrid
    eng = Engine(fast, _trace([("a", 0, SYS, 1)]).engine, max_len=32)
    c = eng.prefix
    assert block_keys(SYS, 8)[1] == block_keys(SYS + (1, 2), 8)[1]
    c.file(SYS, 8, "a", step=0)
    c.file(SYS, 16, "a", step=0)
    assert c.lookup(SYS, 1)[0] == 8 and c.lookup(SYS + (9,), 1)[0] == 16 and c.lookup(SYS[:8], 1) == (0, None)


def test_inert_cache_fails_the_policy_check_with_zero_of_n_hits(hybrid):
    """A fast path whose lookup always misses still gives the right tokens (cache on == off passes) but the event
    check fails: '0 of N expected hits'. The real cache passes both."""
    oracle_model, fast = hybrid
    t = _trace([("a", 0, SYS + (20, 21), 2), ("b", 3, SYS + (40,), 2), ("c", 3, SYS[:9], 2)], R=3, budget=32)

    def build(inert):
        def make(trace):
            eng = Engine(fast.with_options(backend="torch"), trace.engine, max_len=_max_len(trace))
            if inert and eng.prefix is not None:
                eng.prefix.lookup = lambda prompt, step: (0, None)
            return eng
        return make
    good = prefix_cache_checks("t", t, oracle_model, engine_runner(build(False)))
    inert = prefix_cache_checks("t", t, oracle_model, engine_runner(build(True)))
    assert [c.status for c in good] == ["PASS", "PASS"], [c.detail for c in good]
    assert inert[0].status == "PASS" and inert[1].status == "FAIL"
    assert "0 of 2 expected hits" in inert[1].detail


def test_bad_prefix_cache_configs_are_errors_naming_the_field(hybrid):
    _, fast = hybrid
    with pytest.raises(TraceError, match=r"^engine_config\.prefix_cache\.block_size: must be a positive multiple"):
        Engine(fast, EngineConfig(2, 24, 8, prefix_cache=PrefixCacheConfig(12, 1)), max_len=32)
    with pytest.raises(TraceError, match=r"^engine_config\.prefix_cache\.capacity: must be >= 1"):
        Engine(fast, EngineConfig(2, 24, 8, prefix_cache=PrefixCacheConfig(8, 0)), max_len=32)
    cfg = zoo.tiny_config("bamba", **{**HYBRID, "pattern": "*"})
    attn_only = FastModel(cfg, zoo.random_weights(cfg, seed=1), "cpu", torch.float32)
    with pytest.raises(TraceError, match=r"^engine_config\.prefix_cache: the model has no Mamba layers"):
        Engine(attn_only, EngineConfig(2, 24, 8, prefix_cache=PrefixCacheConfig(8, 1)), max_len=32)
    eng = Engine(fast, EngineConfig(2, 24, 8, prefix_cache=PrefixCacheConfig(8, 1)), max_len=32)
    with pytest.raises(TraceError, match=r"^engine: trace engine config"):
        eng.run_trace(_trace([("a", 0, SYS, 1)], M=2))


@pytest.mark.parametrize("device,dtype", [pytest.param("cuda", torch.bfloat16, marks=GPU, id="cuda-bf16")])
def test_cache_on_equals_off_bitwise_bf16_with_cuda_graphs(device, dtype):
    """GPU: the sequential on/off comparison in bf16 with CUDA graphs on (decode-only steps replay graphs)."""
    _, _, fast = _weights(device, dtype)
    reqs = [("a", 0, SYS + (20, 21, 22), 6), ("b", 9, SYS + (40,), 6)]
    on_t, off_t = _trace(reqs, R=1, budget=16), _trace(reqs, R=1, budget=16, B=0)
    runs = [run_recording_logits(Engine(fast, t.engine, max_len=64, graphs=True), t, mode)
            for t in (on_t, off_t) for mode in ("legacy", "async")]
    assert _hits(runs[0][0]) == {"a": 0, "b": 16}
    for on, off in ((runs[0], runs[2]), (runs[1], runs[3])):
        assert on[0].tokens == off[0].tokens
        _same_logits(on[1], off[1])


@pytest.mark.parametrize("device,dtype", [pytest.param("cuda", torch.bfloat16, marks=GPU, id="cuda-bf16")])
def test_hit_suffix_over_a_long_prefix_takes_the_split_key_attention_and_stays_bitwise(device, dtype):
    """GPU: a 5-token suffix after a 2048-token shared prefix (block 1024): the hit's piece is short over a context
    longer than one split chunk, so attention splits over the keys (fastpath/kernels/attention.py); cache on ==
    cache off bitwise (the cold run's last piece is the same piece, so the same split plan)."""
    from fastpath.kernels.attention import SPLIT_MAX_QUERIES, attention_split_rule
    _, _, fast = _weights(device, dtype)
    prefix = tuple(16 + (5 * i + 1) % 48 for i in range(2048))
    reqs = [("a", 0, prefix + (20, 21, 22, 23, 24), 4), ("b", 6, prefix + (30, 31, 32, 33, 34), 4)]
    mk = lambda B: Trace(EngineConfig(1, 1024, 1024, "legacy",  # noqa: E731
                                      prefix_cache=PrefixCacheConfig(B, 2) if B else None),
                         tuple(Request(i, a, p, n) for i, a, p, n in reqs))
    on_t, off_t = mk(1024), mk(0)
    assert 5 <= SPLIT_MAX_QUERIES and 2053 > attention_split_rule(2053 + 8)
    on, off = (run_recording_logits(Engine(fast, t.engine, max_len=2053 + 8), t, "legacy") for t in (on_t, off_t))
    assert _hits(on[0]) == {"a": 0, "b": 2048}
    assert on[0].tokens == off[0].tokens
    _same_logits(on[1], off[1])
