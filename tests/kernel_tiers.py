"""Shared setup of the kernel tests: the CPU tier runs Triton in the interpreter (fp32), the gpu tier bf16 + fp32."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the first `import triton`

GPU = pytest.mark.gpu
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TIERS = [pytest.param("cpu", torch.float32, id="cpu-fp32"),
         pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=[GPU, NO_CUDA]),
         pytest.param("cuda", torch.float32, id="cuda-fp32", marks=[GPU, NO_CUDA])]


def skip_cpu_without_interpreter(device: str) -> None:
    """The CPU tier cannot run Triton kernels without the interpreter."""
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU tier needs TRITON_INTERPRET=1")


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """‖a - ref‖ / ‖ref‖ in fp64; NaN never passes."""
    a, ref = a.double().cpu(), ref.double().cpu()
    assert torch.isfinite(a).all(), "output has NaN/inf (an element was not written?)"
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))
