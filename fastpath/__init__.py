"""hybridqual's fast path: Triton kernels and the batched engine with one state bank (DESIGN §4)."""
from __future__ import annotations

from fastpath.engine.engine import Engine
from fastpath.model import FastModel
from fastpath.options import FastOptions

__all__ = ["Engine", "FastModel", "FastOptions"]
