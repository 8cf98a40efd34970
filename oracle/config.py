"""One `HybridConfig` for every supported hybrid Mamba2/attention architecture, read from HF config.json.

`from_hf_config(path_or_dict)` maps model_type ∈ {bamba, nemotron_h, mamba2, granitemoehybrid}; every
architecture difference becomes an explicit field (see docs/models.md for the full mapping table).
`to_hf_config(config)` writes the HF dict back (used by the model zoo). Errors are `ConfigError`, naming
the field.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("bamba", "nemotron_h", "mamba2", "granitemoehybrid")
MAX_SIZE = 1 << 24          # bound on every integer size (vocab, widths, layers, experts): > any real checkpoint's
# Integer fields of the supported HF configs: type-checked whenever present, also where a model_type ignores them.
INT_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "attention_head_dim", "mamba_n_heads", "mamba_num_heads", "num_heads",
            "mamba_head_dim", "mamba_n_groups", "n_groups", "mamba_d_state", "ssm_state_size", "state_size",
            "mamba_d_conv", "conv_kernel", "mamba_chunk_size", "chunk_size", "mamba_expand", "expand",
            "num_local_experts", "num_experts_per_tok", "shared_intermediate_size", "n_routed_experts",
            "moe_intermediate_size", "moe_shared_expert_intermediate_size", "n_group", "topk_group",
            "max_position_embeddings")
PATTERN_CHARS = {"M": ("mamba", None), "*": ("attention", None), "-": (None, "mlp"), "E": (None, "moe")}
HF_BLOCK_TYPES = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*",
                  "mlp": "-", "moe": "E"}


class ConfigError(ValueError):
    """A config.json that the oracle cannot (or must not) interpret; the message names the field."""


@dataclass(frozen=True)
class LayerSpec:
    """One layer: a sequence mixer and/or a feed-forward block (Bamba: both; Nemotron-H: one of them)."""
    mixer: str | None          # "mamba" | "attention" | None
    ffn: str | None            # "mlp" | "moe" | None


@dataclass(frozen=True)
class HybridConfig:
    """Every field the oracle's math reads; architecture differences are explicit fields."""
    model_type: str
    vocab_size: int
    hidden_size: int
    layers: tuple[LayerSpec, ...]
    norm_eps: float
    # Mamba2 mixer
    mamba_n_heads: int = 0
    mamba_head_dim: int = 0
    mamba_n_groups: int = 1
    mamba_d_state: int = 0
    mamba_d_conv: int = 4
    chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, math.inf)   # clamp of softplus(dt + dt_bias)
    # attention
    n_attn_heads: int = 0
    n_kv_heads: int = 0
    attn_head_dim: int = 0
    attn_bias: bool = False
    attn_scale: float = 0.0          # softmax scale (head_dim**-0.5, or Granite's attention_multiplier)
    rope_dim: int = 0                # rotated dims per head: head_dim (full), head_dim//2 (Bamba), 0 (none)
    rope_theta: float = 10000.0
    # feed-forward
    mlp_act: str = "silu"            # "silu": gated SiLU (gate, up, down); "relu2": squared ReLU (up, down)
    mlp_intermediate_size: int = 0
    mlp_bias: bool = False
    # mixture of experts
    moe_router: str = ""             # "softmax_topk" (granitemoehybrid) | "sigmoid_grouped" (nemotron_h)
    moe_n_experts: int = 0
    moe_top_k: int = 0
    moe_intermediate_size: int = 0
    moe_shared_intermediate_size: int = 0   # 0: no shared expert
    moe_norm_topk_prob: bool = True
    moe_routed_scaling_factor: float = 1.0
    moe_n_group: int = 1
    moe_topk_group: int = 1
    # model-level
    tie_word_embeddings: bool = False
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0      # logits are divided by this (Granite)
    residual_in_fp32: bool = False
    extra: dict = field(default_factory=dict, compare=False, hash=False)  # HF fields kept for round trip

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def d_inner(self) -> int:
        return self.mamba_n_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.mamba_n_groups * self.mamba_d_state

    @property
    def in_proj_dim(self) -> int:
        return self.d_inner + self.conv_dim + self.mamba_n_heads      # [z | xBC | dt]

    @property
    def mamba_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.layers) if s.mixer == "mamba")

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.layers) if s.mixer == "attention")

    @property
    def pattern(self) -> str:
        """Nemotron-H-style pattern string of the layer list (Bamba layers show mixer then ffn)."""
        inv = {v: k for k, v in PATTERN_CHARS.items()}
        return "".join((inv[(s.mixer, None)] if s.mixer else "") + (inv[(None, s.ffn)] if s.ffn else "")
                       for s in self.layers)


