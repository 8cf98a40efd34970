"""SSD stage 1: per chunk and head block, the processed step dt = clamp(softplus(dt_raw + dt_bias)) and the
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
    """Grid (n_chunks, cdiv(H, BLOCK_H)): one [chunk × head block] tile, read along heads (coalesced in the
    [T, H] input) and scanned along tokens; every head's scan is the same sequential-order cumsum."""
    c = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    offs_q = tl.arange(0, BLOCK_Q)
    mq = offs_q < length
    mh = offs_h < H
    m2 = mq[:, None] & mh[None, :]
    tok = start + offs_q                                                   # int64
    hh = offs_h.to(tl.int64)
    v = tl.load(dt_ptr + tok[:, None] * stride_dt_t + hh[None, :] * stride_dt_h, mask=m2, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(dt_bias_ptr + offs_h, mask=mh, other=0.0).to(tl.float32)[None, :]
    dt = softplus(v)
    dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
    dt = tl.where(m2, dt, 0.0)
    a = tl.load(A_ptr + offs_h, mask=mh, other=0.0).to(tl.float32)
    cs = tl.cumsum(dt * a[None, :], axis=0)
    out = hh[None, :] * stride_out_h + tok[:, None]
    tl.store(dt_out_ptr + out, dt, mask=m2)
    tl.store(dacs_out_ptr + out, cs, mask=m2)
