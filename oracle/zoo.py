"""Model zoo: tiny deterministic configs and seeded random weights for every architecture.

Sizes suit the Triton interpreter on CPU (hidden 32, 8 Mamba heads x head_dim 8, state 8-16, chunk 8,
vocab 96, 2-5 layers with >= 1 attention layer where the architecture has attention). Every default
config exercises n_groups > 1; Bamba has partial RoPE, Granite full RoPE plus its multipliers, Nemotron-H
and Granite an MoE layer, Mamba2 tied embeddings. `VARIANTS` names further cases used by tests; `SHIPPED` the
models shipped as goldens/models/zoo-<name> (one per architecture, plus a dense Granite with hidden 48 and a
wide Bamba with twin vocabulary rows); `write_shipped` writes one.

    cfg = tiny_config("bamba", mamba_n_groups=1);  w = random_weights(cfg, seed=0)
    model = build("nemotron_h", seed=3);  write_hf_folder(tmp / "m", "granitemoehybrid", seed=1)
"""
from __future__ import annotations

import dataclasses
import math
import os

import torch
from torch import Tensor

from .checkpoint import expected_shapes, save_checkpoint
from .config import PATTERN_CHARS, ConfigError, HybridConfig, LayerSpec, from_hf_config, to_hf_config
from .model import OracleModel

ARCHS = ("bamba", "nemotron_h", "mamba2", "granitemoehybrid")

_MAMBA = dict(mamba_n_heads=8, mamba_head_dim=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, chunk_size=8)
_ATTN = dict(n_attn_heads=4, n_kv_heads=2, attn_head_dim=8, attn_scale=8 ** -0.5, rope_theta=10000.0)
_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

_DEFAULTS: dict[str, dict] = {
    "bamba": dict(vocab_size=96, hidden_size=32, pattern="M*M", norm_eps=1e-5, **_MAMBA, **_ATTN, rope_dim=4,
                  mlp_act="silu", mlp_intermediate_size=48),
    "nemotron_h": dict(vocab_size=96, hidden_size=32, pattern="ME*M-", norm_eps=1e-5, **_MAMBA, **_ATTN,
                       mlp_act="relu2", mlp_intermediate_size=48,
                       moe_router="sigmoid_grouped", moe_n_experts=4, moe_top_k=2, moe_intermediate_size=16,
                       moe_shared_intermediate_size=24, moe_n_group=2, moe_topk_group=1,
                       moe_routed_scaling_factor=1.5),
    "mamba2": dict(vocab_size=96, hidden_size=32, pattern="MM", norm_eps=1e-5,
                   **{**_MAMBA, "mamba_d_state": 16}, tie_word_embeddings=True, residual_in_fp32=True),
    "granitemoehybrid": dict(vocab_size=96, hidden_size=32, pattern="M*M", norm_eps=1e-6, **_MAMBA,
                             **{**_ATTN, "attn_scale": 0.25}, rope_dim=8, mlp_act="silu", mlp_intermediate_size=24,
                             moe_router="softmax_topk", moe_n_experts=4, moe_top_k=2, moe_intermediate_size=16,
                             moe_shared_intermediate_size=24, embedding_multiplier=2.0, residual_multiplier=0.7,
                             logits_scaling=1.5),
}

# Named cases for tests: name -> (arch, overrides).
VARIANTS: dict[str, tuple[str, dict]] = {
    "bamba": ("bamba", {}),
    "bamba-g1": ("bamba", {"mamba_n_groups": 1}),
    "bamba-g4-clamp": ("bamba", {"mamba_n_groups": 4, "dt_limit": (0.0, 0.4)}),
    "nemotron_h": ("nemotron_h", {}),
    "nemotron_h-g8-dtmin": ("nemotron_h", {"mamba_n_groups": 8, "dt_limit": (0.2, math.inf)}),
    "mamba2": ("mamba2", {}),
    "mamba2-untied-bias": ("mamba2", {"tie_word_embeddings": False, "mamba_proj_bias": True,
                                      "mamba_conv_bias": False}),
    "granitemoehybrid": ("granitemoehybrid", {}),
    "granitemoehybrid-nope-dense": ("granitemoehybrid", {"rope_dim": 0, "moe_n_experts": 0, "pattern": "*M"}),
}

