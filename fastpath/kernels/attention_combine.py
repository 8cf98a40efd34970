"""The merge of split-key prefill attention (fastpath/kernels/attention.py, "split over the keys").

A short prefill piece over a long context gets few query blocks, so one program per (query block, head) would
walk the whole context serially on a handful of SMs. The attention kernel then gives each query block several
programs, one per `chunk` keys, which write unnormalised partials (acc [D], running max m, sum l) per query row
and head; this kernel merges a row's partials in split order (0, 1, ...) — a fixed order, so the result does
not depend on which program finished first — and writes O = Σ e^(m_j - M) acc_j / Σ e^(m_j - M) l_j.
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from ._common import next_pow2, pdl_enter, pdl_meta


@triton.jit
def attention_combine_kernel(
    acc_ptr, ml_ptr, o_ptr, row_ptr, Hq, D, stride_o_t, stride_o_h,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (n_rows, cdiv(Hq, BLOCK_H)): row_ptr holds (packed token t, first workspace row, number of splits) per
    row; a program merges BLOCK_H heads of one row (each head's merge is its own: the bits do not depend on it)."""
    pdl_enter(PDL)
    r = tl.program_id(0)
    t = tl.load(row_ptr + 3 * r).to(tl.int64)
    base = tl.load(row_ptr + 3 * r + 1).to(tl.int64)
    n = tl.load(row_ptr + 3 * r + 2)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mh = h < Hq
    mhd = mh[:, None] & (d < D)[None, :]
    M = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    Ls = tl.zeros([BLOCK_H], dtype=tl.float32)
    O = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for j in range(0, n):
        row = (base + j) * Hq + h
        m_j = tl.load(ml_ptr + 2 * row, mask=mh, other=-1.0e30)
        l_j = tl.load(ml_ptr + 2 * row + 1, mask=mh, other=0.0)
        a_j = tl.load(acc_ptr + row[:, None] * D + d[None, :], mask=mhd, other=0.0)
        M_new = tl.maximum(M, m_j)
        alpha = tl.exp(M - M_new)
        w = tl.exp(m_j - M_new)
        Ls = Ls * alpha + l_j * w
        O = O * alpha[:, None] + a_j * w[:, None]
        M = M_new
    o = O / tl.where(Ls > 0, Ls, 1.0)[:, None]
    tl.store(o_ptr + t * stride_o_t + h[:, None] * stride_o_h + d[None, :], o.to(o_ptr.dtype.element_ty), mask=mhd)


def combine_partials(acc: Tensor, ml: Tensor, out: Tensor, rows: Tensor, n_rows: int,
                     heads_per_program: int | None = None) -> None:
    """out[t] := the merge of workspace rows base..base+n-1 for each (t, base, n) of `rows` (int32 [3·n_rows]);
    heads_per_program (a power of two; None: every head in one program) sets how many heads a program merges."""
    Hq, D = out.shape[1], out.shape[2]
    bh = next_pow2(Hq) if heads_per_program is None else heads_per_program
    attention_combine_kernel[(n_rows, triton.cdiv(Hq, bh))](
        acc, ml, out, rows, Hq, D, out.stride(0), out.stride(1),
        BLOCK_H=bh, BLOCK_D=next_pow2(D, 16), num_warps=4, **pdl_meta(out.device))
