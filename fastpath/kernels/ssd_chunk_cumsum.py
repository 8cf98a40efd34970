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
    HAS_BIAS: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    """1-D grid over (chunk, head), head fastest (the heads of a chunk share its dt cache lines)."""
    pid = tl.program_id(0)
    c = pid // H
    h = (pid % H).to(tl.int64)
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    offs_q = tl.arange(0, BLOCK_Q)
    mq = offs_q < length
    tok = start + offs_q                                                   # int64
    v = tl.load(dt_ptr + tok * stride_dt_t + h * stride_dt_h, mask=mq, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(dt_bias_ptr + h).to(tl.float32)
    dt = softplus(v)
    dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
    dt = tl.where(mq, dt, 0.0)
    cs = tl.cumsum(dt * tl.load(A_ptr + h).to(tl.float32), axis=0)
    out = h * stride_out_h + tok
    tl.store(dt_out_ptr + out, dt, mask=mq)
    tl.store(dacs_out_ptr + out, cs, mask=mq)