# The zoo models shipped as goldens/models/zoo-<name>, all from one seed (`python -m hybridqual.goldens zoo`):
# name -> (arch, overrides). One per architecture at its defaults, plus cases that the defaults cannot reach.
SHIPPED: dict[str, tuple[str, dict]] = {
    **{arch: (arch, {}) for arch in ARCHS},
    # A dense hybrid Granite (as Granite-4.0-H-Micro): every FFN a dense MLP, so the fast path's folded one-row
    # decode step runs on a model with a residual multiplier; hidden 48, not a power of two (a 48-wide row in a
    # 64-wide tile); rms eps 0.05, large enough that where eps sits in the norm shows. d_inner 96 = 2 x hidden
    # (mamba_expand 2, as real Granite); 6 query heads x 8 = hidden (llama.cpp's Granite converter needs
    # head_dim = hidden / heads), 3 per KV head.
    "granite_dense": ("granitemoehybrid", {"moe_n_experts": 0, "hidden_size": 48, "mamba_n_heads": 12,
                                           "n_attn_heads": 6, "norm_eps": 0.05}),
}
VARIANTS["granite_dense"] = SHIPPED["granite_dense"]
# A Bamba as wide as real checkpoints where it matters to kernels, tiny elsewhere: MLP intermediate 4096, so the
# down projection reduces over K = 4096 (where batch-invariant and split-K matmuls split K); two layers. Its
# vocabulary holds twin rows (SHIPPED_EDITS): as untrained reserved tokens of real vocabularies share one row.
SHIPPED["bamba_wide"] = ("bamba", {"mlp_intermediate_size": 4096, "pattern": "M*"})
# Models vLLM's CPU backend runs: its CPU attention takes head sizes 32..512 only (the defaults' 8 is refused at the
# first request), and its relu2 MoE (Nemotron-H's, is_act_and_mul=False) exists on GPU backends only. So attention
# head_dim 32 (2 query heads, 1 KV head, hidden 64): Granite keeps its MoE; Nemotron-H's MoE layer becomes its dense
# relu2 MLP (pattern M-*M-). zoo-mamba2 runs in vLLM as it is.
_HD32 = {"hidden_size": 64, "n_attn_heads": 2, "n_kv_heads": 1, "attn_head_dim": 32}
SHIPPED["granite_hd32"] = ("granitemoehybrid", {**_HD32, "attn_scale": 0.25, "rope_dim": 32})
SHIPPED["nemotron_h_hd32"] = ("nemotron_h", {**_HD32, "attn_scale": 32 ** -0.5, "pattern": "M-*M-",
                                             "moe_router": "", "moe_n_experts": 0, "moe_top_k": 0,
                                             "moe_intermediate_size": 0, "moe_shared_intermediate_size": 0,
                                             "moe_n_group": 1, "moe_topk_group": 1,
                                             "moe_routed_scaling_factor": 1.0})
VARIANTS.update({n: SHIPPED[n] for n in ("granite_hd32", "nemotron_h_hd32")})
# The corners no other shipped model sets, in one Nemotron-H (cheap: two Mamba layers, one attention, one MLP):
# one SSM group (every head reads group 0), a conv window of 3 (d_conv 3: a window of 2 inputs), and dt below the
# config's time_step_min (0.001) on half the heads (SHIPPED_EDITS: their dt_bias lowered), so an engine that clamps
# dt to (time_step_min, inf) instead of time_step_limit (0, inf) (HF PR #48989) computes other states.
SHIPPED["corners"] = ("nemotron_h", {"mamba_n_groups": 1, "mamba_d_conv": 3, "pattern": "M*M-",
                                     "moe_router": "", "moe_n_experts": 0, "moe_top_k": 0, "moe_intermediate_size": 0,
                                     "moe_shared_intermediate_size": 0, "moe_n_group": 1, "moe_topk_group": 1,
                                     "moe_routed_scaling_factor": 1.0})
VARIANTS["corners"] = SHIPPED["corners"]


