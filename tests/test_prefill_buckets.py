"""Bucketed prefill graphs (fastpath/engine/prefill_buckets.py): a one-piece prefill-only step of any length, start and
slot runs its token bucket's kept batch (a CUDA graph on the GPU) built ahead of time — never eagerly — padded with
a slot -1 dummy piece, and leaves the unpadded step's bank and logits bitwise; cache on with buckets == cache off."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastpath import Engine, FastModel, FastOptions  # noqa: E402
from fastpath.batch_invariant import BatchInvariantEngine, run_recording_logits  # noqa: E402
from fastpath.engine.bank import StateBank  # noqa: E402
from fastpath.engine.packing import pack_step  # noqa: E402
from fastpath.engine.prefill_buckets import BucketGraphs, default_buckets  # noqa: E402
from fastpath.engine.validate import ArgumentError  # noqa: E402
from oracle import zoo  # noqa: E402
from oracle.trace import EngineConfig, PrefixCacheConfig, Request, Trace  # noqa: E402

HYBRID = dict(pattern="M*", hidden_size=16, mamba_n_heads=2, mamba_n_groups=1, n_attn_heads=2, n_kv_heads=1)
BUCKETS = (8, 16, 32, 64)                  # the tiny model's chunk size is 8


def _model(device="cpu", dtype=torch.float32, batch_invariant=True) -> FastModel:
    cfg = zoo.tiny_config("bamba", **HYBRID)
    return FastModel(cfg, zoo.random_weights(cfg, seed=3), device, dtype, FastOptions(batch_invariant=batch_invariant))


class _MDependentModel(FastModel):
    """The default model with projections whose bits depend on M, as cuBLAS's kernel and split-K choice makes them
    on the GPU (the CPU's BLAS at these tiny shapes happens not to): y·(1 + (M mod 5)·2⁻²⁰)."""

    def _dense(self, x, w, b=None):
        y = super()._dense(x, w, b)
        return y * (1 + (x.shape[0] % 5) * 2.0 ** -20)


def _default_model() -> FastModel:
    cfg = zoo.tiny_config("bamba", **HYBRID)
    return _MDependentModel(cfg, zoo.random_weights(cfg, seed=3), "cpu", torch.float32, FastOptions())


def _banks(model, max_len: int) -> tuple[StateBank, StateBank]:
    """Two equal banks of 3 request slots + 1 pool slot, every slot filled with seeded values (live state)."""
    banks = [StateBank(model.config, 3, max_len, model.device, kv_dtype=model.dtype, pool=1) for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    for name in ("conv_state", "ssm_state", "k_cache", "v_cache"):
        v = torch.randn(getattr(banks[0], name).shape, generator=g)
        for b in banks:
            getattr(b, name).copy_(v)
    return banks[0], banks[1]


@pytest.mark.parametrize("start,count,slot,max_len", [
    (16, 7, 1, 96),     # bucket 8, one pad token
    (8, 8, 0, 96),      # count == bucket 8: bucket 16
    (24, 9, 2, 96),     # bucket + 1
    (0, 1, 3, 96),      # a one-token piece from position 0 into the pool slot
    (40, 16, 1, 96),    # count == bucket 16: bucket 32
    (48, 17, 0, 96),
    (1032, 5, 2, 2048),  # a context past one key chunk: the real piece's attention splits over the keys
], ids=["b8-1", "b8", "b8+1", "one-token", "b16", "b16+1", "split-keys"])
def test_padded_bucket_step_leaves_the_unpadded_steps_bank_and_logits_bitwise(start, count, slot, max_len):
    """CPU (interpreter, fp32, fixed-tile GEMMs): the step through its bucket (real piece + a slot -1 dummy piece,
    the kept batch's metadata rewritten) == the unpadded step's eager forward on an equal bank: logits and every
    slot of the bank (conv, SSM, K/V) bitwise — the real slot's state is the unpadded step's and no other slot
    (live values everywhere) is touched."""
    model = _model()
    padded, ref = _banks(model, max_len)
    bg = BucketGraphs(model, padded, BUCKETS)
    bg.prepare()
    assert all(torch.equal(a, b) for a, b in zip(padded.slot_state(0).values(), ref.slot_state(0).values()))
    ids = [(5 * i + 2) % 40 for i in range(count)]
    sb = pack_step(model.device, 8, ids, list(range(start, start + count)), [], [(start, count, slot)], [count - 1],
                   4)
    want = model.forward(sb, ref)
    got = bg.forward(bg.bucket(count), (start, count, slot), ids)
    assert (bg.runs, bg.fallbacks) == (1, 0)
    assert torch.equal(got, want)
    for name in ("conv_state", "ssm_state", "k_cache", "v_cache"):
        assert torch.equal(getattr(padded, name), getattr(ref, name)), f"{name} differs from the unpadded step's"


def _trace(prompts: list[tuple[int, ...]], cache: bool) -> Trace:
    """One request after another (R = 2), two new tokens each; pieces of 32, block 32 (no checkpoint inside a hit's
    piece), a budget of 64 (the largest bucket)."""
    reqs = tuple(Request(f"r{i}", 6 * i, p, 2) for i, p in enumerate(prompts))
    return Trace(EngineConfig(2, 64, 32, "legacy", prefix_cache=PrefixCacheConfig(32, 3) if cache else None), reqs)


def _hits(result) -> list[int]:
    return [a["cached_tokens"] for s in result.schedule_log.to_json()["steps"] for a in s["admit"]]


def _prompts() -> list[tuple[int, ...]]:
    """A 64-token shared prefix, then suffixes of never-repeated lengths around the buckets' edges; one prompt that
    shares only the first block (a hit at the other checkpoint position, 32)."""
    prefix = tuple(16 + (7 * i + 3) % 48 for i in range(64))
    tail = lambda n, k: tuple(20 + (3 * j + k) % 40 for j in range(n))   # noqa: E731
    out = [prefix + tail(3, 0)]
    out += [prefix + tail(n, k) for k, n in enumerate((7, 8, 9, 15, 16, 17, 1), 1)]
    out.append(prefix[:32] + tail(5, 9))
    return out


def _check(model, graphs: bool) -> Engine:
    """Cache on + prefill graphs with buckets vs cache off: tokens and logits bitwise. A batch-invariant model's
    cache-off run has no prefill graphs (a padded step has the unpadded step's bits); the default model's has the
    same buckets (a padded step has its bucket's bits, so both runs pad every step a bucket serves)."""
    prompts = _prompts()
    on_t, off_t = _trace(prompts, True), _trace(prompts, False)
    max_len = max(len(p) for p in prompts) + 2
    cls = BatchInvariantEngine if model.options.batch_invariant else Engine
    off_kw = {} if model.options.batch_invariant else dict(prefill_graphs=True, prefill_buckets=BUCKETS)
    on_e = cls(model, on_t.engine, max_len=max_len, graphs=graphs, prefill_graphs=True, prefill_buckets=BUCKETS)
    on = run_recording_logits(on_e, on_t, "legacy")
    off = run_recording_logits(cls(model, off_t.engine, max_len=max_len, graphs=graphs, **off_kw), off_t, "legacy")
    assert _hits(on[0]) == [0] + [64] * 7 + [32]
    _same(on, off)
    return on_e


def _same(on, off) -> None:
    assert on[0].tokens == off[0].tokens
    assert sorted(on[1]) == sorted(off[1])
    bad = {k: (on[1][k] - off[1][k]).abs().max().item() for k in on[1] if not torch.equal(on[1][k], off[1][k])}
    assert not bad, f"logits rows differ (cache on + bucketed prefill graphs vs cache off): {bad}"


def test_hits_of_never_seen_suffix_lengths_run_their_bucket_not_eager_and_equal_cache_off_bitwise():
    """CPU: every hit has a suffix length (7, 8, 9, 15, 16, 17, 1, then 5 at the other checkpoint) and position no
    step had before, around the bucket edges (8, 16); each prefill-only step — the hits and the cold request's
    pieces — runs its bucket's kept batch built at engine start: no eager step, no exact-shape kept batch; ==
    cache off bitwise."""
    b = _check(_model(), graphs=False).prefill_graphs
    assert b.eager == 0 and not b.seen and not b.kept and b.reuses == 0
    # 11 = the cold request's 3 pieces (their checkpoints at piece ends) + 8 hits
    assert b.buckets.runs == 11 and b.buckets.fallbacks == 0 and sorted(b.buckets.entries) == list(BUCKETS)


def test_default_mode_hits_of_never_seen_suffix_lengths_run_their_bucket_and_equal_cache_off_bitwise():
    """CPU, the default model (its projections' bits depend on M, `_MDependentModel`): the hits and the cold pieces
    all run their bucket's kept batch, none eager; == a cache-off run with the same buckets, tokens and logits
    bitwise."""
    b = _check(_default_model(), graphs=False).prefill_graphs
    assert b.eager == 0 and not b.seen and not b.kept
    assert b.buckets.runs == 11 and b.buckets.fallbacks == 0 and b.buckets.storing == 0


def test_a_bucket_step_storing_checkpoints_inside_its_piece_has_the_bits_of_the_step_without_them():
    """CPU, the default model (bits depending on M): 16-token pieces over 8-token blocks, so every cold piece stores
    a checkpoint inside it (run eagerly through its bucket's layout) and the cache-off run's equal piece replays the
    bucket's kept batch: tokens and logits bitwise; a later request hits the piece-end checkpoint at 32 (its piece
    (32, 5) is the cache-off run's last piece) and one the interior checkpoint at 24."""
    model = _default_model()
    a = tuple(16 + (7 * i + 3) % 48 for i in range(40))
    tail = lambda n, k: tuple(20 + (3 * j + k) % 40 for j in range(n))   # noqa: E731
    prompts = [a, a[:32] + tail(5, 1), a[:24] + tail(3, 2)]
    runs = []
    for cache in (True, False):
        reqs = tuple(Request(f"r{i}", 8 * i, p, 2) for i, p in enumerate(prompts))
        t = Trace(EngineConfig(2, 64, 16, "legacy", prefix_cache=PrefixCacheConfig(8, 8) if cache else None), reqs)
        e = Engine(model, t.engine, max_len=80, prefill_graphs=True, prefill_buckets=BUCKETS)
        runs.append((e, run_recording_logits(e, t, "legacy")))
    (on_e, on), (off_e, off) = runs
    assert _hits(on[0]) == [0, 32, 24]
    assert on_e.prefill_graphs.buckets.storing >= 2 and off_e.prefill_graphs.buckets.storing == 0
    assert on_e.prefill_graphs.eager == off_e.prefill_graphs.eager == 0
    assert on[0].tokens == off[0].tokens
    rows = lambda r, names: {k: v for k, v in r[1].items() if k[0] in names}   # noqa: E731
    _same((on[0], rows(on, ("r0", "r1"))), (off[0], rows(off, ("r0", "r1"))))


def test_the_prefill_buckets_configuration_runs_bucket_steps_on_its_reach():
    """qualify's `prefill_buckets` configuration of the fast path (tools/adapters/fastpath.py) on its reach,
    zoo-bamba/prefix_lru: "default" buckets (8, 16) from the trace's budget; bucket steps run, some storing a
    checkpoint inside, none eager and none falling back."""
    import oracle
    from hybridqual.adapters import Engine
    from hybridqual.adapters.fastpath import FastpathAdapter
    from hybridqual.scenarios.plan import MODELS, TRACES
    engine = Engine(FastpathAdapter).configured("prefill_buckets")
    a = engine(MODELS / "zoo-bamba", oracle.load_trace(TRACES / "prefix_lru.json"), "legacy")
    a.run_trace()
    pg = a.engine.prefill_graphs
    assert pg.buckets.buckets == (8, 16) and pg.eager == 0 and pg.buckets.fallbacks == 0
    assert pg.buckets.runs >= 3 and pg.buckets.storing >= 1


def test_prefill_buckets_are_checked():
    """prefill_buckets: needs prefill_graphs and the Triton backend; rising multiples of the chunk size within the
    step budget and max_len; errors name the field."""
    cfg = EngineConfig(1, 32, 32, "legacy")
    bi = _model()
    cfg_t = zoo.tiny_config("bamba", **HYBRID)
    torch_model = FastModel(cfg_t, zoo.random_weights(cfg_t, seed=3), "cpu", torch.float32,
                            FastOptions(backend="torch"))
    for model, buckets, graphs, field in [
            (torch_model, (8,), True, "prefill_buckets.*Triton"),
            (bi, (8,), False, "prefill_buckets"), (bi, 8, True, "prefill_buckets"),
            (bi, (8, 12), True, r"prefill_buckets\[1\]"), (bi, (16, 8), True, r"prefill_buckets\[1\]"),
            (bi, (8, 64), True, r"prefill_buckets\[1\]"), (bi, (8, 1.5), True, "prefill_buckets"),
            (bi, "auto", True, "prefill_buckets.*'default'")]:
        with pytest.raises(ArgumentError, match=field):
            Engine(model, cfg, max_len=128, prefill_graphs=graphs, prefill_buckets=buckets)
    with pytest.raises(ArgumentError, match=r"prefill_buckets\[0\].*max_len"):
        Engine(bi, cfg, max_len=36, prefill_graphs=True, prefill_buckets=(32,))
    assert default_buckets(8, 40) == (8, 16, 32) and default_buckets(256, 512) == (256, 512)
    eng = Engine(bi, cfg, max_len=36, prefill_graphs=True, prefill_buckets="default")   # budget 32, max_len - 8 = 28
    assert eng.prefill_graphs.buckets.buckets == (8, 16)
    eng = Engine(bi, cfg, max_len=12, prefill_graphs=True, prefill_buckets="default")   # max_len - 8 = 4: no bucket
    assert eng.prefill_graphs.buckets is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch_invariant", [True, False], ids=["batch-invariant", "default"])
def test_gpu_bucket_graphs_of_never_seen_suffix_lengths_equal_cache_off_bitwise_bf16(batch_invariant):
    """GPU bf16, decode graphs on too: the buckets are captured at engine start; every prefill-only step (never-seen
    lengths at both checkpoints) replays one; == cache off bitwise (batch-invariant: without prefill graphs;
    default: with the same buckets, cuBLAS at the bucket's M)."""
    eng = _check(_model("cuda", torch.bfloat16, batch_invariant=batch_invariant), graphs=True)
    b = eng.prefill_graphs
    assert b.buckets.captures == len(BUCKETS) and b.buckets.replays == b.buckets.runs == 11 and b.eager == 0
    assert b.buckets.nbytes() > 0


def test_bench_prefix_bucket_rows_time_first_hits_of_new_lengths_and_a_warm_hit_tiny():
    """The prefix bench's bucket rows (tools/bench/prefix.py bucket_hits) on the tiny model, batch-invariant and
    default: three never-seen suffix lengths and warm hits all run a bucket (none eager), and the summary prints the
    mode, the ratio and the goal."""
    from hybridqual.bench.prefix import bucket_hits, prefix_lines, tiny_prefix_model
    model = tiny_prefix_model(torch.device("cpu"))
    prefix = tuple((13 * j + 7) % model.config.vocab_size for j in range(64))
    tail = lambda i: tuple((17 * j + 101 * i + 3) % model.config.vocab_size for j in range(5))   # noqa: E731
    for bi in (True, False):
        r = bucket_hits(model, prefix, tail, 5, 32, 32, 77, hits=1, batch_invariant=bi)
        assert r["lengths"] == [12, 3, 15] and r["buckets"] == [8, 16, 32]
        assert r["counts"]["eager_hits"] == 0 and r["counts"]["runs"] == 1 + 3 + 1 and r["counts"]["fallbacks"] == 0
        line = next(x for x in prefix_lines({**_EMPTY, "buckets": r}) if x.startswith("bucketed prefill graphs"))
        assert "goal <= 2x" in line and f"{r['ratio']:.2f}x" in line and f"({r['mode']} model" in line


_EMPTY = {"suffix": 5, "prefix": 64, "block": 32, "ttft_cold_off_s": 1.0, "ttft_cold_on_s": 1.0, "ttft_hit_s": 1.0,
          "ttft_hits_s": [1.0], "ttft_graph_warmup_s": [1.0], "speedup": 1.0, "ttft_hit_eager_s": 1.0,
          "ttft_hits_eager_s": [1.0], "speedup_eager": 1.0, "prefill_graphs": {}, "cached_tokens": [],
          "cached_tokens_graphs": [], "checkpoint_state_bytes": 0, "checkpoint_kv_bytes": 0, "pool_slot_bytes": 0,
          "attn_only_prefix_kv_bytes": 0}
