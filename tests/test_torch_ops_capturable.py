"""The torch backend's decode-step ops are CUDA-graph capturable: they read nothing back to the host (no nonzero,
no .item(), no boolean-mask select), and they write exactly the valid rows, whatever the padding rows hold.

Capture itself needs CUDA (the gpu tier runs the torch_backend configuration under graphs); on CPU a dispatch
mode records every aten op, and a host read-back is what capture forbids."""
from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from fastpath.engine import torch_ops

HOST_READS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::item", "bool-mask index"}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func._schema.name)
        if func._schema.name in ("aten::index", "aten::index_put_", "aten::index_put") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            self.seen.add("bool-mask index")      # its output size is the mask's count, read back to the host
        return func(*args, **(kwargs or {}))


def _slots(draw_slots: list[int]) -> torch.Tensor:
    return torch.tensor(draw_slots, dtype=torch.int64)


slot_lists = st.integers(1, 6).flatmap(
    lambda n: st.lists(st.integers(-1, 4), min_size=n, max_size=n).filter(
        lambda s: len([v for v in s if v >= 0]) == len({v for v in s if v >= 0})))


@settings(max_examples=60, deadline=None)
@given(slots=slot_lists, seed=st.integers(0, 2**16))
def test_write_rows_writes_exactly_the_valid_rows(slots, seed):
    g = torch.Generator().manual_seed(seed)
    bank = torch.randn(5, 3, 2, generator=g)
    new = torch.randn(len(slots), 3, 2, generator=g)
    want = bank.clone()
    for r, s in enumerate(slots):
        if s >= 0:
            want[s] = new[r]
    idx = _slots(slots)
    torch_ops.write_rows(bank, idx.clamp(min=0), idx >= 0, new)
    assert torch.equal(bank, want)


def test_decode_step_ops_read_nothing_back_to_host():
    torch.manual_seed(0)
    n, D, K, H, P, N, L = 3, 8, 4, 2, 4, 8, 6
    slots = torch.tensor([2, -1, 0])
    conv_bank, ssm_bank = torch.randn(4, D, K - 1), torch.randn(4, H, P, N)
    kc, vc = torch.randn(4, L, 1, P), torch.randn(4, L, 1, P)
    with _Ops() as mode:
        torch_ops.conv_step(torch.randn(n, D), torch.randn(D, K), torch.randn(D), conv_bank, slots)
        torch_ops.ssm_step(torch.randn(n, H, P), torch.rand(n, H), -torch.rand(H), torch.randn(n, 1, N),
                           torch.randn(n, 1, N), torch.randn(H), ssm_bank, slots)
        torch_ops.attention_step(torch.randn(n, H, P), torch.randn(n, 1, P), torch.randn(n, 1, P), kc, vc, slots,
                                 torch.tensor([3, 0, 5]), 0.5)
    assert mode.seen, "the dispatch mode saw no op"
    assert not mode.seen & HOST_READS, sorted(mode.seen & HOST_READS)


def test_the_host_read_detector_sees_a_boolean_mask_select():
    """The detector above can fail: the old masked write reads the mask's count back."""
    bank, idx = torch.zeros(4, 2), torch.tensor([1, -1])
    with _Ops() as mode:
        valid = idx >= 0
        bank.index_copy_(0, idx[valid], torch.ones(2, 2)[valid])
    assert mode.seen & HOST_READS


@settings(max_examples=40, deadline=None)
@given(slots=slot_lists, seed=st.integers(0, 2**16))
def test_attention_step_equals_the_varlen_stand_in_on_one_token_rows(slots, seed):
    g = torch.Generator().manual_seed(seed)
    n, H, Hkv, d, L = len(slots), 4, 2, 8, 7
    q, k, v = torch.randn(n, H, d, generator=g), torch.randn(n, Hkv, d, generator=g), torch.randn(n, Hkv, d, generator=g)
    kc, vc = torch.randn(5, L, Hkv, d, generator=g), torch.randn(5, L, Hkv, d, generator=g)
    pos = torch.randint(0, L, (n,), generator=g)
    kc2, vc2 = kc.clone(), vc.clone()
    got = torch_ops.attention_step(q, k, v, kc, vc, _slots(slots), pos, 0.3)
    want = torch_ops.attention_varlen(q, k, v, kc2, vc2, slots, list(range(n + 1)), pos.tolist(), 0.3)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
