"""HF folder -> GGUF (f32, bf16, q8_0) through llama.cpp's own converter, run in .venv-llamacpp as a subprocess.

    python -m hybridqual.adapters.llamacpp.convert FOLDER [--outtype f32|bf16|q8_0] [--out FILE.gguf] [--no-check]

The converter (convert_hf_to_gguf.py of the llama.cpp commit the install vendors) reads other config.json keys than
transformers 5 writes for some fields. The conversion therefore runs on a converter-facing copy of the folder whose
config.json carries the keys the converter reads (`converter_config`), with the weights linked, never on an edited
converter; every key supplied or rewritten is recorded in the sidecar FILE.gguf.json with the converter's version
and commit. After converting, the GGUF's metadata is checked against the oracle's reading of the config
(`metadata_mismatches`): a GGUF that would load but is not the model is a ConversionError naming each key.

Run as a script inside the llama venv (`--in-venv`, used by `convert`) it drives the converter itself; that mode
imports only the standard library and the converter's own modules.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

OUTTYPES = ("f32", "bf16", "q8_0")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
CONVERTER_SRC = "vendor/llama.cpp"     # where the sdist keeps the converter (file:line references below)


class ConversionError(ValueError):
    """A folder that cannot be converted faithfully, or a converter run that failed; the message names the field."""


@dataclass(frozen=True)
class Mapping:
    """One config.json key the converter needed in another form: supplied, renamed or rewritten, and why."""
    field: str
    action: str            # "supplied" | "rewritten"
    value: Any
    reason: str


def venv_dir() -> Path:
    """The llama venv: $HQ_LLAMACPP_VENV, else .venv-llamacpp/ in the checkout."""
    env = os.environ.get("HQ_LLAMACPP_VENV")
    return Path(env) if env else Path(__file__).resolve().parents[3] / ".venv-llamacpp"


def available() -> str | None:
    """None when the llama venv is usable, else why not (with the command that fixes it)."""
    v = venv_dir()
    for p in (v / "bin" / "python", v / "converter" / "convert_hf_to_gguf.py", v / "llamacpp.json"):
        if not p.exists():
            return f"{p} is missing (run scripts/install-llamacpp.sh)"
    return None


def install_info() -> dict:
    """What scripts/install-llamacpp.sh recorded: llama-cpp-python version, llama.cpp commit, gguf, torch, ..."""
    why = available()
    if why:
        raise ConversionError(why)
    return json.loads((venv_dir() / "llamacpp.json").read_text())


# ------------------------------------------------------------------------------------- the config mapping

def converter_config(raw: dict) -> tuple[dict, list[Mapping]]:
    """The config.json the vendored converter reads as the model `raw` describes (as transformers 5 and the oracle
    read it), and each key supplied or rewritten. Refuses (ConversionError naming the field) what the converter
    cannot express."""
    from oracle.config import from_hf_config
    cfg = from_hf_config(raw)
    out, maps = json.loads(json.dumps(raw)), []

    def put(key: str, value: Any, reason: str) -> None:
        action = "rewritten" if key in raw else "supplied"
        if raw.get(key) != value:
            out[key] = value
            maps.append(Mapping(key, action, value, reason))

    mt = cfg.model_type
    if mt in ("bamba", "granitemoehybrid"):
        if cfg.attention_layer_ids:
            hd = raw.get("head_dim", cfg.attn_head_dim)
            if cfg.attn_head_dim != cfg.hidden_size // cfg.n_attn_heads:
                raise ConversionError(
                    f"head_dim: {hd} != hidden_size // num_attention_heads = {cfg.hidden_size // cfg.n_attn_heads}; "
                    "the converter drops head_dim for Granite-family models (conversion/granite.py:33)")
        if mt == "granitemoehybrid" and "layer_types" in raw:
            put("layer_types", ["attention" if s.mixer == "attention" else "mamba" for s in cfg.layers],
                "the converter counts a layer as attention only when its type is 'attention' "
                "(conversion/granite.py:440-444); transformers 5 writes 'full_attention'/'linear_attention', "
                "which made every layer an SSM layer")
        if cfg.attention_layer_ids and cfg.rope_dim:
            put("attn_rotary_emb", cfg.rope_dim,
                "rotated dims per head: the converter writes rope.dimension_count from attn_rotary_emb "
                "(conversion/granite.py:510), else from head_dim (conversion/llama.py:171), i.e. full RoPE; "
                "transformers 5 writes rope_parameters.partial_rotary_factor instead")
        if cfg.attention_layer_ids and cfg.rope_dim and raw.get("max_position_embeddings") is None:
            default = 262144 if mt == "bamba" else 2048
            put("max_position_embeddings", default,
                "context_length is required by llama.cpp's granitehybrid loader; the converter writes it from "
                "max_position_embeddings (conversion/base.py:1437), and for a model with RoPE nowhere else "
                f"(conversion/granite.py:520-521); {default} is transformers 5's default for {mt}")
        if mt == "granitemoehybrid" and cfg.attention_layer_ids and cfg.rope_dim:
            archs = list(raw.get("architectures") or ["GraniteMoeHybridForCausalLM"])
            if "BambaForCausalLM" not in archs:
                put("architectures", archs + ["BambaForCausalLM"],
                    "position_embedding_type 'rope': the converter enables RoPE (rope.scaling.finetuned, "
                    "llama.cpp's granitehybrid RoPE switch) only when 'BambaForCausalLM' is among the "
                    "architectures (conversion/granite.py:515-519); the first entry still selects the class")
    elif mt == "nemotron_h":
        if any(s.ffn == "moe" for s in cfg.layers) and any(s.ffn == "mlp" for s in cfg.layers):
            raise ConversionError(
                "layers_block_type: mixes dense 'mlp' and 'moe' layers; llama.cpp's nemotron_h_moe gives a feed-"
                "forward length only to the moe layers (conversion/nemotron.py:341-345) and takes a layer with "
                "none for attention (src/models/nemotron-h.cpp:102)")
        put("hybrid_override_pattern", cfg.pattern,
            "the converter reads the layer pattern from hybrid_override_pattern first (conversion/nemotron.py:243); "
            "from transformers 5's layers_block_type list it counts only 'moe' entries as feed-forward layers "
            "(conversion/nemotron.py:209, 252), so a dense model's 'mlp' layers became SSM layers")
        if any(s.ffn == "moe" for s in cfg.layers):
            put("n_shared_experts", 1 if cfg.moe_shared_intermediate_size else 0,
                "required by the converter (conversion/nemotron.py:351); transformers 5 writes only "
                "moe_shared_expert_intermediate_size")
    return out, maps


def known_divergences(cfg) -> list[str]:
    """What the converter gets wrong for this model that no config key can fix (measured; recorded in the sidecar,
    and left for the qualifier to FAIL)."""
    out = []
    if cfg.attention_layer_ids and 0 < cfg.rope_dim < cfg.attn_head_dim:
        out.append(f"partial RoPE ({cfg.rope_dim} of {cfg.attn_head_dim} dims): the converter permutes the q/k rows "
                   "for llama.cpp's interleaved RoPE over the whole head_dim (conversion/llama.py:260-264, permute "
                   "at :175-180), but the model rotates halves of the first rope dims only, so llama.cpp pairs the "
                   "wrong dims (RoPE type NORM, src/llama-model.cpp:3095); re-permuting only the rotated rows makes "
                   "the GGUF match the oracle")
    return out


# --------------------------------------------------------------------------------- the metadata check

def _expected_metadata(cfg) -> dict[str, Any]:
    """The GGUF keys (without the architecture prefix) llama.cpp reads, as the oracle's config implies them."""
    n = cfg.num_layers
    eps = "attention.layer_norm_epsilon" if cfg.model_type == "nemotron_h" else "attention.layer_norm_rms_epsilon"
    exp: dict[str, Any] = {"block_count": n, "embedding_length": cfg.hidden_size, eps: cfg.norm_eps}
    if cfg.mamba_layer_ids:
        exp.update({"ssm.conv_kernel": cfg.mamba_d_conv, "ssm.state_size": cfg.mamba_d_state,
                    "ssm.group_count": cfg.mamba_n_groups, "ssm.inner_size": cfg.d_inner,
                    "ssm.time_step_rank": cfg.mamba_n_heads})
    if cfg.attention_layer_ids:
        exp["attention.head_count_kv"] = [cfg.n_kv_heads if s.mixer == "attention" else 0 for s in cfg.layers]
        if cfg.model_type != "nemotron_h":
            exp["rope.dimension_count"] = cfg.rope_dim or cfg.attn_head_dim
            exp["rope.freq_base"] = cfg.rope_theta
        else:
            exp["attention.key_length"] = cfg.attn_head_dim
    if cfg.model_type == "nemotron_h":
        moe = any(s.ffn == "moe" for s in cfg.layers)
        exp["feed_forward_length"] = [(cfg.moe_intermediate_size if s.ffn == "moe" else cfg.mlp_intermediate_size)
                                      if s.ffn and (s.ffn == "moe") == moe else 0 for s in cfg.layers]
    elif cfg.model_type == "bamba":
        exp["feed_forward_length"] = cfg.mlp_intermediate_size
    if cfg.model_type == "granitemoehybrid":
        exp.update({"embedding_scale": cfg.embedding_multiplier, "residual_scale": cfg.residual_multiplier,
                    "logit_scale": cfg.logits_scaling})
        if cfg.attention_layer_ids:
            exp["attention.scale"] = cfg.attn_scale
    if cfg.model_type in ("bamba", "granitemoehybrid") and cfg.attention_layer_ids:
        exp["rope.scaling.finetuned"] = bool(cfg.rope_dim)
    if cfg.moe_n_experts:
        exp.update({"expert_count": cfg.moe_n_experts, "expert_used_count": cfg.moe_top_k,
                    "expert_shared_feed_forward_length": cfg.moe_shared_intermediate_size})
    if cfg.moe_router == "sigmoid_grouped":
        exp.update({"expert_group_count": cfg.moe_n_group, "expert_group_used_count": cfg.moe_topk_group,
                    "expert_weights_scale": cfg.moe_routed_scaling_factor, "expert_weights_norm": cfg.moe_norm_topk_prob,
                    "expert_feed_forward_length": cfg.moe_intermediate_size})
    return exp


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, bool) or isinstance(got, bool):
        return bool(got) == bool(want)
    if isinstance(want, float) or isinstance(got, float):
        return abs(float(got) - float(want)) <= 1e-6 * max(1.0, abs(float(want)))
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(_same(a, b) for a, b in zip(got, want))
    return got == want