def twin_vocab_rows(config: HybridConfig, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """lm_head row t := row t - 1 for every odd t >= 5 (tokens 4, 5 | 6, 7 | ... share a row): every greedy step
    whose argmax is one of them is an exact tie in any precision, which the lowest index wins (DESIGN §6)."""
    if config.tie_word_embeddings:
        raise ConfigError("twin_vocab_rows: tied embeddings would twin the input rows too")
    w = dict(weights)
    head = w["lm_head.weight"].clone()
    odd = torch.arange(5, config.vocab_size, 2)
    head[odd] = head[odd - 1]
    w["lm_head.weight"] = head
    return w


DT_BIAS_SHIFT = -6.0      # small_dt_heads: softplus(dt + dt_bias) of the shifted heads mostly below 0.001


def small_dt_heads(config: HybridConfig, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """dt_bias of every even head shifted by DT_BIAS_SHIFT in every Mamba layer: their processed dt straddles
    time_step_min (0.001), as trained heads' dt do, so a floor there changes their states."""
    w = dict(weights)
    for name in [n for n in w if n.endswith("dt_bias")]:
        b = w[name].clone()
        b[0::2] += DT_BIAS_SHIFT
        w[name] = b
    return w


# Weight edits of shipped models that no config field expresses: name -> edit(config, tensors) -> tensors.
SHIPPED_EDITS = {"bamba_wide": twin_vocab_rows, "corners": small_dt_heads}


def _layers(arch: str, pattern: str) -> tuple[LayerSpec, ...]:
    for i, ch in enumerate(pattern):
        if ch not in PATTERN_CHARS:
            raise ConfigError(f"pattern: bad character {ch!r} at index {i} (allowed: M * - E)")
    if arch == "nemotron_h":
        return tuple(LayerSpec(*PATTERN_CHARS[ch]) for ch in pattern)
    if any(ch not in "M*" for ch in pattern):
        raise ConfigError(f"pattern: {arch} layers are mixers only ('M' or '*'), got {pattern!r}")
    if arch == "mamba2" and "*" in pattern:
        raise ConfigError("pattern: mamba2 has no attention layers")
    ffn = {"bamba": "mlp", "mamba2": None}.get(arch)
    return tuple(LayerSpec("mamba" if ch == "M" else "attention", ffn) for ch in pattern)


def tiny_config(arch: str, **overrides) -> HybridConfig:
    """The tiny config of `arch`, with HybridConfig field overrides (and `pattern=` for the layer list)."""
    if arch not in _DEFAULTS:
        raise ConfigError(f"arch: {arch!r} is not one of {ARCHS}")
    fields = {**_DEFAULTS[arch], **overrides}
    pattern = fields.pop("pattern")
    if "layers" not in overrides:
        fields["layers"] = _layers(arch, pattern)
    if arch == "granitemoehybrid":
        ffn = "moe" if fields["moe_n_experts"] > 0 else "mlp"
        fields["layers"] = tuple(dataclasses.replace(s, ffn=ffn) for s in fields["layers"])
        if fields["moe_n_experts"] == 0:
            fields.update(moe_router="", moe_top_k=0, moe_intermediate_size=0, moe_shared_intermediate_size=0)
    valid = {f.name for f in dataclasses.fields(HybridConfig)}
    unknown = sorted(set(fields) - valid)
    if unknown:
        raise ConfigError(f"overrides: unknown HybridConfig fields {unknown}")
    cfg = HybridConfig(model_type=arch, extra=dict(_IDS), **fields)
    # Round trip through the HF dict: the zoo only makes configs that from_hf_config accepts unchanged.
    back = from_hf_config(to_hf_config(cfg))
    if back != cfg:
        diff = [f.name for f in dataclasses.fields(HybridConfig) if getattr(back, f.name) != getattr(cfg, f.name)]
        raise ConfigError(f"overrides: not representable as an HF {arch} config (fields {diff})")
    return back


def _init_tensor(name: str, shape: tuple[int, ...], g: torch.Generator) -> Tensor:
    """A seeded tensor of `shape` with a scale suited to its role (keeps activations O(1))."""
    randn = lambda: torch.randn(shape, generator=g, dtype=torch.float64)  # noqa: E731
    rand = lambda: torch.rand(shape, generator=g, dtype=torch.float64)    # noqa: E731
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        return 1.0 + 0.2 * randn()
    if leaf == "A_log":
        return torch.log(1.0 + 7.0 * rand())                 # A in [-8, -1]
    if leaf == "dt_bias":
        return -3.0 + 3.0 * rand()                            # softplus(dt_bias) in ~[0.05, 0.7]
    if leaf == "D":
        return 0.5 + rand()
    if leaf == "score_bias":
        return 0.1 * randn()
    if name.endswith("conv1d.weight"):
        return 0.5 * randn()
    if leaf == "bias":
        return 0.1 * randn()
    if name == "embed.weight":
        return randn()
    fan_in = shape[-1]
    return randn() / math.sqrt(fan_in)


def random_weights(config: HybridConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Seeded canonical tensors for `config` (same seed + config -> same bytes). Tied lm_head = embed."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(expected_shapes(config).items()):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        out[name] = _init_tensor(name, shape, g).to(dtype)
    if config.tie_word_embeddings:
        out["lm_head.weight"] = out["embed.weight"]
    return out


def build(arch: str, seed: int = 0, dtype: torch.dtype = torch.float64, **overrides) -> OracleModel:
    """A tiny OracleModel of `arch` with seeded random weights."""
    cfg = tiny_config(arch, **overrides)
    return OracleModel(cfg, random_weights(cfg, seed), dtype=dtype)


def write_hf_folder(path: str | os.PathLike, arch: str, seed: int = 0, **overrides) -> HybridConfig:
    """Write config.json + model.safetensors (HF names, fp32) for a tiny `arch` model; returns its config."""
    cfg = tiny_config(arch, **overrides)
    save_checkpoint(path, cfg, random_weights(cfg, seed))
    return cfg


def write_shipped(path: str | os.PathLike, name: str, seed: int = 0) -> HybridConfig:
    """Write the shipped zoo model `name` (a key of SHIPPED) to `path`: its config, seeded weights and any edit."""
    arch, overrides = SHIPPED[name]
    cfg = tiny_config(arch, **overrides)
    weights = random_weights(cfg, seed)
    if name in SHIPPED_EDITS:
        weights = SHIPPED_EDITS[name](cfg, weights)
    save_checkpoint(path, cfg, weights)
    return cfg
