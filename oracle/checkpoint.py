"""HF checkpoint IO: config.json + model.safetensors (or a sharded index) <-> canonical tensor names.

Canonical names are architecture-neutral (docs/models.md lists them and the HF names they come from):

    embed.weight [V, D]   final_norm.weight [D]   lm_head.weight [V, D] (the embed tensor when tied)
    layers.{i}.mixer_norm.weight, layers.{i}.ffn_norm.weight                      [D]
    layers.{i}.mamba.{in_proj.weight [in_proj_dim, D], in_proj.bias, conv1d.weight [conv_dim, K], conv1d.bias,
                      dt_bias [H], A_log [H], D [H], norm.weight [d_inner], out_proj.weight [D, d_inner], out_proj.bias}
    layers.{i}.attn.{q,k,v,o}_proj.{weight,bias}
    layers.{i}.mlp.{gate_proj,up_proj,down_proj}.{weight,bias}            (relu2: no gate_proj)
    layers.{i}.moe.router.weight [E, D], moe.router.score_bias [E] (nemotron_h),
    layers.{i}.moe.experts.{gate_proj [E, F, D] (gated only), up_proj [E, F, D], down_proj [E, D, F]},
    layers.{i}.moe.shared.{gate_proj,up_proj,down_proj}.weight

No pickle: safetensors and JSON only. Errors are `CheckpointError` and list every offending tensor.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from .config import HybridConfig, from_hf_config, to_hf_config


WEIGHT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


class CheckpointError(ValueError):
    """A checkpoint that does not match its config (missing/unexpected/misshapen/non-finite tensors, bad files)."""


# ------------------------------------------------------------------------------------------ expected shapes

def expected_shapes(c: HybridConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape, for every tensor the config requires."""
    D, V = c.hidden_size, c.vocab_size
    s: dict[str, tuple[int, ...]] = {"embed.weight": (V, D), "final_norm.weight": (D,), "lm_head.weight": (V, D)}
    for i, spec in enumerate(c.layers):
        p = f"layers.{i}."
        if spec.mixer:
            s[p + "mixer_norm.weight"] = (D,)
        if spec.mixer == "mamba":
            H, m = c.mamba_n_heads, p + "mamba."
            s.update({m + "in_proj.weight": (c.in_proj_dim, D), m + "conv1d.weight": (c.conv_dim, c.mamba_d_conv),
                      m + "dt_bias": (H,), m + "A_log": (H,), m + "D": (H,), m + "norm.weight": (c.d_inner,),
                      m + "out_proj.weight": (D, c.d_inner)})
            if c.mamba_conv_bias:
                s[m + "conv1d.bias"] = (c.conv_dim,)
            if c.mamba_proj_bias:
                s[m + "in_proj.bias"] = (c.in_proj_dim,)
                s[m + "out_proj.bias"] = (D,)
        elif spec.mixer == "attention":
            a, hd = p + "attn.", c.attn_head_dim
            dims = {"q": c.n_attn_heads * hd, "k": c.n_kv_heads * hd, "v": c.n_kv_heads * hd}
            for n, out in dims.items():
                s[f"{a}{n}_proj.weight"] = (out, D)
                if c.attn_bias:
                    s[f"{a}{n}_proj.bias"] = (out,)
            s[a + "o_proj.weight"] = (D, c.n_attn_heads * hd)
            if c.attn_bias:
                s[a + "o_proj.bias"] = (D,)
        if spec.ffn:
            s[p + "ffn_norm.weight"] = (D,)
        if spec.ffn == "mlp":
            s.update(_mlp_shapes(p + "mlp.", D, c.mlp_intermediate_size, c.mlp_act == "silu", c.mlp_bias))
        elif spec.ffn == "moe":
            E, F, q = c.moe_n_experts, c.moe_intermediate_size, p + "moe."
            s[q + "router.weight"] = (E, D)
            if c.moe_router == "sigmoid_grouped":
                s[q + "router.score_bias"] = (E,)
            if c.mlp_act == "silu":
                s[q + "experts.gate_proj"] = (E, F, D)
            s[q + "experts.up_proj"] = (E, F, D)
            s[q + "experts.down_proj"] = (E, D, F)
            if c.moe_shared_intermediate_size:
                s.update(_mlp_shapes(q + "shared.", D, c.moe_shared_intermediate_size, c.mlp_act == "silu", False))
    return s


