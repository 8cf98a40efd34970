"""Fuzzed bad input on the checkpoint side: config.json values and bytes, safetensors headers and data.

Every case must end in one of two ways: a project error (ConfigError / CheckpointError) whose message starts
by naming the field, file or tensor; or a valid model whose logits are finite. Anything else (a TypeError from
deep inside, NaN logits, a silent truncation) fails. Hypothesis runs under the CI profile (derandomised,
bounded; conftest.py); each test bounds its own example count to stay fast.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from oracle.checkpoint import CheckpointError, expected_shapes
from oracle.config import INT_KEYS, ConfigError, HybridConfig, from_hf_config, to_hf_config
from oracle.model import OracleModel
from oracle.streamed import StreamedOracle
from oracle.zoo import ARCHS, random_weights, tiny_config, write_hf_folder

HF_DICTS = {a: json.loads(json.dumps(to_hf_config(tiny_config(a)))) for a in ARCHS}
PROMPT = [1, 5, 9, 3, 7, 2, 8, 4, 6, 11]          # crosses the zoo's chunk of 8
# config.json keys an error may name: every key of the four zoo configs, every integer key, and the keys the
# readers look for when present (alternatives to a key the zoo config uses).
KNOWN_KEYS = set().union(*HF_DICTS.values(), INT_KEYS, {
    "partial_rotary_factor", "rope_theta", "hybrid_override_pattern", "layer_types", "layers_block_type",
    "rope_scaling", "norm_before_gate", "rms_norm", "moe_latent_size", "sliding_window"})

# The values a field is replaced with: non-finite, zero, negative, float for int, int for float, wrong types.
BAD_VALUES = [math.nan, math.inf, -math.inf, 0, -1, 0.0, -0.5, 0.5, 1.5, 8.0, 3, 7, 2 ** 40, 10 ** 400, "32",
              "abc", "Infinity", None, True, False, [], [1], {}, {"__float__": "NaN"}, {"__float__": "Infinity"}]
class _Missing:
    """The field is removed from config.json (a stable repr, so xdist workers collect the same test ids)."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()


def _field_named(message: str, keys: set[str]) -> bool:
    """The message starts with a config.json key (`key:`, `key[i]:`, `key.sub:`) or `config.json:`."""
    m = re.match(r"^([A-Za-z_][\w]*)(?:[\[.][^:]*)?: ", message)
    return bool(m) and (m.group(1) in keys or m.group(1) == "config")


def _finite_logits(cfg: HybridConfig) -> None:
    model = OracleModel(cfg, random_weights(cfg, seed=0), dtype=torch.float64)
    logits, _ = model.prefill([t % cfg.vocab_size for t in PROMPT])
    assert torch.isfinite(logits).all(), f"non-finite logits from an accepted config: {cfg}"


def _accepts_or_names_field(d: dict, keys: set[str]) -> None:
    """from_hf_config(d) raises ConfigError naming a field, or gives a config whose model's logits are finite."""
    try:
        cfg = from_hf_config(d)
    except ConfigError as e:
        assert _field_named(str(e), keys), f"ConfigError does not start with a field name: {e}"
        return
    n = sum(math.prod(s) for s in expected_shapes(cfg).values())
    assert n < 5_000_000, f"a mutated tiny config grew to {n} parameters"
    _finite_logits(cfg)


def _mutations(arch: str):
    d = HF_DICTS[arch]
    keys = sorted(k for k in d if k not in ("architectures", "dtype"))
    nested = [("rope_parameters", k) for k in ("rope_theta", "partial_rotary_factor")] if "rope_parameters" in d \
        else []
    lists = [k for k in keys if isinstance(d[k], list) and d[k]]
    return keys, nested, lists


