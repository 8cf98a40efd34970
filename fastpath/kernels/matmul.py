"""Batch-invariant matmul: y = x @ w.T (+ bias) with tile shapes and a K split fixed by the weight's shape.

Every output element is reduced over K in the same order whatever M is and whichever row the token sits in:
BLOCK_K steps with an fp32 accumulator inside each of SPLIT fixed K ranges, then the SPLIT partials summed
in index order by a second kernel (SPLIT > 1). The launch rule depends only on (N, K) — never on M — the
property cuBLAS/MKL do not promise (they pick kernels and split-K by M). A fixed split keeps skinny
decode GEMMs (M <= 64, N = 2560) from running on a third of the SMs without making the sum depend on M.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ._common import FLOAT_DTYPES, INTERPRET, KernelInputError, check, next_pow2

OP = "matmul"
BLOCK_M = 64


@triton.jit
def matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, K_SPLIT,
                  stride_xm, stride_wn, stride_ym, stride_ys,
                  HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, PARTIAL: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Grid (cdiv(M, BM), cdiv(N, BN), SPLIT); program s reduces K in [s·K_SPLIT, (s+1)·K_SPLIT).
    PARTIAL: store the fp32 partial at y[s] (no bias); else add the bias and store in y's dtype."""
    pm, pn, ps = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    k_lo = ps * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < k_hi), other=0.0)
        b = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None],
                    mask=(rn[None, :] < N) & (kk[:, None] < k_hi), other=0.0)
        if USE_DOT:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:   # interpreter: numpy's BLAS sums a row differently by its place in the block; this does not
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if PARTIAL:
        tl.store(y_ptr + ps * stride_ys + rm[:, None] * stride_ym + rn[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def split_sum_kernel(p_ptr, b_ptr, y_ptr, MN, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """y = Σ_s p[s] (s = 0, 1, … in order) + bias; p [SPLIT, M, N] fp32 contiguous, y [M, N] contiguous."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < MN
    acc = tl.load(p_ptr + i, mask=m, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(p_ptr + s * MN + i, mask=m, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + i % N, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=m)


def matmul_launch_rule(N: int, K: int, elem_bytes: int = 2) -> dict:
    """Tiles and K split from the weight's shape only, picked by tools/bench/gemm.py at M = 64 (each anchor-3b
    projection near cuBLAS's time in CUDA graphs: docs/performance.md, "Choices the code makes"): wide outputs
    take wide tiles; N <= 4096 takes 32-wide tiles, and long K a fixed 4-way split so that the 2560-output
    projections fill the SMs. 4-byte inputs take 3 stages of the wide tiles (4 need 288 KiB of shared memory, past
    sm_90's 227 KiB; stages change no sum's order, so not the bits)."""
    if N >= 16384:                                        # lm_head
        return dict(BN=64, BK=64, SPLIT=1, num_warps=4, num_stages=3)
    if N > 4096:                                          # in_proj, gate_up
        return dict(BN=128, BK=128, SPLIT=1, num_warps=8, num_stages=4 if elem_bytes <= 2 else 3)
    if K >= 4096:                                         # out_proj, down
        return dict(BN=32, BK=128, SPLIT=4, num_warps=4, num_stages=3)
    return dict(BN=32, BK=128, SPLIT=1, num_warps=4, num_stages=5)   # qkv, o_proj


def interpreter_tile(M: int, N: int, K: int, bk: int) -> dict:
    """The Triton interpreter: rows as many as the batch has (up to BLOCK_M), a K step no longer than K when one
    step covers it, and as many output columns per program as Triton's tensor size limit lets the [BM, BK, BN]
    product hold (up to 1024). An interpreted program costs Python per operation and numpy per element of that
    product, and the product sums each element over k in order whatever the tile (USE_DOT off), so the bits are
    the rule's with fewer, smaller programs: the K steps of a longer K and SPLIT stay the rule's."""
    bm = next_pow2(min(M, BLOCK_M), 2)
    bk = bk if K > bk else next_pow2(K, 16)
    return dict(BM=bm, BK=bk, BN=min(1024, next_pow2(N, 16), (1 << 20) // (bm * bk)))


def matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None, out: Tensor | None = None,
           rule: dict | None = None) -> Tensor:
    """x [..., K] @ weight[N, K].T (+ bias[N]) -> [..., N] in x's dtype, batch-invariant (rule: benches only)."""
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
    if not (M and N):
        return y.view(*lead, N)
    r = matmul_launch_rule(N, K, x2.element_size())
    r = {"BM": BLOCK_M, **r, **(interpreter_tile(M, N, K, r["BK"]) if INTERPRET else {}), **(rule or {})}
    bk, split = r["BK"], r["SPLIT"]
    k_split = triton.cdiv(triton.cdiv(K, split), bk) * bk          # a multiple of BK: same k0 steps for every M
    split = triton.cdiv(K, k_split)
    grid = (triton.cdiv(M, r["BM"]), triton.cdiv(N, r["BN"]), split)
    bias_arg = bias if bias is not None else w
    if split == 1:
        matmul_kernel[grid](x2, w, bias_arg, y, M, N, K, k_split, x2.stride(0), w.stride(0), y.stride(0), 0,
                            HAS_BIAS=bias is not None, USE_DOT=not INTERPRET, PARTIAL=False,
                            BM=r["BM"], BN=r["BN"], BK=bk, num_warps=r["num_warps"], num_stages=r["num_stages"])
    else:
        if not y.is_contiguous():
            raise KernelInputError(f"{OP}: `out` must be contiguous")
        part = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
        matmul_kernel[grid](x2, w, bias_arg, part, M, N, K, k_split, x2.stride(0), w.stride(0), N, M * N,
                            HAS_BIAS=False, USE_DOT=not INTERPRET, PARTIAL=True,
                            BM=r["BM"], BN=r["BN"], BK=bk, num_warps=r["num_warps"], num_stages=r["num_stages"])
        blk = 1024
        split_sum_kernel[(triton.cdiv(M * N, blk),)](part, bias_arg, y, M * N, N, SPLIT=split,
                                                     HAS_BIAS=bias is not None, BLOCK=blk)
    return y.view(*lead, N)


class _RouteMatmuls(TorchFunctionMode):
    """Sends `F.linear` and `x @ W` (2-D W) to the fixed-tile matmul; everything else runs unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            return matmul(x, w, b)
        if func in (torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.mm) and not kwargs:
            x, w = args
            if isinstance(w, Tensor) and w.dim() == 2 and x.dim() >= 1 and x.is_floating_point():
                return matmul(x, w.t())
        return func(*args, **kwargs)


def route_matmuls() -> TorchFunctionMode:
    """A context in which F.linear / x @ W run on the fixed-tile matmul (FastModel.moe in batch-invariant mode)."""
    return _RouteMatmuls()