def _mlp_shapes(p: str, D: int, F: int, gated: bool, bias: bool) -> dict[str, tuple[int, ...]]:
    s = {p + "up_proj.weight": (F, D), p + "down_proj.weight": (D, F)}
    if gated:
        s[p + "gate_proj.weight"] = (F, D)
    if bias:
        s.update({p + "up_proj.bias": (F,), p + "down_proj.bias": (D,)})
        if gated:
            s[p + "gate_proj.bias"] = (F,)
    return s


# --------------------------------------------------------------------------------- HF name <-> canonical

_NEMO_PREFIX = re.compile(r"^(backbone|model)\.")


def _hf_layer_names(c: HybridConfig, i: int) -> dict[str, str]:
    """Canonical suffix -> HF name suffix for the 1:1 tensors of layer i (split/stacked ones are handled apart)."""
    spec, out = c.layers[i], {}
    bamba_like = c.model_type in ("bamba", "granitemoehybrid")
    mixer_mod = "mamba." if bamba_like else "mixer."
    attn_mod = "self_attn." if bamba_like else "mixer."
    if spec.mixer:
        out["mixer_norm.weight"] = "input_layernorm.weight" if bamba_like else "norm.weight"
    if spec.ffn:
        out["ffn_norm.weight"] = {"bamba": "pre_ff_layernorm.weight", "granitemoehybrid":
                                  "post_attention_layernorm.weight"}.get(c.model_type, "norm.weight")
    if spec.mixer == "mamba":
        for n in ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D",
                  "norm.weight", "out_proj.weight", "out_proj.bias"):
            out["mamba." + n] = mixer_mod + n
    elif spec.mixer == "attention":
        for n in "qkvo":
            for t in ("weight", "bias"):
                out[f"attn.{n}_proj.{t}"] = f"{attn_mod}{n}_proj.{t}"
    if c.model_type == "bamba" and spec.ffn == "mlp":
        for n in ("gate_proj", "up_proj", "down_proj"):
            for t in ("weight", "bias"):
                out[f"mlp.{n}.{t}"] = f"feed_forward.{n}.{t}"
    if c.model_type == "nemotron_h" and spec.ffn == "mlp":
        for n in ("up_proj", "down_proj"):
            for t in ("weight", "bias"):
                out[f"mlp.{n}.{t}"] = f"mixer.{n}.{t}"
    if c.model_type == "nemotron_h" and spec.ffn == "moe":
        out.update({"moe.router.weight": "mixer.gate.weight", "moe.router.score_bias":
                    "mixer.gate.e_score_correction_bias", "moe.shared.up_proj.weight":
                    "mixer.shared_experts.up_proj.weight", "moe.shared.down_proj.weight":
                    "mixer.shared_experts.down_proj.weight"})
    if c.model_type == "granitemoehybrid" and spec.ffn == "moe":
        out["moe.router.weight"] = "block_sparse_moe.router.layer.weight"
    return out


def _prefix(c: HybridConfig) -> str:
    return "backbone." if c.model_type in ("nemotron_h", "mamba2") else "model."


def _top_names(c: HybridConfig) -> dict[str, str]:
    if c.model_type in ("nemotron_h", "mamba2"):
        return {"embed.weight": "embeddings.weight", "final_norm.weight": "norm_f.weight"}
    return {"embed.weight": "embed_tokens.weight",
            "final_norm.weight": "final_layernorm.weight" if c.model_type == "bamba" else "norm.weight"}


def normalised_names(c: HybridConfig, names) -> dict[str, str]:
    """HF name as the mapping expects it -> name as stored (Nemotron-H/Mamba2 accept `model.` and `embedding.`)."""
    out: dict[str, str] = {}
    for k in names:
        n = k
        if c.model_type in ("nemotron_h", "mamba2"):
            n = "backbone." + n[len("model."):] if n.startswith("model.") else n
            n = n.replace("backbone.embedding.", "backbone.embeddings.")
        if n in out:
            raise CheckpointError(f"{k}: the same tensor is stored twice (as {out[n]!r} and {k!r})")
        out[n] = k
    return out


