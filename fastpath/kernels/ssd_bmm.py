"""SSD stage 2 (optional): per chunk and group, the C·Bᵀ score matrix CB[c, g, i, j] = C_i · B_j in fp32,
computed once per group and re-read by every head of the group in the chunk scan."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def ssd_bmm_kernel(
    B_ptr, C_ptr, cb_ptr, chunk_start_ptr, chunk_len_ptr,
    N,
    stride_b_t, stride_b_g, stride_b_n, stride_c_t, stride_c_g, stride_c_n,
    stride_cb_c, stride_cb_g, stride_cb_i,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Grid (n_chunks, G, (BLOCK_Q // BLOCK_M)**2); blocks above the diagonal are skipped by masking."""
    c = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    nb = BLOCK_Q // BLOCK_M
    ib = tl.program_id(2) // nb
    jb = tl.program_id(2) % nb
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    offs_i = ib * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_j = jb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    mi = tl.where(jb <= ib, offs_i < length, False)
    mj = tl.where(jb <= ib, offs_j < length, False)
    mn = offs_n < N
    Cm = tl.load(C_ptr + (start + offs_i)[:, None] * stride_c_t + g * stride_c_g + offs_n[None, :] * stride_c_n,
                 mask=mi[:, None] & mn[None, :], other=0.0)
    Bm = tl.load(B_ptr + (start + offs_j)[:, None] * stride_b_t + g * stride_b_g + offs_n[None, :] * stride_b_n,
                 mask=mj[:, None] & mn[None, :], other=0.0)
    cb = tl.dot(Cm, tl.trans(Bm), input_precision=DOT_PREC)
    out = cb_ptr + c.to(tl.int64) * stride_cb_c + g * stride_cb_g + offs_i[:, None] * stride_cb_i + offs_j[None, :]
    tl.store(out, cb, mask=mi[:, None] & mj[None, :])