def metadata_mismatches(meta: dict, cfg) -> list[str]:
    """Each GGUF key whose value is not the model's (`meta`: the GGUF's key/values as gguf-py reads them)."""
    arch = meta.get("general.architecture")
    out = []
    for key, want in _expected_metadata(cfg).items():
        full = f"{arch}.{key}"
        got = meta.get(full)
        if got is None:
            if key == "rope.scaling.finetuned" and want:      # llama.cpp's granitehybrid default is true
                continue
            out.append(f"{full}: missing (the model has {want!r})")
        elif isinstance(want, list) and not isinstance(got, list):
            if not all(_same(got, w) or w == 0 for w in want):
                out.append(f"{full}: {got!r}, the model has {want!r}")
        elif not _same(got, want):
            out.append(f"{full}: {got!r}, the model has {want!r}")
    return out


# ------------------------------------------------------------------------------------------- convert

def _venv_run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    py = venv_dir() / "bin" / "python"
    try:
        return subprocess.run([str(py), str(Path(__file__).resolve()), *args], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "PYTHONNOUSERSITE": "1"})
    except subprocess.TimeoutExpired as e:
        raise ConversionError(f"the converter did not finish within {timeout:.0f} s ({' '.join(args[:3])})") from e


def read_metadata(gguf: Path, timeout: float = 120) -> dict:
    """The GGUF's non-tokenizer key/values, read with the venv's gguf-py."""
    r = _venv_run(["--in-venv", "--dump-meta", str(gguf)], timeout)
    if r.returncode != 0:
        raise ConversionError(f"{gguf}: gguf-py cannot read it ({r.stderr.strip().splitlines()[-1:]})")
    return json.loads(r.stdout)


