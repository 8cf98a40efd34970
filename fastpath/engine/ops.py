"""The engine's kernel boundary: every op the batched model calls, with the Triton kernels' signatures.

Each op takes `backend` ("triton" | "torch"; FastOptions.backend, passed by the model — never a module global):
"triton" (the default, and what every engine test of tokens runs) calls fastpath/kernels; "torch" calls the
plain-torch stand-ins of torch_ops.py (same contract, used to cross-check and for scheduler-only tests that must
be fast in the interpreter-bound CPU tier).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from fastpath.kernels.attention import attention_prefill_plan  # noqa: F401  (re-exported: the model's step plan)
from fastpath.kernels.attention import attention_prefill_varlen as _attn_prefill
from fastpath.kernels.attention_decode import attention_decode as _attn_decode
from fastpath.kernels.conv1d import causal_conv1d_varlen as _conv_varlen, conv1d_step as _conv_step
from fastpath.kernels.conv1d_steps import conv1d_steps as _conv_steps
from fastpath.kernels.gated_norm import rms_norm_gated as _rms_norm_gated
from fastpath.kernels.rope import rope as _rope
from fastpath.kernels.sampling import greedy_sample as _greedy_sample
from fastpath.kernels.ssd import ssd_chunk_table as _ssd_chunk_table, ssd_varlen as _ssd_varlen
from fastpath.kernels.ssm_step import ssm_step as _ssm_step
from fastpath.kernels.ssm_steps import ssm_steps as _ssm_steps
from fastpath.options import BACKENDS  # noqa: F401  (re-exported: the backend names)

from . import torch_ops


def _ints(t) -> list[int]:
    return [int(v) for v in (t.tolist() if isinstance(t, Tensor) else t)]


def _dt(dt: Tensor, dt_bias: Tensor | None, limit: tuple[float, float]) -> Tensor:
    d = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    d = F.softplus(d)
    lo, hi = limit
    return torch.clamp(d, lo, hi) if (lo > 0.0 or hi != math.inf) else d


def _into(out: Tensor | None, y: Tensor) -> Tensor:
    if out is None:
        return y
    out.copy_(y)
    return out


def conv1d_step(x, weight, bias, conv_bank, slot, silu=True, out=None, backend="triton", snap=None):
    """Decode conv (see fastpath.kernels.conv1d.conv1d_step); snap: live rows' new windows also stored there."""
    if backend == "triton":
        return _conv_step(x, weight, bias, conv_bank, slot, silu=silu, out=out, snap=snap)
    y = torch_ops.conv_step(x, weight, bias, conv_bank, slot, snap=snap)
    return _into(out, F.silu(y.float()).to(x.dtype) if silu else y)


def conv1d_steps(x, weight, bias, conv_bank, slot, silu=True, out=None, backend="triton", snap=None):
    """W decode convs per row in one launch (see fastpath.kernels.conv1d_steps.conv1d_steps): x [W,R,D], slot
    [W,R], snap [W-1,R,D,K-1]; the torch backend runs conv1d_step position by position."""
    if backend == "triton":
        return _conv_steps(x, weight, bias, conv_bank, slot, silu=silu, out=out, snap=snap)
    if out is None:
        out = torch.empty_like(x)
    for j in range(x.shape[0]):
        conv1d_step(x[j], weight, bias, conv_bank, slot[j], silu=silu, out=out[j], backend=backend,
                    snap=snap[j] if snap is not None and j < x.shape[0] - 1 else None)
    return out


def causal_conv1d_varlen(x, weight, bias, conv_bank, cu_seqlens, slot, has_initial_state, silu=True, out=None,
                         validate=True, backend="triton", tok_seq=None):
    """Prefill conv (see fastpath.kernels.conv1d.causal_conv1d_varlen)."""
    if backend == "triton":
        return _conv_varlen(x, weight, bias, conv_bank, cu_seqlens, slot, has_initial_state, silu=silu, out=out,
                            validate=validate, tok_seq=tok_seq)
    y = torch_ops.conv_varlen(x, weight, bias, conv_bank, _ints(slot), _ints(cu_seqlens),
                              [bool(v) for v in _ints(has_initial_state)])
    return _into(out, F.silu(y.float()).to(x.dtype) if silu else y)


def ssm_step(ssm_bank, x, dt, A, B, C, D, dt_bias, slot, z=None, dt_limit=(0.0, math.inf), out=None,
             backend="triton", snap=None):
    """Decode state update (see fastpath.kernels.ssm_step.ssm_step); snap: live rows' new states also stored."""
    if backend == "triton":
        return _ssm_step(ssm_bank, x, dt, A, B, C, D, dt_bias, slot, z=z, dt_limit=dt_limit, out=out, snap=snap)
    y = torch_ops.ssm_step(x, _dt(dt, dt_bias, dt_limit), A, B, C, D, ssm_bank, slot, snap=snap)
    return _into(out, y)


def ssm_steps(ssm_bank, x, dt, A, B, C, D, dt_bias, slot, dt_limit=(0.0, math.inf), out=None, backend="triton",
              snap=None):
    """W decode state updates per row in one launch (see fastpath.kernels.ssm_steps.ssm_steps): x [W,R,H,P], slot
    [W,R], snap [W-1,R,H,P,N]; the torch backend runs ssm_step position by position."""
    if backend == "triton":
        return _ssm_steps(ssm_bank, x, dt, A, B, C, D, dt_bias, slot, dt_limit=dt_limit, out=out, snap=snap)
    if out is None:
        out = torch.empty_like(x)
    for j in range(x.shape[0]):
        ssm_step(ssm_bank, x[j], dt[j], A, B[j], C[j], D, dt_bias, slot[j], dt_limit=dt_limit, out=out[j],
                 backend=backend, snap=snap[j] if snap is not None and j < x.shape[0] - 1 else None)
    return out


