"""SSD stage 2: the chunk-state walk (each chunk's own state and their passing along the sequence, in one kernel).

One program owns a (sequence, head, P-tile, N-tile) of the state and walks the sequence's chunks in order:
it records the state entering chunk c (prev_states[c], in the inputs' dtype, read by the chunk scan), then
advances it in fp32,
    h ← exp(Σ_chunk dt·A) · h + Σ_j exp(cs_last − cs_j) dt_j x_j ⊗ B_j,
the sum taken in sub-blocks of BLOCK_K tokens (software-pipelined loads), starting from ssm_bank[slot] (when
has_initial_state) and writing the final state back to ssm_bank[slot].
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import mma


@triton.jit
def _xb_term(x_ptr, B_ptr, dt_ptr, dacs_ptr, h, g, tok, mk, cs_last, offs_p, offs_n, mp, mn,
             stride_x_t, stride_x_h, stride_x_p, stride_b_t, stride_b_g, stride_b_n, stride_dt_h,
             DOT_PREC: tl.constexpr):
    """Tokens `tok` (mask mk) of one sub-block: Σ_j exp(cs_last − cs_j) dt_j x_j ⊗ B_j, a [P, N]-tile fp32 dot."""
    cs = tl.load(dacs_ptr + h * stride_dt_h + tok, mask=mk, other=0.0)
    dt = tl.load(dt_ptr + h * stride_dt_h + tok, mask=mk, other=0.0)
    w = tl.where(mk, tl.exp(cs_last - cs) * dt, 0.0)
    xt = tl.load(x_ptr + tok[:, None] * stride_x_t + h * stride_x_h + offs_p[None, :] * stride_x_p,
                 mask=mk[:, None] & mp[None, :], other=0.0)
    bt = tl.load(B_ptr + tok[:, None] * stride_b_t + g * stride_b_g + offs_n[None, :] * stride_b_n,
                 mask=mk[:, None] & mn[None, :], other=0.0)
    xw = (xt.to(tl.float32) * w[:, None]).to(bt.dtype)
    return mma(tl.trans(xw), bt, DOT_PREC)


@triton.jit
def _chunk_local_state(x_ptr, B_ptr, dt_ptr, dacs_ptr, h, g, start, length, cs_last, offs_p, offs_n, mp, mn,
                       stride_x_t, stride_x_h, stride_x_p, stride_b_t, stride_b_g, stride_b_n, stride_dt_h,
                       BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr):
    """The chunk's own state from zero, summed BLOCK_K tokens at a time in fp32 (the one order every kernel uses)."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, length, BLOCK_K):
        acc += _xb_term(x_ptr, B_ptr, dt_ptr, dacs_ptr, h, g, start + k0 + offs_k, (k0 + offs_k) < length, cs_last,
                        offs_p, offs_n, mp, mn, stride_x_t, stride_x_h, stride_x_p, stride_b_t, stride_b_g,
                        stride_b_n, stride_dt_h, DOT_PREC)
    return acc


