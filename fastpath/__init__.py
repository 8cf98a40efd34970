"""hybridqual's fast path: Triton kernels and the batched engine with one state bank (DESIGN §4).

On a machine without a GPU, Triton kernels run only in Triton's interpreter: importing fastpath turns it on (before
any kernel is defined) unless TRITON_INTERPRET was set explicitly. The test is the GPU's device files, not torch
(`import fastpath` stays cheap: the harness's package imports it for this switch alone).
"""
from __future__ import annotations

import os


def _has_gpu_device() -> bool:
    """Whether this machine exposes an NVIDIA or AMD GPU device (what torch.cuda would find)."""
    if os.path.exists("/dev/kfd"):
        return True
    try:
        return any(name.startswith("nvidia") and name[6:].isdigit() for name in os.listdir("/dev"))
    except OSError:
        return False


if "TRITON_INTERPRET" not in os.environ and not _has_gpu_device():
    os.environ["TRITON_INTERPRET"] = "1"

__all__ = ["Engine", "FastModel", "FastOptions"]


def __getattr__(name: str):
    """Engine, FastModel and FastOptions load on first use, so `import fastpath` alone imports no torch or triton."""
    if name == "Engine":
        from fastpath.engine.engine import Engine
        return Engine
    if name == "FastModel":
        from fastpath.model import FastModel
        return FastModel
    if name == "FastOptions":
        from fastpath.options import FastOptions
        return FastOptions
    raise AttributeError(f"module 'fastpath' has no attribute {name!r}")
