"""One-row projection y = x · Wᵀ (+ b) for bs1 decode: a weight-streaming GEMV, fp32 accumulation.

x [1, K], W [N, K] (row-major, K contiguous), y [1, N] in x's dtype. Each program owns BLOCK_N output rows and
walks K in BLOCK_K tiles, so W is read exactly once with long contiguous loads; the tile shape is keyed on
(N, K) only (never on the call), so every call of a given projection has the same bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import FLOAT_DTYPES, KernelInputError, check, gdc_launch_dependents, gdc_wait, next_pow2, pdl_meta
from .matmul import split_sum_kernel

OP = "gemv"


@triton.jit
def gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, K_SPLIT, stride_w_n,
                HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, PDL: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N), SPLIT); program s reduces K in [s·K_SPLIT, (s+1)·K_SPLIT) (PARTIAL: fp32 at y[s]).
    The weight tile of the next step is loaded before x: under PDL the first one is in flight while the kernel
    that produces x drains (the weights never depend on it), and nothing is read from x or written before
    gdc_wait()."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ps = tl.program_id(1)
    mn = n < N
    k0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    wrow = w_ptr + n.to(tl.int64)[:, None] * stride_w_n
    k_lo = ps * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    if EVEN_K:
        wv = tl.load(wrow + (k_lo + k0)[None, :], mask=mn[:, None], other=0.0)
    else:
        wv = tl.load(wrow + (k_lo + k0)[None, :], mask=mn[:, None] & ((k_lo + k0) < k_hi)[None, :], other=0.0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    for k in range(k_lo, k_hi - BLOCK_K, BLOCK_K):          # every tile but the last: a next tile exists
        kk = k + k0
        nk = kk + BLOCK_K
        if EVEN_K:
            xv = tl.load(x_ptr + kk).to(tl.float32)
            wn = tl.load(wrow + nk[None, :], mask=mn[:, None], other=0.0)
        else:
            xv = tl.load(x_ptr + kk).to(tl.float32)
            wn = tl.load(wrow + nk[None, :], mask=mn[:, None] & (nk < k_hi)[None, :], other=0.0)
        acc += wv.to(tl.float32) * xv[None, :]
        wv = wn
    kk = k_lo + ((k_hi - k_lo - 1) // BLOCK_K) * BLOCK_K + k0   # the last tile (wv holds it)
    xv = tl.load(x_ptr + kk, mask=kk < k_hi, other=0.0).to(tl.float32)
    acc += wv.to(tl.float32) * xv[None, :]
    y = tl.sum(acc, axis=1)
    if PARTIAL:
        tl.store(y_ptr + ps * N + n, y, mask=mn)
    else:
        if HAS_BIAS:
            y += tl.load(b_ptr + n, mask=mn, other=0.0).to(tl.float32)
        tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=mn)


def gemv_launch_rule(N: int, K: int) -> dict:
    """Keyed on (N, K) only; picked by tools/bench_gemm.py on an H200 (2026-11-30, CUDA graphs, cold weights):
    4 output rows per program won on every anchor-3b projection (75-96% of copy bandwidth; cuBLAS 46-94%);
    long K rows take 1024-wide tiles and 8 warps. A K split never won (so SPLIT stays 1; benches may set it)."""
    if K >= 4096:
        return dict(BLOCK_N=4, BLOCK_K=1024, SPLIT=1, num_warps=8, num_stages=3)
    return dict(BLOCK_N=4, BLOCK_K=min(512, next_pow2(K, 16)), SPLIT=1, num_warps=4, num_stages=1)


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None, out: Tensor | None = None,
         rule: dict | None = None) -> Tensor:
    """x [1, K] · weight[N, K]ᵀ (+ bias [N]) -> [1, N] in x's dtype (rule: override the launch rule, benches)."""
    check(OP, "x", x, (1, None), FLOAT_DTYPES)
    K = x.shape[1]
    dev = x.device
    check(OP, "weight", weight, (None, K), FLOAT_DTYPES, dev)
    N = weight.shape[0]
    check(OP, "bias", bias, (N,), FLOAT_DTYPES, dev, optional=True)
    if x.stride(1) != 1 or weight.stride(1) != 1 or (bias is not None and bias.stride(0) != 1):
        raise KernelInputError(f"{OP}: the last dims of `x`, `weight` and `bias` must be contiguous")
    if out is None:
        out = torch.empty(1, N, dtype=x.dtype, device=dev)
    check(OP, "out", out, (1, N), (x.dtype,), dev)
    if out.stride(1) != 1:
        raise KernelInputError(f"{OP}: `out` must be contiguous")
    if N == 0:
        return out
    r = {**gemv_launch_rule(N, K), **(rule or {})}
    bk = r["BLOCK_K"]
    k_split = triton.cdiv(triton.cdiv(K, r["SPLIT"]), bk) * bk
    split = triton.cdiv(K, k_split)
    b_arg = bias if bias is not None else weight
    even = K % bk == 0
    meta = dict(BLOCK_N=r["BLOCK_N"], BLOCK_K=bk, EVEN_K=even, num_warps=r["num_warps"], num_stages=r["num_stages"],
                **pdl_meta(dev))
    grid = (triton.cdiv(N, r["BLOCK_N"]), split)
    if split == 1:
        gemv_kernel[grid](x, weight, b_arg, out, N, K, k_split, weight.stride(0), HAS_BIAS=bias is not None,
                          PARTIAL=False, **meta)
    else:                                   # fixed split of K, partials summed in order (deterministic)
        part = torch.empty(split, N, dtype=torch.float32, device=dev)
        gemv_kernel[grid](x, weight, b_arg, part, N, K, k_split, weight.stride(0), HAS_BIAS=False, PARTIAL=True,
                          **meta)
        split_sum_kernel[(triton.cdiv(N, 1024),)](part, b_arg, out, N, N, SPLIT=split, HAS_BIAS=bias is not None,
                                                  BLOCK=1024)
    return out