# ----------------------------------------------------------------------------------------------- helpers

def _decode_float(v: Any, name: str) -> float:
    """JSON floats incl. HF's {"__float__": "Infinity"} and plain "Infinity" strings."""
    if isinstance(v, dict) and "__float__" in v:
        v = v["__float__"]
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            raise ConfigError(f"{name}: {v!r} is not a number") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{name}: {v!r} is not a number")
    try:
        return float(v)
    except OverflowError:
        raise ConfigError(f"{name}: {v} is out of the floating-point range") from None


def _check_float(x: float, name: str, positive: bool = False, nonneg: bool = False) -> float:
    """x finite, and > 0 (positive) or >= 0 (nonneg) when asked; else ConfigError naming the field."""
    if not math.isfinite(x):
        raise ConfigError(f"{name}: must be a finite number, got {x}")
    if positive and not x > 0:
        raise ConfigError(f"{name}: must be > 0, got {x}")
    if nonneg and not x >= 0:
        raise ConfigError(f"{name}: must be >= 0, got {x}")
    return x


def _encode_float(v: float) -> Any:
    return {"__float__": "Infinity"} if v == math.inf else v


class _Fields:
    """Typed reads from the HF dict; every failure names the field."""

    def __init__(self, d: dict):
        self.d = d

    def has(self, k: str) -> bool:
        return self.d.get(k) is not None

    def int(self, k: str, default: Any = None, positive: bool = True) -> int:
        """An integer (no floats, no bools: 32.0 is an error, not 32) in [1 or 0, MAX_SIZE]."""
        v = self.d.get(k, default)
        if v is None:
            raise ConfigError(f"{k}: required field is missing")
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{k}: expected an integer, got {v!r}")
        if positive and v <= 0:
            raise ConfigError(f"{k}: must be > 0, got {v}")
        if v < 0:
            raise ConfigError(f"{k}: must be >= 0, got {v}")
        if v > MAX_SIZE:
            raise ConfigError(f"{k}: {v} is larger than any supported size ({MAX_SIZE})")
        return v

    def float(self, k: str, default: Any = None, positive: bool = False, nonneg: bool = False) -> float:
        """A finite number (HF's {"__float__": ...} form accepted), optionally > 0 or >= 0."""
        v = self.d.get(k, default)
        if v is None:
            raise ConfigError(f"{k}: required field is missing")
        return _check_float(_decode_float(v, k), k, positive, nonneg)

    def bool(self, k: str, default: bool) -> bool:
        v = self.d.get(k, default)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise ConfigError(f"{k}: expected true/false, got {v!r}")
        return v

    def str(self, k: str, default: Any = None) -> Any:
        v = self.d.get(k, default)
        if v is not None and not isinstance(v, str):
            raise ConfigError(f"{k}: expected a string, got {v!r}")
        return v


def _dt_limit(f: _Fields, key: str = "time_step_limit") -> tuple[float, float]:
    v = f.d.get(key)
    if v is None:
        return (0.0, math.inf)
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise ConfigError(f"{key}: expected [low, high], got {v!r}")
    lo, hi = _decode_float(v[0], key), _decode_float(v[1], key)
    if not (0.0 <= lo <= hi and math.isfinite(lo) and hi > 0):
        raise ConfigError(f"{key}: need 0 <= low <= high, low finite, high > 0, got [{lo}, {hi}]")
    return (lo, hi)