def part_names(c: HybridConfig, part: int | str | None) -> set[str]:
    """Canonical names of one part of the model: None (all), "top" (embed, final norm, lm_head) or layer i."""
    want = expected_shapes(c)
    if part is None:
        return set(want)
    if part == "top":
        return {"embed.weight", "final_norm.weight", "lm_head.weight"}
    return {n for n in want if n.startswith(f"layers.{part}.")}


def hf_part_of(c: HybridConfig, hf_name: str) -> int | str:
    """Which part (see part_names) an HF tensor name (normalised) belongs to: its layer index, else "top"."""
    m = re.match(r"^(?:backbone|model)\.layers\.(\d+)\.", hf_name)
    return int(m.group(1)) if m and int(m.group(1)) < c.num_layers else "top"


def to_canonical(c: HybridConfig, hf: dict[str, Tensor], part: int | str | None = None) -> dict[str, Tensor]:
    """HF-named tensors -> canonical names; raises CheckpointError listing missing/unexpected/misshapen tensors.

    `part` (see part_names) maps only that part: `hf` then holds just its tensors (the streamed oracle loads
    one layer at a time). Meta-device tensors are checked by name, shape and dtype only (headers, no data)."""
    hf = {n: hf[k] for n, k in normalised_names(c, hf).items()}
    pool, pre = dict(hf), _prefix(c)
    want = expected_shapes(c)
    out: dict[str, Tensor] = {}
    missing: list[str] = []
    source: dict[str, str] = {}

    def take(hf_name: str) -> Tensor | None:
        if hf_name in pool:
            return pool.pop(hf_name)
        missing.append(hf_name)
        return None

    if part in (None, "top"):
        for canon, h in _top_names(c).items():
            source[canon] = pre + h
            out[canon] = take(pre + h)
    for i, spec in enumerate(c.layers):
        if part not in (None, i):
            continue
        lp = f"layers.{i}."
        for canon, h in _hf_layer_names(c, i).items():
            name = lp + canon
            if name in want:
                source[name] = pre + lp + h
                out[name] = take(pre + lp + h)
        if spec.mixer == "mamba" and out.get(lp + "mamba.conv1d.weight") is not None:
            w = out[lp + "mamba.conv1d.weight"]
            out[lp + "mamba.conv1d.weight"] = w[:, 0, :] if w.dim() == 3 and w.shape[1] == 1 else w
        _ffn_to_canonical(c, i, pre + lp, take, out, pool, source)
    if part in (None, "top"):
        if c.tie_word_embeddings:
            lm = pool.pop("lm_head.weight", None)
            emb = out["embed.weight"]
            if lm is not None and emb is not None and not lm.is_meta and (
                    lm.shape != emb.shape or not torch.equal(lm, emb)):
                raise CheckpointError("lm_head.weight: differs from the embedding but tie_word_embeddings=true")
            out["lm_head.weight"] = emb
        else:
            source["lm_head.weight"] = "lm_head.weight"
            out["lm_head.weight"] = take("lm_head.weight")
        if c.model_type == "nemotron_h":                 # multi-token-prediction heads: not part of the model
            pool = {k: v for k, v in pool.items() if not k.startswith("mtp.")}
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {', '.join(sorted(missing))}")
    if pool:
        problems.append(f"unexpected tensors ({len(pool)}): {', '.join(sorted(pool))}")
    if problems:
        raise CheckpointError(f"checkpoint does not match config ({c.model_type}): " + "; ".join(problems))
    check_tensors(c, out, source, names=part_names(c, part))
    return out


