"""Named engine benchmark configs (DESIGN §8) and random device weights for them.

    anchor-3b       Bamba layout: vocab 32000, hidden 2560, 32 layers, FFN 6144 gated SiLU, attention at layers
                    7/15/23/31 (32 heads, 8 KV heads, head dim 80, partial RoPE), Mamba2 80 heads x 64, 1 group,
                    state 128, conv 4, chunk 256 — 2,865,483,840 parameters.
    anchor-3b-attn  the same dimensions with every mixer attention (the hybrid-vs-attention comparison).
    bamba-9b        Bamba-9B's shape (ibm-ai-platform/Bamba-9B's config.json): vocab 128000, hidden 4096, 32 layers,
                    FFN 14336 gated SiLU, attention at 9/18/27 (32 heads, 8 KV heads, head dim 128, half RoPE),
                    Mamba2 128 heads x 64, 1 group, state 128, conv 4, chunk 256.
    nemotron-3-nano-30b-a3b  NVIDIA-Nemotron-3-Nano-30B-A3B's shape (its config.json): vocab 131072, hidden 2688,
                    52 layers "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME" (23 Mamba2, 23 MoE, 6 attention),
                    Mamba2 64 heads x 64, 8 groups, state 128, conv 4, chunk 128; attention 32 heads, 2 KV heads,
                    head dim 128, no RoPE; MoE 128 experts, top 6, width 1856, one shared expert of 3712, relu2,
                    sigmoid router with routed scaling 2.5.
The two served shapes are built from their config.json fields (SERVED_HF) by oracle.config.from_hf_config, so they
map exactly as the real checkpoints' configs do.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from oracle.checkpoint import expected_shapes
from oracle.config import HybridConfig, LayerSpec, from_hf_config

ANCHOR_ATTN_LAYERS = (7, 15, 23, 31)


def _anchor(attn_layers: tuple[int, ...]) -> HybridConfig:
    layers = tuple(LayerSpec("attention" if i in attn_layers else "mamba", "mlp") for i in range(32))
    return HybridConfig(
        model_type="bamba", vocab_size=32000, hidden_size=2560, layers=layers, norm_eps=1e-5,
        mamba_n_heads=80, mamba_head_dim=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, chunk_size=256,
        n_attn_heads=32, n_kv_heads=8, attn_head_dim=80, attn_scale=80 ** -0.5, rope_dim=40, rope_theta=10000.0,
        mlp_act="silu", mlp_intermediate_size=6144)


# The config.json fields the oracle reads, as the real checkpoints publish them (docs/performance.md cites them).
SERVED_HF: dict[str, dict] = {
    "bamba-9b": {
        "model_type": "bamba", "vocab_size": 128000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "attn_layer_indices": [9, 18, 27], "mamba_n_heads": 128, "mamba_d_head": 64,
        "mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256,
        "mamba_conv_bias": True, "mamba_proj_bias": False, "rope_theta": 10000.0, "tie_word_embeddings": False},
    "nemotron-3-nano-30b-a3b": {
        "model_type": "nemotron_h", "vocab_size": 131072, "hidden_size": 2688, "num_hidden_layers": 52,
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        "mamba_num_heads": 64, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4,
        "chunk_size": 128, "expand": 2, "use_conv_bias": True, "use_bias": False, "mamba_hidden_act": "silu",
        "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "attention_bias": False,
        "mlp_hidden_act": "relu2", "intermediate_size": 1856, "mlp_bias": False, "n_routed_experts": 128,
        "num_experts_per_tok": 6, "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712,
        "n_shared_experts": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1,
        "layer_norm_epsilon": 1e-5, "time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 0.0001,
        "residual_in_fp32": False, "rope_theta": 10000, "tie_word_embeddings": False},
}

CONFIGS = {"anchor-3b": lambda: _anchor(ANCHOR_ATTN_LAYERS), "anchor-3b-attn": lambda: _anchor(tuple(range(32))),
           **{name: (lambda hf=hf: from_hf_config(dict(hf))) for name, hf in SERVED_HF.items()}}


def named_config(name: str) -> HybridConfig:
    """The HybridConfig of a named config (a key of CONFIGS)."""
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
