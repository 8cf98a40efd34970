"""Checkpoints inside prefill pieces (DESIGN §12: "storing never requires a prefill piece to end at p"): with the
cache on, the fast path cuts pieces exactly as with it off — the SSD chunk-state kernel writes the state entering
the chunk at p into the pool slot and the model writes the conv window at p — so cache on == off is bitwise with
the same step shapes, and the checkpoint is the state a piece ending at p leaves."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastpath import Engine, FastModel  # noqa: E402
from fastpath.batch_invariant import run_recording_logits  # noqa: E402
from oracle import zoo  # noqa: E402
from oracle.model import OracleModel  # noqa: E402
from oracle.scheduler import run_trace as oracle_run  # noqa: E402
from oracle.trace import EngineConfig, PrefixCacheConfig, Request, Trace  # noqa: E402
from hybridqual.replay import compare_request_state  # noqa: E402

DIMS = dict(hidden_size=16, mamba_n_heads=2, mamba_n_groups=1, n_attn_heads=2, n_kv_heads=1)
LONG = tuple(16 + (5 * i + 1) % 48 for i in range(27))          # 27 tokens: blocks 8, 16 inside a 24-piece
OTHER = tuple(20 + (3 * i + 2) % 40 for i in range(20))


def _models(pattern: str):
    cfg = (zoo.tiny_config("bamba", pattern=pattern, **DIMS) if "*" in pattern else
           zoo.tiny_config("mamba2", hidden_size=16, mamba_n_heads=2, mamba_n_groups=1))     # Mamba-only: "MM"
    w = zoo.random_weights(cfg, seed=5)
    return OracleModel(cfg, w, dtype=torch.float64), FastModel(cfg, w, "cpu", torch.float32)


def _trace(reqs, B: int | None, P: int = 24, R: int = 2, budget: int = 48, M: int = 3, mode: str = "legacy"):
    return Trace(EngineConfig(R, budget, P, mode, prefix_cache=PrefixCacheConfig(B, M) if B else None),
                 tuple(Request(i, a, tuple(p), n) for i, a, p, n in reqs))


def _strip(log) -> list[dict]:
    """The schedule log without its cache fields (prefix_cache events, cached_tokens on admissions)."""
    out = []
    for s in log.to_json()["steps"]:
        s = {k: v for k, v in s.items() if k != "prefix_cache"}
        s["admit"] = [{k: v for k, v in a.items() if k != "cached_tokens"} for a in s["admit"]]
        out.append(s)
    return out


@pytest.mark.parametrize("backend,mode", [("triton", "legacy"), ("torch", "async")])
def test_cache_on_equals_off_bitwise_with_the_same_pieces_when_checkpoints_fall_inside_pieces(backend, mode):
    """Two concurrent requests with different prompts (no hits): the cache only stores. The pieces, every other
    schedule field, the tokens and every sampled logits row are those of the run without a cache, bitwise; the
    stores include boundaries strictly inside pieces."""
    omodel, fast = _models("M*M")
    fast = fast.with_options(backend=backend)
    reqs = [("a", 0, LONG, 2), ("b", 1, OTHER, 1)]
    on_t, off_t = _trace(reqs, 8, mode=mode), _trace(reqs, None, mode=mode)
    on, on_rows = run_recording_logits(Engine(fast, on_t.engine, max_len=40), on_t, mode)
    off, off_rows = run_recording_logits(Engine(fast, off_t.engine, max_len=40), off_t, mode)
    assert _strip(on.schedule_log) == _strip(off.schedule_log)
    truth = oracle_run(omodel, on_t, mode)
    assert on.tokens == off.tokens == truth.tokens
    assert sorted(on_rows) == sorted(off_rows)
    assert all(torch.equal(on_rows[k], off_rows[k]) for k in on_rows)
    steps = on.schedule_log.to_json()["steps"]
    ends = {(b["request"], b["pos"] + b["count"]) for s in steps for b in s["batch"]}
    stored = [(e["request"], e["pos"]) for s in steps for e in s["prefix_cache"]["stored"]]
    assert ("a", 8) in stored and ("a", 16) in stored and ("a", 8) not in ends and ("a", 16) not in ends
    assert on.schedule_log.to_json() == truth.schedule_log.to_json()         # the truth stores the same


def _pool_states(fast, P: int) -> dict[int, dict[str, torch.Tensor]]:
    """Run LONG alone with block 8 and prefill_chunk P; the pool slot of each stored prefix length, copied."""
    t = _trace([("a", 0, LONG, 1)], 8, P=P, R=1, budget=24)
    eng = Engine(fast, t.engine, max_len=40)
    eng.run_trace(t)
    return {e.pos: eng.bank.slot_state(eng.bank.pool_slot(e.index)) for e in eng.prefix.entries.values()}


def _inside_vs_at_end(backend: str) -> list[tuple[int, str, torch.Tensor, torch.Tensor]]:
    """Mamba-only LONG with block 8: (p, state name, the checkpoint stored inside a 24-piece, the one a piece ending
    at p stored) for p = 8, 16 and the conv and SSM states."""
    _, fast = _models("MM")
    fast = fast.with_options(backend=backend)
    inside, at_end = _pool_states(fast, 24), _pool_states(fast, 8)
    assert sorted(inside) == sorted(at_end) == [8, 16, 24]
    return [(p, n, inside[p][n], at_end[p][n]) for p in (8, 16) for n in ("conv", "ssm")]


def test_a_checkpoint_inside_a_piece_is_bitwise_the_state_a_piece_ending_there_leaves():
    """Mamba-only, Triton kernels (prefill arithmetic is piece-invariant there, bitwise: the fixed-tile matmul's
    bits do not depend on the number of rows): pieces of 24 store 8 and 16 from inside the piece; pieces of 8 end
    on every boundary and store by copying the slot. Same bits, conv and SSM."""
    for p, name, inside, at_end in _inside_vs_at_end("triton"):
        assert torch.equal(inside, at_end), (p, name)


def test_torch_backend_checkpoint_inside_a_piece_is_the_state_a_piece_ending_there_leaves_to_fp32_rounding():
    """The torch backend projects with BLAS (F.linear), whose bits depend on the row count on some CPUs (an AMD EPYC
    here: 24 rows vs 8 differ in the last bits), so pieces of 24 and of 8 leave equal states only to fp32
    rounding; the checkpoint taken inside the piece is still the state at p (a wrong position is off by O(1))."""
    pairs = _inside_vs_at_end("torch")
    for p, name, inside, at_end in pairs:
        torch.testing.assert_close(inside, at_end, rtol=1e-5, atol=1e-5, msg=(p, name))
    assert not torch.allclose(pairs[1][2], pairs[3][3], rtol=1e-3, atol=1e-3)   # the states at 8 and 16 do differ


def test_a_hybrid_checkpoint_inside_a_piece_is_the_oracles_state_at_p():
    """Hybrid, Triton kernels: the pool slot of each interior checkpoint (conv window, SSM state, K/V of [0, p))
    matches the oracle's state after prompt[0:p] to fp32 rounding."""
    omodel, fast = _models("M*M")
    t = _trace([("a", 0, LONG, 1)], 8, R=1, budget=24)
    eng = Engine(fast, t.engine, max_len=40)
    eng.run_trace(t)
    for e in eng.prefix.entries.values():
        _, state = omodel.prefill(list(LONG[:e.pos]))
        assert compare_request_state(eng, state, eng.bank.pool_slot(e.index), e.pos, 1e-5) is None, e.pos


