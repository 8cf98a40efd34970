"""fastpath.kernels.ssd_fused (the one-launch SSD prefill) vs the fp64 recurrence (oracle/ssd.py) and vs the
staged path, through ssd_varlen(fused=True): varlen pieces starting mid-chunk, slot-bank initial states, a
slot -1 piece, a zero-length piece, checkpoints, chunk-aligned splits bitwise, and run-to-run bitwise."""
from __future__ import annotations

import math

import pytest
import torch

from kernel_tiers import GPU, NO_CUDA, TIERS, skip_cpu_without_interpreter as _skip_cpu_without_interpreter  # noqa: E402  (sets TRITON_INTERPRET on CPU)

from fastpath.kernels.ssd import ssd_chunk_table, ssd_launch_rule, ssd_varlen  # noqa: E402
from oracle.mamba2 import process_dt  # noqa: E402
from oracle.ssd import ssm_recurrence  # noqa: E402

# the same bounds as tests/test_kernel_ssd.py (docs/kernels.md)
REL = {torch.float32: 5e-6, torch.bfloat16: 1.5e-2}


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double().cpu(), ref.double().cpu()
    assert torch.isfinite(a).all(), "output has NaN/inf (an element was not written?)"
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


def make_inputs(T, H, P, G, N, dtype, device, gen, S=8):
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    d = dict(x=r(T, H, P).to(dtype), dt=(r(T, H) * 0.7 - 0.5).to(dtype), A=-(torch.rand(H, generator=gen) * 2 + 0.1),
             B=r(T, G, N).to(dtype), C=r(T, G, N).to(dtype), D=r(H), dt_bias=r(H) * 0.3, bank=r(S, H, P, N))
    return {k: v.to(device) for k, v in d.items()}


def reference(inp, lo, hi, h0, limit):
    dt = process_dt(inp["dt"][lo:hi].double().cpu(), inp["dt_bias"].double().cpu(), limit)
    return ssm_recurrence(inp["x"][lo:hi].double().cpu(), dt, inp["A"].double().cpu(), inp["B"][lo:hi].double().cpu(),
                          inp["C"][lo:hi].double().cpu(), inp["D"].double().cpu(),
                          None if h0 is None else h0.double().cpu())


def assert_matches_reference(inp, out, bank, bank0, cu, slots, has_init, dtype, limit=(0.0, math.inf), what="",
                             skip_empty=False) -> None:
    """Each sequence's output, and its final state where it has a slot, within REL[dtype] of the fp64 recurrence
    from its entering state (bank0[slot] where has_init); skip_empty: sequences of no tokens are not checked."""
    for s, slot in enumerate(slots):
        if skip_empty and cu[s] == cu[s + 1]:
            continue
        h0 = bank0[slot] if has_init[s] and slot >= 0 else None
        y, hf = reference(inp, cu[s], cu[s + 1], h0, limit)
        assert rel(out[cu[s]:cu[s + 1]], y) < REL[dtype], f"{what}sequence {s} output"
        if slot >= 0:
            assert rel(bank[slot], hf) < REL[dtype], f"{what}sequence {s} final state"


def cumulative(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def run(inp, bank, lens, start_pos, slots, has_init, Q, limit, device, fused, rule=None, table=False):
    cu = cumulative(lens)
    out = torch.full_like(inp["x"], float("nan"))
    slot_t = torch.tensor(slots, device=device)
    tab = ssd_chunk_table(cu, start_pos, Q, device, slot=slots, n_slots=bank.shape[0]) if table else None
    ssd_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], bank, cu, slot_t,
               start_pos, torch.tensor(has_init, device=device), Q, dt_limit=limit, out=out, fused=fused,
               _rule=rule, table=tab)
    return cu, out


def small_rule(H, G, P, N, Q, dtype, **fused):
    rule = ssd_launch_rule(H, G, P, N, Q, dtype)
    rule["fused"].update(fused)
    return rule


# pieces 1, 3, 4 start mid-chunk; 4 spans several chunks; 5 is a slot -1 piece; 6 has zero length
LENS = [1, 15, 16, 17, 53, 7, 0]
START = [0, 5, 16, 3, 25, 0, 4]
INIT = [False, True, True, False, True, False, False]
SLOTS = [6, 0, 3, 1, 4, -1, 5]