def _rope(f: _Fields, head_dim: int, partial_factor: float | None) -> tuple[int, float]:
    rp = f.d.get("rope_parameters") or {}
    if not isinstance(rp, dict):
        raise ConfigError(f"rope_parameters: expected an object, got {rp!r}")
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"rope_parameters.rope_type: {rope_type!r} is not supported (only 'default')")
    if f.has("rope_scaling"):
        raise ConfigError("rope_scaling: RoPE scaling is not supported")
    theta = _check_float(_decode_float(rp.get("rope_theta", f.d.get("rope_theta", 10000.0)),
                                       "rope_parameters.rope_theta"), "rope_parameters.rope_theta", positive=True)
    factor = partial_factor if partial_factor is not None else _check_float(_decode_float(
        rp.get("partial_rotary_factor", f.d.get("partial_rotary_factor", 1.0)), "partial_rotary_factor"),
        "partial_rotary_factor", positive=True)
    if factor > 1:
        raise ConfigError(f"partial_rotary_factor: must be in (0, 1], got {factor}")
    rot = int(head_dim * factor)
    if rot % 2 != 0 or not (0 < rot <= head_dim):
        raise ConfigError(f"partial_rotary_factor: gives {rot} rotated dims of head_dim={head_dim}; need even, > 0")
    return rot, theta


def _check_act(f: _Fields, key: str, want: str) -> None:
    v = f.str(key, want)
    if v != want:
        raise ConfigError(f"{key}: {v!r} is not supported for model_type {f.d['model_type']!r} (expected {want!r})")


def _block_list(f: _Fields, key: str) -> list[str]:
    v = f.d.get(key)
    if not isinstance(v, list) or not v:
        raise ConfigError(f"{key}: expected a non-empty list of layer types, got {v!r}")
    out = []
    for i, t in enumerate(v):
        if not isinstance(t, str) or t not in HF_BLOCK_TYPES:
            raise ConfigError(f"{key}[{i}]: unknown layer type {t!r} (known: {sorted(HF_BLOCK_TYPES)})")
        out.append(HF_BLOCK_TYPES[t])
    return out


def _check_pattern(pattern: Any, key: str) -> str:
    if not isinstance(pattern, str) or not pattern:
        raise ConfigError(f"{key}: expected a non-empty pattern string, got {pattern!r}")
    for i, c in enumerate(pattern):
        if c not in PATTERN_CHARS:
            raise ConfigError(f"{key}: bad pattern character {c!r} at index {i} (allowed: M * - E)")
    return pattern


def _check_gated_norm(f: _Fields) -> None:
    if f.d.get("norm_before_gate") is True:
        raise ConfigError("norm_before_gate: true is not supported (the gate multiplies before the norm)")
    if f.d.get("rms_norm") is False:
        raise ConfigError("rms_norm: false is not supported (the Mamba2 output norm is a gated RMSNorm)")


def _mamba_fields(f: _Fields, heads: str, head_dim: str, groups: str, state: str, conv: str, chunk: str,
                  expand: str | None, conv_bias: str, proj_bias: str) -> dict:
    _check_gated_norm(f)
    n_heads = f.int(heads)
    hd = f.d.get(head_dim, "auto")
    if hd == "auto" or hd is None:
        if expand is None:
            raise ConfigError(f"{head_dim}: required field is missing")
        inner = f.int(expand, 2) * f.int("hidden_size")
        if inner % n_heads:
            raise ConfigError(f"{heads}: {n_heads} does not divide {expand} * hidden_size = {inner}")
        hd = inner // n_heads
    else:
        hd = f.int(head_dim)
    if expand is not None and f.has(expand) and f.int(expand) * f.int("hidden_size") != n_heads * hd:
        raise ConfigError(f"{head_dim}: {heads} * {head_dim} = {n_heads * hd} != "
                          f"{expand} * hidden_size = {f.int(expand) * f.int('hidden_size')}")
    g = f.int(groups, 1)
    if n_heads % g:
        raise ConfigError(f"{groups}: {heads}={n_heads} is not divisible by {groups}={g}")
    d_conv = f.int(conv, 4)
    if d_conv < 2:
        raise ConfigError(f"{conv}: must be >= 2, got {d_conv}")
    return dict(mamba_n_heads=n_heads, mamba_head_dim=hd, mamba_n_groups=g, mamba_d_state=f.int(state),
                mamba_d_conv=d_conv, chunk_size=f.int(chunk, 256), mamba_conv_bias=f.bool(conv_bias, True),
                mamba_proj_bias=f.bool(proj_bias, False))


