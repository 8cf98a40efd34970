"""The converter-facing config mapping (no llama.cpp needed) and, with .venv-llamacpp, real conversions."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridqual.adapters.llamacpp import convert as conv
from oracle.config import from_hf_config

MODELS = Path(__file__).resolve().parents[1] / "goldens" / "models"
needs_venv = pytest.mark.skipif(conv.available() is not None, reason=str(conv.available()))


def _raw(name: str) -> dict:
    return json.loads((MODELS / name / "config.json").read_text())


def _fields(maps) -> dict:
    return {m.field: m.value for m in maps}


def test_bamba_gets_rotary_dims_and_context_length():
    out, maps = conv.converter_config(_raw("zoo-bamba"))
    assert _fields(maps) == {"attn_rotary_emb": 4, "max_position_embeddings": 262144}
    assert all(m.action == "supplied" for m in maps)
    assert out["attn_rotary_emb"] == 4 and out["rope_parameters"] == _raw("zoo-bamba")["rope_parameters"]


def test_granite_layer_types_and_rope_switch():
    _, maps = conv.converter_config(_raw("zoo-granitemoehybrid"))
    f = _fields(maps)
    assert f["layer_types"] == ["mamba", "attention", "mamba"]
    assert f["architectures"] == ["GraniteMoeHybridForCausalLM", "BambaForCausalLM"]
    assert f["attn_rotary_emb"] == 8 and f["max_position_embeddings"] == 2048


def test_mamba2_needs_no_mapping():
    out, maps = conv.converter_config(_raw("zoo-mamba2"))
    assert maps == [] and out == _raw("zoo-mamba2")


def test_nemotron_h_mixed_mlp_and_moe_is_refused_naming_the_field():
    with pytest.raises(conv.ConversionError, match="layers_block_type: mixes dense 'mlp' and 'moe'"):
        conv.converter_config(_raw("zoo-nemotron_h"))


def test_nemotron_h_moe_gets_pattern_and_shared_experts():
    raw = _raw("zoo-nemotron_h")
    raw["layers_block_type"] = ["linear_attention", "moe", "full_attention", "linear_attention", "moe"]
    _, maps = conv.converter_config(raw)
    assert _fields(maps) == {"hybrid_override_pattern": "ME*ME", "n_shared_experts": 1}


def test_granite_head_dim_other_than_hidden_over_heads_is_refused():
    raw = _raw("zoo-granitemoehybrid")
    raw["head_dim"] = 16
    with pytest.raises(conv.ConversionError, match="^head_dim: 16"):
        conv.converter_config(raw)


def test_metadata_check_names_the_wrong_key():
    cfg = from_hf_config(_raw("tiny-sort"))
    meta = {"general.architecture": "granitehybrid",
            **{f"granitehybrid.{k}": v for k, v in conv._expected_metadata(cfg).items()}}
    assert conv.metadata_mismatches(meta, cfg) == []
    meta["granitehybrid.rope.dimension_count"] = 16            # what the unmapped conversion writes
    assert conv.metadata_mismatches(meta, cfg) == ["granitehybrid.rope.dimension_count: 16, the model has 8"]


def test_known_divergence_is_recorded_for_partial_rope_only():
    assert "partial RoPE (8 of 16 dims)" in conv.known_divergences(from_hf_config(_raw("tiny-sort")))[0]
    assert conv.known_divergences(from_hf_config(_raw("zoo-granitemoehybrid"))) == []


@pytest.mark.llamacpp
@needs_venv
def test_convert_granite_records_the_mapping(tmp_path):
    side = conv.convert(MODELS / "zoo-granitemoehybrid", tmp_path / "g.gguf", "f32")
    assert (tmp_path / "g.gguf").stat().st_size > 0
    assert json.loads((tmp_path / "g.gguf.json").read_text()) == side
    assert {m["field"] for m in side["config_mappings"]} == {"layer_types", "architectures", "attn_rotary_emb",
                                                              "max_position_embeddings"}
    assert side["metadata_mismatches"] == [] and len(side["converter"]["llama_cpp_commit"]) == 40


@pytest.mark.llamacpp
@needs_venv
def test_unmapped_conversion_is_caught_by_the_metadata_check(tmp_path):
    with pytest.raises(conv.ConversionError, match=r"head_count_kv: \[0, 0, 0\], the model has \[0, 2, 0\]"):
        conv.convert(MODELS / "zoo-granitemoehybrid", tmp_path / "raw.gguf", "f32", mapping=False)


@pytest.mark.llamacpp
@needs_venv
def test_bad_outtype_and_missing_folder(tmp_path):
    with pytest.raises(conv.ConversionError, match="outtype"):
        conv.convert(MODELS / "zoo-mamba2", tmp_path / "x.gguf", "q4_k")
    with pytest.raises(conv.ConversionError, match="config.json: cannot read"):
        conv.convert(tmp_path / "nope", tmp_path / "x.gguf")
