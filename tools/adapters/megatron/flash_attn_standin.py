"""A stand-in for the two flash-attn functions Megatron's dynamic batching calls, written from flash-attn's
public API (docstrings of `flash_attn_varlen_func` / `flash_attn_with_kvcache`, flash-attn 2.x) in plain PyTorch.

flash-attn cannot be built or installed on the machines this project runs on (DESIGN §14 allows a stand-in for a
kernel an engine imports from such a package): every report of the Megatron adapter says that attention ran on
this stand-in. Semantics kept from the API: paged KV through `block_table` ([num_blocks, page_size, Hkv, d]
caches), GQA (Hkv divides H), `causal=True` aligned to the bottom-right corner (query i of a sequence with Lq
queries and Lk keys sees keys j <= i + Lk - Lq), softmax in fp32, output in q's dtype. Anything else the API
offers (dropout, sliding windows, softcap, ALiBi, returning probabilities beyond the LSE) raises
NotImplementedError naming the argument, so a config that needs it is refused, never silently approximated.
"""
from __future__ import annotations

import sys
import types

import torch

__version__ = "2.8.3+hybridqual.standin"    # Megatron's version checks read flash_attn.__version__
STANDIN = "hybridqual flash-attn stand-in (tools/adapters/megatron/flash_attn_standin.py, PyTorch)"


def _refuse(**given) -> None:
    for name, (value, ok) in given.items():
        if value != ok:
            raise NotImplementedError(f"flash-attn stand-in: {name}={value!r} is not supported (only {ok!r})")


def _keys(cache: torch.Tensor, block_table: torch.Tensor | None, b: int, start: int, length: int) -> torch.Tensor:
    """Keys (or values) [length, Hkv, d] of sequence b: from the paged cache through its block-table row, or the
    packed tensor's rows start..start+length."""
    if block_table is None:
        return cache[start:start + length]
    page = cache.shape[1]
    n_pages = (length + page - 1) // page
    blocks = block_table[b, :n_pages].long()
    return cache[blocks].reshape(n_pages * page, *cache.shape[2:])[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    """q [Lq, H, d], k/v [Lk, Hkv, d] -> (out [Lq, H, d] in q.dtype, lse [H, Lq] fp32)."""
    lq, h, _ = q.shape
    lk, hkv, _ = k.shape
    if h % hkv:
        raise ValueError(f"flash-attn stand-in: nheads {h} is not a multiple of nheads_k {hkv}")
    rep = h // hkv
    qf = q.float().transpose(0, 1)                                       # [H, Lq, d]
    kf = k.float().repeat_interleave(rep, dim=1).transpose(0, 1)         # [H, Lk, d]
    vf = v.float().repeat_interleave(rep, dim=1).transpose(0, 1)
    s = torch.matmul(qf, kf.transpose(1, 2)) * scale                     # [H, Lq, Lk]
    if causal:
        i = torch.arange(lq, device=q.device)[:, None]
        j = torch.arange(lk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (lk - lq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                     # [H, Lq]
    p = torch.exp(s - lse[..., None])
    out = torch.matmul(p, vf).transpose(0, 1).to(q.dtype)                # [Lq, H, d]
    return out, lse


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """Variable-length attention: q [total_q, H, d]; k/v [total_k, Hkv, d], or paged [blocks, page, Hkv, d] with
    `block_table` [batch, max_pages]; cu_seqlens_* [batch + 1] int32. Returns out [total_q, H, d] (and, with
    return_attn_probs, (out, softmax_lse [H, total_q], None))."""
    _refuse(dropout_p=(dropout_p, 0.0), window_size=(tuple(window_size), (-1, -1)), softcap=(softcap, 0.0),
            alibi_slopes=(alibi_slopes, None))
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if lq == 0:
            continue
        kb = _keys(k, block_table, b, ck[b], lk)
        vb = _keys(v, block_table, b, ck[b], lk)
        out[cq[b]:cq[b + 1]], lse[:, cq[b]:cq[b + 1]] = _attend(q[cq[b]:cq[b + 1]], kb, vb, scale, causal)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Decode against a (paged) KV cache that already holds the new keys: q [B, Lq, H, d]; k_cache/v_cache
    [blocks, page, Hkv, d] with block_table [B, max_pages] (or [B, Lk, Hkv, d] without); cache_seqlens [B].
    Returns out [B, Lq, H, d] (and softmax_lse [B, H, Lq] with return_softmax_lse)."""
    _refuse(k=(k, None), v=(v, None), rotary_cos=(rotary_cos, None), cache_batch_idx=(cache_batch_idx, None),
            cache_leftpad=(cache_leftpad, None), window_size=(tuple(window_size), (-1, -1)),
            softcap=(softcap, 0.0), alibi_slopes=(alibi_slopes, None))
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    if q.is_cuda and torch.cuda.is_current_stream_capturing():       # megatron-graphs: no host sync in a capture
        out, lse = _attend_static(q, k_cache, v_cache, block_table, cache_seqlens, scale, causal)
        return (out, lse) if return_softmax_lse else out
    lens = cache_seqlens.tolist() if torch.is_tensor(cache_seqlens) else [int(cache_seqlens)] * q.shape[0]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
    for b, lk in enumerate(lens):
        if block_table is None:
            kb, vb = k_cache[b, :lk], v_cache[b, :lk]
        else:
            kb, vb = _keys(k_cache, block_table, b, 0, lk), _keys(v_cache, block_table, b, 0, lk)
        out[b], lse[b] = _attend(q[b], kb, vb, scale, causal)
    return (out, lse) if return_softmax_lse else out


def _attend_static(q, k_cache, v_cache, block_table, cache_seqlens, scale: float, causal: bool):
    """The same attention with fixed shapes (every page of the block table gathered, keys past each sequence's
    length masked), so a CUDA graph can capture it: no lengths read on the host. Rows of zero length (graph
    padding) give zeros. Used only while a stream is capturing; the eager path above is the reference."""
    b, lq, h, _ = q.shape
    if block_table is None:
        kb, vb = k_cache[:b], v_cache[:b]
    else:
        kb, vb = k_cache[block_table.long()].flatten(1, 2), v_cache[block_table.long()].flatten(1, 2)
    rep = h // kb.shape[2]
    kf = kb.float().repeat_interleave(rep, dim=2).transpose(1, 2)       # [B, H, Lk, d]
    vf = vb.float().repeat_interleave(rep, dim=2).transpose(1, 2)
    s = torch.matmul(q.float().transpose(1, 2), kf.transpose(2, 3)) * scale      # [B, H, Lq, Lk]
    lens = torch.as_tensor(cache_seqlens, device=q.device).view(b, 1, 1, 1)
    j = torch.arange(kf.shape[2], device=q.device).view(1, 1, 1, -1)
    ok = j < lens
    if causal:
        ok = ok & (j <= torch.arange(lq, device=q.device).view(1, 1, -1, 1) + lens - lq)
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                      # [B, H, Lq]
    p = torch.where(ok, torch.exp(s - lse[..., None]), torch.zeros_like(s))
    return torch.matmul(p, vf).transpose(1, 2).to(q.dtype), lse


def install() -> types.ModuleType:
    """Register this module as `flash_attn` (before Megatron is imported) unless a real flash-attn already is."""
    mod = sys.modules.get("flash_attn")
    if mod is not None and getattr(mod, "STANDIN", None) is None:
        raise RuntimeError("a real flash_attn is already imported; the Megatron adapter uses the stand-in only "
                           "(docs/megatron.md)")
    me = sys.modules[__name__]
    sys.modules["flash_attn"] = me
    return me