@triton.jit
def _walk_tile(P, N, heads_per_group, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """A walker's tile on grid (P-tiles × N-tiles, H, n_seqs): its P- and N-tile, head, sequence, group, offsets
    and masks."""
    n_nb = tl.cdiv(N, BLOCK_N)
    pb = tl.program_id(0) // n_nb
    nb = tl.program_id(0) % n_nb
    h = tl.program_id(1).to(tl.int64)
    s = tl.program_id(2)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    mp = offs_p < P
    mn = offs_n < N
    return pb, nb, h, s, h // heads_per_group, offs_p, offs_n, mp, mn, mp[:, None] & mn[None, :]


@triton.jit
def _bank_state(bank_ptr, slot_ptr, has_init_ptr, s, h, offs_p, offs_n, mpn, stride_bank_s, stride_bank_h,
                stride_bank_p, stride_bank_n):
    """The walk's start: its bank tile (pointers) and the fp32 state there (zeros without an initial state)."""
    slot = tl.load(slot_ptr + s).to(tl.int64)
    has_init = tl.load(has_init_ptr + s) != 0
    bank_tile = (bank_ptr + slot * stride_bank_s + h * stride_bank_h
                 + offs_p[:, None] * stride_bank_p + offs_n[None, :] * stride_bank_n)
    # (scalar conditions go through tl.where: the interpreter rejects `tensor_mask & scalar_bool`)
    state = tl.load(bank_tile, mask=tl.where((slot >= 0) & has_init, mpn, False), other=0.0).to(tl.float32)
    return slot, bank_tile, state


@triton.jit
def _record_entering(state, prev_ptr, bank_ptr, ckpt_ptr, c, h, offs_p, offs_n, mpn, stride_prev_c, stride_prev_h,
                     stride_prev_p, stride_bank_s, stride_bank_h, stride_bank_p, stride_bank_n,
                     HAS_CKPT: tl.constexpr):
    """The state entering chunk c: to prev_states[c] in the inputs' dtype (for the scan) and, HAS_CKPT, in fp32 to
    the bank slot ckpt_ptr[c] when that is >= 0 (a prefix-cache checkpoint)."""
    prev = prev_ptr + c * stride_prev_c + h * stride_prev_h + offs_p[:, None] * stride_prev_p + offs_n[None, :]
    tl.store(prev, state.to(prev_ptr.dtype.element_ty), mask=mpn)
    if HAS_CKPT:
        ck = tl.load(ckpt_ptr + c).to(tl.int64)
        ck_tile = (bank_ptr + ck * stride_bank_s + h * stride_bank_h
                   + offs_p[:, None] * stride_bank_p + offs_n[None, :] * stride_bank_n)
        tl.store(ck_tile, state, mask=tl.where(ck >= 0, mpn, False))


@triton.jit
def ssd_chunk_state_kernel(
    x_ptr, B_ptr, dt_ptr, dacs_ptr, bank_ptr, prev_ptr,
    seq_chunk_ptr, chunk_start_ptr, chunk_len_ptr, slot_ptr, has_init_ptr,
    P, N, heads_per_group,
    stride_x_t, stride_x_h, stride_x_p,
    stride_b_t, stride_b_g, stride_b_n,
    stride_dt_h,
    stride_bank_s, stride_bank_h, stride_bank_p, stride_bank_n,
    stride_prev_c, stride_prev_h, stride_prev_p,
    ckpt_ptr,
    BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    HAS_CKPT: tl.constexpr = False,
):
    """Grid (cdiv(P, BLOCK_P) * cdiv(N, BLOCK_N), H, n_seqs): the tiles of a head run side by side. HAS_CKPT:
    ckpt_ptr[c] >= 0 is a bank slot that receives the fp32 state entering chunk c (a prefix-cache checkpoint)."""
    pb, nb, h, s, g, offs_p, offs_n, mp, mn, mpn = _walk_tile(P, N, heads_per_group, BLOCK_P, BLOCK_N)
    slot, bank_tile, state = _bank_state(bank_ptr, slot_ptr, has_init_ptr, s, h, offs_p, offs_n, mpn, stride_bank_s,
                                         stride_bank_h, stride_bank_p, stride_bank_n)
    c0 = tl.load(seq_chunk_ptr + s)          # int64, so c * stride_prev_c is int64
    c1 = tl.load(seq_chunk_ptr + s + 1)
    for c in range(c0, c1):
        _record_entering(state, prev_ptr, bank_ptr, ckpt_ptr, c, h, offs_p, offs_n, mpn, stride_prev_c, stride_prev_h,
                         stride_prev_p, stride_bank_s, stride_bank_h, stride_bank_p, stride_bank_n, HAS_CKPT)
        start = tl.load(chunk_start_ptr + c).to(tl.int64)
        length = tl.load(chunk_len_ptr + c)
        cs_last = tl.load(dacs_ptr + h * stride_dt_h + start + length - 1)
        acc = _chunk_local_state(x_ptr, B_ptr, dt_ptr, dacs_ptr, h, g, start, length, cs_last, offs_p, offs_n, mp, mn,
                                 stride_x_t, stride_x_h, stride_x_p, stride_b_t, stride_b_g, stride_b_n, stride_dt_h,
                                 BLOCK_K, BLOCK_P, BLOCK_N, DOT_PREC)
        state = tl.exp(cs_last) * state + acc
    tl.store(bank_tile, state, mask=tl.where(slot >= 0, mpn, False))