def _attn_fields(f: _Fields, default_head_dim: int | None = None) -> dict:
    h = f.int("num_attention_heads")
    kv = f.int("num_key_value_heads", h)
    if h % kv:
        raise ConfigError(f"num_key_value_heads: num_attention_heads={h} is not divisible by it ({kv})")
    hd = f.d.get("head_dim", default_head_dim)
    if hd is None:
        if f.int("hidden_size") % h:
            raise ConfigError(f"num_attention_heads: {h} does not divide hidden_size={f.int('hidden_size')}")
        hd = f.int("hidden_size") // h
    hd = f.int("head_dim", hd)
    return dict(n_attn_heads=h, n_kv_heads=kv, attn_head_dim=hd, attn_scale=hd ** -0.5)


def _uniform_layers(types: list[str], ffn: str | None) -> tuple[LayerSpec, ...]:
    return tuple(LayerSpec("mamba" if t == "M" else "attention", ffn) for t in types)


# ------------------------------------------------------------------------------------------ per model_type

def _bamba(f: _Fields) -> dict:
    n = f.int("num_hidden_layers")
    idx = f.d.get("attn_layer_indices") or []
    if not isinstance(idx, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in idx):
        raise ConfigError(f"attn_layer_indices: expected a list of integers, got {idx!r}")
    for i in idx:
        if not 0 <= i < n:
            raise ConfigError(f"attn_layer_indices: {i} is out of range for num_hidden_layers={n}")
    if len(set(idx)) != len(idx):
        raise ConfigError(f"attn_layer_indices: duplicate entries in {idx}")
    _check_act(f, "hidden_act", "silu")
    out = _mamba_fields(f, "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv",
                        "mamba_chunk_size", "mamba_expand", "mamba_conv_bias", "mamba_proj_bias")
    out.update(layers=_uniform_layers(["*" if i in idx else "M" for i in range(n)], "mlp"),
               norm_eps=f.float("rms_norm_eps", 1e-5, positive=True), dt_limit=_dt_limit(f),
               mlp_act="silu", mlp_intermediate_size=f.int("intermediate_size"), mlp_bias=f.bool("mlp_bias", False),
               tie_word_embeddings=f.bool("tie_word_embeddings", False))
    if idx:
        out.update(_attn_fields(f), attn_bias=f.bool("attention_bias", False))
        out["rope_dim"], out["rope_theta"] = _rope(f, out["attn_head_dim"], 0.5)   # Bamba: always half
    return out


def _granite(f: _Fields) -> dict:
    n = f.int("num_hidden_layers")
    types = _block_list(f, "layer_types") if f.has("layer_types") else ["M"] * n
    if len(types) != n:
        raise ConfigError(f"layer_types: has {len(types)} entries but num_hidden_layers={n}")
    if any(t not in "M*" for t in types):
        raise ConfigError("layer_types: granitemoehybrid layers must be mamba/linear_attention or attention")
    _check_act(f, "hidden_act", "silu")
    n_exp = f.int("num_local_experts", 0, positive=False)
    out = _mamba_fields(f, "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv",
                        "mamba_chunk_size", "mamba_expand", "mamba_conv_bias", "mamba_proj_bias")
    out.update(layers=_uniform_layers(types, "moe" if n_exp > 0 else "mlp"),
               norm_eps=f.float("rms_norm_eps", 1e-6, positive=True), dt_limit=_dt_limit(f), mlp_act="silu",
               mlp_intermediate_size=f.int("shared_intermediate_size"),
               tie_word_embeddings=f.bool("tie_word_embeddings", False),
               embedding_multiplier=f.float("embedding_multiplier", 1.0, positive=True),
               residual_multiplier=f.float("residual_multiplier", 1.0, positive=True),
               logits_scaling=f.float("logits_scaling", 1.0, positive=True))   # logits are divided by it
    if n_exp > 0:
        k = f.int("num_experts_per_tok", 2)
        if k > n_exp:
            raise ConfigError(f"num_experts_per_tok: {k} > num_local_experts={n_exp}")
        out.update(moe_router="softmax_topk", moe_n_experts=n_exp, moe_top_k=k,
                   moe_intermediate_size=f.int("intermediate_size"),
                   moe_shared_intermediate_size=out["mlp_intermediate_size"], moe_norm_topk_prob=True)
    if "*" in types:
        out.update(_attn_fields(f), attn_bias=f.bool("attention_bias", False),
                   attn_scale=f.float("attention_multiplier", 1.0, positive=True))
        pet = f.str("position_embedding_type")
        if pet == "rope":
            out["rope_dim"], out["rope_theta"] = _rope(f, out["attn_head_dim"], None)
        elif pet not in (None, "nope"):
            raise ConfigError(f"position_embedding_type: {pet!r} is not supported (rope, nope or null)")
    return out


