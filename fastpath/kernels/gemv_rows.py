"""Few-row projection y = x · Wᵀ (+ b) for 1..8 rows: a bs1 speculative verify's k+1 positions, a small decode
batch, a short prefill piece. The one-row GEMV (fastpath/kernels/gemv.py) with up to ROWS_PER_PROGRAM rows sharing
each weight tile it reads: every row keeps its own accumulator, so a row's arithmetic is the one-row GEMV's.

x [M, K], W [N, K] (row-major, K contiguous), y [M, N]. A program owns BLOCK_N output columns of one block of rows
and walks K in BLOCK_K tiles with the one-row GEMV's tile (`gemv_launch_rule`, keyed on (N, K) only), so row r's
arithmetic is that of `gemv(x[r:r+1])`. Its bits are too where both kernels compile to the same register layout,
which fixes the order of the final sum: Triton picks the layout from the loads' alignment, and with K a multiple
of K_MULTIPLE they agree (tested, fp32 and bf16); with other K, fp32 rows differ from the one-row GEMV's in the
last bits on sm_90 (docs/kernels.md), so the engine takes this kernel only for K % K_MULTIPLE == 0.
Each row's x tile is loaded already broadcast over the program's columns, in the weight tile's own register
layout, so the product needs no layout conversion (no shared-memory round trip or barrier per K tile).
Row blocks of one column tile are neighbours in the grid, so a weight tile read twice (M > ROWS_PER_PROGRAM) comes
from L2.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import FLOAT_DTYPES, KernelInputError, check, pdl_enter, pdl_meta
from .gemv import _w_tile, check_projection, gemv_launch_rule, interpreter_tile

OP = "gemv_rows"
K_MULTIPLE = 16            # K for which a row's bits are the one-row GEMV's (the compiler's 16-divisibility hint)
MAX_ROWS = 8               # above this, the row blocks would re-read W more than a GEMM tile does
ROWS_PER_PROGRAM = 3       # accumulators a program keeps: a k = 2 verify in one block; 4 would need 134 registers
                           # a thread at the 1024-wide tile (sm_90), one CTA an SM


@triton.jit
def gemv_rows_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_x_m, stride_w_n, stride_y_m, ROW_BLOCKS,
                     HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, PDL: tl.constexpr):
    """Program p: rows [ROWS·(p % ROW_BLOCKS), +ROWS) ∩ [0, M), columns of tile p // ROW_BLOCKS. The first weight
    tile is loaded before the PDL wait (weights are never written by a predecessor)."""
    pid = tl.program_id(0)
    m0 = (pid % ROW_BLOCKS) * ROWS
    n = (pid // ROW_BLOCKS) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = n < N
    k0 = tl.arange(0, BLOCK_K)
    zn = n * 0                                               # an x row's index repeated over the columns
    xr = x_ptr + m0.to(tl.int64) * stride_x_m
    wrow = w_ptr + n.to(tl.int64)[:, None] * stride_w_n
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if ROWS > 1:
        acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if ROWS > 2:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    wv = _w_tile(wrow, k0, K, mn, EVEN_K)
    pdl_enter(PDL)
    for k in range(0, K, BLOCK_K):
        kk = k + k0
        wn = _w_tile(wrow, kk + BLOCK_K, K, mn & (zn + k + BLOCK_K < K), EVEN_K)   # the next tile, if any
        w = wv.to(tl.float32)
        acc0 += w * _x_bcast(xr, kk, K, zn + m0, M)
        if ROWS > 1:
            acc1 += w * _x_bcast(xr + stride_x_m, kk, K, zn + m0 + 1, M)
        if ROWS > 2:
            acc2 += w * _x_bcast(xr + 2 * stride_x_m, kk, K, zn + m0 + 2, M)
        wv = wn
    yr = y_ptr + m0.to(tl.int64) * stride_y_m + n
    _store_row(yr, acc0, b_ptr, n, mn & (zn + m0 < M), HAS_BIAS)
    if ROWS > 1:
        _store_row(yr + stride_y_m, acc1, b_ptr, n, mn & (zn + m0 + 1 < M), HAS_BIAS)
    if ROWS > 2:
        _store_row(yr + 2 * stride_y_m, acc2, b_ptr, n, mn & (zn + m0 + 2 < M), HAS_BIAS)


@triton.jit
def _x_bcast(xrow, kk, K, row, M):
    """x[row, kk] in fp32 as a [BLOCK_N, BLOCK_K] tile (`row`: the row index repeated over the program's columns,
    so every column loads the same row), in the weight tile's layout; zeros past K, and everywhere past row M."""
    return tl.load(xrow + (row * 0)[:, None] + kk[None, :], mask=(row < M)[:, None] & (kk < K)[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _store_row(yr, acc, b_ptr, n, mask, HAS_BIAS: tl.constexpr):
    """y[row, n] = Σ_k acc[n, k] (+ b[n]), rounded to y's dtype: the one-row GEMV's reduction and epilogue."""
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(yr, y.to(yr.dtype.element_ty), mask=mask)


def gemv_rows_launch_rule(N: int, K: int, M: int, interpret: bool = False) -> dict:
    """The one-row GEMV's tile (keyed on (N, K) only: a row's bits do not depend on M), ROWS = min(M,
    ROWS_PER_PROGRAM) accumulators a program; in the interpreter (CPU), up to 256 columns a program."""
    r = {k: v for k, v in gemv_launch_rule(N, K).items() if k != "SPLIT"}
    r["ROWS"] = min(M, ROWS_PER_PROGRAM)
    if interpret:
        r.update(interpreter_tile(N))
    return r


def gemv_rows(x: Tensor, weight: Tensor, bias: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """x [M, K] (1 <= M <= MAX_ROWS) · weight[N, K]ᵀ (+ bias [N]) -> [M, N] in x's dtype; with K % K_MULTIPLE == 0
    row r has the bits of the one-row GEMV of x[r]."""
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
    r = gemv_rows_launch_rule(N, K, M, interpret=dev.type == "cpu")
    row_blocks = triton.cdiv(M, r["ROWS"])
    grid = (triton.cdiv(N, r["BLOCK_N"]) * row_blocks,)
    gemv_rows_kernel[grid](x, weight, bias if bias is not None else weight, out, M, N, K, x.stride(0),
                           weight.stride(0), out.stride(0), row_blocks, HAS_BIAS=bias is not None, ROWS=r["ROWS"],
                           BLOCK_N=r["BLOCK_N"], BLOCK_K=r["BLOCK_K"], EVEN_K=K % r["BLOCK_K"] == 0,
                           num_warps=r["num_warps"], num_stages=r["num_stages"], **pdl_meta(dev))
    return out
