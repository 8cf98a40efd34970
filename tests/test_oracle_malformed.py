"""Malformed configs and checkpoints: each case raises ConfigError/CheckpointError whose message names the problem.

The corpus is built from a good zoo folder by one small edit per case (config.json field or safetensors file).
"""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import oracle
from oracle.checkpoint import CheckpointError
from oracle.config import ConfigError, from_hf_config
from oracle.streamed import StreamedOracle

# ----------------------------------------------------------------------------------------------- configs
# (case id, base variant, edit of the config dict, regex the ConfigError message must match)
CONFIG_CASES = [
    ("unknown-model-type", "bamba", lambda d: d.update(model_type="llama"), r"model_type: 'llama' is not supported"),
    ("missing-model-type", "bamba", lambda d: d.pop("model_type"), r"model_type: None"),
    ("bad-pattern-char", "nemotron_h",
     lambda d: (d.pop("layers_block_type"), d.update(hybrid_override_pattern="M*X-")),
     r"hybrid_override_pattern: bad pattern character 'X' at index 2"),
    ("unknown-layer-type", "nemotron_h", lambda d: d["layers_block_type"].__setitem__(1, "conv"),
     r"layers_block_type\[1\]: unknown layer type 'conv'"),
    ("heads-not-divisible-by-groups", "bamba", lambda d: d.update(mamba_n_groups=3),
     r"mamba_n_groups: mamba_n_heads=8 is not divisible by mamba_n_groups=3"),
    ("heads-not-divisible-by-groups-nemotron", "nemotron_h", lambda d: d.update(n_groups=3), r"n_groups"),
    ("q-heads-not-divisible-by-kv", "granitemoehybrid", lambda d: d.update(num_key_value_heads=3),
     r"num_key_value_heads"),
    ("attn-index-out-of-range", "bamba", lambda d: d.update(attn_layer_indices=[1, 7]),
     r"attn_layer_indices: 7 is out of range"),
    ("head-dim-inconsistent", "bamba", lambda d: d.update(mamba_d_head=16), r"mamba_d_head"),
    ("layer-count-mismatch", "granitemoehybrid", lambda d: d.update(num_hidden_layers=5),
     r"layer_types: has 3 entries but num_hidden_layers=5"),
    ("nemotron-layer-count-mismatch", "nemotron_h", lambda d: d.update(num_hidden_layers=9), r"num_hidden_layers"),
    ("bad-time-step-limit", "mamba2", lambda d: d.update(time_step_limit=[0.5, 0.1]), r"time_step_limit"),
    ("missing-vocab-size", "mamba2", lambda d: d.pop("vocab_size"), r"vocab_size: required field is missing"),
    ("non-integer-hidden-size", "mamba2", lambda d: d.update(hidden_size="32"), r"hidden_size: expected an integer"),
    ("top-k-exceeds-experts", "nemotron_h", lambda d: d.update(num_experts_per_tok=9), r"num_experts_per_tok"),
    ("unsupported-rope-scaling", "granitemoehybrid",
     lambda d: d["rope_parameters"].update(rope_type="yarn"), r"rope_type: 'yarn' is not supported"),
    ("wrong-mlp-activation", "nemotron_h", lambda d: d.update(mlp_hidden_act="gelu"), r"mlp_hidden_act"),
    ("norm-before-gate", "mamba2", lambda d: d.update(norm_before_gate=True), r"norm_before_gate: true"),
    # values: finite, in range, integers not truncated
    ("nan-eps", "bamba", lambda d: d.update(rms_norm_eps=math.nan), r"rms_norm_eps: must be a finite number"),
    ("zero-eps", "nemotron_h", lambda d: d.update(layer_norm_epsilon=0.0), r"layer_norm_epsilon: must be > 0"),
    ("inf-rope-theta", "granitemoehybrid", lambda d: d["rope_parameters"].update(rope_theta=math.inf),
     r"rope_parameters\.rope_theta: must be a finite number"),
    ("negative-rope-theta", "bamba", lambda d: d["rope_parameters"].update(rope_theta=-10.0),
     r"rope_parameters\.rope_theta: must be > 0"),
    ("nan-partial-rotary", "granitemoehybrid", lambda d: d["rope_parameters"].update(partial_rotary_factor=math.nan),
     r"partial_rotary_factor: must be a finite number"),
    ("zero-logits-scaling", "granitemoehybrid", lambda d: d.update(logits_scaling=0.0), r"logits_scaling: must be > 0"),
    ("nan-embedding-multiplier", "granitemoehybrid", lambda d: d.update(embedding_multiplier={"__float__": "NaN"}),
     r"embedding_multiplier: must be a finite number"),
    ("zero-residual-multiplier", "granitemoehybrid", lambda d: d.update(residual_multiplier=0),
     r"residual_multiplier: must be > 0"),
    ("zero-attention-multiplier", "granitemoehybrid", lambda d: d.update(attention_multiplier=0.0),
     r"attention_multiplier: must be > 0"),
    ("overflowing-multiplier", "granitemoehybrid", lambda d: d.update(embedding_multiplier=10 ** 400),
     r"embedding_multiplier: .* out of the floating-point range"),
    ("nan-time-step-min", "nemotron_h", lambda d: d.update(time_step_min=math.nan), r"time_step_min: must be a finite"),
    ("inf-time-step-low", "mamba2", lambda d: d.update(time_step_limit=[math.inf, math.inf]), r"time_step_limit"),
    ("nan-routed-scaling", "nemotron_h", lambda d: d.update(routed_scaling_factor=math.nan),
     r"routed_scaling_factor: must be a finite number"),
    ("float-for-int", "bamba", lambda d: d.update(mamba_d_state=8.0), r"mamba_d_state: expected an integer, got 8\.0"),
    ("float-for-ignored-int", "nemotron_h", lambda d: d.update(expand=2.5), r"expand: expected an integer, got 2\.5"),
    ("zero-chunk", "mamba2", lambda d: d.update(chunk_size=0), r"chunk_size: must be > 0"),
    ("negative-experts", "granitemoehybrid", lambda d: d.update(num_local_experts=-4),
     r"num_local_experts: must be >= 0"),
    ("huge-size", "bamba", lambda d: d.update(vocab_size=2 ** 40), r"vocab_size: .* larger than any supported size"),
    ("model-type-list", "bamba", lambda d: d.update(model_type=["bamba"]), r"model_type: \['bamba'\] is not supported"),
    ("layer-type-object", "nemotron_h", lambda d: d["layers_block_type"].__setitem__(0, {}),
     r"layers_block_type\[0\]: unknown layer type \{\}"),
    ("eos-out-of-vocab", "bamba", lambda d: d.update(eos_token_id=96), r"eos_token_id: 96 is not a token id"),
    ("eos-float", "mamba2", lambda d: d.update(eos_token_id=[2, 3.0]), r"eos_token_id: \[2, 3\.0\] is not a token id"),
    ("top-k-beyond-kept-groups", "nemotron_h", lambda d: d.update(num_experts_per_tok=3),
     r"num_experts_per_tok: 3 > the 2 experts of topk_group=1 groups"),
]


