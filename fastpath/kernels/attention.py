"""Causal GQA attention against the per-slot KV cache (mirrors oracle/attention.py: attention).

k_cache/v_cache [S, max_len, Hkv, d]: slot s holds its request's keys/values at their absolute positions.
Each call first writes the new K/V at positions start_pos[s] + i, then attends: a query at absolute
position p sees cached keys at positions <= p. Prefill (varlen, packed, continuation pieces allowed); RoPE is
applied beforehand (fastpath/kernels/rope.py). Decode (one token per row, RoPE and the K/V write included, split
over the context) is fastpath/kernels/attention_decode.py.

Split over the keys: a piece of <= SPLIT_MAX_QUERIES tokens whose context is longer than one chunk (a prefix-cache
hit's suffix, a short continuation) would otherwise get (1..4 query blocks) x heads programs, each walking the
whole context serially. Each of its query blocks gets one program per `chunk` keys instead, writing partials to
a workspace that attention_combine.py merges in split order. The plan is made on the host from each sequence's
own (start, length) and the cache length, so a sequence's bits do not depend on what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from .attention_combine import combine_partials
from ._common import (FLOAT_DTYPES, INDEX_DTYPES, KernelInputError, check, check_slots, dot_precision, mma, mma_acc,
                      host_ints, next_pow2, pdl_enter, pdl_meta, token_sequence_index)

OP_PREFILL = "attention_prefill_varlen"


@triton.jit
def kv_cache_write_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, tok_seq_ptr, cu_ptr, slot_ptr, start_ptr, max_len, D,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_kc_s, stride_kc_p, stride_kc_h, stride_vc_s, stride_vc_p, stride_vc_h,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (T, Hkv): token t's K/V go to cache[slot, start_pos + index in sequence]."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.load(tok_seq_ptr + t)
    pos = tl.load(start_ptr + s).to(tl.int64) + t - tl.load(cu_ptr + s).to(tl.int64)
    slot = tl.load(slot_ptr + s).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m = tl.where((slot >= 0) & (pos < max_len), d < D, False)
    kv = tl.load(k_ptr + t * stride_k_t + h * stride_k_h + d, mask=m, other=0.0)
    tl.store(kc_ptr + slot * stride_kc_s + pos * stride_kc_p + h * stride_kc_h + d, kv, mask=m)
    vv = tl.load(v_ptr + t * stride_v_t + h * stride_v_h + d, mask=m, other=0.0)
    tl.store(vc_ptr + slot * stride_vc_s + pos * stride_vc_p + h * stride_vc_h + d, vv, mask=m)


@triton.jit
def _scores(q, q2, k_ptrs, k2_ptrs, k_mask, k2_mask, BLOCK_D2: tl.constexpr, DOT_PREC: tl.constexpr):
    """q·kᵀ of one key block over the head dim's first chunk, then (BLOCK_D2 > 0) its second, accumulated."""
    k = tl.load(k_ptrs, mask=k_mask, other=0.0)
    sc = mma(q, tl.trans(k), DOT_PREC)
    if BLOCK_D2 > 0:
        k2 = tl.load(k2_ptrs, mask=k2_mask, other=0.0)
        sc = mma_acc(q2, tl.trans(k2), sc, DOT_PREC)
    return sc


@triton.jit
def _online_softmax(sc, m_i, l_i, EXP2: tl.constexpr = False):
    """One key block of the online softmax: the new running max and sum, the old output's factor, the weights.
    EXP2: the scores are in base-2 units (the scale carries log2 e), so the weights are powers of two."""
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    if EXP2:
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
    else:
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(sc - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), alpha, p


@triton.jit
def _weighted_values(acc, alpha, p, v_ptrs, v_mask, DOT_PREC: tl.constexpr):
    """The output chunk after one key block: acc·alpha + p·V (V's rows of this chunk of the head dim)."""
    v = tl.load(v_ptrs, mask=v_mask, other=0.0)
    return acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PREC)


