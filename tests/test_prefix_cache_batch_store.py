"""Checkpoints stored by every piece of a multi-request prefill step (SGLang #31833: only the step's first request
stored the right state): a later request that hits the second piece's interior checkpoint continues exactly as
the fp64 oracle, tokens and logits rows within qualify's fp32 bound."""
from __future__ import annotations

import pytest
import torch

from fastpath import Engine, FastModel
from oracle import zoo
from oracle.model import OracleModel
from oracle.scheduler import run_trace as oracle_run
from oracle.trace import EngineConfig, PrefixCacheConfig, Request, Trace
from hybridqual.qualify.compare import LOGITS_C, teacher_forced_logits

X = tuple(16 + (5 * i + 1) % 48 for i in range(27))
Y = tuple(20 + (3 * i + 2) % 40 for i in range(27))


@pytest.mark.parametrize("mode", ["legacy", "async"])
def test_a_hit_on_the_second_pieces_interior_checkpoint_continues_as_the_oracle(mode):
    cfg = zoo.tiny_config("bamba", pattern="M*M", hidden_size=16, mamba_n_heads=2, mamba_n_groups=1, n_attn_heads=2,
                          n_kv_heads=1)
    w = zoo.random_weights(cfg, seed=5)
    truth = OracleModel(cfg, w, dtype=torch.float64)
    fast = FastModel(cfg, w, "cpu", torch.float32).with_options(backend="torch")
    reqs = (Request("a", 0, X, 2), Request("b", 0, Y, 2),               # one step: pieces of 27, 27 (8, 16, 24 inside)
            Request("c", 4, Y[:24] + (7, 9, 11), 4))                    # hits b's checkpoint at 24
    trace = Trace(EngineConfig(3, 64, 32, mode, prefix_cache=PrefixCacheConfig(8, 4)), reqs)
    want = oracle_run(truth, trace, mode)
    assert any(a.get("cached_tokens") == 24 for s in want.schedule_log.to_json()["steps"] for a in s["admit"])
    eng = Engine(fast, trace.engine, max_len=40)
    rows: dict[tuple[str, int], torch.Tensor] = {}

    def record(batch, logits):
        for j, b in enumerate(batch):
            rows[(b.request, b.pos + b.count)] = logits[j].detach().double().clone()
    eng.on_logits = record
    got = eng.run_trace(trace, mode)
    assert got.tokens == want.tokens
    for r in reqs:
        ref = teacher_forced_logits(truth, r.prompt, got.tokens[r.id])
        mine = torch.stack([rows[(r.id, len(r.prompt) + i)] for i in range(len(got.tokens[r.id]))])
        assert (mine - ref).abs().max().item() <= LOGITS_C[torch.float32] * max(1.0, ref.std().item()), r.id
