"""Residual add + RMSNorm in one pass (mirrors FastModel._residual then FastModel._norm, one launch per row).

    h_new = h + (delta * multiplier rounded to delta's dtype), rounded to h_out's dtype (the residual stream)
    out   = weight * rmsnorm(h_new rounded to out's dtype)            (fp32 statistics)

`delta` None = plain RMSNorm of h. `rows` (int64 [S]) picks the source rows of h/delta for the S output rows
(the final norm over each sequence's last token); then h_new is not stored. Same rounding points as the
unfused torch ops, so bf16 results match them up to the reduction order of the statistics.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import FLOAT_DTYPES, INDEX_DTYPES, INTERPRET, KernelInputError, check, next_pow2, pdl_enter, pdl_meta

OP = "add_rms_norm"
MAX_D = 65536


@triton.jit
def add_rms_norm_kernel(
    h_ptr, d_ptr, w_ptr, rows_ptr, hout_ptr, out_ptr, S, D, eps, mult,
    stride_h, stride_d, stride_ho, stride_o,
    HAS_DELTA: tl.constexpr, HAS_MULT: tl.constexpr, HAS_ROWS: tl.constexpr, STORE_H: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (cdiv(S, BLOCK_S),): BLOCK_S output rows a program; the last dims are contiguous. PDL: programmatic
    dependent launch."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    mt = t < S
    src = t
    if HAS_ROWS:
        src = tl.load(rows_ptr + t, mask=mt, other=0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    m = mt[:, None] & (col < D)[None, :]
    x = tl.load(h_ptr + src[:, None] * stride_h + col[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_DELTA:
        d = tl.load(d_ptr + src[:, None] * stride_d + col[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_MULT:
            d = (d * mult).to(d_ptr.dtype.element_ty).to(tl.float32)
        x = (x + d).to(hout_ptr.dtype.element_ty)
        if STORE_H:
            tl.store(hout_ptr + t[:, None] * stride_ho + col[None, :], x, mask=m)
        x = x.to(tl.float32)
    x = x.to(out_ptr.dtype.element_ty).to(tl.float32)
    var = tl.sum(x * x, axis=1) / D
    normed = x * (1.0 / tl.sqrt(var + eps))[:, None]
    w = tl.load(w_ptr + col, mask=col < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + t[:, None] * stride_o + col[None, :], (w[None, :] * normed).to(out_ptr.dtype.element_ty),
             mask=m)


def add_rms_norm_rows(D: int) -> int:
    """Rows a program: 1 compiled (a row's statistics in one program's warps); in the Triton interpreter (CPU),
    where a program costs its op count whatever its tile, up to 64K elements' worth of rows."""
    return max(1, min(64, 65536 // next_pow2(D))) if INTERPRET else 1


def add_rms_norm(h: Tensor, delta: Tensor | None, weight: Tensor, eps: float, multiplier: float = 1.0,
                 rows: Tensor | None = None, out_dtype: torch.dtype | None = None,
                 h_out: Tensor | None = None, out: Tensor | None = None) -> tuple[Tensor | None, Tensor]:
    """h, delta [T, D] -> (h + delta·m [T, D] or None when rows given or delta None, rmsnorm(..)·weight [S, D])."""
    check(OP, "h", h, (None, None), FLOAT_DTYPES)
    T, D = h.shape
    dev = h.device
    check(OP, "delta", delta, (T, D), FLOAT_DTYPES, dev, optional=True)
    check(OP, "weight", weight, (D,), FLOAT_DTYPES, dev)
    check(OP, "rows", rows, (None,), INDEX_DTYPES, dev, optional=True)
    if D > MAX_D:
        raise KernelInputError(f"{OP}: hidden size {D} exceeds {MAX_D}")
    for name, t in (("h", h), ("delta", delta), ("weight", weight)):
        if t is not None and t.stride(-1) != 1:
            raise KernelInputError(f"{OP}: the last dim of `{name}` must be contiguous")
    S = T if rows is None else rows.shape[0]
    store_h = delta is not None and rows is None
    if store_h:
        if h_out is None:
            h_out = torch.empty_like(h)
        check(OP, "h_out", h_out, (T, D), (h.dtype,), dev)
        if h_out.stride(-1) != 1:
            raise KernelInputError(f"{OP}: the last dim of `h_out` must be contiguous")
    if out is None:
        out = torch.empty(S, D, dtype=out_dtype or h.dtype, device=dev)
    check(OP, "out", out, (S, D), FLOAT_DTYPES, dev)
    if out.stride(-1) != 1:
        raise KernelInputError(f"{OP}: the last dim of `out` must be contiguous")
    if S == 0:
        return (h_out if store_h else None), out
    block = next_pow2(D)
    hdst = h_out if store_h else h             # dtype of the residual stream (never written when not store_h)
    bs = add_rms_norm_rows(D)
    add_rms_norm_kernel[(triton.cdiv(S, bs),)](
        h, delta if delta is not None else h, weight, rows if rows is not None else out, hdst, out, S, D, float(eps),
        float(multiplier), h.stride(0), (delta if delta is not None else h).stride(0), hdst.stride(0), out.stride(0),
        HAS_DELTA=delta is not None, HAS_MULT=multiplier != 1.0, HAS_ROWS=rows is not None, STORE_H=store_h,
        BLOCK_S=bs, BLOCK=block, **pdl_meta(out.device), num_warps=min(16, max(1, block // 256)))
    return (h_out if store_h else None), out