def _ffn_to_canonical(c: HybridConfig, i: int, hp: str, take, out: dict, pool: dict, source: dict) -> None:
    spec, lp = c.layers[i], f"layers.{i}."
    if c.model_type == "granitemoehybrid" and spec.ffn in ("mlp", "moe"):
        tgt = lp + ("mlp." if spec.ffn == "mlp" else "moe.shared.")
        w_in, w_out = take(hp + "shared_mlp.input_linear.weight"), take(hp + "shared_mlp.output_linear.weight")
        if w_in is not None:
            _expect_even(w_in, 0, hp + "shared_mlp.input_linear.weight")
            out[tgt + "gate_proj.weight"], out[tgt + "up_proj.weight"] = w_in.chunk(2, dim=0)
            source[tgt + "gate_proj.weight"] = source[tgt + "up_proj.weight"] = hp + "shared_mlp.input_linear.weight"
        out[tgt + "down_proj.weight"], source[tgt + "down_proj.weight"] = w_out, hp + "shared_mlp.output_linear.weight"
        if spec.ffn == "moe":
            e_in, e_out = take(hp + "block_sparse_moe.input_linear.weight"), take(hp + "block_sparse_moe.output_linear.weight")
            if e_in is not None:
                _expect_even(e_in, 1, hp + "block_sparse_moe.input_linear.weight")
                out[lp + "moe.experts.gate_proj"], out[lp + "moe.experts.up_proj"] = e_in.chunk(2, dim=1)
                source[lp + "moe.experts.gate_proj"] = hp + "block_sparse_moe.input_linear.weight"
                source[lp + "moe.experts.up_proj"] = hp + "block_sparse_moe.input_linear.weight"
            out[lp + "moe.experts.down_proj"] = e_out
            source[lp + "moe.experts.down_proj"] = hp + "block_sparse_moe.output_linear.weight"
    if c.model_type == "nemotron_h" and spec.ffn == "moe":
        for n in ("up_proj", "down_proj"):
            merged = hp + f"mixer.experts.{n}"
            if merged in pool:                                   # HF in-memory layout, [E, ...] already
                out[lp + f"moe.experts.{n}"] = pool.pop(merged)
                source[lp + f"moe.experts.{n}"] = merged
                continue
            per = [take(hp + f"mixer.experts.{j}.{n}.weight") for j in range(c.moe_n_experts)]
            source[lp + f"moe.experts.{n}"] = hp + f"mixer.experts.*.{n}.weight"
            if all(t is not None for t in per):
                try:
                    out[lp + f"moe.experts.{n}"] = torch.stack(per)
                except RuntimeError:
                    raise CheckpointError(f"{hp}mixer.experts.*.{n}.weight: experts have different shapes") from None


def _expect_even(t: Tensor, dim: int, name: str) -> None:
    if t.dim() <= dim or t.shape[dim] % 2:
        raise CheckpointError(f"{name}: dim {dim} of shape {tuple(t.shape)} must be even ([gate; up] stacked)")


def check_tensors(c: HybridConfig, tensors: dict[str, Tensor], source: dict[str, str] | None = None,
                  names: set[str] | None = None) -> None:
    """Every canonical tensor present, of the expected shape, floating point and finite; else CheckpointError.
    `names` restricts the check to a part of the model; meta tensors (headers only) skip the finiteness check."""
    want, source = expected_shapes(c), source or {}
    if names is not None:
        want = {n: s for n, s in want.items() if n in names}
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if extra:
        problems.append(f"unexpected tensors: {', '.join(extra)}")
    for name in sorted(set(want) & set(tensors)):
        t, label = tensors[name], name + (f" (HF {source[name]})" if name in source else "")
        if not isinstance(t, Tensor):
            problems.append(f"{label}: not a tensor")
        elif tuple(t.shape) != want[name]:
            problems.append(f"{label}: shape {tuple(t.shape)} != expected {want[name]}")
        elif not t.is_floating_point():
            problems.append(f"{label}: dtype {t.dtype} is not floating point")
        elif t.dtype not in WEIGHT_DTYPES:
            problems.append(f"{label}: dtype {t.dtype} is not supported (fp64/fp32/fp16/bf16; a quantised "
                            f"checkpoint needs its scales)")
    if problems:
        raise CheckpointError("; ".join(problems))
    bad = sorted(n for n in want if not tensors[n].is_meta and not all_finite(tensors[n]))
    if bad:
        raise CheckpointError(f"non-finite (NaN/Inf) weights in: {', '.join(bad)}")


