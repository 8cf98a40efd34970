"""Row table + state bank bookkeeping of the fast-path engine (no model involved)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fastpath.engine.bank import StateBank
from fastpath.engine.rows import Move, RowTable, apply_moves_, compaction_moves, index_pair

settings.register_profile("engine_ci", max_examples=60, derandomize=True, deadline=None)


def test_compaction_fills_leftmost_hole_with_rightmost_live_row():
    live = [True, False, True, False, True, True]
    assert compaction_moves(live) == [Move(5, 1), Move(4, 3)]
    assert compaction_moves([False, False, True]) == [Move(2, 0)]
    assert compaction_moves([True, True, False, False]) == []


@settings(settings.get_profile("engine_ci"))
@given(st.lists(st.booleans(), min_size=0, max_size=12))
def test_compaction_moves_pack_live_rows_and_are_disjoint(live):
    moves = compaction_moves(live)
    rows = [i if alive else None for i, alive in enumerate(live)]
    for m in moves:
        assert rows[m.dst] is None and rows[m.src] is not None and m.src > m.dst
        rows[m.dst], rows[m.src] = rows[m.src], None
    n = sum(live)
    assert all(r is not None for r in rows[:n]) and all(r is None for r in rows[n:])
    srcs, dsts = {m.src for m in moves}, {m.dst for m in moves}
    assert not srcs & dsts, "a move reads a row an earlier move wrote"


def test_apply_moves_matches_sequential_moves():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(6, 3, generator=g)
    ref = t.clone()
    moves = compaction_moves([True, False, True, False, True, True])
    for m in moves:
        ref[m.dst] = ref[m.src]
        ref[m.src] = -1
    src, dst = index_pair(moves, t.device)
    apply_moves_(t, src, dst, fill=-1)
    assert torch.equal(t, ref)


def test_slots_are_lifo_and_freed_slot_is_reused_first():
    rt = RowTable(4)
    assert [rt.admit(f"r{i}")[1] for i in range(3)] == [0, 1, 2]
    rt.release([1])                       # r1 held slot 1
    rt.compact()
    assert rt.admit("r3") == (2, 1), "the freed slot must be handed out first"
    rt.check()


@settings(settings.get_profile("engine_ci"))
@given(st.integers(1, 6), st.lists(st.tuples(st.booleans(), st.integers(0, 63)), min_size=1, max_size=30))
def test_row_table_invariants_and_device_mirror_hold_after_every_operation(R, ops):
    rt = RowTable(R)
    slot_of: dict[str, int] = {}
    n = 0
    for admit, mask in ops:
        if admit and rt.has_free_slot():
            row, slot = rt.admit(f"q{n}")
            slot_of[f"q{n}"] = slot
            n += 1
        else:
            rows = [r for r in range(rt.active) if mask >> r & 1]
            for rid, slot in rt.release(rows):
                assert slot_of.pop(rid) == slot
            rt.compact()
        rt.check()
        assert rt.row_to_slot_dev.tolist() == rt.row_to_slot, "device row table differs from host mirror"
        for r in range(rt.active):    # a moved row keeps its slot
            assert rt.row_to_slot[r] == slot_of[rt.row_request[r]]


def test_bad_sizes_are_rejected_by_name():
    with pytest.raises(ValueError, match="max_requests"):
        RowTable(0)
    cfg = _cfg()
    with pytest.raises(ValueError, match="max_len"):
        StateBank(cfg, 2, 0)


def _cfg():
    return SimpleNamespace(mamba_layer_ids=(0, 2), attention_layer_ids=(1,), conv_dim=12, mamba_d_conv=4,
                           mamba_n_heads=2, mamba_head_dim=3, mamba_d_state=4, n_kv_heads=1, attn_head_dim=4)


def test_bank_zero_slot_touches_only_that_slot_and_never_moves():
    bank = StateBank(_cfg(), max_requests=3, max_len=8)
    g = torch.Generator().manual_seed(1)
    for t in (bank.conv_state, bank.ssm_state):
        t.copy_(torch.randn(t.shape, generator=g))
    before = {s: bank.slot_state(s) for s in range(3)}
    bank.zero_slot(1)
    bank.assert_stable()
    assert bank.ssm(2).data_ptr() == bank.ssm_state[1].data_ptr()
    assert torch.count_nonzero(bank.ssm_state[:, 1]) == 0 and torch.count_nonzero(bank.conv_state[:, 1]) == 0
    for s in (0, 2):
        after = bank.slot_state(s)
        assert all(torch.equal(after[k], before[s][k]) for k in after)
    with pytest.raises(IndexError, match="slot"):
        bank.zero_slot(3)
