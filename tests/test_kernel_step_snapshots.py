"""The decode-step kernels' snapshot outputs (a speculative verify's per-position snapshots): each live row's new
SSM state / conv window is stored at snap[r] bit for bit equal to what it writes into its bank slot; rows with
slot -1 leave their snapshot rows as they were; the step's own outputs do not change with or without `snap`."""
from __future__ import annotations

import pytest
import torch

from kernel_tiers import TIERS  # noqa: E402  (sets TRITON_INTERPRET on CPU)

from fastpath.engine import ops  # noqa: E402
from fastpath.kernels._common import KernelInputError  # noqa: E402
from fastpath.kernels.conv1d import conv1d_step  # noqa: E402
from fastpath.kernels.ssm_step import ssm_step  # noqa: E402

SLOTS = [3, -1, 0, 5]                     # permuted, a gap, a pad row


def _ssm_inputs(device, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    R, H, P, G, N = len(SLOTS), 4, 8, 2, 16
    t = lambda *s: torch.randn(*s, generator=g).to(device)          # noqa: E731
    return dict(x=t(R, H, P).to(dtype), dt=t(R, H).to(dtype), A=-t(H).abs().float(), B=t(R, G, N).to(dtype),
                C=t(R, G, N).to(dtype), D=t(H).to(dtype), dt_bias=t(H).to(dtype), z=t(R, H, P).to(dtype),
                slot=torch.tensor(SLOTS, device=device)), t(6, H, P, N).float()


def _conv_inputs(device, dtype, seed, K=4):
    g = torch.Generator().manual_seed(seed)
    R, D = len(SLOTS), 24
    t = lambda *s: torch.randn(*s, generator=g).to(device)          # noqa: E731
    return (t(R, D).to(dtype), t(D, K).to(dtype), t(D).to(dtype), torch.tensor(SLOTS, device=device)), \
        t(6, D, K - 1).to(dtype)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_ssm_step_snapshot_is_the_bank_rows_bits_and_changes_nothing_else(device, dtype, backend):
    kw, bank = _ssm_inputs(device, dtype, seed=1)
    snap = torch.full((len(SLOTS),) + bank.shape[1:], 7.0, device=device)
    bank_plain = bank.clone()
    y_plain = ops.ssm_step(bank_plain, **kw, backend=backend)
    y = ops.ssm_step(bank, **kw, backend=backend, snap=snap)
    assert torch.equal(y, y_plain) and torch.equal(bank, bank_plain)
    for r, s in enumerate(SLOTS):
        assert torch.equal(snap[r], bank[s]) if s >= 0 else bool((snap[r] == 7.0).all()), r


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_conv_step_snapshot_is_the_bank_rows_bits_and_changes_nothing_else(device, dtype, backend):
    (x, w, b, slot), bank = _conv_inputs(device, dtype, seed=2)
    snap = torch.full((len(SLOTS),) + bank.shape[1:], 7.0, device=device, dtype=bank.dtype)
    bank_plain = bank.clone()
    y_plain = ops.conv1d_step(x, w, b, bank_plain, slot, backend=backend)
    y = ops.conv1d_step(x, w, b, bank, slot, backend=backend, snap=snap)
    assert torch.equal(y, y_plain) and torch.equal(bank, bank_plain)
    for r, s in enumerate(SLOTS):
        assert torch.equal(snap[r], bank[s]) if s >= 0 else bool((snap[r] == 7.0).all()), r


def test_a_snapshot_of_the_wrong_shape_or_dtype_is_refused_naming_it():
    kw, bank = _ssm_inputs("cpu", torch.float32, seed=3)
    with pytest.raises(KernelInputError, match="snap"):
        ssm_step(bank, **kw, snap=torch.zeros(len(SLOTS), 4, 8, 15))
    (x, w, b, slot), cbank = _conv_inputs("cpu", torch.float32, seed=4)
    with pytest.raises(KernelInputError, match="snap"):
        conv1d_step(x, w, b, cbank, slot, snap=torch.zeros(len(SLOTS), 24, 3, dtype=torch.float64))