@triton.jit
def attention_kernel(
    q_ptr, kc_ptr, vc_ptr, o_ptr, meta_ptr, cu_ptr, slot_ptr, start_ptr, acc_ptr, ml_ptr,
    scale, q_per_kv, D, Hq, n_blk, n_item, n_seq, chunk,
    stride_q_t, stride_q_h, stride_kc_s, stride_kc_p, stride_kc_h, stride_vc_s, stride_vc_p, stride_vc_h,
    stride_o_t, stride_o_h,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr,
    DOT_PREC: tl.constexpr, UNMASKED_FULL: tl.constexpr, PDL: tl.constexpr, EXP2: tl.constexpr = False,
):
    """Grid (n_items, Hq): flash-style online softmax of one query block over keys [lo, hi) of the slot's cache.
    meta (int32): blk_seq, blk_q0 [n_blk] | item_blk, item_split [n_item] | part_base, n_split [n_seq]. Split -1:
    every key up to the block's end, normalised output to o; split j >= 0: keys [j·chunk, (j+1)·chunk), the
    unnormalised partial (acc, max, sum) of each query row to row part_base + i·n_split + j of the workspace."""
    pdl_enter(PDL)
    it = tl.program_id(0)
    hq = tl.program_id(1).to(tl.int64)
    kvh = hq // q_per_kv
    b = tl.load(meta_ptr + 2 * n_blk + it)
    j = tl.load(meta_ptr + 2 * n_blk + n_item + it)
    s = tl.load(meta_ptr + b)
    q0 = tl.load(meta_ptr + n_blk + b).to(tl.int64)
    first = tl.load(cu_ptr + s).to(tl.int64)
    L = tl.load(cu_ptr + s + 1).to(tl.int64) - first
    slot = tl.load(slot_ptr + s).to(tl.int64)
    sp = tl.load(start_ptr + s).to(tl.int64)
    live = slot >= 0
    offs_m = q0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    md = d < D
    mm = offs_m < L
    qpos = sp + offs_m
    q_rows = q_ptr + (first + offs_m)[:, None] * stride_q_t + hq * stride_q_h
    q = tl.load(q_rows + d[None, :], mask=mm[:, None] & md[None, :], other=0.0)
    if BLOCK_D2 > 0:                                  # the head dim's second chunk, [BLOCK_D, BLOCK_D + BLOCK_D2)
        d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        md2 = d2 < D
        q2 = tl.load(q_rows + d2[None, :], mask=mm[:, None] & md2[None, :], other=0.0)
        acc2 = tl.zeros([BLOCK_M, BLOCK_D2], dtype=tl.float32)
    else:                                             # unused: one chunk holds the head dim
        d2, md2, q2, acc2 = d, md, q, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    kv_end = tl.where(live, sp + tl.minimum(L, q0 + BLOCK_M), 0)
    lo = tl.where(j >= 0, j.to(tl.int64) * chunk, 0)
    hi = tl.where(j >= 0, tl.minimum(lo + chunk, kv_end), kv_end)
    kbase = kc_ptr + slot * stride_kc_s + kvh * stride_kc_h
    vbase = vc_ptr + slot * stride_vc_s + kvh * stride_vc_h
    # Key blocks wholly inside [lo, hi) and at or before the block's first query position are visible to every row:
    # no key or causal mask there. The blocks run in the same order either way, and both loops scale the masked
    # product (the compiler then fuses the scale into `sc - max` alike in both): same sums, same bits.
    n_full = tl.where(UNMASKED_FULL, (tl.minimum(hi, sp + q0 + 1) - lo) // BLOCK_N, 0)
    n_full = tl.maximum(n_full, 0)
    for i in range(0, n_full):
        offs_n = lo + i * BLOCK_N + tl.arange(0, BLOCK_N)
        krow, vrow = kbase + offs_n[:, None] * stride_kc_p, vbase + offs_n[:, None] * stride_vc_p
        sc = _scores(q, q2, krow + d[None, :], krow + d2[None, :], md[None, :], md2[None, :], BLOCK_D2,
                     DOT_PREC) * scale
        m_i, l_i, alpha, p = _online_softmax(sc, m_i, l_i, EXP2)
        acc = _weighted_values(acc, alpha, p, vrow + d[None, :], md[None, :], DOT_PREC)
        if BLOCK_D2 > 0:
            acc2 = _weighted_values(acc2, alpha, p, vrow + d2[None, :], md2[None, :], DOT_PREC)
    for n0 in range(lo + n_full * BLOCK_N, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mn = offs_n < hi
        krow, vrow = kbase + offs_n[:, None] * stride_kc_p, vbase + offs_n[:, None] * stride_vc_p
        vis = (offs_n[None, :] <= qpos[:, None]) & mn[None, :]
        sc = _scores(q, q2, krow + d[None, :], krow + d2[None, :], mn[:, None] & md[None, :],
                     mn[:, None] & md2[None, :], BLOCK_D2, DOT_PREC)
        sc = tl.where(vis, sc, float("-inf")) * scale
        m_i, l_i, alpha, p = _online_softmax(sc, m_i, l_i, EXP2)
        acc = _weighted_values(acc, alpha, p, vrow + d[None, :], mn[:, None] & md[None, :], DOT_PREC)
        if BLOCK_D2 > 0:
            acc2 = _weighted_values(acc2, alpha, p, vrow + d2[None, :], mn[:, None] & md2[None, :], DOT_PREC)
    if j < 0:
        norm = tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_rows = o_ptr + (first + offs_m)[:, None] * stride_o_t + hq * stride_o_h
        tl.store(o_rows + d[None, :], tl.where(live, acc / norm, 0.0).to(o_ptr.dtype.element_ty),
                 mask=mm[:, None] & md[None, :])
        if BLOCK_D2 > 0:
            tl.store(o_rows + d2[None, :], tl.where(live, acc2 / norm, 0.0).to(o_ptr.dtype.element_ty),
                     mask=mm[:, None] & md2[None, :])
    else:
        base = tl.load(meta_ptr + 2 * n_blk + 2 * n_item + s).to(tl.int64)
        nsp = tl.load(meta_ptr + 2 * n_blk + 2 * n_item + n_seq + s).to(tl.int64)
        row = (base + offs_m * nsp + j) * Hq + hq
        tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=mm[:, None] & md[None, :])
        if BLOCK_D2 > 0:
            tl.store(acc_ptr + row[:, None] * D + d2[None, :], acc2, mask=mm[:, None] & md2[None, :])
        if EXP2:                                       # the merge reads the max in natural units: × ln 2
            m_i = m_i * 0.6931471805599453
        tl.store(ml_ptr + 2 * row, m_i, mask=mm)
        tl.store(ml_ptr + 2 * row + 1, l_i, mask=mm)


def head_dim_chunks(head_dim: int, split: bool = True) -> tuple[int, int]:
    """(first, second) chunk widths the attention kernel's dots take the head dim in: the largest power of two
    <= head_dim (>= 16), then the rest rounded up to a power of two (0: none), so a head dim of 80 is 64 + 16 wide
    instead of 128 (37.5% of the padded multiply-adds were zeros); split False: one chunk, the next power of two."""
    if not split or head_dim <= 16:
        return next_pow2(head_dim, 16), 0
    first = 1 << (head_dim.bit_length() - 1)
    return first, (next_pow2(head_dim - first, 16) if head_dim > first else 0)


def attention_launch_rule(head_dim: int, elem_bytes: int = 2) -> dict:
    """128 query rows and 128 keys per step at 8 warps for 2-byte inputs with head dims up to 128; 64 × 64 at 4 warps
    otherwise (64 × 32 above 128; fp32 at 128 × 128 needs 264.5 KiB of shared memory at head dim 80, past sm_90's 227
    KiB); key blocks every row sees run without masks (UNMASKED_FULL); the head dim in two power-of-two chunks (BLOCK_DQ
    + BLOCK_D2, `head_dim_chunks`; BLOCK_D: the K/V write's tile); num_stages None: Triton's default; fp_fusion (on; a
    bench key): the compiler may fuse a multiply and an add into one FMA; COMBINE_H: heads per program of the split
    merge (1 with the big blocks, timed faster in bf16; None: all in one program, fewer programs for the CPU
    interpreter's fp32; the merge's bits do not depend on it); EXP2 (on; a bench key): base-2 exponentials with log2 e
    folded into the scale (tl.exp2's flush-to-zero form needs no subnormal fix-up: 594 SASS instructions a key block
    instead of 854; docs/performance.md)."""
    dq, d2 = head_dim_chunks(head_dim)
    big = head_dim <= 128 and elem_bytes <= 2
    return dict(BLOCK_M=128 if big else 64, BLOCK_N=128 if big else 64 if head_dim <= 128 else 32,
                BLOCK_D=next_pow2(head_dim, 16), BLOCK_DQ=dq, BLOCK_D2=d2, num_warps=8 if big else 4,
                UNMASKED_FULL=True, num_stages=None, fp_fusion=True, COMBINE_H=1 if big else None, EXP2=True)


SPLIT_MAX_QUERIES = 256     # a piece this short gets at most 2–4 query blocks: too few programs to fill the GPU
SPLIT_MAX_SPLITS = 16
SPLIT_MIN_KEYS = 1024


def attention_split_rule(max_len: int) -> int:
    """Keys per split (keyed on the cache length only, like the decode kernel's): >= SPLIT_MIN_KEYS and at most
    SPLIT_MAX_SPLITS splits of a full cache. A piece splits iff it has <= SPLIT_MAX_QUERIES tokens, a live slot
    and its context end start_pos + length exceeds one chunk — its own shape only, never the batch's."""
    return max(SPLIT_MIN_KEYS, next_pow2(triton.cdiv(max_len, SPLIT_MAX_SPLITS)))


def split_plan(cu: list[int], sp: list[int], sl: list[int], block_m: int, chunk: int) -> dict:
    """Host plan of one call: query blocks (blk_seq, blk_q0), work items (item_blk, item_split: -1 = the whole key
    range, else split j), per sequence the workspace base and split count, and the merge rows (t, base, n)."""
    blk_seq, blk_q0, item_blk, item_split, rows = [], [], [], [], []
    n_seq = len(cu) - 1
    base, nsp, used = [0] * n_seq, [0] * n_seq, 0
    for s in range(n_seq):
        L = cu[s + 1] - cu[s]
        end = sp[s] + L
        split = sl[s] >= 0 and 0 < L <= SPLIT_MAX_QUERIES and end > chunk
        if split:
            base[s], nsp[s] = used, triton.cdiv(end, chunk)
            used += L * nsp[s]
            rows += [v for i in range(L) for v in (cu[s] + i, base[s] + i * nsp[s], triton.cdiv(sp[s] + i + 1, chunk))]
        for q0 in range(0, L, block_m):
            blk_seq.append(s)
            blk_q0.append(q0)
            n = triton.cdiv(sp[s] + min(L, q0 + block_m), chunk) if split else 0
            for j in (range(n) if split else (-1,)):
                item_blk.append(len(blk_seq) - 1)
                item_split.append(j)
    return dict(meta=blk_seq + blk_q0 + item_blk + item_split + base + nsp, n_blk=len(blk_seq),
                n_item=len(item_blk), part_rows=used, rows=rows)


def check_qkv_cache(op: str, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor,
                    v_cache: Tensor) -> tuple[int, int, int]:
    """Shapes, dtypes, GQA divisibility and contiguous head dims of q, k, v and the caches -> (T, Hq, Hkv)."""
    check(op, "q", q, (None, None, None), FLOAT_DTYPES)
    T, Hq, D = q.shape
    check(op, "k", k, (T, None, D), (q.dtype,), q.device)
    Hkv = k.shape[1]
    if Hkv < 1 or Hq % Hkv != 0:
        raise KernelInputError(f"{op}: n_heads={Hq} is not divisible by n_kv_heads={Hkv}")
    check(op, "v", v, (T, Hkv, D), (q.dtype,), q.device)
    check(op, "k_cache", k_cache, (None, None, Hkv, D), (q.dtype,), q.device)
    check(op, "v_cache", v_cache, tuple(k_cache.shape), (q.dtype,), q.device)
    for name, t in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise KernelInputError(f"{op}: the head dim of `{name}` must be contiguous")
    return T, Hq, Hkv


@dataclass(frozen=True)
class AttentionPlan:
    """One prefill step's attention metadata, built once from the host lists and shared by every attention layer
    of the step: the checked (cu_seqlens, slot, start_pos), the split plan on the device (one pinned copy), and the
    split partials' workspace (layers run one after another on one stream, so they can share it)."""
    cu: tuple[int, ...]
    slot: tuple[int, ...]
    start: tuple[int, ...]
    n_slots: int
    max_len: int
    n_heads: int
    head_dim: int
    chunk: int
    rule: dict
    n_blk: int
    n_item: int
    n_rows: int
    meta: Tensor           # int32: the split plan's blocks and items | the merge rows (t, base, n)
    acc: Tensor
    ml: Tensor
    dtype: torch.dtype     # q's and the caches' (the launch rule's tiles depend on its size)

    @property
    def n_seq(self) -> int:
        return len(self.cu) - 1


def attention_prefill_plan(cu_seqlens, slot, start_pos, n_slots: int, max_len: int, n_heads: int, head_dim: int,
                           device: torch.device | str, split_keys: int | None = None,
                           dtype: torch.dtype = torch.bfloat16) -> AttentionPlan:
    """The AttentionPlan of a packed prefill call from its host lists (or small tensors, read back once):
    cu_seqlens rising from 0, slots -1 or distinct inside the bank of n_slots, every sequence inside max_len;
    dtype: q's and the caches' (the call's must equal it)."""
    op, dev = OP_PREFILL, torch.device(device)
    cu, sl, sp = (host_ints(op, n, t) for n, t in (("cu_seqlens", cu_seqlens), ("slot", slot),
                                                   ("start_pos", start_pos)))
    n_seq = len(cu) - 1
    if (len(sl), len(sp)) != (n_seq, n_seq):
        raise KernelInputError(f"{op}: `slot` and `start_pos` have {len(sl)} and {len(sp)} entries for "
                               f"{n_seq} sequences (cu_seqlens)")
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise KernelInputError(f"{op}: `cu_seqlens` must rise from 0 to T={cu[-1] if cu else None}")
    check_slots(op, sl, n_slots)
    for s in range(n_seq):
        if sp[s] < 0 or sp[s] + cu[s + 1] - cu[s] > max_len:
            raise KernelInputError(f"{op}: sequence {s} (`start_pos`={sp[s]}, length {cu[s + 1] - cu[s]}) "
                                   f"does not fit the cache's max_len {max_len}")
    if split_keys is not None and split_keys < 1:
        raise KernelInputError(f"{op}: `split_keys`={split_keys} must be >= 1")
    rule = attention_launch_rule(head_dim, dtype.itemsize)
    chunk = split_keys or attention_split_rule(max_len)
    plan = split_plan(cu, sp, sl, rule["BLOCK_M"], chunk)
    host = torch.tensor(plan["meta"] + plan["rows"], dtype=torch.int32)
    meta = (host.pin_memory() if dev.type == "cuda" else host).to(dev, non_blocking=True)
    acc = torch.empty(max(plan["part_rows"], 1) * n_heads * head_dim, dtype=torch.float32, device=dev)
    ml = torch.empty(max(plan["part_rows"], 1) * n_heads * 2, dtype=torch.float32, device=dev)
    return AttentionPlan(tuple(cu), tuple(sl), tuple(sp), n_slots, max_len, n_heads, head_dim, chunk, rule,
                         plan["n_blk"], plan["n_item"], len(plan["rows"]) // 3, meta, acc, ml, dtype)


def _launch(q, k, v, k_cache, v_cache, out, tok_seq, cu, slot, start, plan: AttentionPlan, scale) -> None:
    """Write K/V, attend (items of the plan), merge the split rows."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    pm = pdl_meta(q.device)
    rule, meta = plan.rule, plan.meta
    kv_cache_write_kernel[(T, Hkv)](
        k, v, k_cache, v_cache, tok_seq, cu, slot, start, k_cache.shape[1], D,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        BLOCK_D=rule["BLOCK_D"], num_warps=1, **pm)
    attention_kernel[(plan.n_item, Hq)](
        q, k_cache, v_cache, out, meta, cu, slot, start, plan.acc, plan.ml,
        float(scale) * (1.4426950408889634 if rule["EXP2"] else 1.0), Hq // Hkv, D, Hq,     # × log2 e
        plan.n_blk, plan.n_item, cu.shape[0] - 1, plan.chunk,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], out.stride(0), out.stride(1),
        BLOCK_M=rule["BLOCK_M"], BLOCK_N=rule["BLOCK_N"], BLOCK_D=rule["BLOCK_DQ"], BLOCK_D2=rule["BLOCK_D2"],
        DOT_PREC=dot_precision(q.dtype), UNMASKED_FULL=rule["UNMASKED_FULL"], EXP2=rule["EXP2"],
        num_warps=rule["num_warps"],
        **({} if rule["num_stages"] is None else {"num_stages": rule["num_stages"]}),
        **({} if rule["fp_fusion"] else {"enable_fp_fusion": False}), **pm)
    if plan.n_rows:
        combine_partials(plan.acc, plan.ml, out, meta[2 * plan.n_blk + 2 * plan.n_item + 2 * plan.n_seq:],
                         plan.n_rows, rule["COMBINE_H"])


def attention_prefill_varlen(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                             cu_seqlens: Tensor, slot: Tensor, start_pos: Tensor, scale: float,
                             out: Tensor | None = None, host: tuple | None = None,
                             split_keys: int | None = None, tok_seq: Tensor | None = None,
                             plan: AttentionPlan | None = None) -> Tensor:
    """Packed q [T,Hq,d], k/v [T,Hkv,d] of sequences at start_pos: write K/V into the cache, attend -> [T,Hq,d].
    host: (cu_seqlens, slot, start_pos) as Python lists equal to the tensors (the engine has them: no host sync);
    split_keys: keys per split instead of attention_split_rule's (tests force the split at small shapes);
    tok_seq: token_sequence_index(cu_seqlens, T), when the caller built it once for every layer of a step;
    plan: attention_prefill_plan(...) of these lists, built once for every layer of a step (then `host` and
    `split_keys` are not needed; the plan must fit this call's shapes and cache)."""
    op = OP_PREFILL
    T, Hq, Hkv = check_qkv_cache(op, q, k, v, k_cache, v_cache)
    dev = q.device
    check(op, "cu_seqlens", cu_seqlens, (None,), INDEX_DTYPES, dev)
    n_seq = cu_seqlens.shape[0] - 1
    check(op, "slot", slot, (n_seq,), INDEX_DTYPES, dev)
    check(op, "start_pos", start_pos, (n_seq,), INDEX_DTYPES, dev)
    if plan is None:
        if host is not None and tuple(map(len, host)) != (n_seq + 1, n_seq, n_seq):
            raise KernelInputError(f"{op}: `host` lists have lengths {tuple(map(len, host))}, expected "
                                   f"{(n_seq + 1, n_seq, n_seq)} (cu_seqlens, slot, start_pos)")
        plan = attention_prefill_plan(*(host if host is not None else (cu_seqlens, slot, start_pos)),
                                      k_cache.shape[0], k_cache.shape[1], Hq, q.shape[2], dev, split_keys, q.dtype)
    else:
        got = (plan.n_seq, plan.n_slots, plan.max_len, plan.n_heads, plan.head_dim, plan.meta.device, plan.dtype)
        want = (n_seq, k_cache.shape[0], k_cache.shape[1], Hq, q.shape[2], dev, q.dtype)
        if got != want or (split_keys is not None and split_keys != plan.chunk):
            raise KernelInputError(f"{op}: `plan` was built for (sequences, slots, max_len, heads, head_dim, "
                                   f"device, dtype) {got}, this call has {want}")
    if plan.cu[-1] != T:
        raise KernelInputError(f"{op}: `cu_seqlens` must rise from 0 to T={T}")
    if out is None:
        out = torch.empty_like(q)
    check(op, "out", out, tuple(q.shape), (q.dtype,), dev)
    if out.stride(-1) != 1:
        raise KernelInputError(f"{op}: the head dim of `out` must be contiguous")
    if T == 0:
        return out
    if tok_seq is None:
        tok_seq = token_sequence_index(cu_seqlens, T)
    check(op, "tok_seq", tok_seq, (T,), INDEX_DTYPES, dev)
    _launch(q, k, v, k_cache, v_cache, out, tok_seq, cu_seqlens, slot, start_pos, plan, scale)
    return out