def convert(folder: str | os.PathLike, out: str | os.PathLike | None = None, outtype: str = "f32",
            check: bool = True, timeout: float = 1800, mapping: bool = True) -> dict:
    """Convert HF `folder` to the GGUF `out` (default FOLDER-NAME.OUTTYPE.gguf beside it) and write its sidecar
    OUT.json; returns the sidecar. With `check`, metadata mismatches raise ConversionError (the file is kept).
    `mapping=False` gives the converter config.json as it is (to show what the mapping fixes)."""
    from oracle.config import from_hf_config
    if outtype not in OUTTYPES:
        raise ConversionError(f"outtype: {outtype!r} is not one of {OUTTYPES}")
    folder = Path(folder).resolve()
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConversionError(f"config.json: cannot read {folder / 'config.json'} ({type(e).__name__}: {e})") from None
    conv_cfg, maps = converter_config(raw) if mapping else (raw, [])
    out = Path(out) if out else folder.parent / f"{folder.name}.{outtype}.gguf"
    out = out.resolve()
    info = install_info()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hq-gguf-") as tmp:
        face = Path(tmp) / folder.name
        face.mkdir()
        (face / "config.json").write_text(json.dumps(conv_cfg, indent=1))
        for f in folder.iterdir():
            if f.name != "config.json" and f.is_file():
                os.symlink(f, face / f.name)
        has_tok = any((folder / t).exists() for t in TOKENIZER_FILES)
        r = _venv_run(["--in-venv", "--convert", str(venv_dir() / "converter"), str(face), str(out), outtype,
                       "1" if has_tok else "0"], timeout)
    if r.returncode != 0 or not out.exists():
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-6:])
        raise ConversionError(f"{folder.name}: convert_hf_to_gguf.py failed (exit {r.returncode}):\n{tail}")
    meta = read_metadata(out)
    bad = metadata_mismatches(meta, from_hf_config(raw))
    side = {"gguf": str(out), "source": str(folder), "outtype": outtype,
            "converter": {"script": "convert_hf_to_gguf.py", "llama_cpp_python": info.get("llama_cpp_python"),
                          "llama_cpp_commit": info.get("llama_cpp_commit"), "gguf_py": info.get("gguf"),
                          "transformers": info.get("transformers"), "source_dir": CONVERTER_SRC},
            "config_mappings": [asdict(m) for m in maps],
            "vocab": None if has_tok else "no tokenizer files: the converter's builtin GPT-NeoX vocabulary, cut to "
                                          "vocab_size (token ids only; the qualifier never tokenizes text)",
            "metadata_mismatches": bad, "known_divergences": known_divergences(from_hf_config(raw)), "seconds": round(time.monotonic() - t0, 1),
            "date": time.strftime("%Y-%m-%d")}
    Path(f"{out}.json").write_text(json.dumps(side, indent=1))
    if bad and check:
        raise ConversionError(f"{out.name} is not the model {folder.name}: " + "; ".join(bad))
    return side


