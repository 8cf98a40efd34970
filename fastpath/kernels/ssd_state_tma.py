"""SSD stage 3 through tensor descriptors: ssd_chunk_state_kernel's walk (a program per (sequence, head, P-tile,
N-tile) records the state entering each chunk and advances it,
    h ← exp(Σ_chunk dt·A) · h + Σ_j exp(cs_last − cs_j) dt_j x_j ⊗ B_j),
the same sums in the same order, with x and B read as [BLOCK_K, ·] boxes of 2-D descriptors (on
Hopper: TMA copies into shared memory) instead of pointer tensors. Whole sub-blocks run without row masks; the box of
a chunk's partial last sub-block runs past it into the next chunk (or sequence), and those rows are zeroed before
use, so nothing from outside the chunk reaches its sum.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import KernelInputError, reg_cap
from .ssd_chunk_state import _bank_state, _record_entering, _walk_tile
from .ssd_scan_tma import rows_2d


@triton.jit
def _xb_box(x_desc, B_desc, dt_ptr, dacs_ptr, h, start, length, k0, cs_last, col_x, col_b, offs_k, stride_dt_h,
            DOT_PREC: tl.constexpr, FULL: tl.constexpr):
    """Σ_j exp(cs_last − cs_j) dt_j x_j ⊗ B_j over the sub-block's boxes ([P, N]-tile fp32 dot). FULL: every row is
    in the chunk; else rows past its end are zeroed in x and B (the same sums on the chunk's rows either way)."""
    tok = start.to(tl.int64) + k0 + offs_k
    row = (start + k0).to(tl.int32)
    if FULL:
        cs = tl.load(dacs_ptr + h * stride_dt_h + tok)
        dt = tl.load(dt_ptr + h * stride_dt_h + tok)
        w = tl.exp(cs_last - cs) * dt
        xt = x_desc.load([row, col_x])
        bt = B_desc.load([row, col_b])
    else:
        mk = (k0 + offs_k) < length
        cs = tl.load(dacs_ptr + h * stride_dt_h + tok, mask=mk, other=0.0)
        dt = tl.load(dt_ptr + h * stride_dt_h + tok, mask=mk, other=0.0)
        w = tl.where(mk, tl.exp(cs_last - cs) * dt, 0.0)
        xt = tl.where(mk[:, None], x_desc.load([row, col_x]), 0.0)
        bt = tl.where(mk[:, None], B_desc.load([row, col_b]), 0.0)
    xw = (xt.to(tl.float32) * w[:, None]).to(bt.dtype)
    return tl.dot(tl.trans(xw), bt, input_precision=DOT_PREC)


@triton.jit
def ssd_state_tma_kernel(
    x_desc, B_desc, dt_ptr, dacs_ptr, bank_ptr, prev_ptr,
    seq_chunk_ptr, chunk_start_ptr, chunk_len_ptr, slot_ptr, has_init_ptr, ckpt_ptr,
    P, N, heads_per_group,
    stride_dt_h,
    stride_bank_s, stride_bank_h, stride_bank_p, stride_bank_n,
    stride_prev_c, stride_prev_h, stride_prev_p,
    BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    HAS_CKPT: tl.constexpr = False,
):
    """Grid (cdiv(P, BLOCK_P) * cdiv(N, BLOCK_N), H, n_seqs), as ssd_chunk_state_kernel; x is a [T, H·P]
    descriptor, B a [T, G·N] one."""
    pb, nb, h, s, g, offs_p, offs_n, mp, mn, mpn = _walk_tile(P, N, heads_per_group, BLOCK_P, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    col_x = (h * P + pb * BLOCK_P).to(tl.int32)
    col_b = (g * N + nb * BLOCK_N).to(tl.int32)

    slot, bank_tile, state = _bank_state(bank_ptr, slot_ptr, has_init_ptr, s, h, offs_p, offs_n, mpn, stride_bank_s,
                                         stride_bank_h, stride_bank_p, stride_bank_n)
    c0 = tl.load(seq_chunk_ptr + s)
    c1 = tl.load(seq_chunk_ptr + s + 1)
    for c in range(c0, c1):
        _record_entering(state, prev_ptr, bank_ptr, ckpt_ptr, c, h, offs_p, offs_n, mpn, stride_prev_c, stride_prev_h,
                         stride_prev_p, stride_bank_s, stride_bank_h, stride_bank_p, stride_bank_n, HAS_CKPT)
        start = tl.load(chunk_start_ptr + c)
        length = tl.load(chunk_len_ptr + c)
        cs_last = tl.load(dacs_ptr + h * stride_dt_h + start + length - 1)
        acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
        n_full = length - length % BLOCK_K
        for k0 in range(0, n_full, BLOCK_K):       # whole sub-blocks: no row masks, B stays a shared-memory tile
            acc += _xb_box(x_desc, B_desc, dt_ptr, dacs_ptr, h, start, length, k0, cs_last, col_x, col_b, offs_k,
                           stride_dt_h, DOT_PREC, True)
        if n_full < length:                        # the chunk's partial last sub-block
            acc += _xb_box(x_desc, B_desc, dt_ptr, dacs_ptr, h, start, length, n_full, cs_last, col_x, col_b, offs_k,
                           stride_dt_h, DOT_PREC, False)
        state = tl.exp(cs_last) * state + acc
    tl.store(bank_tile, state, mask=tl.where(slot >= 0, mpn, False))


def launch_ssd_state_tma(x, B, dt_p, dacs, ssm_bank, prev, table, slot, has_init, heads_per_group: int,
                         cfg: dict, dot_prec: str):
    """Launch ssd_state_tma_kernel over a validated batch (ssd.ssd_varlen dispatches here for state mode "tma").
    cfg: the launch rule's state entry (BLOCK_K, BLOCK_P, BLOCK_N, num_warps, num_stages, optional maxnreg)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    T, H, P = x.shape
    N = B.shape[2]
    bk, bp, bn = cfg["BLOCK_K"], cfg["BLOCK_P"], cfg["BLOCK_N"]
    if P % bp or N % bn:
        raise KernelInputError(f"ssd_varlen: state mode 'tma' needs BLOCK_P dividing P ({bp} vs {P}) and BLOCK_N "
                               f"dividing N ({bn} vs {N})")
    xd = TensorDescriptor.from_tensor(rows_2d(x, "x", "state mode 'tma'"), [bk, bp])
    bd = TensorDescriptor.from_tensor(rows_2d(B, "B", "state mode 'tma'"), [bk, bn])
    ck = table.ckpt_slot
    grid = ((P // bp) * (N // bn), H, slot.shape[0])
    return ssd_state_tma_kernel[grid](
        xd, bd, dt_p, dacs, ssm_bank, prev, table.seq_chunk_ptr, table.chunk_start, table.chunk_len, slot, has_init,
        ck if ck is not None else slot, P, N, heads_per_group, dt_p.stride(0), *ssm_bank.stride(),
        prev.stride(0), prev.stride(1), prev.stride(2), BLOCK_K=bk, BLOCK_P=bp, BLOCK_N=bn, DOT_PREC=dot_prec,
        HAS_CKPT=ck is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **reg_cap(cfg))
