"""Our HF folder -> Megatron HybridModel state dict: exact round trip, refusals by name (default tier, no Megatron
needed), and static logits vs the fp64 oracle through Megatron's own layers (marker `megatron`, the venv)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import oracle
from oracle.checkpoint import load_checkpoint
from oracle import zoo
from hybridqual.adapters.megatron import available, mapping

MODELS = Path(__file__).resolve().parents[1] / "goldens" / "models"
MAPPABLE = ["tiny-sort", "zoo-bamba", "zoo-mamba2"]
needs_megatron = pytest.mark.skipif(available() is not None, reason=f"megatron-core not importable: {available()}")


@pytest.mark.parametrize("name", MAPPABLE)
def test_state_dict_round_trip_is_exact(name):
    cfg, t = load_checkpoint(MODELS / name)
    sd = mapping.to_megatron(cfg, t)
    back = mapping.from_megatron(cfg, sd)
    assert set(back) == set(t)
    for k in t:
        assert torch.equal(back[k], t[k]), k


def test_qkv_rows_follow_megatrons_group_interleave():
    cfg, t = load_checkpoint(MODELS / "tiny-sort")      # 4 query heads, 2 KV groups, head dim 16
    w = mapping.to_megatron(cfg, t)["decoder.layers.4.self_attention.linear_qkv.weight"]
    d = cfg.attn_head_dim
    q, k, v = (t[f"layers.2.attn.{n}_proj.weight"] for n in "qkv")
    # group 1 = query heads 2, 3, then k head 1, then v head 1
    g1 = w[4 * d:8 * d]
    assert torch.equal(g1[:2 * d], q[2 * d:4 * d]) and torch.equal(g1[2 * d:3 * d], k[d:2 * d])
    assert torch.equal(g1[3 * d:], v[d:2 * d])
    assert mapping.pattern(cfg) == "M-M-*-M-"


@pytest.mark.parametrize("name, field", [("zoo-granitemoehybrid", "norm_eps"), ("zoo-granitemoehybrid", "layers"),
                                         ("zoo-granitemoehybrid", "embedding_multiplier"),
                                         ("zoo-granite_dense", "residual_multiplier"),   # dense, still Granite's
                                         ("zoo-nemotron_h", "mlp_act")])
def test_unmappable_zoo_models_are_refused_by_field(name, field):
    cfg, t = load_checkpoint(MODELS / name)
    with pytest.raises(mapping.UnsupportedConfig, match=field):
        mapping.to_megatron(cfg, t)


def test_eps_and_dt_clamp_refused_only_when_they_differ():
    ok = zoo.tiny_config("bamba")
    assert mapping.refusals(ok) == []
    from dataclasses import replace
    assert any(r.startswith("norm_eps") for r in mapping.refusals(replace(ok, norm_eps=1e-6)))
    assert any(r.startswith("dt_limit") for r in mapping.refusals(replace(ok, dt_limit=(0.0, 0.5))))
    assert not any(r.startswith("dt_limit") for r in mapping.refusals(replace(ok, dt_limit=(0.0, math.inf))))


@pytest.mark.megatron
@needs_megatron
@pytest.mark.parametrize("name", MAPPABLE)
def test_static_logits_equal_the_oracle_in_fp32(name):
    from hybridqual.adapters.megatron.runtime import build_model
    model, cfg = build_model(MODELS / name)
    toks = [(7 * i + 3) % cfg.vocab_size for i in range(21)]        # 21 > 2 SSD chunks of 8
    with torch.no_grad():
        mask = torch.triu(torch.ones(len(toks), len(toks)), diagonal=1).bool()[None, None]
        got = model(torch.tensor([toks]), torch.arange(len(toks))[None], attention_mask=mask)[0].double()
    ref = oracle.load(MODELS / name).prefill(toks)[0]
    err = (got - ref).abs().max().item()
    assert err <= 1e-5 * max(1.0, ref.abs().max().item()), err      # fp32 level: measured 1.3e-5 at scale 15.7