@st.composite
def config_edits(draw):
    """(arch, edited dict, keys): one to three fields replaced (or removed), possibly inside a list or object."""
    arch = draw(st.sampled_from(ARCHS))
    keys, nested, lists = _mutations(arch)
    d = json.loads(json.dumps(HF_DICTS[arch]))
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(["top"] * 4 + (["nested"] if nested else []) + (["list"] if lists else [])))
        value = draw(st.sampled_from(BAD_VALUES + [MISSING]))
        if where == "top":
            k = draw(st.sampled_from(keys))
            d.pop(k, None) if value is MISSING else d.__setitem__(k, value)
        elif where == "nested":
            outer, inner = draw(st.sampled_from(nested))
            if isinstance(d.get(outer), dict):
                d[outer].pop(inner, None) if value is MISSING else d[outer].__setitem__(inner, value)
        else:
            k = draw(st.sampled_from(lists))
            if isinstance(d.get(k), list) and d[k]:
                d[k][draw(st.integers(0, len(d[k]) - 1))] = None if value is MISSING else value
    return arch, d, KNOWN_KEYS


@settings(max_examples=60)
@given(config_edits())
def test_fuzzed_config_values_give_a_named_config_error_or_finite_logits(case):
    """NaN/inf/0/negative/float-for-int/strings/None/missing in any field of every zoo config: ConfigError naming
    the field, or a model with finite logits."""
    arch, d, keys = case
    _accepts_or_names_field(d, keys)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("value", BAD_VALUES + [MISSING], ids=repr)
def test_every_field_of_every_zoo_config_rejects_or_survives_each_bad_value(arch, value):
    """The exhaustive single-field sweep behind the fuzz (fields x values, config reading only, no model):
    a ConfigError naming the field, or a config; and never a silent change of an integer field."""
    keys, _, _ = _mutations(arch)
    for k in keys:
        d = json.loads(json.dumps(HF_DICTS[arch]))
        d.pop(k) if value is MISSING else d.__setitem__(k, value)
        try:
            cfg = from_hf_config(d)
        except ConfigError as e:
            assert _field_named(str(e), KNOWN_KEYS), (k, value, str(e))
            continue
        if isinstance(value, float) and isinstance(HF_DICTS[arch][k], int) and not isinstance(HF_DICTS[arch][k],
                                                                                             bool):
            pytest.fail(f"{arch}.{k}: float {value!r} accepted where the config has an integer")
        for f in ("norm_eps", "rope_theta", "attn_scale", "embedding_multiplier", "residual_multiplier",
                  "logits_scaling", "moe_routed_scaling_factor"):
            x = getattr(cfg, f)
            assert math.isfinite(x) and (x > 0 or (f == "attn_scale" and not cfg.attention_layer_ids)), (k, value, f)


@settings(max_examples=40)
@given(arch=st.sampled_from(ARCHS), cut=st.integers(0, 10 ** 6), byte=st.integers(0, 255),
       kind=st.sampled_from(["truncate", "flip", "bad-utf8", "bom", "empty", "deep"]))
def test_fuzzed_config_json_bytes_give_a_config_error_or_a_config(arch, cut, byte, kind):
    """Truncated, byte-flipped, non-UTF-8, BOM-prefixed, empty or absurdly nested config.json files: ConfigError
    naming config.json (or the field), or a config that reads."""
    blob = json.dumps(HF_DICTS[arch], indent=1).encode()
    i = cut % len(blob)
    blob = {"truncate": blob[:i], "flip": blob[:i] + bytes([byte]) + blob[i + 1:],
            "bad-utf8": blob[:i] + b"\xff\xfe" + blob[i:], "bom": b"\xef\xbb\xbf" + blob, "empty": b"",
            "deep": b"[" * 100_000 + b"]" * 100_000}[kind]
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "wb") as fh:
            fh.write(blob)
        try:
            from_hf_config(tmp)
        except ConfigError as e:
            assert _field_named(str(e), KNOWN_KEYS), str(e)


# ---------------------------------------------------------------------------------------- safetensors

_ZOO_FILES: dict[str, tuple[bytes, bytes]] = {}


