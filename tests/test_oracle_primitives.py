"""The oracle's reference primitives against independent formulations (torch ops, closed forms)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from oracle.attention import attention, rope
from oracle.conv1d import causal_conv1d, conv1d_step
from oracle.gated_norm import rms_norm, rms_norm_gated
from oracle.mamba2 import process_dt


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_causal_conv1d_matches_torch_depthwise_conv_and_carries_the_window():
    """causal_conv1d == F.conv1d(groups=D, left pad K-1); split + window and step-by-step give the same."""
    g = _g(0)
    L, D, K = 13, 6, 4
    x = torch.randn(L, D, generator=g, dtype=torch.float64)
    w = torch.randn(D, K, generator=g, dtype=torch.float64)
    b = torch.randn(D, generator=g, dtype=torch.float64)
    y, win = causal_conv1d(x, w, b)
    ref = F.conv1d(x.T[None], w[:, None, :], b, padding=K - 1, groups=D)[0, :, :L].T
    assert (y - ref).abs().max() <= 1e-12
    assert torch.equal(win, x[-(K - 1):].T)                        # last K-1 inputs, oldest first
    y1, w1 = causal_conv1d(x[:5], w, b)
    y2, w2 = causal_conv1d(x[5:], w, b, w1)
    assert (torch.cat([y1, y2]) - y).abs().max() <= 1e-12 and torch.equal(w2, win)
    window, steps = None, []
    for t in range(L):
        y_t, window = conv1d_step(x[t], w, b, window)
        steps.append(y_t)
    assert (torch.stack(steps) - y).abs().max() <= 1e-12


def test_rms_norm_gated_normalises_each_group_separately():
    """Grouped gated norm == per-group formula; with n_groups > 1 it differs from the ungrouped norm."""
    g = _g(1)
    y = torch.randn(5, 12, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3, 12, dtype=torch.float64)
    z = torch.randn(5, 12, generator=g, dtype=torch.float64)
    w = torch.randn(12, generator=g, dtype=torch.float64)
    out = rms_norm_gated(y, z, w, n_groups=3, eps=1e-6)
    gated = y * z * torch.sigmoid(z)
    for k in range(3):
        part = gated[:, 4 * k:4 * k + 4]
        ref = part / torch.sqrt(part.pow(2).mean(-1, keepdim=True) + 1e-6) * w[4 * k:4 * k + 4]
        assert (out[:, 4 * k:4 * k + 4] - ref).abs().max() <= 1e-12
    ungrouped = rms_norm_gated(y, z, w, n_groups=1, eps=1e-6)
    assert (ungrouped - rms_norm(gated, w, 1e-6)).abs().max() <= 1e-12
    assert (ungrouped - out).abs().max() > 1e-2
    with pytest.raises(ValueError, match="n_groups"):
        rms_norm_gated(y, z, w, n_groups=5, eps=1e-6)


@pytest.mark.parametrize("rot_dim", [8, 4, 0])
def test_rope_is_a_rotation_whose_scores_depend_on_relative_position(rot_dim):
    """RoPE keeps norms, leaves dims >= rot_dim alone, and q(p)·k(p') depends only on p - p'."""
    g = _g(2)
    q = torch.randn(1, 2, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 8, generator=g, dtype=torch.float64)
    def score(pq: int, pk: int) -> torch.Tensor:
        return (rope(q, torch.tensor([pq]), rot_dim, 100.0) * rope(k, torch.tensor([pk]), rot_dim, 100.0)).sum(-1)
    rq = rope(q, torch.tensor([37]), rot_dim, 100.0)
    assert (rq.norm(dim=-1) - q.norm(dim=-1)).abs().max() <= 1e-12
    assert torch.equal(rq[..., rot_dim:], q[..., rot_dim:])
    assert (score(10, 3) - score(27, 20)).abs().max() <= 1e-12
    if rot_dim:
        assert (score(10, 3) - score(10, 4)).abs().max() > 1e-6
        # rotate-half pairing: dim i pairs with dim i + rot_dim/2, angle = pos * theta^(-2i/rot_dim)
        half, pos = rot_dim // 2, 5.0
        ang = pos * 100.0 ** (-2 * torch.arange(half, dtype=torch.float64) / rot_dim)
        x = q[0, 0]
        ref_first = x[:half] * torch.cos(ang) - x[half:rot_dim] * torch.sin(ang)
        assert (rope(q, torch.tensor([5]), rot_dim, 100.0)[0, 0, :half] - ref_first).abs().max() <= 1e-12


def test_attention_matches_torch_sdpa_with_gqa_and_a_kv_cache_offset():
    """attention() == torch SDPA (causal over absolute positions, KV heads repeated) incl. queries after a cache."""
    g = _g(3)
    Lk, Lq, Hq, Hkv, d = 9, 4, 4, 2, 8
    q = torch.randn(Lq, Hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(Lk, Hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(Lk, Hkv, d, generator=g, dtype=torch.float64)
    qpos, kpos = torch.arange(Lk - Lq, Lk), torch.arange(Lk)
    out = attention(q, k, v, qpos, kpos, scale=0.3)
    mask = kpos[None, :] <= qpos[:, None]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1),
                                         v.repeat_interleave(2, 1).transpose(0, 1), attn_mask=mask, scale=0.3)
    assert (out - ref.transpose(0, 1)).abs().max() <= 1e-12


def test_process_dt_is_softplus_then_clamp():
    """process_dt = clamp(softplus(dt + bias), lo, hi); (0, inf) is no clamp."""
    dt = torch.tensor([[-20.0, 0.0, 3.0]], dtype=torch.float64)
    bias = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    sp = torch.log1p(torch.exp(dt + bias))
    assert (process_dt(dt, bias, (0.0, math.inf)) - sp).abs().max() <= 1e-15
    clamped = process_dt(dt, bias, (0.01, 2.0))
    assert clamped[0, 0] == 0.01 and clamped[0, 2] == 2.0 and (clamped[0, 1] - sp[0, 1]).abs() <= 1e-15
