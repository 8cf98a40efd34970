"""llama.cpp's quantized K/V cache as a declared precision (DESIGN §20; tools/adapters/llamacpp/kv_cache.py): the
llama.cpp adapter's configurations kv_q8_0 (type_k = type_v = q8_0, flash attention on) and kv_f16 (f16, flash
attention off) run the f32 GGUF, declare kv_dtype and are judged with the constants measured for them. Default tier:
what a configuration declares and sends to the worker; marker llamacpp: qualify through the real llama.cpp with those
constants PASSes, and the same q8_0 run judged with fp32's or the f16 cache's constants, or a coarser q4_0 cache
judged with q8_0's, FAILs the logits line."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from hybridqual.adapters.base import EngineOptions
from hybridqual.adapters.llamacpp import convert as conv
from hybridqual.adapters.llamacpp import kv_cache
from hybridqual.adapters.llamacpp.adapter import (LlamaCppAdapter, LlamaCppBF16Adapter, LlamaCppFlashAttnAdapter,
                                                  LlamaCppQ8Adapter)
from hybridqual.adapters.llamacpp.worker import Engine
from hybridqual.qualify.compare import LOGITS_C, TAU
from oracle.trace import load_trace

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "goldens" / "models"
Q8 = EngineOptions(configuration="kv_q8_0")
needs_venv = pytest.mark.skipif(conv.available() is not None, reason=str(conv.available()))


@pytest.mark.parametrize("name", ["kv_q8_0", "kv_f16"])
def test_a_kv_configuration_declares_its_cache_type_and_the_constants_measured_for_it(name):
    kv = kv_cache.KV_CACHES[name]
    assert kv.precision is not None and kv.precision.tau >= 2 * kv.precision.measured_err   # docs/findings.md L13
    caps = LlamaCppAdapter.capabilities("cpu", EngineOptions(configuration=name))
    assert caps.kv_dtype == kv.kv_type and caps.compute_dtype is kv.precision
    assert TAU[caps.compute_dtype] == kv.precision.tau and LOGITS_C[caps.compute_dtype] == kv.precision.logits_c
    assert TAU[caps.compute_dtype] > TAU[torch.float32] and LOGITS_C[caps.compute_dtype] > LOGITS_C[torch.float32]
    plain = LlamaCppAdapter.capabilities("cpu")
    assert plain.kv_dtype == "float32" and plain.compute_dtype == torch.float32
    conf = {c.name: c for c in LlamaCppAdapter.configurations()}[name]
    assert conf.reach and all(r.split("/")[0] in kv.models for r in conf.reach)


def test_the_q8_0_cache_is_judged_more_loosely_than_the_f16_one():
    q8, f16 = kv_cache.KV_Q8_0, kv_cache.KV_F16
    assert q8.tau > f16.tau and q8.logits_c > f16.logits_c


def test_the_worker_is_asked_for_a_q8_0_cache_with_flash_attention(monkeypatch):
    """A quantized V cache needs flash attention in llama.cpp (src/llama-context.cpp refuses it otherwise)."""
    monkeypatch.setenv("HQ_LLAMACPP_GGUF", "/nowhere.gguf")          # no conversion: only the message is built
    trace = load_trace(ROOT / "goldens" / "traces" / "seed_compaction.json")
    q8 = LlamaCppAdapter(MODELS / "zoo-nemotron_h_hd32", trace, "legacy", options=Q8).load_message(64, 2)
    assert (q8["kv_type"], q8["flash_attn"]) == ("q8_0", "on")
    plain = LlamaCppAdapter(MODELS / "zoo-nemotron_h_hd32", trace, "legacy").load_message(64, 2)
    assert (plain["kv_type"], plain["flash_attn"]) == ("f32", "off")
    assert Engine.KV_TYPES["q8_0"] == 8 and Engine.KV_TYPES["q4_0"] == 2      # ggml_type
    assert LlamaCppAdapter.kv_setting(Q8) == ("q8_0", "on") and LlamaCppAdapter.kv_setting() == ("f32", "off")


@pytest.mark.parametrize("cls", [LlamaCppFlashAttnAdapter, LlamaCppBF16Adapter, LlamaCppQ8Adapter])
def test_other_gguf_types_declare_no_kv_configuration(cls, monkeypatch):
    """The constants are measured on the f32 GGUF: a bf16 or q8_0 GGUF, or llama.cpp's defaults, offer none."""
    assert cls.configurations() == ()
    with pytest.raises(ValueError, match="--configuration kv_q8_0"):
        cls.configure("kv_q8_0")
    monkeypatch.setenv("HQ_LLAMACPP_GGUF", "/nowhere.gguf")
    trace = load_trace(ROOT / "goldens" / "traces" / "seed_compaction.json")
    with pytest.raises(ValueError, match="configuration"):
        cls(MODELS / "zoo-nemotron_h_hd32", trace, "legacy", options=Q8)