@pytest.mark.parametrize("table", [False, True], ids=["no-table", "slot-table"])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_fused_mixed_batch_matches_recurrence_and_staged_path(device, dtype, table):
    """Every output and final state vs fp64 (the staged path's bound), and vs the staged path itself; bank
    entries of unused slots bitwise unchanged; the zero-length piece without an initial state leaves zeros."""
    _skip_cpu_without_interpreter(device)
    Q, H, P, G, N = 16, 4, 16, 2, 16
    gen = torch.Generator().manual_seed(31 + table)
    limit = (1e-3, 1.5)
    inp = make_inputs(sum(LENS), H, P, G, N, dtype, device, gen)
    bank0 = inp["bank"].clone()
    rule = small_rule(H, G, P, N, Q, dtype, BLOCK_S=8 if device == "cpu" else 16)   # CPU: two sub-chunks a chunk
    cu, out = run(inp, inp["bank"], LENS, START, SLOTS, INIT, Q, limit, device, True, rule, table)
    assert_matches_reference(inp, out, inp["bank"], bank0, cu, SLOTS, INIT, dtype, limit, skip_empty=True)
    assert torch.equal(inp["bank"][5], torch.zeros_like(bank0[5])), "zero-length piece: its final state is zero"
    assert torch.equal(inp["bank"][[2, 7]], bank0[[2, 7]]), "bank entries of unused slots changed"
    bank_s = bank0.clone()
    _, out_s = run(inp, bank_s, LENS, START, SLOTS, INIT, Q, limit, device, False)
    assert rel(out, out_s) < REL[dtype] and rel(inp["bank"], bank_s) < REL[dtype], "fused vs staged path"


@pytest.mark.parametrize("device,dtype", TIERS)
def test_fused_is_bitwise_repeatable_and_packing_independent(device, dtype):
    """Two runs give the same bits; one sequence in one call == the same sequence in three chunk-aligned calls,
    each packed behind a different neighbour (outputs and final state, bitwise)."""
    _skip_cpu_without_interpreter(device)
    Q, H, P, G, N = 16, 2, 16, 1, 16
    L = 3 * Q + 5
    gen = torch.Generator().manual_seed(8)
    inp = make_inputs(L, H, P, G, N, dtype, device, gen, S=6)
    other = make_inputs(2 * Q, H, P, G, N, dtype, device, gen)
    lim = (0.0, math.inf)
    bank_a, bank_b = inp["bank"].clone(), inp["bank"].clone()
    _, ya = run(inp, bank_a, [L], [0], [2], [True], Q, lim, device, True)
    _, yb = run(inp, bank_b, [L], [0], [2], [True], Q, lim, device, True)
    assert torch.equal(ya, yb) and torch.equal(bank_a, bank_b), "two runs differ"
    bank = inp["bank"].clone()
    for i, (lo, hi) in enumerate([(0, Q), (Q, 3 * Q), (3 * Q, L)]):
        n_other = [3, Q - 1, 9][i]
        piece = {k: (torch.cat([other[k][:n_other], inp[k][lo:hi]]) if k in ("x", "dt", "B", "C") else inp[k])
                 for k in inp}
        _, out = run(piece, bank, [n_other, hi - lo], [4, lo], [5, 2], [False, True], Q, lim, device, True)
        assert torch.equal(out[n_other:], ya[lo:hi]), f"piece {i} outputs differ from the one-call run"
    assert torch.equal(bank[2], bank_a[2]), "final state differs from the one-call run"