def all_finite(t: Tensor) -> bool:
    """No NaN/Inf in t: via aminmax (NaN propagates to both; several times faster than isfinite on bf16)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) and torch.isfinite(hi))


def to_hf(c: HybridConfig, tensors: dict[str, Tensor], part: int | str | None = None) -> dict[str, Tensor]:
    """Canonical tensors -> HF names and layouts (the on-disk layout transformers 5.x writes and reads);
    `part` (see part_names) converts just that part (tools/anchor.py writes a model layer by layer)."""
    check_tensors(c, tensors, names=part_names(c, part))
    pre, hf = _prefix(c), {}
    if part in (None, "top"):
        for canon, h in _top_names(c).items():
            hf[pre + h] = tensors[canon]
        if not c.tie_word_embeddings:
            hf["lm_head.weight"] = tensors["lm_head.weight"]
    for i, spec in enumerate(c.layers):
        if part not in (None, i):
            continue
        lp = f"layers.{i}."
        for canon, h in _hf_layer_names(c, i).items():
            if lp + canon in tensors:
                t = tensors[lp + canon]
                hf[pre + lp + h] = t[:, None, :] if canon == "mamba.conv1d.weight" else t
        hp = pre + lp
        if c.model_type == "granitemoehybrid":
            src = lp + ("mlp." if spec.ffn == "mlp" else "moe.shared.")
            hf[hp + "shared_mlp.input_linear.weight"] = torch.cat(
                [tensors[src + "gate_proj.weight"], tensors[src + "up_proj.weight"]], dim=0)
            hf[hp + "shared_mlp.output_linear.weight"] = tensors[src + "down_proj.weight"]
            if spec.ffn == "moe":
                hf[hp + "block_sparse_moe.input_linear.weight"] = torch.cat(
                    [tensors[lp + "moe.experts.gate_proj"], tensors[lp + "moe.experts.up_proj"]], dim=1)
                hf[hp + "block_sparse_moe.output_linear.weight"] = tensors[lp + "moe.experts.down_proj"]
        if c.model_type == "nemotron_h" and spec.ffn == "moe":
            for n in ("up_proj", "down_proj"):
                for j in range(c.moe_n_experts):
                    hf[hp + f"mixer.experts.{j}.{n}.weight"] = tensors[lp + f"moe.experts.{n}"][j]
    return {k: v.contiguous() for k, v in hf.items()}


# ------------------------------------------------------------------------------------------------ file IO

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _read_json(path: str) -> object:
    try:
        with open(path, "rb") as fh:
            return json.loads(fh.read().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text ({e})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({type(e).__name__}: {e.strerror or e})") from None


def _weight_files(path: str) -> tuple[list[str], dict[str, str] | None]:
    """The folder's safetensors files, and the shard index's weight_map (tensor -> file) when sharded."""
    single, index = os.path.join(path, "model.safetensors"), os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        d = _read_json(index)
        weight_map = d.get("weight_map") if isinstance(d, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: weight_map: expected a non-empty object of tensor -> shard file")
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or not shard or os.path.basename(shard) != shard:
                raise CheckpointError(f"{index}: weight_map[{name!r}]: {shard!r} is not a file name in the folder")
        for shard in sorted(set(weight_map.values())):
            if not os.path.isfile(os.path.join(path, shard)):
                raise CheckpointError(f"{index}: shard {shard!r} not found in {path}")
        return [os.path.join(path, f) for f in sorted(set(weight_map.values()))], weight_map
    if os.path.exists(single):
        return [single], None
    raise CheckpointError(f"{path}: neither model.safetensors nor model.safetensors.index.json found")


class SafetensorsIndex:
    """A folder's tensors by stored name, from the safetensors headers only: name -> (file, shape, dtype).
    `read(names)` opens each file (mmap) just for that read, so memory holds only the tensors asked for."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        files, weight_map = _weight_files(self.path)
        self.entries: dict[str, tuple[str, tuple[int, ...], torch.dtype]] = {}
        for file in files:
            for name, shape, dtype in _header(file):
                if name in self.entries:
                    raise CheckpointError(f"{name}: stored in two files ({self.entries[name][0]} and {file})")
                self.entries[name] = (file, shape, dtype)
        if weight_map is not None:
            listed, found = set(weight_map), set(self.entries)
            wrong = sorted(n for n in listed & found if os.path.basename(self.entries[n][0]) != weight_map[n])
            if listed != found or wrong:
                raise CheckpointError(f"{self.path}/model.safetensors.index.json: weight_map and shards disagree: "
                                      f"listed-not-found {sorted(listed - found)}, found-not-listed "
                                      f"{sorted(found - listed)}, in another shard {wrong}")

    def meta(self) -> dict[str, Tensor]:
        """Every tensor as a meta-device tensor of its stored shape and dtype (no data)."""
        return {n: torch.empty(shape, dtype=dt, device="meta") for n, (_, shape, dt) in self.entries.items()}

    def read(self, names) -> dict[str, Tensor]:
        """The named tensors (stored dtype, CPU); CheckpointError naming the file and tensor if one cannot be read."""
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.entries[n][0], []).append(n)
        out: dict[str, Tensor] = {}
        for file, ns in by_file.items():
            n = ns[0]
            try:
                with safe_open(file, framework="pt") as fh:
                    for n in ns:
                        out[n] = fh.get_tensor(n)
            except Exception as e:  # safetensors raises several error types for corrupt data
                raise CheckpointError(f"{file}: tensor {n}: cannot read ({type(e).__name__}: {e})") from None
        return out


