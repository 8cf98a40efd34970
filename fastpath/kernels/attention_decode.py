"""Decode attention, one token per row, in ONE launch (mirrors oracle/attention.py: rope, then attention).

Split-KV ("flash decoding"): program (r, kv head, split) rotates the row's query heads of that KV head (RoPE by
rope.py's `rotate_half`, so rounded as the rope kernel rounds them), attends over keys
[split·CHUNK, min((split+1)·CHUNK, pos+1)) of cache[slot], and writes its partial (max, sum, unnormalised output)
to a workspace; the program that owns position pos first writes the row's new K (rotated) and V there. The last
program of a (row, KV head) to finish — an atomic counter, reset by that program — merges the partials in split
order, so the result does not depend on which program came last. CHUNK is keyed on the cache length only (never
on the batch), so a row's bits do not depend on the other rows. Slot -1: no cache read or write, output zero. No
host sync (graph-safe).

Why one launch: it replaces, per layer, the RoPE kernel, the K/V write kernel and an attention kernel whose one
program per query head walked the whole context serially (measured in docs/kernels.md, "Launch rules").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import INDEX_DTYPES, KernelInputError, check, dot_precision, mma, next_pow2, pdl_enter, pdl_meta
from .attention import check_qkv_cache
from .rope import inv_freq, rotate_half

OP = "attention_decode"
MAX_SPLITS = 64


@triton.jit
def attention_decode_kernel(
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, pos_ptr, inv_freq_ptr, part_ptr, cnt_ptr, o_ptr,
    scale, max_len, q_per_kv, D, half, n_split, Hkv,
    s_q_r, s_q_h, s_k_r, s_k_h, s_v_r, s_v_h, s_kc_s, s_kc_p, s_kc_h, s_vc_s, s_vc_p, s_vc_h, s_o_r, s_o_h,
    CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr, QC: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, ROPE: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (R, Hkv, n_split). Workspace per (row, KV head, split): acc [QC, BLOCK_D], then m [QC], l [QC]."""
    r = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    p = tl.load(pos_ptr + r).to(tl.int64)
    live = slot >= 0
    pdl_enter(PDL)
    d = tl.arange(0, BLOCK_D)
    md = d < D
    qi = tl.arange(0, BLOCK_Q)
    mq = qi < q_per_kv
    ang_pos = p.to(tl.float32)
    lo = sp * CHUNK
    hi = tl.where(live, tl.minimum(tl.minimum(lo + CHUNK, p + 1), max_len), lo)
    if live & (p >= lo) & (p < lo + CHUNK) & (p < max_len):      # this split owns pos: the new K/V go in first
        one = tl.arange(0, 1)
        kn = rotate_half(k_ptr, r * s_k_r + kvh * s_k_h + one[:, None], d, md[None, :], ang_pos, inv_freq_ptr, half,
                     ROPE)
        tl.store(kc_ptr + slot * s_kc_s + p * s_kc_p + kvh * s_kc_h + one[:, None] + d[None, :], kn,
                 mask=md[None, :])
        vn = tl.load(v_ptr + r * s_v_r + kvh * s_v_h + d, mask=md, other=0.0)
        tl.store(vc_ptr + slot * s_vc_s + p * s_vc_p + kvh * s_vc_h + d, vn, mask=md)
        tl.debug_barrier()                                         # visible to the whole program before the loop
    qh = kvh * q_per_kv + qi
    q = rotate_half(q_ptr, r * s_q_r + qh[:, None] * s_q_h, d, mq[:, None] & md[None, :], ang_pos, inv_freq_ptr, half,
                ROPE)
    m_i = tl.full([BLOCK_Q], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    kbase = kc_ptr + slot * s_kc_s + kvh * s_kc_h
    vbase = vc_ptr + slot * s_vc_s + kvh * s_vc_h
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mn = offs_n < hi
        k = tl.load(kbase + offs_n[:, None] * s_kc_p + d[None, :], mask=mn[:, None] & md[None, :], other=0.0)
        v = tl.load(vbase + offs_n[:, None] * s_vc_p + d[None, :], mask=mn[:, None] & md[None, :], other=0.0)
        sc = mma(q, tl.trans(k), DOT_PREC) * scale
        sc = tl.where(mn[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp(m_i - m_new)
        pr = tl.exp(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        acc = acc * alpha[:, None] + mma(pr.to(v.dtype), v, DOT_PREC)
        m_i = m_new
    # this split's partial: only the QC rows that are real query heads
    W = QC * BLOCK_D + 2 * QC
    pair = r * Hkv + kvh
    base = part_ptr + (pair * n_split + sp) * W
    mrow = qi < QC
    tl.store(base + qi[:, None] * BLOCK_D + d[None, :], acc, mask=mrow[:, None])
    tl.store(base + QC * BLOCK_D + qi, m_i, mask=mrow)
    tl.store(base + QC * BLOCK_D + QC + qi, l_i, mask=mrow)
    tl.debug_barrier()                                             # every thread's partial stored before the count
    done = tl.atomic_add(cnt_ptr + pair, 1, sem="acq_rel")
    if done == n_split - 1:                                        # the last split of (row, KV head): merge in order
        tl.store(cnt_ptr + pair, 0)
        c = tl.arange(0, QC)
        s0 = tl.arange(0, BLOCK_S)
        M = tl.full([QC], -1.0e30, dtype=tl.float32)
        L = tl.zeros([QC], dtype=tl.float32)
        O = tl.zeros([QC, BLOCK_D], dtype=tl.float32)
        n_live = tl.where(live, tl.minimum(p // CHUNK + 1, n_split), 1)
        pbase = part_ptr + pair * n_split * W
        for s_lo in range(0, n_live, BLOCK_S):
            s = s_lo + s0
            ms = s < n_live
            blk = pbase + s.to(tl.int64)[:, None] * W + QC * BLOCK_D
            m_s = tl.load(blk + c[None, :], mask=ms[:, None], other=-1.0e30, cache_modifier=".cg")      # [S, QC]
            l_s = tl.load(blk + QC + c[None, :], mask=ms[:, None], other=0.0, cache_modifier=".cg")
            a_s = tl.load(pbase + s.to(tl.int64)[:, None, None] * W + c[None, :, None] * BLOCK_D + d[None, None, :],
                          mask=ms[:, None, None], other=0.0, cache_modifier=".cg")                    # [S, QC, D]
            M_new = tl.maximum(M, tl.max(m_s, axis=0))
            w_s = tl.exp(m_s - M_new[None, :])
            alpha = tl.exp(M - M_new)
            L = L * alpha + tl.sum(l_s * w_s, axis=0)
            O = O * alpha[:, None] + tl.sum(a_s * w_s[:, :, None], axis=0)
            M = M_new
        o = O / tl.where(L > 0, L, 1.0)[:, None]
        o = tl.where(live, o, 0.0)
        oh = kvh * q_per_kv + c
        tl.store(o_ptr + r * s_o_r + oh[:, None] * s_o_h + d[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=(c < q_per_kv)[:, None] & md[None, :])


def attention_decode_rule(max_len: int, head_dim: int) -> dict:
    """Keyed on the cache shape only: 64-key steps, chunks of >= 64 keys and at most MAX_SPLITS splits."""
    chunk = max(64, next_pow2(triton.cdiv(max_len, MAX_SPLITS)))
    return dict(CHUNK=chunk, BLOCK_N=64 if head_dim <= 128 else 32, BLOCK_D=next_pow2(head_dim, 16), num_warps=4)


_COUNTERS: dict = {}


def _counters(k_cache: Tensor, n: int) -> Tensor:
    """Zeroed int32 arrival counters, one set per KV cache (so two engines on two streams never share one; each
    launch's merging programs reset theirs to 0 before exiting)."""
    key = (str(k_cache.device), k_cache.data_ptr(), n)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(n, dtype=torch.int32, device=k_cache.device)
    return _COUNTERS[key]


def attention_decode(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot: Tensor,
                     pos: Tensor, scale: float, out: Tensor | None = None, rope_dim: int = 0,
                     rope_theta: float = 10000.0) -> Tensor:
    """One token per row at position pos[r]: q [R,Hq,d], k/v [R,Hkv,d] (rope_dim > 0: not yet rotated; rotated
    here on their first rope_dim dims) -> writes K/V into cache[slot[r], pos[r]], attends -> [R,Hq,d]."""
    R, Hq, Hkv = check_qkv_cache(OP, q, k, v, k_cache, v_cache)
    D, dev = q.shape[2], q.device
    check(OP, "slot", slot, (R,), INDEX_DTYPES, dev)
    check(OP, "pos", pos, (R,), INDEX_DTYPES, dev)
    if rope_dim < 0 or rope_dim % 2 != 0 or rope_dim > D:
        raise KernelInputError(f"{OP}: rope_dim={rope_dim} must be even and <= head_dim={D}")
    if out is None:
        out = torch.empty_like(q)
    check(OP, "out", out, (R, Hq, D), (q.dtype,), dev)
    if out.stride(-1) != 1:
        raise KernelInputError(f"{OP}: the head dim of `out` must be contiguous")
    if R == 0:
        return out
    rule = attention_decode_rule(k_cache.shape[1], D)
    n_split = triton.cdiv(k_cache.shape[1], rule["CHUNK"])
    qpk = Hq // Hkv
    qc = next_pow2(qpk)
    part = torch.empty(R * Hkv * n_split * (qc * rule["BLOCK_D"] + 2 * qc), dtype=torch.float32, device=dev)
    freqs = inv_freq(max(rope_dim, 2), rope_theta, dev)
    attention_decode_kernel[(R, Hkv, n_split)](
        q, k, v, k_cache, v_cache, slot, pos, freqs, part, _counters(k_cache, R * Hkv), out,
        float(scale), k_cache.shape[1], qpk, D, rope_dim // 2, n_split, Hkv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3],
        *v_cache.stride()[:3], out.stride(0), out.stride(1),
        CHUNK=rule["CHUNK"], BLOCK_N=rule["BLOCK_N"], BLOCK_Q=max(16, qc), QC=qc, BLOCK_D=rule["BLOCK_D"],
        BLOCK_S=max(1, min(next_pow2(n_split), 16, 8192 // (qc * rule["BLOCK_D"]))), ROPE=rope_dim > 0,
        DOT_PREC=dot_precision(q.dtype), num_warps=rule["num_warps"], **pdl_meta(dev))
    return out
