"""Config and checkpoint IO: round trips, sharded folders, HF naming variants, zoo determinism."""
from __future__ import annotations

import json
import os

import pytest
import torch

import oracle
from oracle.checkpoint import load_checkpoint, read_safetensors, save_checkpoint, to_canonical
from oracle.config import from_hf_config, to_hf_config
from oracle.zoo import VARIANTS, random_weights, tiny_config


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_round_trips_through_the_hf_dict(variant):
    """from_hf_config(to_hf_config(c)) == c for every zoo variant (every field, incl. layers)."""
    arch, overrides = VARIANTS[variant]
    cfg = tiny_config(arch, **overrides)
    assert from_hf_config(json.loads(json.dumps(to_hf_config(cfg)))) == cfg


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_checkpoint_save_load_round_trip_is_bitwise(tmp_path, variant):
    """save_checkpoint then load_checkpoint returns the same config and bitwise-equal canonical tensors."""
    arch, overrides = VARIANTS[variant]
    cfg = tiny_config(arch, **overrides)
    w = random_weights(cfg, seed=4)
    save_checkpoint(tmp_path, cfg, w)
    cfg2, w2 = load_checkpoint(tmp_path)
    assert cfg2 == cfg and set(w2) == set(w)
    for k in w:
        assert torch.equal(w[k], w2[k]), k


def test_zoo_weights_are_deterministic_per_seed():
    """Same (config, seed) -> identical tensors; another seed -> different tensors."""
    cfg = tiny_config("granitemoehybrid")
    a, b, c = random_weights(cfg, 3), random_weights(cfg, 3), random_weights(cfg, 4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(not torch.equal(a[k], c[k]) for k in a)


def test_sharded_hf_folder_loads_like_the_single_file(zoo_folder, tmp_path):
    """A folder saved by transformers in several shards (index.json) loads to the same tensors."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    src = zoo_folder("nemotron_h", seed=2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    _, single = load_checkpoint(src)
    _, sharded = load_checkpoint(tmp_path)
    assert set(single) == set(sharded) and all(torch.equal(single[k], sharded[k]) for k in single)


def test_nemotron_names_accept_model_prefix_and_merged_experts(zoo_folder):
    """Nemotron-H tensors named `model.` (HF in-memory) with merged [E, ...] experts map to the same canonical set."""
    cfg, canonical = load_checkpoint(zoo_folder("nemotron_h"))
    raw = read_safetensors(zoo_folder("nemotron_h"))
    renamed = {"model." + k[len("backbone."):] if k.startswith("backbone.") else k: v for k, v in raw.items()}
    moe_layer = [i for i, s in enumerate(cfg.layers) if s.ffn == "moe"][0]
    p = f"model.layers.{moe_layer}.mixer.experts."
    for n in ("up_proj", "down_proj"):
        per = [renamed.pop(f"{p}{j}.{n}.weight") for j in range(cfg.moe_n_experts)]
        renamed[p + n] = torch.stack(per)
    again = to_canonical(cfg, renamed)
    assert set(again) == set(canonical) and all(torch.equal(again[k], canonical[k]) for k in canonical)


def test_tied_embeddings_share_one_tensor_and_are_not_written_twice(tmp_path):
    """Mamba2 zoo model ties lm_head to the embedding: canonical lm_head is the embed tensor; no lm_head on disk."""
    cfg = tiny_config("mamba2")
    assert cfg.tie_word_embeddings
    save_checkpoint(tmp_path, cfg, random_weights(cfg, seed=0))
    assert "lm_head.weight" not in read_safetensors(tmp_path)
    _, w = load_checkpoint(tmp_path)
    assert w["lm_head.weight"] is w["embed.weight"]
    model = oracle.load(tmp_path, dtype=torch.float32)
    assert model.config == cfg


@pytest.mark.parametrize("arch", ["bamba", "granitemoehybrid"])
def test_auto_mamba_head_dim_resolves_to_expand_times_hidden_over_heads(arch):
    """mamba_d_head "auto" (or absent) = mamba_expand * hidden_size / mamba_n_heads, as HF resolves it."""
    d = to_hf_config(tiny_config(arch))
    d["mamba_d_head"] = "auto"
    assert from_hf_config(d).mamba_head_dim == d["mamba_expand"] * d["hidden_size"] // d["mamba_n_heads"]
    d.pop("mamba_d_head")
    assert from_hf_config(d) == tiny_config(arch)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_part_by_part_mapping_equals_the_whole(tmp_path, variant):
    """to_canonical / to_hf on each part ("top", layer i) with only that part's tensors give, together, exactly the
    whole-model mapping (the streamed oracle and tools/anchor.py rely on it)."""
    from oracle.checkpoint import hf_part_of, normalised_names, to_hf
    arch, overrides = VARIANTS[variant]
    cfg = tiny_config(arch, **overrides)
    w = random_weights(cfg, seed=2)
    hf = to_hf(cfg, w)
    parts = ["top", *range(cfg.num_layers)]
    split_hf: dict = {}
    for part in parts:
        names = {k for k in w if (k.startswith(f"layers.{part}.") if part != "top" else not k.startswith("layers."))}
        piece = to_hf(cfg, {k: w[k] for k in names}, part)
        assert not set(piece) & set(split_hf)
        split_hf.update(piece)
    assert set(split_hf) == set(hf) and all(torch.equal(split_hf[k], hf[k]) for k in hf)
    whole = to_canonical(cfg, hf)
    by_part: dict = {}
    for part in parts:
        mine = {k: hf[k] for n, k in normalised_names(cfg, hf).items() if hf_part_of(cfg, n) == part}
        by_part.update(to_canonical(cfg, mine, part))
    assert set(by_part) == set(whole) and all(torch.equal(by_part[k], whole[k]) for k in whole)


def test_safetensors_index_gives_shapes_and_dtypes_without_reading_data(zoo_folder):
    """SafetensorsIndex: names, shapes and dtypes from the headers equal the loaded tensors'; read() returns the
    same bytes as load_file; meta() tensors carry no data."""
    from safetensors.torch import load_file
    from oracle.checkpoint import SafetensorsIndex
    folder = zoo_folder("granitemoehybrid")
    index, full = SafetensorsIndex(folder), load_file(os.path.join(folder, "model.safetensors"))
    assert set(index.entries) == set(full)
    for name, (_, shape, dtype) in index.entries.items():
        assert shape == tuple(full[name].shape) and dtype == full[name].dtype
    assert all(t.is_meta for t in index.meta().values())
    some = sorted(full)[:3]
    assert all(torch.equal(index.read(some)[k], full[k]) for k in some)