def _header(file: str) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every tensor in one safetensors file, from its header (validated by safetensors)."""
    try:
        with safe_open(file, framework="pt") as fh:
            raw = [(n, fh.get_slice(n)) for n in fh.keys()]
            entries = [(n, tuple(int(d) for d in sl.get_shape()), sl.get_dtype()) for n, sl in raw]
    except Exception as e:  # SafetensorError (bad header/offsets), OSError, ...
        raise CheckpointError(f"{file}: cannot read safetensors header ({type(e).__name__}: {e})") from None
    out = []
    for n, shape, dt in entries:
        if dt not in _ST_DTYPES:
            raise CheckpointError(f"{file}: tensor {n}: dtype {dt} is not supported")
        out.append((n, shape, _ST_DTYPES[dt]))
    return out


def read_safetensors(path: str) -> dict[str, Tensor]:
    """All tensors of a folder: model.safetensors, or the shards listed in model.safetensors.index.json."""
    index = SafetensorsIndex(path)
    return index.read(list(index.entries))


FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)   # what a model computes or stores in


def check_dtype(dtype: object, name: str = "dtype") -> torch.dtype:
    """`dtype` when it is one of FLOAT_DTYPES; else a ValueError naming the argument and the accepted values (a
    string or an integer dtype would otherwise fail deep inside torch, or load silently as integers)."""
    if isinstance(dtype, torch.dtype) and dtype in FLOAT_DTYPES:
        return dtype
    what = "not a torch.dtype" if not isinstance(dtype, torch.dtype) else "not a floating dtype"
    raise ValueError(f"{name}: {dtype!r} is {what}; one of {', '.join(str(d) for d in FLOAT_DTYPES)}")


def load_checkpoint(path: str | os.PathLike) -> tuple[HybridConfig, dict[str, Tensor]]:
    """Load an HF folder -> (HybridConfig, canonical tensors in their stored dtype)."""
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(f"path: expected a folder path, got {type(path).__name__} {path!r}")
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory")
    config = from_hf_config(path)
    with in_folder(path):
        return config, to_canonical(config, read_safetensors(path))


@contextlib.contextmanager
def in_folder(path: str) -> Iterator[None]:
    """A CheckpointError raised inside names the folder (prefixed unless it already names it)."""
    try:
        yield
    except CheckpointError as e:
        if path in str(e):
            raise
        raise CheckpointError(f"{path}: {e}") from None


def save_checkpoint(path: str | os.PathLike, config: HybridConfig, tensors: dict[str, Tensor],
                    dtype: torch.dtype | None = None) -> None:
    """Write config.json + model.safetensors in HF naming (optionally cast to `dtype`)."""
    if dtype is not None:
        check_dtype(dtype)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    hf = to_hf(config, tensors)
    if dtype is not None:
        hf = {k: v.to(dtype) for k, v in hf.items()}
    hf = {k: v.detach().cpu().clone().contiguous() for k, v in hf.items()}  # no shared storage in the file
    write_hf_config(path, config, next(iter(hf.values())).dtype)
    save_file(hf, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def write_hf_config(path: str, config: HybridConfig, dtype: torch.dtype) -> None:
    """config.json for `config` with the stored `dtype` and the HF architecture name."""
    d = to_hf_config(config)
    d["dtype"] = str(dtype).replace("torch.", "")
    d["architectures"] = [{"bamba": "BambaForCausalLM", "nemotron_h": "NemotronHForCausalLM",
                           "mamba2": "Mamba2ForCausalLM",
                           "granitemoehybrid": "GraniteMoeHybridForCausalLM"}[config.model_type]]
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(d, fh, indent=2, sort_keys=True)
