"""Few-row projection y = x · Wᵀ (+ b) for 2..8 rows: a bs1 speculative verify's k+1 positions, a small decode
batch, a short prefill piece. The one-row GEMV's weight streaming (fastpath/kernels/gemv.py), with the dot products
of up to BLOCK_M rows from one read of each weight tile; fp32 accumulation.

x [M, K], W [N, K] (row-major, K contiguous), y [M, N]. Grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)): a program owns
BLOCK_N output columns of BLOCK_M rows and walks K in BLOCK_K tiles. A row's arithmetic does not depend on the other
rows of its block (per-lane FMAs, then the same [BLOCK_M, BLOCK_N, BLOCK_K] reduction whatever M is), and the tile
is keyed on (N, K) only, so a row's bits do not depend on how many rows the call has.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import FLOAT_DTYPES, KernelInputError, check, next_pow2, pdl_enter, pdl_meta
from .gemv import _w_tile, check_projection

OP = "gemv_rows"
MAX_ROWS = 8           # above this, the row blocks would re-read W more than a GEMM tile does
BLOCK_M = 4


@triton.jit
def gemv_rows_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_x_m, stride_w_n, stride_y_m,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, PDL: tl.constexpr):
    """Program (i, j): columns [i·BLOCK_N, ...) of rows [j·BLOCK_M, ...). The first weight tile is loaded before
    the PDL wait (weights are never written by a predecessor)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mn, mm = n < N, m < M
    k0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    wrow = w_ptr + n.to(tl.int64)[:, None] * stride_w_n
    xrow = x_ptr + m.to(tl.int64)[:, None] * stride_x_m
    wv = _w_tile(wrow, k0, K, mn, EVEN_K)
    pdl_enter(PDL)
    for k in range(0, K - BLOCK_K, BLOCK_K):                 # every tile but the last: a next tile exists
        kk = k + k0
        xv = _x_rows(xrow, kk, K, mm)
        wn = _w_tile(wrow, kk + BLOCK_K, K, mn, EVEN_K)
        acc += wv.to(tl.float32)[None, :, :] * xv[:, None, :]
        wv = wn
    kk = ((K - 1) // BLOCK_K) * BLOCK_K + k0                  # the last tile (wv holds it)
    xv = _x_rows(xrow, kk, K, mm)
    acc += wv.to(tl.float32)[None, :, :] * xv[:, None, :]
    y = tl.sum(acc, axis=2)                                  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=mn, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m.to(tl.int64)[:, None] * stride_y_m + n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mm[:, None] & mn[None, :])


@triton.jit
def _x_rows(xrow, kk, K, mm):
    """The [BLOCK_M, BLOCK_K] tile of x's rows at columns kk, in fp32 (zeros past K and past the last row)."""
    return tl.load(xrow + kk[None, :], mask=mm[:, None] & (kk < K)[None, :], other=0.0).to(tl.float32)


def gemv_rows_launch_rule(N: int, K: int, interpret: bool = False) -> dict:
    """Keyed on (N, K) only: the one-row GEMV's tiles with K tiles halved (BLOCK_M rows of accumulators: 32 fp32
    registers per thread at K >= 4096, 64 below). In the interpreter (CPU), up to 256 columns per program; a
    column's sum does not depend on how many columns its program owns."""
    if K >= 4096:
        r = dict(BLOCK_N=4, BLOCK_K=512, num_warps=8, num_stages=3)
    else:
        r = dict(BLOCK_N=2, BLOCK_K=min(512, next_pow2(K, 16)), num_warps=2, num_stages=1)
    if interpret:
        r["BLOCK_N"] = min(256, next_pow2(N, 2))
    return r


def gemv_rows(x: Tensor, weight: Tensor, bias: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """x [M, K] (1 <= M <= MAX_ROWS) · weight[N, K]ᵀ (+ bias [N]) -> [M, N] in x's dtype."""
    check(OP, "x", x, (None, None), FLOAT_DTYPES)
    M, K = x.shape
    if not 1 <= M <= MAX_ROWS:
        raise KernelInputError(f"{OP}: `x` has {M} rows; this kernel takes 1 to {MAX_ROWS}")
    dev = x.device
    N = check_projection(OP, x, weight, bias, K)
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=dev)
    check(OP, "out", out, (M, N), (x.dtype,), dev)
    if out.stride(1) != 1:
        raise KernelInputError(f"{OP}: `out` must be contiguous in its last dim")
    if N == 0:
        return out
    if K == 0:                                  # an empty sum: y = bias (or 0)
        return out.copy_(bias.expand(M, N)) if bias is not None else out.zero_()
    r = gemv_rows_launch_rule(N, K, interpret=dev.type == "cpu")
    grid = (triton.cdiv(N, r["BLOCK_N"]), triton.cdiv(M, BLOCK_M))
    gemv_rows_kernel[grid](x, weight, bias if bias is not None else weight, out, M, N, K, x.stride(0),
                           weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M,
                           BLOCK_N=r["BLOCK_N"], BLOCK_K=r["BLOCK_K"], EVEN_K=K % r["BLOCK_K"] == 0,
                           num_warps=r["num_warps"], num_stages=r["num_stages"], **pdl_meta(dev))
    return out
