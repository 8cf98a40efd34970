"""SSD stage 1: per chunk and head, the processed step dt = clamp(softplus(dt_raw + dt_bias)) and the
within-chunk cumulative log-decay cumsum(dt · A). Both are written head-major, [H, T] fp32."""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import softplus


@triton.jit
def ssd_chunk_cumsum_kernel(
    dt_ptr, dt_bias_ptr, A_ptr, dt_out_ptr, dacs_out_ptr,
    chunk_start_ptr, chunk_len_ptr,
    H, dt_lo, dt_hi,
    stride_dt_t, stride_dt_h, stride_out_h,
    HAS_BIAS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Grid (n_chunks, cdiv(H, BLOCK_H))."""
    c = tl.program_id(0)
    hb = tl.program_id(1)
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    offs_q = tl.arange(0, BLOCK_Q)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mq = offs_q < length
    mh = offs_h < H
    m = mq[:, None] & mh[None, :]
    tok = start + offs_q                                                   # int64
    v = tl.load(dt_ptr + tok[:, None] * stride_dt_t + offs_h[None, :] * stride_dt_h, mask=m, other=0.0)
    v = v.to(tl.float32)
    if HAS_BIAS:
        v += tl.load(dt_bias_ptr + offs_h, mask=mh, other=0.0).to(tl.float32)[None, :]
    dt = softplus(v)
    dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
    dt = tl.where(m, dt, 0.0)
    A = tl.load(A_ptr + offs_h, mask=mh, other=0.0).to(tl.float32)
    cs = tl.cumsum(dt * A[None, :], axis=0)
    out = offs_h[None, :].to(tl.int64) * stride_out_h + tok[:, None]
    tl.store(dt_out_ptr + out, dt, mask=m)
    tl.store(dacs_out_ptr + out, cs, mask=m)
