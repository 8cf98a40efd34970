"""conv1d_steps and ssm_steps (fastpath/kernels/conv1d_steps.py, ssm_steps.py): W decode positions per row in one
launch give the bits of W conv1d_step / ssm_step calls — outputs, bank rows and per-position snapshots — for rows
whose live positions sit first (a verify batch), last (a catch-up) or nowhere (padding), leave other slots alone,
and name the field a bad input breaks."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastpath.kernels._common import KernelInputError  # noqa: E402
from fastpath.kernels.conv1d import conv1d_step  # noqa: E402
from fastpath.kernels.conv1d_steps import conv1d_steps  # noqa: E402
from fastpath.kernels.ssm_step import ssm_step  # noqa: E402
from fastpath.kernels.ssm_steps import ssm_steps  # noqa: E402

W, S = 4, 5
# rows: live at positions 0..1 (slot 3), 0..3 (slot 0), 2..3 (slot 4: right-aligned), none (padding)
SLOTS = [[3, 0, -1, -1], [3, 0, -1, -1], [-1, 0, 4, -1], [-1, 0, 4, -1]]


def _slot(dev) -> torch.Tensor:
    return torch.tensor(SLOTS, dtype=torch.int64, device=dev)


def _apart(dev) -> None:
    """Between two reference one-position launches on CUDA: each reads its state before its PDL wait, safe in the
    engine, where other kernels sit between two steps of a layer, but a race when they run back to back."""
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


def _ssm_case(dev, dtype, H=4, P=8, N=16, G=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    R = len(SLOTS[0])
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(bank=rnd(S, H, P, N).to(dev), x=rnd(W, R, H, P).to(dev, dtype), dt=rnd(W, R, H).to(dev, dtype),
                A=-torch.rand(H, generator=g).to(dev) - 0.5, B=rnd(W, R, G, N).to(dev, dtype),
                C=rnd(W, R, G, N).to(dev, dtype), D=rnd(H).to(dev, dtype), bias=rnd(H).to(dev, dtype))


def _ssm_both(dev, dtype, **shape):
    c = _ssm_case(dev, dtype, **shape)
    R, (H, P, N) = len(SLOTS[0]), c["bank"].shape[1:]
    slot = _slot(dev)
    one, many = c["bank"].clone(), c["bank"].clone()
    y1, y2 = torch.empty_like(c["x"]), torch.empty_like(c["x"])
    s1, s2 = torch.full((W - 1, R, H, P, N), 7.0, device=dev), torch.full((W - 1, R, H, P, N), 7.0, device=dev)
    for j in range(W):
        ssm_step(one, c["x"][j], c["dt"][j], c["A"], c["B"][j], c["C"][j], c["D"], c["bias"], slot[j],
                 dt_limit=(0.0, 8.0), out=y1[j], snap=s1[j] if j < W - 1 else None)
        _apart(dev)
    ssm_steps(many, c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"], c["bias"], slot, dt_limit=(0.0, 8.0), out=y2,
              snap=s2)
    return c, (one, y1, s1), (many, y2, s2)


def test_ssm_steps_has_the_bits_of_one_ssm_step_per_position():
    """fp32: y, every bank slot (touched or not) and every snapshot equal bitwise; slots 1 and 2 (no row) and the
    snapshots of positions a row does not have keep their values; padding positions give zeros."""
    c, (b1, y1, s1), (b2, y2, s2) = _ssm_both("cpu", torch.float32)
    assert torch.equal(y1, y2) and torch.equal(b1, b2) and torch.equal(s1, s2)
    assert torch.equal(b2[1:3], c["bank"][1:3]) and not torch.equal(b2[0], c["bank"][0])
    assert torch.equal(y2[2:, 0], torch.zeros_like(y2[2:, 0])) and torch.equal(y2[:, 3], torch.zeros_like(y2[:, 3]))
    assert (s2[2, 0] == 7.0).all() and (s2[0, 2] == 7.0).all() and not (s2[2, 2] == 7.0).all()


def _conv_both(dev, dtype, D=24, K=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    R = len(SLOTS[0])
    x = torch.randn(W, R, D, generator=g).to(dev, dtype)
    w, b = torch.randn(D, K, generator=g).to(dev, dtype), torch.randn(D, generator=g).to(dev, dtype)
    bank = torch.randn(S, D, K - 1, generator=g).to(dev)
    slot = _slot(dev)
    one, many = bank.clone(), bank.clone()
    y1, y2 = torch.empty_like(x), torch.empty_like(x)
    s1, s2 = torch.full((W - 1, R, D, K - 1), 7.0, device=dev), torch.full((W - 1, R, D, K - 1), 7.0, device=dev)
    for j in range(W):
        conv1d_step(x[j], w, b, one, slot[j], out=y1[j], snap=s1[j] if j < W - 1 else None)
        _apart(dev)
    conv1d_steps(x, w, b, many, slot, out=y2, snap=s2)
    return bank, (one, y1, s1), (many, y2, s2)


def test_conv1d_steps_has_the_bits_of_one_conv1d_step_per_position():
    """fp32: y, every bank slot and every snapshot equal bitwise; untouched slots keep their windows; padding
    positions give zeros."""
    bank, (b1, y1, s1), (b2, y2, s2) = _conv_both("cpu", torch.float32)
    assert torch.equal(y1, y2) and torch.equal(b1, b2) and torch.equal(s1, s2)
    assert torch.equal(b2[1:3], bank[1:3]) and torch.equal(y2[:, 3], torch.zeros_like(y2[:, 3]))
    assert (s2[2, 0] == 7.0).all() and not (s2[2, 2] == 7.0).all()


def test_multi_step_kernels_name_the_field_a_bad_input_breaks():
    c = _ssm_case("cpu", torch.float32)
    slot = _slot("cpu")
    with pytest.raises(KernelInputError, match="slot"):
        ssm_steps(c["bank"], c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"], c["bias"], slot[:2])
    with pytest.raises(KernelInputError, match="snap"):
        ssm_steps(c["bank"], c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"], c["bias"], slot,
                  snap=torch.zeros(W, 4, 4, 8, 16))
    x = torch.zeros(W, 4, 24)
    with pytest.raises(KernelInputError, match="slot"):
        conv1d_steps(x, torch.zeros(24, 4), None, torch.zeros(S, 24, 3), slot[:3])
    with pytest.raises(KernelInputError, match="weight"):
        conv1d_steps(x, torch.zeros(23, 4), None, torch.zeros(S, 24, 3), slot)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_multi_step_kernels_have_the_bits_of_the_one_step_kernels_at_model_shape(dtype):
    """Compiled, with PDL where the device has it: anchor-3b's Mamba shape (80 heads x 64, state 128, one group;
    conv 5376 channels) — ssm_steps and conv1d_steps == the one-position kernels bitwise."""
    _, (b1, y1, s1), (b2, y2, s2) = _ssm_both("cuda", dtype, H=80, P=64, N=128, G=1)
    assert torch.equal(y1, y2) and torch.equal(b1, b2) and torch.equal(s1, s2)
    _, (b1, y1, s1), (b2, y2, s2) = _conv_both("cuda", dtype, D=5376)
    assert torch.equal(y1, y2) and torch.equal(b1, b2) and torch.equal(s1, s2)
