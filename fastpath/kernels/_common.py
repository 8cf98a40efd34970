"""Helpers shared by the fast-path kernels: input validation, launch rules, small Triton math.

Launch configurations are chosen by a deterministic rule keyed on the *model* shape (head counts, head
dim, state size, chunk size, dtype) and never on the number of tokens or rows of a call, so the same
sequence gets the same tile shapes — hence the same bits — whatever batch it is packed into. No
@triton.autotune (it cannot run in the interpreter on a machine with no GPU driver, and timing-based
choices would make results depend on which config won).
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

try:    # programmatic dependent launch (grid dependency control), Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401  (re-exported)
except ImportError:   # pragma: no cover - older Triton: kernels launch without PDL
    gdc_launch_dependents = gdc_wait = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if INTERPRET:   # older Triton interpreters (the GPU image's 3.6) with NumPy >= 2.5: scalar loads as loop bounds
    from ._interpreter_compat import apply as _apply_interpreter_compat
    from ._interpreter_speed import apply as _apply_interpreter_speed
    from ._interpreter_speed import drop_dead_overflow_checks as _drop_dead_overflow_checks
    from ._interpreter_speed import memoize_np_dtype as _memoize_np_dtype
    _apply_interpreter_compat()
    _apply_interpreter_speed()     # a @triton.jit helper call skips re-patching what its grid patched
    _drop_dead_overflow_checks()   # int32 overflow checks whose asserts the interpreter drops (debug off)
    _memoize_np_dtype()            # the Triton-to-NumPy dtype table, built once per dtype instead of per call
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


class KernelInputError(ValueError):
    """A kernel wrapper was given an input of the wrong shape, dtype or device; the message names it."""


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, triton.next_power_of_2(max(int(n), 1)))


def check(op: str, name: str, t: Tensor | None, shape: Sequence[int | None] | None = None,
          dtypes: Sequence[torch.dtype] | None = None, device: torch.device | None = None,
          optional: bool = False) -> None:
    """Raise KernelInputError naming `op`/`name` unless t has the given shape (None = any), dtype and device."""
    if t is None:
        if optional:
            return
        raise KernelInputError(f"{op}: `{name}` is required")
    if not isinstance(t, Tensor):
        raise KernelInputError(f"{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise KernelInputError(f"{op}: `{name}` has shape {list(t.shape)}, expected {want}")
    if dtypes is not None and t.dtype not in dtypes:
        raise KernelInputError(f"{op}: `{name}` has dtype {t.dtype}, expected one of {list(dtypes)}")
    if device is not None and t.device != device:
        raise KernelInputError(f"{op}: `{name}` is on {t.device}, expected {device}")


_PDL: dict[int, bool] = {}


def pdl(device: torch.device) -> bool:
    """Programmatic dependent launch for this device: CUDA, compute capability >= 9 (Hopper), compiled kernels,
    and not turned off by HQ_PDL=0. A kernel launched with it may start while its predecessor drains and must
    `gdc_wait()` before touching anything that predecessor produced; predecessors `gdc_launch_dependents()`."""
    if INTERPRET or gdc_wait is None or device.type != "cuda" or pdl_mode() == 0:
        return False
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _PDL:
        _PDL[i] = torch.cuda.get_device_capability(i)[0] >= 9
    return _PDL[i]


def pdl_mode() -> int:
    """HQ_PDL: 0 off, 1 wait then trigger, 2 trigger then wait (the successor's grid may launch, and prefetch its
    weights, while this one still waits for its own predecessor; completion stays transitive, see `pdl_enter`)."""
    v = os.environ.get("HQ_PDL", "1")
    if v not in ("0", "1", "2"):
        raise ValueError(f"HQ_PDL: {v!r} is not 0, 1 or 2")
    return int(v)


def pdl_meta(device: torch.device) -> dict:
    """Launch keywords for a kernel that starts with `pdl_enter(PDL)`: PDL = pdl_mode() (and launch_pdl) when
    `pdl(device)`, else PDL = 0."""
    return {"PDL": pdl_mode(), "launch_pdl": True} if pdl(device) else {"PDL": 0}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of a kernel launched with PDL: wait until the previous grid is complete and its writes are
    visible (gdc_wait), and let the next PDL-launched grid start (gdc_launch_dependents) — after the wait (PDL 1)
    or before it (PDL 2). Either order is safe: every kernel waits before it reads or writes anything a
    predecessor touches, so a grid completes only after its predecessor did."""
    if PDL == 2:
        gdc_launch_dependents()
        gdc_wait()
    elif PDL == 1:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def row_slot(slot_ptr, r, W, stride_slot_w, stride_slot_r):
    """A multi-position row's one slot (ssm_steps, conv1d_steps): the largest of slot[0..W-1, r] — its live
    positions all carry it (the caller's contract), the others -1; -1 when the row has no live position."""
    slot = tl.load(slot_ptr + r * stride_slot_r).to(tl.int64)
    for j in range(1, W):
        slot = tl.maximum(slot, tl.load(slot_ptr + j * stride_slot_w + r * stride_slot_r).to(tl.int64))
    return slot


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands use exact fp32 products on the GPU (not tf32); 16-bit operands use the tensor cores. In the
    interpreter "sum": `mma` sums elementwise products, whose bits do not depend on a row's place in the tile
    (numpy's BLAS, what the interpreter's tl.dot runs, gives a row other bits at another tile row on some CPUs)."""
    if INTERPRET:
        return "sum"
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def mma(a, b, DOT_PREC: tl.constexpr):
    """a @ b in fp32: tl.dot at DOT_PREC, or ("sum", the interpreter) a sum of elementwise fp32 products."""
    if DOT_PREC == "sum":
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    else:
        return tl.dot(a, b, input_precision=DOT_PREC)


@triton.jit
def mma_acc(a, b, acc, DOT_PREC: tl.constexpr):
    """acc + a @ b in fp32, accumulated inside tl.dot on the GPU (see mma)."""
    if DOT_PREC == "sum":
        return acc + mma(a, b, DOT_PREC)
    else:
        return tl.dot(a, b, acc=acc, input_precision=DOT_PREC)


def dt_limits(limit: tuple[float, float]) -> tuple[float, float]:
    """(lo, hi) clamp for the processed dt, with an infinite hi mapped to the largest float32."""
    lo, hi = float(limit[0]), float(limit[1])
    if not lo <= hi:
        raise KernelInputError(f"dt_limit: lo={lo} > hi={hi}")
    return lo, min(hi, 3.4e38)


def host_ints(op: str, name: str, t: Tensor | Sequence[int]) -> list[int]:
    """A small index tensor (or list) as Python ints (one host sync for device tensors)."""
    if isinstance(t, Tensor):
        if t.dtype not in INDEX_DTYPES + (torch.bool,):
            raise KernelInputError(f"{op}: `{name}` has dtype {t.dtype}, expected int32/int64")
        return [int(v) for v in t.tolist()]
    return [int(v) for v in t]


def token_sequence_index(cu_seqlens: Tensor, n_tokens: int) -> Tensor:
    """int32 [T]: which packed sequence each token belongs to (no host sync: the output size is given)."""
    n_seq = cu_seqlens.shape[0] - 1
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.repeat_interleave(torch.arange(n_seq, device=cu_seqlens.device, dtype=torch.int32), lengths,
                                   output_size=n_tokens)


def check_slots(op: str, slots: list[int], n_slots: int) -> None:
    """Slots must be -1 (padding) or distinct indices into the bank."""
    seen: set[int] = set()
    for i, s in enumerate(slots):
        if s == -1:
            continue
        if not 0 <= s < n_slots:
            raise KernelInputError(f"{op}: `slot`[{i}]={s} is outside the bank (0..{n_slots - 1}, or -1)")
        if s in seen:
            raise KernelInputError(f"{op}: `slot`[{i}]={s} is repeated; each slot may appear once")
        seen.add(s)


@triton.jit
def softplus(v):
    """log(1 + exp(v)) like torch (threshold 20), accurate for very negative v (log1p via Kahan's trick)."""
    e = tl.exp(tl.minimum(v, 20.0))
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
    return tl.where(v > 20.0, v, log1p)


@triton.jit
def sigmoid(v):
    """1 / (1 + exp(-v)) in fp32."""
    return 1.0 / (1.0 + tl.exp(-v))
