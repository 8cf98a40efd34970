"""Named engine configs: anchor-3b is DESIGN §8's model exactly; anchor-3b-attn differs only in its mixers."""
from __future__ import annotations

import pytest

from fastpath.engine.configs import ANCHOR_ATTN_LAYERS, n_params, named_config
from oracle.config import from_hf_config, to_hf_config


def test_anchor_3b_has_the_design_parameter_count_and_layout():
    c = named_config("anchor-3b")
    assert n_params(c) == 2_865_483_840
    assert c.attention_layer_ids == ANCHOR_ATTN_LAYERS and len(c.layers) == 32
    assert (c.mamba_n_heads, c.mamba_head_dim, c.mamba_n_groups, c.mamba_d_state, c.chunk_size) == (80, 64, 1, 128, 256)
    assert from_hf_config(to_hf_config(c)) == c, "not representable as an HF bamba config"


def test_anchor_3b_attn_is_the_same_model_with_attention_everywhere():
    a, b = named_config("anchor-3b"), named_config("anchor-3b-attn")
    assert b.attention_layer_ids == tuple(range(32)) and not b.mamba_layer_ids
    assert (a.hidden_size, a.vocab_size, a.mlp_intermediate_size, a.n_kv_heads) == \
        (b.hidden_size, b.vocab_size, b.mlp_intermediate_size, b.n_kv_heads)
    with pytest.raises(ValueError, match="config"):
        named_config("anchor-7b")


def test_memory_prediction_counts_tied_weights_once_and_grows_with_the_step():
    import torch
    from fastpath import Engine, FastModel
    from fastpath.engine.memory import activation_bytes, predict
    from oracle import zoo
    from oracle.trace import EngineConfig
    cfg = zoo.tiny_config("mamba2")                  # tied embeddings
    model = FastModel(cfg, zoo.random_weights(cfg, 0), "cpu", torch.float32)
    eng = Engine(model, EngineConfig(2, 16, 8, "legacy"), max_len=16)
    p = predict(eng)
    untied = sum(t.numel() * 4 for k, t in model.w.items())
    assert p["weights"] == untied - cfg.vocab_size * cfg.hidden_size * 4
    assert p["bank"] == eng.bank.nbytes() and p["total"] == p["weights"] + p["bank"] + p["activations"]
    big = named_config("anchor-3b")
    assert activation_bytes(big, 2048, torch.bfloat16) > 2 * activation_bytes(big, 512, torch.bfloat16)
