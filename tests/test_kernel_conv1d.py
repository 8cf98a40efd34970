"""fastpath.kernels.conv1d (varlen prefill + decode step over the conv bank) vs oracle/conv1d.py in fp64."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from kernel_tiers import TIERS, skip_cpu_without_interpreter as _skip_cpu_without_interpreter, rel  # noqa: E402  (sets TRITON_INTERPRET on CPU)

from fastpath.kernels._common import KernelInputError  # noqa: E402
from fastpath.kernels.conv1d import causal_conv1d_varlen, conv1d_step  # noqa: E402
from oracle.conv1d import causal_conv1d  # noqa: E402
from oracle.conv1d import conv1d_step as oracle_step  # noqa: E402

REL = {torch.float32: 5e-6, torch.bfloat16: 1e-2}   # docs/kernels.md


def cumsum(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


@pytest.mark.parametrize("K", [3, 4], ids=["d_conv3", "d_conv4"])
@pytest.mark.parametrize("silu", [True, False], ids=["silu", "linear"])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_conv1d_varlen_matches_oracle_windows_in_bank(device, dtype, silu, K):
    """Lengths 0/1/2/K-1/K/19 mixing with and without initial windows, permuted slots, a slot -1 piece, at
    d_conv 3 and 4: outputs and new windows vs fp64; unused bank entries bitwise unchanged."""
    _skip_cpu_without_interpreter(device)
    Dc, S = 40, 9
    gen = torch.Generator().manual_seed(31 + silu)
    lens = [1, 2, K - 1, 0, K, 19, 5]
    has_init = [True, False, True, True, True, False, True]
    slots = [4, 0, 8, 2, 6, 1, -1]
    cu = cumsum(lens)
    x = torch.randn(cu[-1], Dc, generator=gen).to(dtype)
    w, b = torch.randn(Dc, K, generator=gen), torch.randn(Dc, generator=gen)
    bank = torch.randn(S, Dc, K - 1, generator=gen)
    bank_d = bank.clone().to(device)
    out = torch.full((cu[-1], Dc), float("nan"), dtype=dtype, device=device)
    causal_conv1d_varlen(x.to(device), w.to(device), b.to(device), bank_d, torch.tensor(cu, device=device),
                         torch.tensor(slots, device=device), torch.tensor(has_init, device=device), silu=silu, out=out)
    out, bank_after = out.cpu(), bank_d.cpu()
    for s, slot in enumerate(slots):
        win = bank[slot].double() if has_init[s] and slot >= 0 else None
        y, new_win = causal_conv1d(x[cu[s]:cu[s + 1]].double(), w.double(), b.double(), win)
        if silu:
            y = F.silu(y)
        if lens[s]:
            assert rel(out[cu[s]:cu[s + 1]], y) < REL[dtype], f"sequence {s} output"
        if slot >= 0:
            assert rel(bank_after[slot], new_win) < REL[dtype], f"sequence {s} window"
    assert torch.equal(bank_after[[3, 5, 7]], bank[[3, 5, 7]]), "bank entries of unused slots changed"


@pytest.mark.parametrize("device,dtype", TIERS)
def test_conv1d_prefill_split_is_bitwise_identical_and_step_continues_it(device, dtype):
    """A prompt in one call == the same prompt in three pieces (bitwise); then decode steps continue the
    window to the fp64 result of one long conv."""
    _skip_cpu_without_interpreter(device)
    Dc, K, L, steps = 24, 4, 13, 3
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(L + steps, Dc, generator=gen).to(dtype).to(device)
    w, b = torch.randn(Dc, K, generator=gen).to(device), torch.randn(Dc, generator=gen).to(device)
    bank = torch.zeros(3, Dc, K - 1, device=device)
    one = torch.full((L, Dc), float("nan"), dtype=dtype, device=device)
    causal_conv1d_varlen(x[:L], w, b, bank, torch.tensor([0, L], device=device), torch.tensor([1], device=device),
                         torch.tensor([False], device=device), out=one)
    win_one = bank[1].clone()
    bank.zero_()
    for lo, hi in [(0, 2), (2, 3), (3, L)]:
        part = torch.full((hi - lo, Dc), float("nan"), dtype=dtype, device=device)
        causal_conv1d_varlen(x[lo:hi], w, b, bank, torch.tensor([0, hi - lo], device=device),
                             torch.tensor([1], device=device), torch.tensor([lo > 0], device=device), out=part)
        assert torch.equal(part, one[lo:hi]), f"piece [{lo}, {hi}) differs from the one-call run"
    assert torch.equal(bank[1], win_one)
    outs = []
    for t in range(L, L + steps):
        o = torch.full((2, Dc), float("nan"), dtype=dtype, device=device)
        conv1d_step(torch.stack([x[t], x[t]]), w, b, bank, torch.tensor([-1, 1], device=device), out=o)
        assert torch.equal(o[0].cpu(), torch.zeros(Dc, dtype=dtype)), "pad row output"
        outs.append(o[1])
    y, win = causal_conv1d(x.double().cpu(), w.double().cpu(), b.double().cpu())
    assert rel(torch.stack(outs), F.silu(y[L:])) < REL[dtype]
    assert rel(bank[1], win) < REL[dtype]
    assert torch.equal(bank[[0, 2]].cpu(), torch.zeros(2, Dc, K - 1)), "unused slots written"


@pytest.mark.parametrize("K", [2, 3, 4], ids=["d_conv2", "d_conv3", "d_conv4"])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_conv1d_step_rows_match_oracle_and_pad_rows_touch_nothing(device, dtype, K):
    """Decode rows with permuted slots and -1 pads (int32 slots), at d_conv 2, 3 and 4: outputs and rolled
    windows vs fp64."""
    _skip_cpu_without_interpreter(device)
    Dc, S = 40, 6
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(5, Dc, generator=gen).to(dtype)
    w, b = torch.randn(Dc, K, generator=gen), torch.randn(Dc, generator=gen)
    bank = torch.randn(S, Dc, K - 1, generator=gen)
    slots = torch.tensor([3, -1, 0, 5, -1], dtype=torch.int32)
    bank_d = bank.clone().to(device)
    out = torch.full((5, Dc), float("nan"), dtype=dtype, device=device)
    conv1d_step(x.to(device), w.to(device), None, bank_d, slots.to(device), silu=False, out=out)
    out, bank_after = out.cpu(), bank_d.cpu()
    for r, s in enumerate(slots.tolist()):
        if s < 0:
            assert torch.equal(out[r], torch.zeros_like(out[r]))
            continue
        y, win = oracle_step(x[r].double(), w.double(), None, bank[s].double())
        assert rel(out[r], y) < REL[dtype]
        assert rel(bank_after[s], win) < REL[dtype]
    assert torch.equal(bank_after[[1, 2, 4]], bank[[1, 2, 4]])


def test_conv1d_rejects_bad_inputs_naming_the_field():
    """Window shape mismatch, repeated slots, bad cu_seqlens raise KernelInputError naming the field."""
    x, w, bank = torch.randn(4, 8), torch.randn(8, 4), torch.zeros(3, 8, 3)
    base = dict(x=x, weight=w, bias=None, conv_bank=bank, cu_seqlens=torch.tensor([0, 2, 4]),
                slot=torch.tensor([0, 1]), has_initial_state=torch.tensor([True, False]))
    cases = [("conv_bank", dict(conv_bank=torch.zeros(3, 8, 4))), ("slot", dict(slot=torch.tensor([1, 1]))),
             ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 3, 2]))), ("weight", dict(weight=torch.randn(7, 4)))]
    for field, change in cases:
        with pytest.raises(KernelInputError, match=field):
            causal_conv1d_varlen(**{**base, **change})
