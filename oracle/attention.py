"""Rotary position embedding and causal grouped-query attention, literal form (one sequence, no batch).

RoPE is the rotate-half ("NeoX") form HF uses for these models, applied to the first `rot_dim` dims of
each head (rot_dim = head_dim: full; head_dim/2: Bamba's partial RoPE; 0: none) and leaving the rest:

    inv_freq[i] = theta^(-2i / rot_dim),   angle[t, i] = pos_t * inv_freq[i]
    x_rot = x * cos(angle ++ angle) + rotate_half(x) * sin(angle ++ angle),   rotate_half([a, b]) = [-b, a]

Attention: q [Lq, Hq, d], k/v [Lk, Hkv, d]; query head h reads kv head h // (Hq // Hkv); a query at
absolute position p sees keys at positions <= p.
"""
from __future__ import annotations

import torch
from torch import Tensor


def rotate_half(x: Tensor) -> Tensor:
    """[a, b] -> [-b, a] along the last dim."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rope(x: Tensor, positions: Tensor, rot_dim: int, theta: float) -> Tensor:
    """x [L, H, d] rotated on its first rot_dim dims by absolute positions [L]."""
    if rot_dim == 0:
        return x
    d = x.shape[-1]
    if rot_dim % 2 != 0 or rot_dim > d:
        raise ValueError(f"rope: rot_dim={rot_dim} must be even and <= head_dim={d}")
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64, device=x.device).to(cd) / rot_dim))
    angle = positions.to(cd)[:, None] * inv_freq[None, :]                # [L, rot_dim/2]
    emb = torch.cat([angle, angle], dim=-1)                              # [L, rot_dim]
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]              # [L, 1, rot_dim]
    xr, xp = x[..., :rot_dim].to(cd), x[..., rot_dim:]
    xr = xr * cos + rotate_half(xr) * sin
    return torch.cat([xr.to(x.dtype), xp], dim=-1)


def attention(q: Tensor, k: Tensor, v: Tensor, q_positions: Tensor, k_positions: Tensor,
              scale: float) -> Tensor:
    """Causal GQA: softmax(q·k * scale, masked to k_pos <= q_pos) · v -> [Lq, Hq, d]."""
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hq % Hkv != 0:
        raise ValueError(f"attention: n_heads={Hq} is not divisible by n_kv_heads={Hkv}")
    k = k.repeat_interleave(Hq // Hkv, dim=1)                            # [Lk, Hq, d]
    v = v.repeat_interleave(Hq // Hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale                  # [Hq, Lq, Lk]
    visible = k_positions[None, :] <= q_positions[:, None]               # [Lq, Lk]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    probs = torch.softmax(scores.to(cd), dim=-1).to(v.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v)
