"""The engine's boundary checks: argument types, device and dtype, progress guarantees, memory before allocation.

Every failure is a clear error naming the argument (`ArgumentError`: both a TypeError and a ValueError, so callers
catching either see it) or, for the engine config's fields, an `oracle.trace.TraceError` naming the field — raised
before torch allocates anything, never a traceback from inside the bank or a kernel.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from oracle.trace import EngineConfig, check_engine_against_model

from . import memory

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ArgumentError(TypeError, ValueError):
    """An API argument has the wrong type or value; the message starts with the argument's name."""

    def __init__(self, name: str, message: str):
        self.field = name
        super().__init__(f"{name}: {message}")


def _flag(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ArgumentError(name, f"must be True or False, got {type(v).__name__} {v!r}")
    return v


def check_kernels_run_on(device: torch.device, options) -> None:
    """The Triton backend on the CPU needs Triton's interpreter, switched on before the kernels were defined."""
    from fastpath.kernels._common import INTERPRET
    if device.type == "cpu" and options.backend == "triton" and not INTERPRET:
        raise ArgumentError("device", "'cpu': the fast path's Triton kernels run on the CPU only in Triton's "
                            "interpreter; set TRITON_INTERPRET=1 before importing fastpath (or pass "
                            "options=FastOptions(backend='torch') for the plain-torch stand-ins)")


def resolve_device(device: Any) -> torch.device:
    """None -> CUDA if available, else CPU; a str or torch.device naming cpu or an existing CUDA device."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise ArgumentError("device", f"must be a str or torch.device, got {type(device).__name__} {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ArgumentError("device", f"{device!r} is not a device: {str(e).splitlines()[0]}") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ArgumentError("device", f"{device!r}: the fast path runs on 'cpu' or 'cuda', not {dev.type!r}")
    if not torch.cuda.is_available():
        raise ArgumentError("device", f"{device!r}: CUDA is not available on this machine")
    n = torch.cuda.device_count()
    if dev.index is not None and dev.index >= n:
        raise ArgumentError("device", f"{device!r}: this machine has {n} CUDA device(s) (0..{n - 1})")
    return dev


def resolve_dtype(dtype: Any, device: torch.device) -> torch.dtype:
    """None -> bf16 on CUDA, fp32 on CPU; else one of fp32 / bf16 / fp16."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPES:
        raise ArgumentError("dtype", f"must be one of {[str(d) for d in DTYPES]}, got {dtype!r}")
    return dtype


def check_path(path: Any) -> Path:
    """A model folder given as str / os.PathLike that exists (the checkpoint loader reports what is inside)."""
    if not isinstance(path, (str, Path)):
        raise ArgumentError("path", f"must be a str or pathlib.Path, got {type(path).__name__} {path!r:.80}")
    p = Path(path)
    if not p.is_dir():
        raise ArgumentError("path", f"{str(p)!r} is not a model folder (config.json + *.safetensors)")
    return p


def check_engine_args(model: Any, engine_config: Any, max_len: Any, graphs: Any, pad_decode: Any) -> EngineConfig:
    """Validate Engine(...)'s arguments and that the bank + KV + activation peak fit the device; returns the
    normalised engine config. A prefill_chunk below the chunk size (or any config that could not make progress)
    is an error here, at construction, not a run that spins."""
    for attr in ("config", "device", "dtype", "forward", "options", "backend"):
        if not hasattr(model, attr):
            raise ArgumentError("model", f"must be a FastModel (or subclass), got {type(model).__name__}")
    ec = check_engine_against_model(engine_config, model.config.chunk_size, "engine_config")
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
        raise ArgumentError("max_len", f"must be an int >= 1, got {max_len!r}")
    _flag("graphs", graphs)
    _flag("pad_decode", pad_decode)
    memory.check_fits(model.config, ec, max_len, model.dtype, model.device,
                      replay=bool(getattr(model.options, "spec_replay", False)), padded=bool(graphs or pad_decode),
                      device_drafts=bool(getattr(model.options, "spec_device_drafts", False)))
    return ec