@pytest.mark.parametrize("device,dtype", TIERS)
def test_fused_non_power_of_two_chunk_and_precomputed_cb(device, dtype):
    """Chunk 48 (three 16-token sub-chunks), ticket order off and on, C·B inline and precomputed, dt processed
    inside or by the staged cumsum kernel: all vs fp64."""
    _skip_cpu_without_interpreter(device)
    Q, H, P, G, N = 48, 2, 16, 1, 16
    lens, start_pos, has_init, slots = [2 * Q + 3, 5, Q + 22, 3], [Q + 7, 0, 2, 1], [True, False, True, False], \
        [2, 0, 3, -1]
    gen = torch.Generator().manual_seed(23)
    for use_cb, ticket, pre_dt in ((False, False, False), (True, True, False), (False, True, True), (False, True, False)):
        inp = make_inputs(sum(lens), H, P, G, N, dtype, device, gen, S=5)
        bank0 = inp["bank"].clone()
        rule = small_rule(H, G, P, N, Q, dtype, BLOCK_S=16, use_cb=use_cb, ticket=ticket, pre_dt=pre_dt)
        cu, out = run(inp, inp["bank"], lens, start_pos, slots, has_init, Q, (0.0, math.inf), device, True, rule)
        assert_matches_reference(inp, out, inp["bank"], bank0, cu, slots, has_init, dtype, what=f"use_cb={use_cb}: ")
        assert torch.equal(inp["bank"][[1, 4]], bank0[[1, 4]]), "bank entries of unused slots changed"


@pytest.mark.parametrize("device,dtype", TIERS)
def test_fused_writes_checkpoints_like_a_piece_that_ends_there(device, dtype):
    """A checkpoint at a chunk start inside the piece holds bitwise the final state of a piece ending there."""
    _skip_cpu_without_interpreter(device)
    Q, H, P, G, N = 16, 2, 16, 1, 16
    L = 3 * Q + 4
    gen = torch.Generator().manual_seed(12)
    inp = make_inputs(L, H, P, G, N, dtype, device, gen, S=4)
    bank = inp["bank"].clone()
    table = ssd_chunk_table([0, L], [0], Q, device, slot=[1], n_slots=4, checkpoints=[(0, 2 * Q, 3)])
    out = torch.full_like(inp["x"], float("nan"))
    ssd_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], bank, [0, L],
               torch.tensor([1], device=device), [0], torch.tensor([False], device=device), Q, out=out,
               table=table, fused=True)
    short = {k: (inp[k][:2 * Q] if k in ("x", "dt", "B", "C") else inp[k]) for k in inp}
    bank2 = inp["bank"].clone()
    run(short, bank2, [2 * Q], [0], [0], [False], Q, (0.0, math.inf), device, True)
    assert torch.equal(bank[3], bank2[0]), "checkpoint differs from the state a piece ending there leaves"
    _, hf = reference(inp, 0, L, None, (0.0, math.inf))
    assert rel(bank[1], hf) < REL[dtype]


@GPU
@NO_CUDA
def test_fused_bf16_at_model_shape_matches_staged_and_repeats_bitwise():
    """The launch rule's tiles at H32 P64 N128 Q256 (bf16, CUDA): a 3-piece varlen batch (mid-chunk start,
    initial state, a slot -1 piece) vs fp64 and vs the staged path; five runs bitwise equal (the ticket order
    and the inter-program chain give one result); no host sync with a slot-checked table."""
    Q, H, P, G, N = 256, 32, 64, 1, 128
    dev, dtype = "cuda", torch.bfloat16
    lens, start_pos, has_init, slots = [5 * Q + 37, 300, 2 * Q], [100, 0, 0], [True, False, False], [1, -1, 0]
    gen = torch.Generator().manual_seed(2)
    inp = make_inputs(sum(lens), H, P, G, N, dtype, dev, gen, S=3)
    bank0 = inp["bank"].clone()
    cu = cumulative(lens)
    table = ssd_chunk_table(cu, start_pos, Q, dev, slot=slots, n_slots=3)
    slot_t, init_t = torch.tensor(slots, device=dev), torch.tensor(has_init, device=dev)
    outs, banks = [], []
    for _ in range(5):
        bank = bank0.clone()
        out = torch.full_like(inp["x"], float("nan"))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            ssd_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], bank, cu,
                       slot_t, start_pos, init_t, Q, out=out, table=table, fused=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        outs.append(out)
        banks.append(bank)
    for i in range(1, 5):
        assert torch.equal(outs[i], outs[0]) and torch.equal(banks[i], banks[0]), f"run {i} differs"
    out, bank = outs[0], banks[0]
    assert_matches_reference(inp, out, bank, bank0, cu, slots, has_init, dtype)
    bank_s = bank0.clone()
    _, out_s = run(inp, bank_s, lens, start_pos, slots, has_init, Q, (0.0, math.inf), dev, False)
    assert rel(out, out_s) < 5e-3 and rel(bank, bank_s) < 5e-3, "fused vs staged path"
