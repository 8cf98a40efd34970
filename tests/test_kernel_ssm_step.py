"""fastpath.kernels.ssm_step (decode state update over the bank) vs oracle.ssd.ssm_step in fp64."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from kernel_tiers import TIERS, skip_cpu_without_interpreter as _skip_cpu_without_interpreter, rel  # noqa: E402  (sets TRITON_INTERPRET on CPU)

from fastpath.kernels._common import KernelInputError  # noqa: E402
from fastpath.kernels.ssm_step import ssm_step  # noqa: E402
from oracle.mamba2 import process_dt  # noqa: E402
from oracle.ssd import heads_of_groups, ssm_recurrence  # noqa: E402
from oracle.ssd import ssm_step as oracle_step  # noqa: E402

REL = {torch.float32: 5e-6, torch.bfloat16: 1.5e-2}   # docs/kernels.md


@pytest.mark.parametrize("gate", [False, True], ids=["no-z", "z-gate"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_ssm_step_rows_match_oracle_and_pad_rows_touch_nothing(device, dtype, slot_dtype, gate):
    """Permuted slots with gaps and -1 pad rows, n_groups=2, dt clamp: live rows match fp64 (output and bank
    entry), pad rows output exactly zero, bank entries of unused slots bitwise unchanged."""
    _skip_cpu_without_interpreter(device)
    R, H, P, G, N, S = 6, 4, 8, 2, 16, 9
    gen = torch.Generator().manual_seed(21 + gate)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x, dt, B, C, z = (r(R, H, P).to(dtype), r(R, H).to(dtype), r(R, G, N).to(dtype), r(R, G, N).to(dtype),
                      r(R, H, P).to(dtype))
    A, D, dtb = -(torch.rand(H, generator=gen) * 2 + 0.1), r(H), r(H) * 0.3
    bank = r(S, H, P, N)
    slots = torch.tensor([7, -1, 2, 0, -1, 5], dtype=slot_dtype)
    limit = (1e-3, 1.2)
    dev = lambda t: t.to(device)  # noqa: E731
    bank_d = dev(bank.clone())
    out = torch.full((R, H, P), float("nan"), dtype=dtype, device=device)
    ssm_step(bank_d, dev(x), dev(dt), dev(A), dev(B), dev(C), dev(D), dev(dtb), dev(slots),
             z=dev(z) if gate else None, dt_limit=limit, out=out)
    out, bank_after = out.cpu(), bank_d.cpu()
    for row, s in enumerate(slots.tolist()):
        if s < 0:
            assert torch.equal(out[row], torch.zeros_like(out[row])), f"pad row {row} output"
            continue
        dtp = process_dt(dt[row].double(), dtb.double(), limit)
        y, h = oracle_step(bank[s].double(), x[row].double(), dtp, A.double(),
                           heads_of_groups(B[row:row + 1].double(), H)[0],
                           heads_of_groups(C[row:row + 1].double(), H)[0],
                           D.double())
        if gate:
            y = y * F.silu(z[row].double())
        assert rel(out[row], y) < REL[dtype], f"row {row} output"
        assert rel(bank_after[s], h) < REL[dtype], f"row {row} state"
    unused = [1, 3, 4, 6, 8]
    assert torch.equal(bank_after[unused], bank[unused]), "bank entries of unused slots changed"


@pytest.mark.parametrize("device,dtype", TIERS)
def test_ssm_step_repeated_steps_follow_the_recurrence(device, dtype):
    """Eight decode steps of two requests (rows swap between steps, as after compaction) == the fp64 recurrence."""
    _skip_cpu_without_interpreter(device)
    L, H, P, G, N = 8, 2, 8, 1, 16
    gen = torch.Generator().manual_seed(4)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x, dt, B, C = r(2, L, H, P).to(dtype), r(2, L, H).to(dtype), r(2, L, G, N).to(dtype), r(2, L, G, N).to(dtype)
    A, D, dtb = -(torch.rand(H, generator=gen) + 0.1), r(H), r(H) * 0.3
    bank = torch.zeros(3, H, P, N, device=device)
    slots = [2, 0]
    ys = torch.full((2, L, H, P), float("nan"), dtype=dtype)
    for t in range(L):
        order = [0, 1] if t % 2 == 0 else [1, 0]
        out = torch.full((2, H, P), float("nan"), dtype=dtype, device=device)
        pick = lambda a: a[order, t].to(device)  # noqa: E731
        ssm_step(bank, pick(x), pick(dt), A.to(device), pick(B), pick(C), D.to(device), dtb.to(device),
                 torch.tensor([slots[i] for i in order], device=device), out=out)
        ys[order, t] = out.cpu()
    for i in range(2):
        dtp = process_dt(dt[i].double(), dtb.double(), (0.0, float("inf")))
        y, h = ssm_recurrence(x[i].double(), dtp, A.double(), B[i].double(), C[i].double(), D.double())
        assert rel(ys[i], y) < REL[dtype]
        assert rel(bank[slots[i]], h) < REL[dtype]


def test_ssm_step_rejects_bad_inputs_naming_the_field():
    """A bf16 bank, float slots, a mis-shaped z raise KernelInputError naming the field."""
    R, H, P, G, N = 2, 2, 8, 1, 16
    x, dt, B = torch.randn(R, H, P), torch.randn(R, H), torch.randn(R, G, N)
    bank, slot = torch.zeros(3, H, P, N), torch.tensor([0, 1])
    base = dict(ssm_bank=bank, x=x, dt=dt, A=-torch.ones(H), B=B, C=B, D=None, dt_bias=None, slot=slot)
    for field, change in [("ssm_bank", dict(ssm_bank=bank.bfloat16())), ("slot", dict(slot=slot.float())),
                          ("z", dict(z=torch.randn(R, H))), ("A", dict(A=torch.ones(H + 1)))]:
        with pytest.raises(KernelInputError, match=field):
            ssm_step(**{**base, **change})
