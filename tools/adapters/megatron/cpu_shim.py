"""Run Megatron-Core's CUDA-only inference plumbing on a CPU (only there; on a GPU nothing here is used).

Megatron's dynamic engine allocates with `device="cuda"` / `torch.cuda.current_device()`, pins host buffers,
and times and orders its work with CUDA events and streams. None of that is arithmetic: on CPU there is one
device and one stream, so the shim (1) rewrites CUDA devices to the CPU and drops `pin_memory` in every torch
call made inside `active()` (a TorchFunctionMode), and (2) replaces the handful of `torch.cuda` entry points
that would raise without a driver by their one-device meaning: events and streams that are always complete,
synchronize() a no-op, memory statistics zero. The model's arithmetic (Megatron's layers, its Triton Mamba
kernels in the interpreter, the flash-attn stand-in) is untouched. `installed()` lists what was replaced, for
the report.
"""
from __future__ import annotations

import contextlib
import time

import torch
from torch.overrides import TorchFunctionMode

REPLACED: list[str] = []


def _is_cuda(d) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.startswith("cuda")
    return False


def _cpu(d):
    return torch.device("cpu") if _is_cuda(d) else d


_IS_CUDA = torch.Tensor.is_cuda      # the property's getter arrives as a method-wrapper bound to this descriptor


class _CpuDevices(TorchFunctionMode):
    """Every torch call: CUDA device arguments -> cpu, pin_memory -> False; Tensor.pin_memory/.cuda -> self.
    While `claim_cuda` is set (inside the wrappers of `ASSERTS_CUDA`), `tensor.is_cuda` answers True."""
    claim_cuda = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.claim_cuda and getattr(func, "__self__", None) is _IS_CUDA:
            return True
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.pin_memory, torch.Tensor.cuda):
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func in (torch.Tensor.to, torch.Tensor.new_empty, torch.Tensor.new_zeros, torch.Tensor.new_full,
                    torch.Tensor.new_tensor, torch.Tensor.new_ones):
            args = tuple(_cpu(a) for a in args)
        return func(*args, **kwargs)


class _Event:
    """A CUDA event on a one-stream CPU: complete as soon as recorded; elapsed_time from the wall clock (ms)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.t = None

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: "_Event") -> float:
        return 1000.0 * ((other.t or 0.0) - (self.t or 0.0))


class _Stream:
    """The one CPU 'stream': work is done when issued."""

    def __init__(self, device=None, priority: int = 0, **_) -> None:
        self.device = torch.device("cpu")

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        event = event or _Event()
        event.record()
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_STREAM = _Stream()


def _install_torch_cuda() -> None:
    """Replace the torch.cuda entry points that raise without a driver (once per process)."""
    if REPLACED:
        return
    cuda = torch.cuda
    repl = {
        "current_device": lambda: "cpu",
        "Event": _Event, "Stream": _Stream,
        "current_stream": lambda device=None: _STREAM, "default_stream": lambda device=None: _STREAM,
        "stream": lambda s=None: contextlib.nullcontext(), "synchronize": lambda device=None: None,
        "memory_allocated": lambda device=None: 0, "max_memory_allocated": lambda device=None: 0,
        "memory_reserved": lambda device=None: 0, "memory_stats": lambda device=None: {},
        "reset_peak_memory_stats": lambda device=None: None, "empty_cache": lambda: None,
        "set_device": lambda device: None,
        "get_device_capability": lambda device=None: (9, 0),   # kernel choices as on sm_90 (Hopper), not Blackwell
    }
    for name, fn in repl.items():
        setattr(cuda, name, fn)
        REPLACED.append(f"torch.cuda.{name}")


_MODE: _CpuDevices | None = None

# Triton launch wrappers that assert `t.is_cuda` before launching (the kernels themselves run in the interpreter):
# (module defining it, function name, modules that imported it by name)
ASSERTS_CUDA = [("megatron.core.inference.contexts.attention_context.triton.tensor_ops", "tensor_masked_update",
                 ("megatron.core.ssm.mamba_mixer",)),
                ("megatron.core.ssm.ops.intermediate_extraction", "scatter_intermediate_ssm",
                 ("megatron.core.ssm.mamba_mixer",)),
                ("megatron.core.ssm.ops.intermediate_extraction", "scatter_intermediate_conv",
                 ("megatron.core.ssm.mamba_mixer",))]


def _claiming_cuda(fn):
    def wrapper(*args, **kwargs):
        if _MODE is None:
            return fn(*args, **kwargs)
        _MODE.claim_cuda = True
        try:
            return fn(*args, **kwargs)
        finally:
            _MODE.claim_cuda = False
    wrapper.__wrapped__ = fn
    return wrapper


def _install_cuda_asserts() -> None:
    import importlib
    for mod_name, fn_name, users in ASSERTS_CUDA:
        mod = importlib.import_module(mod_name)
        fn = getattr(mod, fn_name)
        if hasattr(fn, "__wrapped__"):
            continue
        wrapped = _claiming_cuda(fn)
        for m in (mod_name, *users):
            setattr(importlib.import_module(m), fn_name, wrapped)
        REPLACED.append(f"{mod_name}.{fn_name}: its `is_cuda` assertion sees True (the kernel runs interpreted)")


def install() -> None:
    """Replace the raising torch.cuda entry points (idempotent); `active()` adds the device rewriting."""
    _install_torch_cuda()


def install_after_import() -> None:
    """The wrappers of functions that assert CUDA tensors (needs megatron imported; idempotent). The fused KV-append
    kernel checks `device.type == 'cuda'`, so on CPU the context takes its own indexing fallback (the path
    dynamic_context.py has for when that kernel is not importable)."""
    _install_cuda_asserts()
    import megatron.core.inference.contexts.dynamic_context as dc
    if dc.triton_append_key_value_cache is not None:
        dc.triton_append_key_value_cache = None
        REPLACED.append("dynamic_context.triton_append_key_value_cache = None (Megatron's own indexing fallback)")


@contextlib.contextmanager
def active():
    """Within: CUDA devices in torch calls mean the CPU (nested uses are fine)."""
    global _MODE
    if _MODE is not None:
        yield
        return
    _MODE = _CpuDevices()
    try:
        with _MODE:
            yield
    finally:
        _MODE = None


def installed() -> list[str]:
    """What the shim replaced (for the report)."""
    return list(REPLACED) + (["torch device arguments 'cuda' -> 'cpu', pin_memory -> False (TorchFunctionMode)"]
                             if REPLACED else [])
