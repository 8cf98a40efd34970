"""The sizes people serve (`hybridqual.anchor write --shape`): Bamba-9B's and Nemotron-3-Nano-30B-A3B's shapes have
the published parameter totals at full size, and a tiny --scale writes a folder whose config.json maps
(oracle.config.from_hf_config) to the real layer pattern, MoE and per-head sizes, with weights the oracle runs."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

import oracle
from fastpath.engine.configs import n_params, named_config
from hybridqual.anchor import SHAPES, main, shape_config
from oracle.config import from_hf_config

# The real checkpoints' layer patterns, as their config.json files give them: Bamba-9B names its attention layers
# (attn_layer_indices [9, 18, 27] of 32), NVIDIA-Nemotron-3-Nano-30B-A3B spells its 52 layers in
# hybrid_override_pattern (M: Mamba2, E: MoE, *: attention).
REAL_PATTERN = {
    "bamba-9b": "".join("*" if i in (9, 18, 27) else "M" for i in range(32)),
    "nemotron-3-nano-30b-a3b": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
}
# Published totals: Bamba-9B's model card "9B (9.78B)"; Nemotron-3-Nano "31.6B total parameters" (30B-A3B).
REAL_BILLIONS = {"bamba-9b": (9.78, 2), "nemotron-3-nano-30b-a3b": (31.6, 1)}
KEPT = ("mamba_head_dim", "mamba_d_state", "mamba_d_conv", "chunk_size", "attn_head_dim", "rope_dim", "rope_theta",
        "mlp_act", "moe_router", "moe_n_experts", "moe_top_k", "moe_norm_topk_prob", "moe_routed_scaling_factor",
        "moe_n_group", "moe_topk_group", "tie_word_embeddings", "norm_eps", "dt_limit")


def pattern(c) -> str:
    """One character a layer: the mixer (M, *) or the feed-forward (E: MoE, -: MLP) a Nemotron-H layer has;
    Bamba's layers, each a mixer + MLP, by their mixer."""
    return "".join("M" if s.mixer == "mamba" else "*" if s.mixer == "attention" else "E" if s.ffn == "moe" else "-"
                   for s in c.layers)


@pytest.mark.parametrize("shape", sorted(REAL_BILLIONS))
def test_a_served_shape_has_the_published_parameter_total_at_full_size(shape):
    c = named_config(shape)
    want, digits = REAL_BILLIONS[shape]
    assert round(n_params(c) / 1e9, digits) == want
    assert pattern(c) == REAL_PATTERN[shape]


def test_the_served_shapes_are_the_real_ones():
    b, n = named_config("bamba-9b"), named_config("nemotron-3-nano-30b-a3b")
    assert (b.hidden_size, b.num_layers, b.mamba_n_heads, b.mamba_head_dim, b.mamba_d_state, b.mamba_n_groups,
            b.chunk_size, b.vocab_size, b.mlp_intermediate_size, b.n_attn_heads, b.n_kv_heads, b.rope_dim) == \
        (4096, 32, 128, 64, 128, 1, 256, 128000, 14336, 32, 8, 64)
    assert (n.hidden_size, n.num_layers, n.mamba_n_heads, n.mamba_head_dim, n.mamba_n_groups, n.mamba_d_state,
            n.chunk_size, n.vocab_size, n.n_attn_heads, n.n_kv_heads, n.attn_head_dim, n.rope_dim) == \
        (2688, 52, 64, 64, 8, 128, 128, 131072, 32, 2, 128, 0)
    assert (n.moe_router, n.moe_n_experts, n.moe_top_k, n.moe_intermediate_size, n.moe_shared_intermediate_size,
            n.moe_routed_scaling_factor, n.mlp_act) == ("sigmoid_grouped", 128, 6, 1856, 3712, 2.5, "relu2")


@pytest.mark.parametrize("shape", sorted(REAL_PATTERN))
def test_a_tiny_scale_writes_a_folder_that_maps_to_the_real_pattern_and_runs(shape, tmp_path):
    out = os.fspath(tmp_path / shape)
    assert main(["write", out, "--shape", shape, "--scale", "32", "--layers-per-shard", "8"]) == 0
    hf = json.loads((tmp_path / shape / "config.json").read_text())
    got, full = from_hf_config(hf), named_config(shape)
    assert pattern(got) == REAL_PATTERN[shape]
    assert {k: getattr(got, k) for k in KEPT} == {k: getattr(full, k) for k in KEPT}
    assert (got.hidden_size, got.mamba_n_heads, got.vocab_size) == \
        (full.hidden_size // 32, full.mamba_n_heads // 32, full.vocab_size // 32)
    assert got == shape_config(shape, 32)
    model = oracle.load(tmp_path / shape)
    assert replace(model.config, extra={}) == replace(got, extra={})
    logits, _ = model.prefill([1, 2, 3, 4])
    assert logits.shape == (4, got.vocab_size) and bool(torch.isfinite(logits).all())


def test_a_bad_shape_or_scale_is_refused_by_name(tmp_path, capsys):
    assert main(["write", os.fspath(tmp_path / "x"), "--shape", "llama-70b"]) == 2
    assert "--shape: 'llama-70b' is not one of " + ", ".join(SHAPES) in capsys.readouterr().err
    assert main(["write", os.fspath(tmp_path / "x"), "--shape", "nemotron-3-nano-30b-a3b", "--scale", "64"]) == 2
    assert "--scale: 64 must be a positive integer dividing" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    c = shape_config("nemotron-3-nano-30b-a3b", 32, layers=6)
    assert pattern(c) == REAL_PATTERN["nemotron-3-nano-30b-a3b"][:6] and c.attention_layer_ids == (5,)