def test_an_unknown_kv_setting_names_the_field():
    with pytest.raises(ValueError, match="configuration: 'kv_q3'"):
        kv_cache.kv_cache("kv_q3")


class KvQ8JudgedAsFloat32(LlamaCppAdapter):
    """A q8_0 K/V cache (flash attention on) declared as an f32 one: judged with fp32's constants."""
    kv_type, flash_attn, kv_configurable = "q8_0", "on", False


class KvQ8JudgedAsF16Cache(KvQ8JudgedAsFloat32):
    """A q8_0 K/V cache declared as the f16 one: judged with kv_f16's constants."""

    @classmethod
    def capabilities(cls, device: str, options: EngineOptions = EngineOptions()):
        return dataclasses.replace(super().capabilities(device), compute_dtype=kv_cache.KV_F16, kv_dtype="f16")


class KvQ4JudgedAsQ8(KvQ8JudgedAsFloat32):
    """A q4_0 K/V cache declared as q8_0 (a cache rounded more coarsely than it declares, DESIGN §20)."""
    kv_type = "q4_0"

    @classmethod
    def capabilities(cls, device: str, options: EngineOptions = EngineOptions()):
        return dataclasses.replace(super().capabilities(device), compute_dtype=kv_cache.KV_Q8_0, kv_dtype="q8_0")


TRACES = ["seed_compaction", "prefix_multi_turn"]


def _qualify(engine: str, model: str, out: Path, configuration: str | None = None) -> tuple[int, dict]:
    import json
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "hybridqual.qualify", "--engine", engine, "--model", model,
                        "--trace", *TRACES, "--mode", "legacy", "--quiet", "--out", str(out),
                        *(["--configuration", configuration] if configuration else [])],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    checks: dict = {}
    for c in json.loads((out / "report.json").read_text())["checks"]:
        checks.setdefault(c["trace"].split(" ")[0], {})[c["name"].split(" (")[0]] = c
    return r.returncode, checks


@pytest.mark.llamacpp
@needs_venv
@pytest.mark.parametrize("name,model", [("kv_q8_0", "zoo-nemotron_h_hd32"), ("kv_f16", "zoo-granitemoehybrid")])
def test_a_kv_configuration_qualifies_with_its_measured_constants(name, model, tmp_path):
    rc, checks = _qualify("llamacpp", model, tmp_path, name)
    assert rc == 0 and len(checks) == len(TRACES), checks
    for trace, lines in checks.items():
        for line in ("legacy: tokens match the truth", "legacy: logits match the oracle's"):
            assert lines[line]["status"] == "PASS", (trace, line, lines[line]["detail"])


@pytest.mark.llamacpp
@needs_venv
@pytest.mark.parametrize("cls", ["KvQ8JudgedAsFloat32", "KvQ8JudgedAsF16Cache", "KvQ4JudgedAsQ8"])
def test_a_cache_judged_with_a_finer_types_constants_fails(cls, tmp_path):
    """The constants discriminate: q8_0's error is above fp32's and the f16 cache's c, q4_0's above q8_0's."""
    rc, checks = _qualify(f"tests.test_llamacpp_kv_cache:{cls}", "zoo-nemotron_h_hd32", tmp_path)
    assert rc == 1 and len(checks) == len(TRACES), checks
    for trace, lines in checks.items():
        assert lines["legacy: logits match the oracle's"]["status"] == "FAIL", (trace, lines)


@pytest.mark.llamacpp
@needs_venv
def test_granite_hybrid_with_mamba_expand_1_aborts_at_load_a_worker_error():
    """zoo-granite_hd32 (the one Granite hybrid with an attention head dim a q8_0 block divides) has mamba_expand 1;
    llama.cpp's granite-hybrid loader supports only 2 and aborts (docs/findings.md L14): a WorkerError naming the
    assert, so kv_q8_0 is measured on zoo-nemotron_h_hd32 alone."""
    from hybridqual.adapters.llamacpp.adapter import WorkerError
    trace = load_trace(ROOT / "goldens" / "traces" / "seed_compaction.json")
    with pytest.raises(WorkerError, match=r"SIGABRT[\s\S]*GGML_ASSERT\(2 \* n_embd == d_inner\)"):
        LlamaCppAdapter(MODELS / "zoo-granite_hd32", trace, "legacy").run_trace()


def test_an_unmeasured_kv_setting_is_not_offered_and_declares_nothing():
    assert kv_cache.KV_CACHES["kv_q4_0"].precision is None
    assert "kv_q4_0" not in [c.name for c in LlamaCppAdapter.configurations()]
    with pytest.raises(ValueError, match="configuration: 'kv_q4_0' has no measured constants"):
        LlamaCppAdapter.capabilities("cpu", EngineOptions(configuration="kv_q4_0"))