def test_a_checkpoint_closer_than_the_conv_window_to_the_piece_start_takes_the_initial_window():
    """chunk_size 2 < d_conv - 1 = 3: a boundary 2 tokens into a piece needs an input from before the piece (its
    initial conv window). Pieces of 6 (boundaries 2 and 4 tokens in): every checkpoint is the oracle's state at p
    (not bitwise against pieces of 2: CPU GEMMs of 6 and of 2 rows round differently, measured 6e-7)."""
    cfg = zoo.tiny_config("mamba2", hidden_size=16, mamba_n_heads=2, mamba_n_groups=1, chunk_size=2)
    w = zoo.random_weights(cfg, seed=5)
    fast = FastModel(cfg, w, "cpu", torch.float32).with_options(backend="torch")
    omodel = OracleModel(cfg, w, dtype=torch.float64)
    t = Trace(EngineConfig(1, 24, 6, "legacy", prefix_cache=PrefixCacheConfig(2, 16)), (Request("a", 0, LONG[:13], 1),))
    eng = Engine(fast, t.engine, max_len=40)
    eng.run_trace(t)
    assert sorted(e.pos for e in eng.prefix.entries.values()) == list(range(2, 13, 2))
    for e in eng.prefix.entries.values():
        _, state = omodel.prefill(list(LONG[:e.pos]))
        assert compare_request_state(eng, state, eng.bank.pool_slot(e.index), e.pos, 1e-5) is None, e.pos


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_checkpoints_inside_pieces_keep_cache_on_equal_off_bitwise_bf16_with_cuda_graphs():
    """GPU: the same comparison in bf16 with CUDA graphs (the kernel stores the fp32 carried state, not the bf16
    copy the scan reads)."""
    cfg = zoo.tiny_config("bamba", pattern="M*M", **DIMS)
    w = zoo.random_weights(cfg, seed=5)
    fast = FastModel(cfg, w, "cuda", torch.bfloat16)
    reqs = [("a", 0, LONG, 4), ("b", 1, OTHER, 3)]
    for mode in ("legacy", "async"):
        on_t, off_t = _trace(reqs, 8, mode=mode), _trace(reqs, None, mode=mode)
        on, on_rows = run_recording_logits(Engine(fast, on_t.engine, max_len=40, graphs=True), on_t, mode)
        off, off_rows = run_recording_logits(Engine(fast, off_t.engine, max_len=40, graphs=True), off_t, mode)
        assert _strip(on.schedule_log) == _strip(off.schedule_log) and on.tokens == off.tokens
        assert sorted(on_rows) == sorted(off_rows) and all(torch.equal(on_rows[k], off_rows[k]) for k in on_rows)
        stored = [(e["request"], e["pos"]) for s in on.schedule_log.to_json()["steps"]
                  for e in s["prefix_cache"]["stored"]]
        assert ("a", 8) in stored and ("a", 16) in stored


def test_checkpoint_positions_that_are_not_chunk_starts_inside_the_piece_are_errors_naming_them():
    from fastpath.kernels._common import KernelInputError
    from fastpath.kernels.ssd import ssd_chunk_table
    t = ssd_chunk_table([0, 24], [8], 8, "cpu", [0], 4, checkpoints=[(0, 16, 3), (0, 24, 2)])
    assert t.ckpt_slot.tolist() == [-1, 3, 2]                 # chunks start at 8, 16, 24: the state entering each
    for bad, why in (((0, 12, 3), "not a chunk start"), ((0, 8, 3), "not a chunk start"),
                     ((0, 32, 3), "not a chunk start"), ((1, 16, 3), "no such sequence"),
                     ((0, 16, 4), "slot outside 0..3")):
        with pytest.raises(KernelInputError, match=r"`checkpoints`\[0\] = .*" + why):
            ssd_chunk_table([0, 24], [8], 8, "cpu", [0], 4, checkpoints=[bad])