def ssd_chunk_table(cu_seqlens, start_pos, chunk_size, device, slot=None, n_slots=None, backend="triton",
                    checkpoints=None):
    """Chunk table shared by the Mamba layers of one step (None on the torch backend); `checkpoints`: states at
    chunk starts inside a piece also written to other bank slots (see fastpath.kernels.ssd.ssd_chunk_table)."""
    if backend != "triton":
        return None
    return _ssd_chunk_table(cu_seqlens, start_pos, chunk_size, device, slot=slot, n_slots=n_slots,
                            checkpoints=checkpoints)


def ssd_varlen(x, dt, A, B, C, D, dt_bias, ssm_bank, cu_seqlens, slot, start_pos, has_initial_state, chunk_size,
               dt_limit=(0.0, math.inf), out=None, table=None, backend="triton", checkpoints=()):
    """Varlen chunked SSD prefill (see fastpath.kernels.ssd.ssd_varlen). `checkpoints` (sequence, position, bank
    slot): interior chunk-start states also written to those slots; on Triton they must be in `table`."""
    if backend == "triton":
        if checkpoints and (table is None or table.ckpt_slot is None):
            raise ValueError("ssd_varlen: checkpoints need a chunk table built with them (ssd_chunk_table)")
        return _ssd_varlen(x, dt, A, B, C, D, dt_bias, ssm_bank, cu_seqlens, slot, start_pos, has_initial_state,
                           chunk_size, dt_limit=dt_limit, out=out, table=table)
    y = torch_ops.ssd_varlen(x, _dt(dt, dt_bias, dt_limit), A, B, C, D, ssm_bank, _ints(slot), _ints(cu_seqlens),
                             _ints(start_pos), [bool(v) for v in _ints(has_initial_state)], chunk_size,
                             checkpoints)
    return _into(out, y)


def rms_norm_gated(y, z, weight, n_groups, eps, out=None, backend="triton"):
    """Grouped gated RMSNorm; z None = plain RMSNorm (see fastpath.kernels.gated_norm)."""
    if backend == "triton":
        return _rms_norm_gated(y, z, weight, n_groups, eps, out=out)
    if z is None:
        g = y.float().reshape(*y.shape[:-1], n_groups, y.shape[-1] // n_groups)
        g = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).reshape(y.shape)
        return _into(out, (weight.float() * g).to(y.dtype))
    return _into(out, torch_ops.rms_norm_gated(y, z, weight, n_groups, eps))


def rope(x, positions, rot_dim, theta, out=None, backend="triton"):
    """Rotate-half RoPE on the first rot_dim dims (see fastpath.kernels.rope)."""
    if backend == "triton":
        return _rope(x, positions, rot_dim, theta, out=out)
    inv = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64, device=x.device).float() / rot_dim))
    ang = positions.float()[:, None] * inv[None]
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    xr = x[..., :rot_dim].float()
    half = rot_dim // 2
    rot = torch.cat([-xr[..., half:], xr[..., :half]], -1)
    return _into(out, torch.cat([(xr * cos + rot * sin).to(x.dtype), x[..., rot_dim:]], -1))


def attention_decode(q, k, v, k_cache, v_cache, slot, pos, scale, out=None, rope_dim=0, rope_theta=10000.0,
                     backend="triton"):
    """One token per row against the slot's KV cache; rope_dim > 0: q and k rotated first (see
    fastpath.kernels.attention_decode)."""
    if backend == "triton":
        return _attn_decode(q, k, v, k_cache, v_cache, slot, pos, scale, out=out, rope_dim=rope_dim,
                            rope_theta=rope_theta)
    if rope_dim:
        q, k = rope(q, pos, rope_dim, rope_theta, backend="torch"), rope(k, pos, rope_dim, rope_theta, backend="torch")
    return _into(out, torch_ops.attention_step(q, k, v, k_cache, v_cache, slot, pos, scale))


def attention_prefill_varlen(q, k, v, k_cache, v_cache, cu_seqlens, slot, start_pos, scale, out=None,
                             backend="triton", host=None, tok_seq=None, plan=None):
    """Packed causal prefill, K/V written to the slot's cache (see fastpath.kernels.attention); host: the
    (cu_seqlens, slot, start_pos) host lists, so the wrapper reads nothing back from the device; tok_seq: the
    step's token -> sequence index, built once for all layers; plan: the step's AttentionPlan (Triton only)."""
    if backend == "triton":
        return _attn_prefill(q, k, v, k_cache, v_cache, cu_seqlens, slot, start_pos, scale, out=out, host=host,
                             tok_seq=tok_seq, plan=plan)
    cu, sl, sp = host if host is not None else (cu_seqlens, slot, start_pos)
    y = torch_ops.attention_varlen(q, k, v, k_cache, v_cache, _ints(sl), _ints(cu), _ints(sp), scale)
    return _into(out, y)


def greedy_sample(logits: Tensor, out: Tensor, backend: str = "triton") -> Tensor:
    """argmax into the preallocated int64 buffer (lowest index wins ties)."""
    if backend == "triton":
        return _greedy_sample(logits, out)
    return torch.argmax(logits, dim=-1, out=out)
