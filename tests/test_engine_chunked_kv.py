"""Chunked prefill of a hybrid writes the same rotated keys and values as one-piece prefill.

A continuation piece must number its tokens from its absolute start: RoPE'd keys in the KV cache then agree
with a one-piece prefill of the same prompt (to fp32 rounding; the split changes summation order only).
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastpath import Engine, FastModel  # noqa: E402
from oracle import zoo  # noqa: E402
from oracle.trace import EngineConfig, Request, Trace  # noqa: E402

SMALL = dict(pattern="M*", hidden_size=16, mamba_n_heads=2, mamba_n_groups=1, n_attn_heads=2, n_kv_heads=1)


def _prefill(fast: FastModel, prompt: tuple[int, ...], piece: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    trace = Trace(EngineConfig(1, piece, piece, "legacy"), (Request("p", 0, prompt, 2),))
    eng = Engine(fast.with_options(backend="torch"), trace.engine, max_len=len(prompt) + 2)
    res = eng.run_trace(trace)
    L = len(prompt)
    return res.tokens["p"], eng.bank.k_cache[:, 0, :L].clone(), eng.bank.v_cache[:, 0, :L].clone()


def test_chunked_prefill_writes_the_same_rotated_keys_as_one_piece():
    """Three chunk-aligned pieces vs one piece (bamba: partial RoPE): K and V caches agree to 1e-5 relative."""
    cfg = zoo.tiny_config("bamba", **SMALL)
    fast = FastModel(cfg, zoo.random_weights(cfg, seed=11), "cpu", torch.float32)
    C = cfg.chunk_size
    prompt = tuple((5 * i + 2) % 90 for i in range(3 * C))
    whole, pieces = _prefill(fast, prompt, 3 * C), _prefill(fast, prompt, C)
    for name, a, b in (("k", whole[1], pieces[1]), ("v", whole[2], pieces[2])):
        err = ((a - b).norm() / a.norm()).item()
        assert err < 1e-5, f"{name} cache differs between chunked and one-piece prefill: rel {err:.2e}"
    assert whole[0] == pieces[0]
