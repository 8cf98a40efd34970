"""Our HF-format folder -> a Megatron-Core HybridModel's config, layer pattern and state dict (exact, invertible).

The HybridConfig (oracle.config) of a model is mapped field by field; what Megatron cannot express exactly is
refused with `UnsupportedConfig` naming the field (never approximated):
- the Mamba gated norm's eps is hard-coded 1e-5 in Megatron's MambaMixer, so every norm eps must be 1e-5 (ours
  share one `norm_eps`); Megatron applies no dt clamp (dt_limit hard-coded (0, inf)), so `dt_limit` must be that;
- MambaMixer asserts no projection bias and a conv bias; attention/MLP biases, MoE, squared-ReLU MLPs, Granite's
  multipliers / logits scaling and attention scale other than head_dim^-0.5 are not mapped (yet).
Layer layout: each of our layers (mixer, ffn) becomes up to two Megatron layers, mixer first: "M" (MambaLayer,
its `norm` = our mixer_norm), "*" (TransformerLayer: input_layernorm + SelfAttention) and "-" (MLPLayer:
pre_mlp_layernorm + MLP). Tensor names: see `to_megatron` (canonical names: docs/models.md).
"""
from __future__ import annotations

import math

import torch

from oracle.config import ConfigError, HybridConfig

MEGATRON_GATED_NORM_EPS = 1e-5      # megatron/core/ssm/mamba_mixer.py: ExtendedRMSNorm(..., eps=1e-5, ...)


class UnsupportedConfig(ConfigError):
    """The model uses something Megatron's HybridModel cannot express exactly (the message names the field)."""


def refusals(cfg: HybridConfig) -> list[str]:
    """Every reason (field: why) this config cannot be mapped exactly; empty when it can."""
    out = []
    if cfg.norm_eps != MEGATRON_GATED_NORM_EPS and cfg.mamba_layer_ids:
        out.append(f"norm_eps: {cfg.norm_eps} (Megatron's gated Mamba norm hard-codes eps 1e-5)")
    if tuple(cfg.dt_limit) != (0.0, math.inf) and cfg.mamba_layer_ids:
        out.append(f"dt_limit: {tuple(cfg.dt_limit)} (Megatron applies no dt clamp: its scan passes dt_limit "
                   "(0, inf))")
    if cfg.mamba_proj_bias:
        out.append("mamba_proj_bias: true (MambaMixer asserts `not bias`)")
    if cfg.mamba_layer_ids and not cfg.mamba_conv_bias:
        out.append("mamba_conv_bias: false (MambaMixer asserts `conv_bias`)")
    if cfg.attn_bias:
        out.append("attn_bias: true (not mapped)")
    if cfg.mlp_bias:
        out.append("mlp_bias: true (not mapped)")
    if any(s.ffn == "moe" for s in cfg.layers):
        out.append(f"layers: MoE layers ({cfg.moe_router} router) are not mapped")
    if any(s.ffn == "mlp" for s in cfg.layers) and cfg.mlp_act != "silu":
        out.append(f"mlp_act: {cfg.mlp_act!r} (only the gated SiLU MLP is mapped)")
    for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
        if getattr(cfg, name) != 1.0:
            out.append(f"{name}: {getattr(cfg, name)} (Megatron's HybridModel has no such multiplier here)")
    if cfg.attention_layer_ids:
        if not math.isclose(cfg.attn_scale, cfg.attn_head_dim ** -0.5, rel_tol=0, abs_tol=1e-12):
            out.append(f"attn_scale: {cfg.attn_scale} (Megatron uses kv_channels^-0.5)")
        if cfg.rope_dim not in (0,) and cfg.rope_dim % 2:
            out.append(f"rope_dim: {cfg.rope_dim} (odd)")
    return out


def check_mappable(cfg: HybridConfig) -> None:
    """Raise UnsupportedConfig listing every unmappable field."""
    why = refusals(cfg)
    if why:
        raise UnsupportedConfig(f"{cfg.model_type} model not mappable to Megatron-Core exactly: " + "; ".join(why))


def layer_plan(cfg: HybridConfig) -> list[tuple[str, int]]:
    """(Megatron symbol, our layer index) for every Megatron layer, in order."""
    plan = []
    for i, spec in enumerate(cfg.layers):
        if spec.mixer == "mamba":
            plan.append(("M", i))
        elif spec.mixer == "attention":
            plan.append(("*", i))
        if spec.ffn == "mlp":
            plan.append(("-", i))
    return plan


def pattern(cfg: HybridConfig) -> str:
    """Megatron's hybrid_layer_pattern for this config, e.g. Bamba M,*,M -> 'M-*-M-'."""
    return "".join(sym for sym, _ in layer_plan(cfg))