# ---------------------------------------------------------------------------- inside the llama venv

def _in_venv(argv: list[str]) -> int:
    """--convert CONVERTER_DIR FACE OUT OUTTYPE HAS_TOKENIZER | --dump-meta GGUF (llama venv only)."""
    if argv[0] == "--dump-meta":
        import gguf
        r = gguf.GGUFReader(argv[1])
        meta = {}
        for k, f in r.fields.items():
            if k.startswith("tokenizer.") or k.startswith("GGUF."):
                continue
            v = f.contents()
            meta[k] = v.tolist() if hasattr(v, "tolist") else v
        print(json.dumps(meta))
        return 0
    conv_dir, face, out, outtype, has_tok = argv[1:6]
    sys.path.insert(0, conv_dir)           # the converter finds its builtin vocabularies under sys.path[0]/models
    import convert_hf_to_gguf as c
    if has_tok == "0":
        # A folder without tokenizer files: NemotronHModel.set_vocab insists on AutoTokenizer
        # (conversion/nemotron.py:371); use the builtin vocabulary as the converter's Mamba2 path does.
        from conversion.mamba import Mamba2Model
        from conversion.nemotron import NemotronHModel

        def builtin_vocab(self):
            self.hparams["pad_vocab_size_multiple"] = 8
            Mamba2Model.set_vocab(self)
        NemotronHModel.set_vocab = builtin_vocab
    sys.argv = ["convert_hf_to_gguf.py", face, "--outtype", outtype, "--outfile", out]
    c.main()
    return 0


def argument_problem(folder: str, out: str | None) -> str | None:
    """The first bad argument (one line naming it), or None: FOLDER holds a config.json, --out is a file whose
    folder exists and is writable; checked before the converter starts."""
    if not (Path(folder) / "config.json").is_file():
        return f"FOLDER {folder}: no config.json there"
    if out is not None:
        parent = Path(out).parent
        if Path(out).is_dir():
            return f"--out {out}: is a folder, not a file"
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            return f"--out {out}: its folder {parent} does not exist or is not writable"
    return None


def main(argv: list[str] | None = None) -> int:
    """CLI: convert a folder, print the sidecar."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--in-venv":
        return _in_venv(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m hybridqual.adapters.llamacpp.convert", description=__doc__.split("\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--outtype", default="f32", choices=OUTTYPES)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-check", action="store_true", help="write the GGUF even when its metadata is not the model's")
    ap.add_argument("--no-mapping", action="store_true", help="give the converter config.json unchanged")
    a = ap.parse_args(argv)
    problem = argument_problem(a.folder, a.out)
    if problem:
        print(f"convert: {problem}", file=sys.stderr)
        return 2
    try:
        side = convert(a.folder, a.out, a.outtype, check=not a.no_check, mapping=not a.no_mapping)
    except ConversionError as e:
        print(f"convert: {e}", file=sys.stderr)
        return 1
    print(json.dumps(side, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