def _nemotron_h(f: _Fields) -> dict:
    if f.has("layers_block_type") or f.has("layer_types"):
        types = _block_list(f, "layers_block_type" if f.has("layers_block_type") else "layer_types")
        if f.has("hybrid_override_pattern") and \
                _check_pattern(f.d["hybrid_override_pattern"], "hybrid_override_pattern") != "".join(types):
            raise ConfigError("hybrid_override_pattern: disagrees with layers_block_type")
    else:
        types = list(_check_pattern(f.d.get("hybrid_override_pattern"), "hybrid_override_pattern"))
    if f.has("num_hidden_layers") and f.int("num_hidden_layers") != len(types):
        raise ConfigError(f"num_hidden_layers: {f.int('num_hidden_layers')} != {len(types)} layers in the pattern")
    _check_act(f, "mamba_hidden_act", "silu")
    _check_act(f, "mlp_hidden_act", "relu2")
    if f.has("moe_latent_size"):
        raise ConfigError("moe_latent_size: latent MoE projections are not supported")
    if f.has("sliding_window"):
        raise ConfigError("sliding_window: sliding-window attention is not supported")
    if f.bool("attention_bias", False):
        raise ConfigError("attention_bias: nemotron_h attention has no biases (HF ignores the flag); refusing true")
    out = _mamba_fields(f, "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel",
                        "chunk_size", None, "use_conv_bias", "use_bias")
    # dt is clamped to time_step_limit, as NVIDIA's Nemotron-H code and HF >= 5.25 do; time_step_min/max only
    # initialise dt_bias (HF <= 5.24 clamped with (time_step_min, inf) instead: docs/models.md, footnote 1).
    f.float("time_step_min", 0.001, nonneg=True)    # still a config value: a malformed one is refused
    out.update(layers=tuple(LayerSpec(*PATTERN_CHARS[c]) for c in types),
               norm_eps=f.float("layer_norm_epsilon", 1e-5, positive=True),
               dt_limit=_dt_limit(f), mlp_act="relu2",
               mlp_intermediate_size=f.int("intermediate_size"), mlp_bias=f.bool("mlp_bias", False),
               tie_word_embeddings=f.bool("tie_word_embeddings", False),
               residual_in_fp32=f.bool("residual_in_fp32", False))
    if "*" in types:   # HF NemotronHConfig: head_dim defaults to 128; older configs call it attention_head_dim
        out.update(_attn_fields(f, f.d.get("attention_head_dim", 128)))
    if "E" in types:
        n_exp, k = f.int("n_routed_experts"), f.int("num_experts_per_tok")
        ng, tg = f.int("n_group", 1), f.int("topk_group", 1)
        if k > n_exp:
            raise ConfigError(f"num_experts_per_tok: {k} > n_routed_experts={n_exp}")
        if n_exp % ng:
            raise ConfigError(f"n_group: {ng} does not divide n_routed_experts={n_exp}")
        if tg > ng:
            raise ConfigError(f"topk_group: {tg} > n_group={ng}")
        if n_exp // ng < 2:
            raise ConfigError(f"n_group: {ng} leaves < 2 experts per group (the group score sums the top 2)")
        if k > tg * (n_exp // ng):
            raise ConfigError(f"num_experts_per_tok: {k} > the {tg * (n_exp // ng)} experts of topk_group={tg} groups")
        out.update(moe_router="sigmoid_grouped", moe_n_experts=n_exp, moe_top_k=k,
                   moe_intermediate_size=f.int("moe_intermediate_size"),
                   moe_shared_intermediate_size=f.int("moe_shared_expert_intermediate_size"),
                   moe_norm_topk_prob=f.bool("norm_topk_prob", True),
                   moe_routed_scaling_factor=f.float("routed_scaling_factor", 1.0, positive=True), moe_n_group=ng,
                   moe_topk_group=tg)
    return out


def _mamba2(f: _Fields) -> dict:
    n = f.int("num_hidden_layers")
    _check_act(f, "hidden_act", "silu")
    out = _mamba_fields(f, "num_heads", "head_dim", "n_groups", "state_size", "conv_kernel", "chunk_size",
                        "expand", "use_conv_bias", "use_bias")
    out.update(layers=tuple(LayerSpec("mamba", None) for _ in range(n)),
               norm_eps=f.float("layer_norm_epsilon", 1e-5, positive=True), dt_limit=_dt_limit(f),
               tie_word_embeddings=f.bool("tie_word_embeddings", False),
               residual_in_fp32=f.bool("residual_in_fp32", True))
    return out


_READERS = {"bamba": _bamba, "nemotron_h": _nemotron_h, "mamba2": _mamba2, "granitemoehybrid": _granite}


def from_hf_config(path_or_dict: str | os.PathLike | dict) -> HybridConfig:
    """Read an HF config.json (a folder, a file path, or the parsed dict) into a HybridConfig."""
    if isinstance(path_or_dict, dict):
        d = path_or_dict
    elif not isinstance(path_or_dict, (str, os.PathLike)):
        raise ConfigError(f"config.json: expected a folder, a file path or a dict, got {type(path_or_dict).__name__}")
    else:
        p = os.fspath(path_or_dict)
        if os.path.isdir(p):
            p = os.path.join(p, "config.json")
        try:
            with open(p, "rb") as fh:
                d = json.loads(fh.read().decode("utf-8-sig"))
        except FileNotFoundError:
            raise ConfigError(f"config.json: not found at {p}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config.json: {p} is not UTF-8 text ({e})") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"config.json: not valid JSON in {p} ({e})") from None
        except (OSError, RecursionError) as e:
            raise ConfigError(f"config.json: cannot read {p} ({type(e).__name__}: {e})") from None
    if not isinstance(d, dict):
        raise ConfigError("config.json: top level must be a JSON object")
    mt = d.get("model_type")
    if not isinstance(mt, str) or mt not in _READERS:
        raise ConfigError(f"model_type: {mt!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    f = _Fields(d)
    for k in INT_KEYS:
        if f.has(k) and not (k == "head_dim" and d[k] == "auto"):
            f.int(k, positive=False)
    fields = _READERS[mt](f)
    vocab = f.int("vocab_size")
    ids = {k: d[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in d}
    for k, v in ids.items():
        for t in (v if isinstance(v, list) else [v]):
            if t is not None and (isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab):
                raise ConfigError(f"{k}: {v!r} is not a token id (or list of them) in [0, vocab_size={vocab})")
    if f.has("max_position_embeddings"):      # the positions a request may use (oracle.trace.model_positions)
        ids["max_position_embeddings"] = d["max_position_embeddings"]
    return HybridConfig(model_type=mt, vocab_size=vocab, hidden_size=f.int("hidden_size"), extra=ids, **fields)


# --------------------------------------------------------------------------------------------- write back

def to_hf_config(c: HybridConfig) -> dict:
    """The HF config.json dict for `c` (what transformers 5.x and from_hf_config both read)."""
    d: dict[str, Any] = {"model_type": c.model_type, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
                         "tie_word_embeddings": c.tie_word_embeddings, **c.extra}
    inner = c.d_inner
    if c.model_type in ("bamba", "granitemoehybrid"):
        d.update(num_hidden_layers=c.num_layers, hidden_act="silu", mamba_n_heads=c.mamba_n_heads,
                 mamba_d_head=c.mamba_head_dim, mamba_n_groups=c.mamba_n_groups, mamba_d_state=c.mamba_d_state,
                 mamba_d_conv=c.mamba_d_conv, mamba_expand=inner // c.hidden_size, mamba_chunk_size=c.chunk_size,
                 mamba_conv_bias=c.mamba_conv_bias, mamba_proj_bias=c.mamba_proj_bias,
                 time_step_limit=[c.dt_limit[0], _encode_float(c.dt_limit[1])], rms_norm_eps=c.norm_eps)
        if inner % c.hidden_size:
            raise ConfigError(f"mamba_expand: d_inner={inner} is not a multiple of hidden_size={c.hidden_size}")
    if c.attention_layer_ids:
        d.update(num_attention_heads=c.n_attn_heads, num_key_value_heads=c.n_kv_heads, head_dim=c.attn_head_dim,
                 attention_bias=c.attn_bias, rope_parameters={"rope_theta": c.rope_theta, "rope_type": "default"})
    if c.model_type == "bamba":
        d.update(attn_layer_indices=list(c.attention_layer_ids), intermediate_size=c.mlp_intermediate_size,
                 mlp_bias=c.mlp_bias)
        if c.attention_layer_ids:
            d["rope_parameters"]["partial_rotary_factor"] = 0.5
    elif c.model_type == "granitemoehybrid":
        # dense (no experts) as the dense Granite 4.0 configs write it: num_experts_per_tok 0, intermediate_size the
        # MLP's (transformers reads neither then; llama.cpp's loader asserts top-k <= experts, sizes the FFN from it)
        d.update(layer_types=["linear_attention" if s.mixer == "mamba" else "full_attention" for s in c.layers],
                 shared_intermediate_size=c.mlp_intermediate_size, num_local_experts=c.moe_n_experts,
                 num_experts_per_tok=c.moe_top_k,
                 intermediate_size=c.moe_intermediate_size or c.mlp_intermediate_size or 1,
                 embedding_multiplier=c.embedding_multiplier, residual_multiplier=c.residual_multiplier,
                 logits_scaling=c.logits_scaling, position_embedding_type="rope" if c.rope_dim else None)
        if c.attention_layer_ids:
            d.update(attention_multiplier=c.attn_scale)
            d["rope_parameters"]["partial_rotary_factor"] = c.rope_dim / c.attn_head_dim if c.rope_dim else 1.0
    elif c.model_type == "nemotron_h":
        d.update(layers_block_type=[{("mamba", None): "linear_attention", ("attention", None): "full_attention",
                                     (None, "mlp"): "mlp", (None, "moe"): "moe"}[(s.mixer, s.ffn)] for s in c.layers],
                 mamba_num_heads=c.mamba_n_heads, mamba_head_dim=c.mamba_head_dim, n_groups=c.mamba_n_groups,
                 ssm_state_size=c.mamba_d_state, conv_kernel=c.mamba_d_conv, chunk_size=c.chunk_size,
                 use_conv_bias=c.mamba_conv_bias, use_bias=c.mamba_proj_bias, expand=max(inner // c.hidden_size, 1),
                 time_step_min=0.001, time_step_limit=[c.dt_limit[0], _encode_float(c.dt_limit[1])],
                 layer_norm_epsilon=c.norm_eps, mlp_hidden_act="relu2", mamba_hidden_act="silu",
                 intermediate_size=c.mlp_intermediate_size or 1, mlp_bias=c.mlp_bias,
                 residual_in_fp32=c.residual_in_fp32)
        d.pop("rope_parameters", None)
        if c.moe_n_experts:
            d.update(n_routed_experts=c.moe_n_experts, num_experts_per_tok=c.moe_top_k,
                     moe_intermediate_size=c.moe_intermediate_size,
                     moe_shared_expert_intermediate_size=c.moe_shared_intermediate_size,
                     norm_topk_prob=c.moe_norm_topk_prob, routed_scaling_factor=c.moe_routed_scaling_factor,
                     n_group=c.moe_n_group, topk_group=c.moe_topk_group)
    elif c.model_type == "mamba2":
        d.update(num_hidden_layers=c.num_layers, hidden_act="silu", num_heads=c.mamba_n_heads,
                 head_dim=c.mamba_head_dim, n_groups=c.mamba_n_groups, state_size=c.mamba_d_state,
                 conv_kernel=c.mamba_d_conv, chunk_size=c.chunk_size, expand=inner // c.hidden_size,
                 use_conv_bias=c.mamba_conv_bias, use_bias=c.mamba_proj_bias,
                 time_step_limit=[c.dt_limit[0], _encode_float(c.dt_limit[1])], layer_norm_epsilon=c.norm_eps,
                 residual_in_fp32=c.residual_in_fp32)
        if inner % c.hidden_size:
            raise ConfigError(f"expand: d_inner={inner} is not a multiple of hidden_size={c.hidden_size}")
    else:
        raise ConfigError(f"model_type: {c.model_type!r} is not supported")
    return d