def _qkv_interleaved(cfg: HybridConfig, q, k, v) -> torch.Tensor:
    """Megatron's linear_qkv rows: per KV group g, its H/Hkv query heads, then k_g, then v_g."""
    d, hkv = cfg.attn_head_dim, cfg.n_kv_heads
    rep = cfg.n_attn_heads // hkv
    qg = q.reshape(hkv, rep * d, -1)
    return torch.cat([qg, k.reshape(hkv, d, -1), v.reshape(hkv, d, -1)], dim=1).reshape(-1, q.shape[-1])


def _qkv_split(cfg: HybridConfig, w) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d, hkv = cfg.attn_head_dim, cfg.n_kv_heads
    rep = cfg.n_attn_heads // hkv
    g = w.reshape(hkv, (rep + 2) * d, -1)
    q, k, v = g[:, :rep * d], g[:, rep * d:(rep + 1) * d], g[:, (rep + 1) * d:]
    return q.reshape(-1, w.shape[-1]), k.reshape(-1, w.shape[-1]), v.reshape(-1, w.shape[-1])


# Per Megatron layer symbol: (canonical name under `layers.{i}.`, HybridModel name under `decoder.layers.{j}.`) of
# every tensor that moves unchanged; the reshaped ones (conv weight, fused QKV, fused gate/up) are in _reshaped.
_RENAMED = {
    "M": (("mixer_norm.weight", "norm.weight"), ("mamba.in_proj.weight", "mixer.in_proj.weight"),
          ("mamba.conv1d.bias", "mixer.conv1d_bias"), ("mamba.dt_bias", "mixer.dt_bias"),
          ("mamba.A_log", "mixer.A_log"), ("mamba.D", "mixer.D"), ("mamba.norm.weight", "mixer.norm.weight"),
          ("mamba.out_proj.weight", "mixer.out_proj.weight")),
    "*": (("mixer_norm.weight", "input_layernorm.weight"), ("attn.o_proj.weight", "self_attention.linear_proj.weight")),
    "-": (("ffn_norm.weight", "pre_mlp_layernorm.weight"), ("mlp.down_proj.weight", "mlp.linear_fc2.weight")),
}


def _layers(cfg: HybridConfig):
    """(symbol, HybridModel prefix, canonical prefix) of every Megatron layer, in order."""
    for j, (sym, i) in enumerate(layer_plan(cfg)):
        yield sym, f"decoder.layers.{j}.", f"layers.{i}."


def _reshaped(cfg: HybridConfig, sym: str, p: str, L: str, t: dict, sd: dict, forward: bool) -> None:
    """The tensors of one layer whose layout differs: canonical `t` -> `sd` when `forward`, else `sd` -> `t`."""
    if sym == "M":          # conv weight [conv_dim, K] <-> [conv_dim, 1, K]
        if forward:
            sd[p + "mixer.conv1d_weight"] = t[L + "mamba.conv1d.weight"].unsqueeze(1)
        else:
            t[L + "mamba.conv1d.weight"] = sd[p + "mixer.conv1d_weight"].squeeze(1)
    elif sym == "*":        # q, k, v <-> one fused QKV, interleaved per KV group
        names = [L + f"attn.{x}_proj.weight" for x in "qkv"]
        if forward:
            sd[p + "self_attention.linear_qkv.weight"] = _qkv_interleaved(cfg, *(t[n] for n in names))
        else:
            t.update(zip(names, _qkv_split(cfg, sd[p + "self_attention.linear_qkv.weight"])))
    else:                   # gate, up <-> one fc1 ([gate; up])
        names = [L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"]
        if forward:
            sd[p + "mlp.linear_fc1.weight"] = torch.cat([t[n] for n in names], 0)
        else:
            t.update(zip(names, sd[p + "mlp.linear_fc1.weight"].chunk(2, dim=0)))


def to_megatron(cfg: HybridConfig, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical tensors (oracle.checkpoint) -> HybridModel state dict (parameter names only)."""
    check_mappable(cfg)
    sd = {"embedding.word_embeddings.weight": t["embed.weight"], "decoder.final_norm.weight": t["final_norm.weight"]}
    if not cfg.tie_word_embeddings:
        sd["output_layer.weight"] = t["lm_head.weight"]
    for sym, p, L in _layers(cfg):
        for ours, theirs in _RENAMED[sym]:
            sd[p + theirs] = t[L + ours]
        _reshaped(cfg, sym, p, L, t, sd, forward=True)
    return sd


def from_megatron(cfg: HybridConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `to_megatron` (for the round-trip test): HybridModel state dict -> canonical tensors."""
    t = {"embed.weight": sd["embedding.word_embeddings.weight"], "final_norm.weight": sd["decoder.final_norm.weight"]}
    t["lm_head.weight"] = t["embed.weight"] if cfg.tie_word_embeddings else sd["output_layer.weight"]
    for sym, p, L in _layers(cfg):
        for ours, theirs in _RENAMED[sym]:
            t[L + ours] = sd[p + theirs]
        _reshaped(cfg, sym, p, L, t, sd, forward=False)
    return t
