"""Named engine benchmark configs (DESIGN §8) and random device weights for them.

    anchor-3b       Bamba layout: vocab 32000, hidden 2560, 32 layers, FFN 6144 gated SiLU, attention at layers
                    7/15/23/31 (32 heads, 8 KV heads, head dim 80, partial RoPE), Mamba2 80 heads x 64, 1 group,
                    state 128, conv 4, chunk 256 — 2,865,483,840 parameters.
    anchor-3b-attn  the same dimensions with every mixer attention (the hybrid-vs-attention comparison).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from oracle.checkpoint import expected_shapes
from oracle.config import HybridConfig, LayerSpec

ANCHOR_ATTN_LAYERS = (7, 15, 23, 31)


def _anchor(attn_layers: tuple[int, ...]) -> HybridConfig:
    layers = tuple(LayerSpec("attention" if i in attn_layers else "mamba", "mlp") for i in range(32))
    return HybridConfig(
        model_type="bamba", vocab_size=32000, hidden_size=2560, layers=layers, norm_eps=1e-5,
        mamba_n_heads=80, mamba_head_dim=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, chunk_size=256,
        n_attn_heads=32, n_kv_heads=8, attn_head_dim=80, attn_scale=80 ** -0.5, rope_dim=40, rope_theta=10000.0,
        mlp_act="silu", mlp_intermediate_size=6144)


CONFIGS = {"anchor-3b": lambda: _anchor(ANCHOR_ATTN_LAYERS), "anchor-3b-attn": lambda: _anchor(tuple(range(32)))}


def named_config(name: str) -> HybridConfig:
    """The HybridConfig of a named config ("anchor-3b" | "anchor-3b-attn")."""
    if name not in CONFIGS:
        raise ValueError(f"config: {name!r} is not one of {sorted(CONFIGS)}")
    return CONFIGS[name]()


def n_params(config: HybridConfig) -> int:
    """Parameter count (untied lm_head counted)."""
    return sum(math.prod(s) for s in expected_shapes(config).values())


def random_device_weights(config: HybridConfig, device: torch.device | str, dtype: torch.dtype,
                          seed: int = 0) -> dict[str, Tensor]:
    """Seeded random canonical tensors made directly on the device (no host copy of 3B parameters)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in sorted(expected_shapes(config).items()):
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight"):
            t = torch.ones(shape, device=device, dtype=dtype)
        elif leaf == "A_log":
            t = torch.log(1.0 + 7.0 * torch.rand(shape, generator=g, device=device))
        elif leaf == "dt_bias":
            t = -3.0 + 3.0 * torch.rand(shape, generator=g, device=device)
        elif leaf == "D":
            t = 0.5 + torch.rand(shape, generator=g, device=device)
        elif leaf == "bias":
            t = torch.zeros(shape, device=device, dtype=dtype)
        else:
            fan_in = shape[-1]
            t = torch.randn(shape, generator=g, device=device, dtype=dtype) * (1.0 / math.sqrt(fan_in))
        out[name] = t.to(dtype) if leaf not in ("A_log", "dt_bias", "D") else t.float()
    return out
