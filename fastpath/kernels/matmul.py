"""Batch-invariant matmul: y = x @ w.T (+ bias) with ONE fixed tile shape and no split-K.

Every output element is reduced over K in the same order (BLOCK_K steps, fp32 accumulator, one program
owns the whole K range) whatever M is and whichever row the token sits in, so a token's projection is
bitwise independent of the batch it is packed into.  The launch configuration depends only on the weight's
shape and dtype (never on M) — the property cuBLAS/MKL do not promise (they pick kernels and split-K by M).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import FLOAT_DTYPES, INTERPRET, KernelInputError, check

OP = "matmul"
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
NUM_WARPS, NUM_STAGES = 4, 4


@triton.jit
def matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
                  stride_xm, stride_wn, stride_ym,
                  HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Grid (cdiv(M, BM), cdiv(N, BN)); x [M, K], w [N, K], y [M, N], all with unit last stride."""
    pm, pn = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None],
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        if USE_DOT:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:   # interpreter: numpy's BLAS sums a row differently by its place in the block; this does not
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """x [..., K] @ weight[N, K].T (+ bias[N]) -> [..., N] in x's dtype, batch-invariant (fixed tiles)."""
    check(OP, "x", x, None, FLOAT_DTYPES)
    check(OP, "weight", weight, None, FLOAT_DTYPES, device=x.device)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise KernelInputError(f"{OP}: `weight` must be [N, K={x.shape[-1]}], got {tuple(weight.shape)}")
    N, K = weight.shape
    if bias is not None and (bias.shape != (N,) or bias.device != x.device):
        raise KernelInputError(f"{OP}: `bias` must be [{N}] on {x.device}, got {tuple(bias.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    if w.dtype != x2.dtype:
        w = w.to(x2.dtype)
    M = x2.shape[0]
    y = out.view(M, N) if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
        matmul_kernel[grid](x2, w, bias if bias is not None else w, y, M, N, K,
                            x2.stride(0), w.stride(0), y.stride(0),
                            HAS_BIAS=bias is not None, USE_DOT=not INTERPRET, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
                            num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return y.view(*lead, N)
