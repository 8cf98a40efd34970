"""The Triton interpreter's wide tiles (every head, or many rows, in one program: the CPU path's launch rules) give
exactly the bits of the compiled rules' narrow tiles (one head or one row a program), so the CPU tier still tests
the arithmetic the GPU runs, only in fewer programs."""
from __future__ import annotations

import pytest
import torch

from kernel_tiers import skip_cpu_without_interpreter  # noqa: E402  (sets TRITON_INTERPRET on CPU)

from fastpath.kernels import conv1d, fused_add_norm, gated_norm  # noqa: E402
from fastpath.kernels._common import INTERPRET  # noqa: E402
from fastpath.kernels.ssm_step import ssm_step, ssm_step_launch_rule  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRET, reason="the wide tiles are the interpreter's launch rules")


def _r(gen, *s):
    return torch.randn(*s, generator=gen)


def test_ssm_step_all_heads_in_one_program_equals_one_head_a_program_bitwise():
    skip_cpu_without_interpreter("cpu")
    R, H, P, G, N, S = 5, 8, 8, 2, 16, 7
    gen = torch.Generator().manual_seed(3)
    x, dt, B, C, z = _r(gen, R, H, P), _r(gen, R, H), _r(gen, R, G, N), _r(gen, R, G, N), _r(gen, R, H, P)
    A, D, dtb = -(torch.rand(H, generator=gen) + 0.1), _r(gen, H), _r(gen, H) * 0.3
    bank = _r(gen, S, H, P, N)
    slot = torch.tensor([4, -1, 0, 6, 2], dtype=torch.int32)
    wide = ssm_step_launch_rule(H, P, N)
    assert wide["BLOCK_H"] == H
    outs = []
    for rule in (wide, dict(wide, BLOCK_H=1, BLOCK_P=4)):
        b = bank.clone()
        y = ssm_step(b, x, dt, A, B, C, D, dtb, slot, z=z, dt_limit=(1e-3, 1.5), _rule=rule)
        outs.append((y, b))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("rows", [False, True], ids=["all", "picked"])
def test_add_rms_norm_many_rows_a_program_equals_one_row_a_program_bitwise(rows, monkeypatch):
    gen = torch.Generator().manual_seed(5)
    T, Dm = 37, 48
    h, d, w = _r(gen, T, Dm), _r(gen, T, Dm), _r(gen, Dm)
    pick = torch.tensor([36, 0, 5, 5, 20], dtype=torch.int64) if rows else None
    assert fused_add_norm.add_rms_norm_rows(Dm) > 1
    wide = fused_add_norm.add_rms_norm(h, d, w, 1e-5, 0.3, rows=pick)
    monkeypatch.setattr(fused_add_norm, "add_rms_norm_rows", lambda D: 1)
    narrow = fused_add_norm.add_rms_norm(h, d, w, 1e-5, 0.3, rows=pick)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(wide, narrow))


@pytest.mark.parametrize("n_groups", [1, 2, 4])
def test_rms_norm_gated_many_rows_a_program_equals_one_row_a_program_bitwise(n_groups, monkeypatch):
    gen = torch.Generator().manual_seed(7 + n_groups)
    y, z, w = _r(gen, 3, 13, 64), _r(gen, 3, 13, 64), _r(gen, 64)
    assert gated_norm.rms_norm_gated_rows(64 // n_groups) > 1
    wide = gated_norm.rms_norm_gated(y, z, w, n_groups, 1e-6)
    monkeypatch.setattr(gated_norm, "rms_norm_gated_rows", lambda gs: 1)
    assert torch.equal(wide, gated_norm.rms_norm_gated(y, z, w, n_groups, 1e-6))


def test_conv1d_every_channel_in_one_tile_equals_128_channel_tiles_bitwise(monkeypatch):
    gen = torch.Generator().manual_seed(11)
    Dc, K, S = 320, 4, 5
    x, wt, bias = _r(gen, 9, Dc), _r(gen, Dc, K), _r(gen, Dc)
    bank = _r(gen, S, Dc, K - 1)
    cu = torch.tensor([0, 2, 7, 9], dtype=torch.int32)
    slot, init = torch.tensor([3, 0, 4], dtype=torch.int32), torch.tensor([1, 0, 1], dtype=torch.int32)
    step_slot = torch.tensor([1, -1, 3], dtype=torch.int32)
    assert conv1d.conv1d_launch_rule(Dc)["BLOCK_D"] > 128

    def both():
        b = bank.clone()
        y = conv1d.causal_conv1d_varlen(x, wt, bias, b, cu, slot, init)
        ys = conv1d.conv1d_step(x[:3], wt, bias, b, step_slot)
        return y, ys, b
    wide = both()
    rule = conv1d.conv1d_launch_rule
    monkeypatch.setattr(conv1d, "conv1d_launch_rule", lambda d: dict(rule(d), BLOCK_D=128))
    assert all(torch.equal(a, b) for a, b in zip(wide, both()))