def _zoo_files(arch: str) -> tuple[bytes, bytes]:
    """(config.json, model.safetensors) bytes of the arch's zoo folder, written once per test run."""
    if arch not in _ZOO_FILES:
        with tempfile.TemporaryDirectory() as tmp:
            write_hf_folder(tmp, arch, seed=0)
            _ZOO_FILES[arch] = tuple(open(os.path.join(tmp, f), "rb").read()
                                     for f in ("config.json", "model.safetensors"))
    return _ZOO_FILES[arch]


def _split(blob: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def _join(header: dict | bytes, data: bytes, length: int | None = None) -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h) if length is None else length) + h + data


def _edit_header(header: dict, data: bytes, kind: str, pick: int, num: int) -> tuple[dict, bytes]:
    names = sorted(k for k in header if k != "__metadata__")
    name = names[pick % len(names)]
    e = header[name]
    lo, hi = e["data_offsets"]
    if kind == "offsets-out-of-range":
        e["data_offsets"] = [lo, len(data) + 1 + num % 1000]
    elif kind == "offsets-reversed":
        e["data_offsets"] = [hi, lo]
    elif kind == "shape-mismatch":                # same byte count, another shape
        e["shape"] = [math.prod(e["shape"])] if len(e["shape"]) > 1 else [1, e["shape"][0]]
    elif kind == "shape-wrong-size":
        e["shape"] = [d + 1 + num % 3 for d in e["shape"]]
    elif kind == "dtype":
        e["dtype"] = ["F16", "BF16", "I32", "BOOL", "F8_E4M3", "U8", "XX", 7][num % 8]
    elif kind == "drop-entry":
        header.pop(name)
    elif kind == "rename":
        header[name + ".x"] = header.pop(name)
    elif kind == "nan-data":
        data = data[:lo] + b"\xff" * (hi - lo) + data[hi:]
    elif kind == "shape-type":
        e["shape"] = [["a"], [-1], [2.5], None, "3"][num % 5]
    return header, data


@settings(max_examples=60)
@given(arch=st.sampled_from(ARCHS), pick=st.integers(0, 10 ** 6), num=st.integers(0, 10 ** 6),
       kind=st.sampled_from(["truncate", "length-field", "garbage-header", "offsets-out-of-range", "offsets-reversed",
                             "shape-mismatch", "shape-wrong-size", "dtype", "drop-entry", "rename", "nan-data",
                             "shape-type"]))
def test_fuzzed_safetensors_give_a_checkpoint_error_naming_file_or_tensor(arch, pick, num, kind):
    """Truncated files, wrong header lengths, garbage headers, out-of-range offsets, shape/dtype mismatches, dropped
    or renamed tensors, NaN data: oracle.load and StreamedOracle raise CheckpointError naming the folder or file
    (and the tensor where one is at fault), or load a model whose logits are finite."""
    with tempfile.TemporaryDirectory() as tmp:
        config_json, blob = _zoo_files(arch)
        with open(os.path.join(tmp, "config.json"), "wb") as fh:
            fh.write(config_json)
        path = os.path.join(tmp, "model.safetensors")
        header, data = _split(blob)
        if kind == "truncate":
            blob = blob[:pick % len(blob)]
        elif kind == "length-field":
            blob = _join(_split(blob)[0], data, length=[0, 1, 7, len(blob), 2 ** 63, pick][num % 6])
        elif kind == "garbage-header":
            n = struct.unpack("<Q", blob[:8])[0]
            junk = bytes((pick * 7 + i * num) % 256 for i in range(n))
            blob = blob[:8] + junk + blob[8 + n:]
        else:
            blob = _join(*_edit_header(header, data, kind, pick, num))
        with open(path, "wb") as fh:
            fh.write(blob)
        for load in (lambda: oracle.load(tmp).prefill(PROMPT)[0],
                     lambda: StreamedOracle(tmp).score([(PROMPT, [3])])[0]):
            try:
                logits = load()
            except CheckpointError as e:
                assert str(e).startswith(tmp), f"CheckpointError does not name the folder/file: {e}"
                continue
            assert torch.isfinite(logits).all(), f"{kind}: accepted a checkpoint with non-finite logits"
