"""hybridqual's fast path: Triton kernels and the batched engine with one state bank (DESIGN §4).

On a machine without a GPU, Triton kernels run only in Triton's interpreter: importing fastpath turns it on (before
any kernel is defined) unless TRITON_INTERPRET was set explicitly. The test is the GPU's device files, not torch.
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

from fastpath.engine.engine import Engine
from fastpath.model import FastModel
from fastpath.options import FastOptions

__all__ = ["Engine", "FastModel", "FastOptions"]