@pytest.mark.parametrize("case,variant,edit,pattern", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_malformed_config_raises_config_error_naming_the_field(zoo_folder, case, variant, edit, pattern):
    """Each broken config.json -> ConfigError whose message names the field (from the dict and via oracle.load)."""
    with open(os.path.join(zoo_folder(variant), "config.json")) as fh:
        d = json.load(fh)
    from_hf_config(d)                                        # the unedited config is fine
    edit(d)
    with pytest.raises(ConfigError, match=pattern):
        from_hf_config(d)


def test_config_json_that_is_not_json_is_reported(tmp_path):
    """A config.json that does not parse -> ConfigError saying so."""
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        from_hf_config(tmp_path)


def test_config_json_undecodable_or_unreadable_names_the_path(zoo_folder, tmp_path):
    """Bad UTF-8 and a directory named config.json -> ConfigError with the path; a UTF-8 BOM is accepted."""
    good = open(os.path.join(zoo_folder("bamba"), "config.json"), "rb").read()
    (tmp_path / "config.json").write_bytes(good[:10] + b"\xff\xfe" + good[10:])
    with pytest.raises(ConfigError, match=f"config.json: {tmp_path}.* is not UTF-8"):
        from_hf_config(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\xef\xbb\xbf" + good)
    assert from_hf_config(tmp_path) == from_hf_config(zoo_folder("bamba"))
    os.remove(tmp_path / "config.json")
    os.mkdir(tmp_path / "config.json")
    with pytest.raises(ConfigError, match="config.json: cannot read"):
        from_hf_config(tmp_path)


# ------------------------------------------------------------------------------------------- checkpoints

def _copy(zoo_folder, variant: str, tmp_path) -> str:
    dst = os.fspath(tmp_path / variant)
    shutil.copytree(zoo_folder(variant), dst)
    return dst


def _edit_tensors(folder: str, edit) -> None:
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


CKPT_CASES = [
    ("wrong-shape", "bamba",
     lambda t: t.update({"model.layers.0.mamba.in_proj.weight": torch.zeros(10, 32)}),
     r"layers\.0\.mamba\.in_proj\.weight \(HF model\.layers\.0\.mamba\.in_proj\.weight\): shape \(10, 32\)"),
    ("missing-tensor", "nemotron_h", lambda t: t.pop("backbone.layers.2.mixer.k_proj.weight"),
     r"missing tensors \(1\): backbone\.layers\.2\.mixer\.k_proj\.weight"),
    ("missing-expert", "nemotron_h", lambda t: t.pop("backbone.layers.1.mixer.experts.3.up_proj.weight"),
     r"missing tensors \(1\): backbone\.layers\.1\.mixer\.experts\.3\.up_proj\.weight"),
    ("extra-tensor", "mamba2", lambda t: t.update({"backbone.layers.0.mixer.bogus": torch.zeros(3)}),
     r"unexpected tensors \(1\): backbone\.layers\.0\.mixer\.bogus"),
    ("bias-not-in-config", "bamba", lambda t: t.update({"model.layers.1.self_attn.q_proj.bias": torch.zeros(32)}),
     r"unexpected tensors \(1\): model\.layers\.1\.self_attn\.q_proj\.bias"),
    ("nan-weight", "granitemoehybrid",
     lambda t: t["model.layers.0.mamba.dt_bias"].__setitem__(2, float("nan")),
     r"non-finite \(NaN/Inf\) weights in: layers\.0\.mamba\.dt_bias"),
    ("inf-weight", "bamba", lambda t: t["lm_head.weight"].__setitem__((0, 0), math.inf),
     r"non-finite \(NaN/Inf\) weights in: lm_head\.weight"),
    ("integer-dtype", "mamba2",
     lambda t: t.update({"backbone.norm_f.weight": torch.ones(32, dtype=torch.int32)}),
     r"final_norm\.weight \(HF backbone\.norm_f\.weight\): dtype torch\.int32 is not floating point"),
    ("odd-granite-gate-up", "granitemoehybrid",
     lambda t: t.update({"model.layers.0.shared_mlp.input_linear.weight": torch.zeros(47, 32)}),
     r"shared_mlp\.input_linear\.weight: dim 0 of shape \(47, 32\) must be even"),
    ("untied-lm-head-in-tied-model", "mamba2",
     lambda t: t.update({"lm_head.weight": torch.zeros(96, 32)}), r"lm_head\.weight: differs from the embedding"),
    ("fp8-weights", "bamba",
     lambda t: t.update({"model.final_layernorm.weight": torch.ones(32).to(torch.float8_e4m3fn)}),
     r"final_norm\.weight \(HF model\.final_layernorm\.weight\): dtype torch\.float8_e4m3fn is not supported"),
    ("bool-dtype", "bamba", lambda t: t.update({"model.final_layernorm.weight": torch.ones(32, dtype=torch.bool)}),
     r"final_norm\.weight .*dtype torch\.bool is not floating point"),
]


@pytest.mark.parametrize("case,variant,edit,pattern", CKPT_CASES, ids=[c[0] for c in CKPT_CASES])
def test_malformed_checkpoint_raises_checkpoint_error_naming_the_tensor(zoo_folder, tmp_path, case, variant, edit,
                                                                        pattern):
    """Each broken model.safetensors -> CheckpointError whose message lists the offending tensor(s)."""
    folder = _copy(zoo_folder, variant, tmp_path)
    oracle.load(folder)                                      # the unedited copy loads
    _edit_tensors(folder, edit)
    with pytest.raises(CheckpointError, match=pattern):
        oracle.load(folder)


def test_missing_or_corrupt_files_are_reported(zoo_folder, tmp_path):
    """No weights file, a truncated safetensors file, and a shard index naming a missing shard -> CheckpointError."""
    folder = _copy(zoo_folder, "bamba", tmp_path)
    weights = os.path.join(folder, "model.safetensors")
    blob = open(weights, "rb").read()
    with open(weights, "wb") as fh:
        fh.write(blob[: len(blob) // 2])
    with pytest.raises(CheckpointError, match="cannot read safetensors"):
        oracle.load(folder)
    os.remove(weights)
    with pytest.raises(CheckpointError, match="neither model.safetensors nor model.safetensors.index.json"):
        oracle.load(folder)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump({"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}, fh)
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors"):
        oracle.load(folder)
    with pytest.raises(CheckpointError, match="not a directory"):
        oracle.load(os.path.join(folder, "nope"))
    for bad in (None, 3, b"folder"):
        with pytest.raises(CheckpointError, match="path: expected a folder path"):
            oracle.load(bad)
        with pytest.raises(CheckpointError, match="path: expected a folder path"):
            StreamedOracle(bad)
        with pytest.raises(ConfigError, match="config.json: expected a folder, a file path or a dict"):
            from_hf_config(bad)


@pytest.mark.parametrize("index,pattern", [
    (b"{not json", r"model\.safetensors\.index\.json: not valid JSON"),
    (b'{"weight_map": {"a": "\xff"}}', r"model\.safetensors\.index\.json: not UTF-8"),
    (b'[1, 2]', r"weight_map: expected a non-empty object"),
    (b'{"weight_map": {"model.embed_tokens.weight": "../model.safetensors"}}',
     r"weight_map\['model\.embed_tokens\.weight'\]: '\.\./model\.safetensors' is not a file name in the folder"),
    (b'{"weight_map": {"model.embed_tokens.weight": 3}}', r"weight_map\['model\.embed_tokens\.weight'\]: 3 is not"),
    (b'{"weight_map": {"model.embed_tokens.weight": "w.safetensors"}}',
     r"weight_map and shards disagree: listed-not-found \[\], found-not-listed \[.*lm_head\.weight"),
])
def test_bad_shard_index_is_a_checkpoint_error_naming_the_index(zoo_folder, tmp_path, index, pattern):
    """model.safetensors.index.json that does not decode, is not an object, escapes the folder or disagrees with its
    shards -> CheckpointError naming the index (and the entry)."""
    folder = _copy(zoo_folder, "bamba", tmp_path)
    os.rename(os.path.join(folder, "model.safetensors"), os.path.join(folder, "w.safetensors"))
    with open(os.path.join(folder, "model.safetensors.index.json"), "wb") as fh:
        fh.write(index)
    for load in (oracle.load, StreamedOracle):
        with pytest.raises(CheckpointError, match=pattern):
            load(folder)
