"""fastpath.kernels.ssd_varlen vs the fp64 per-token recurrence (oracle/ssd.py), on the state bank."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kernel_tiers import GPU, NO_CUDA, TIERS, skip_cpu_without_interpreter as _skip_cpu_without_interpreter  # noqa: E402  (sets TRITON_INTERPRET on CPU)

import fastpath.kernels.ssd as ssd_mod  # noqa: E402
from fastpath.kernels._common import KernelInputError  # noqa: E402
from fastpath.kernels.ssd import ssd_chunk_table, ssd_varlen  # noqa: E402
from oracle.mamba2 import process_dt  # noqa: E402
from oracle.ssd import chunk_bounds, ssm_recurrence  # noqa: E402

# ‖Δ‖/‖ref‖ bounds per dtype, with the measured errors they cover (docs/kernels.md, "Error bounds"); the bf16 bound
# covers bf16 outputs and 16-bit tensor-core operands.
REL = {torch.float32: 5e-6, torch.bfloat16: 1.5e-2}


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """‖a - ref‖ / ‖ref‖ in fp64; NaN (unwritten output) never passes."""
    a = a.double().cpu()
    ref = ref.double().cpu()
    assert torch.isfinite(a).all(), "output has NaN/inf (an element was not written?)"
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


def make_inputs(T, H, P, G, N, dtype, device, gen, S=8):
    """Fresh random SSD inputs (raw dt around softplus's bend, negative A, fp32 bank)."""
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(x=r(T, H, P).to(dtype), dt=(r(T, H) * 0.7 - 0.5).to(dtype), A=-(torch.rand(H, generator=gen) * 2 + 0.1),
                B=r(T, G, N).to(dtype), C=r(T, G, N).to(dtype), D=r(H), dt_bias=r(H) * 0.3,
                bank=r(S, H, P, N))


def to(d, device):
    return {k: v.to(device) for k, v in d.items()}


def reference(inp, s_lo, s_hi, h0, limit):
    """fp64 recurrence for one sequence's token range, from h0 (None = zeros)."""
    dt = process_dt(inp["dt"][s_lo:s_hi].double().cpu(), inp["dt_bias"].double().cpu(), limit)
    return ssm_recurrence(inp["x"][s_lo:s_hi].double().cpu(), dt, inp["A"].double().cpu(),
                          inp["B"][s_lo:s_hi].double().cpu(), inp["C"][s_lo:s_hi].double().cpu(),
                          inp["D"].double().cpu(), None if h0 is None else h0.double().cpu())


def with_tiles(monkeypatch, **tiles) -> None:
    """ssd_varlen launched with `tiles` in place of its launch rule's (SSDLaunchRule fields): tiles smaller than
    the chunk run the sub-blocked loops at CPU sizes."""
    real = ssd_mod.ssd_launch_rule
    monkeypatch.setattr(ssd_mod, "ssd_launch_rule", lambda *a: dataclasses.replace(real(*a), **tiles))


def run_batch(inp, lens, start_pos, slots, has_init, Q, limit, device, table=False):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    out = torch.full_like(inp["x"], float("nan"))
    tab = ssd_chunk_table(cu, start_pos, Q, device, slot=slots, n_slots=inp["bank"].shape[0]) if table else None
    ssd_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], inp["bank"],
               torch.tensor(cu, device=device), torch.tensor(slots, device=device),
               torch.tensor(start_pos, device=device),
               torch.tensor(has_init, device=device), Q, dt_limit=limit, out=out, table=tab)
    return cu, out


@pytest.mark.parametrize("device,dtype", TIERS)
def test_ssd_varlen_mixed_batch_matches_recurrence(device, dtype):
    """Lengths 1/Q-1/Q/Q+1/several chunks, mid-chunk continuations, mixed initial states, permuted slots,
    a slot -1 piece, n_groups=2, dt clamp: every output and final state vs fp64; other bank entries untouched."""
    _skip_cpu_without_interpreter(device)
    Q, H, P, G, N = 16, 4, 16, 2, 16
    gen = torch.Generator().manual_seed(11)
    lens = [1, Q - 1, Q, Q + 1, 3 * Q + 5, 7]
    start_pos = [0, 5, Q, 3, Q + 9, 0]          # pieces 1, 3 and 4 start mid-chunk
    has_init = [False, True, True, False, True, False]
    slots = [6, 0, 3, 1, 4, -1]                  # permuted, gaps (2, 5, 7 unused), one padding piece
    limit = (1e-3, 1.5)
    inp = to(make_inputs(sum(lens), H, P, G, N, dtype, device, gen), device)
    bank0 = inp["bank"].clone()
    cu, out = run_batch(inp, lens, start_pos, slots, has_init, Q, limit, device)
    for s, slot in enumerate(slots):
        h0 = bank0[slot] if has_init[s] and slot >= 0 else None
        y, hf = reference(inp, cu[s], cu[s + 1], h0, limit)
        assert rel(out[cu[s]:cu[s + 1]], y) < REL[dtype], f"sequence {s} output"
        if slot >= 0:
            assert rel(inp["bank"][slot], hf) < REL[dtype], f"sequence {s} final state"
    untouched = [2, 5, 7]
    assert torch.equal(inp["bank"][untouched], bank0[untouched]), "bank entries of unused slots changed"


@pytest.mark.parametrize("device,dtype", TIERS)
def test_ssd_varlen_without_D_bias_or_limit_single_group(device, dtype):
    """Optional inputs off (D, dt_bias None; no clamp), G = 1, one sequence of several chunks, prebuilt table."""
    _skip_cpu_without_interpreter(device)
    Q, H, P, G, N = 16, 2, 16, 1, 16
    L = 2 * Q + 3
    gen = torch.Generator().manual_seed(5)
    inp = to(make_inputs(L, H, P, G, N, dtype, device, gen, S=2), device)
    out = torch.full_like(inp["x"], float("nan"))
    slot = torch.tensor([1], device=device)
    table = ssd_chunk_table([0, L], [0], Q, device, slot=slot, n_slots=2)   # slots checked once, no sync later
    ssd_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], None, None, inp["bank"], [0, L],
               slot, [0], torch.tensor([False], device=device), Q, out=out, table=table)
    dt = torch.nn.functional.softplus(inp["dt"].double().cpu())
    y, hf = ssm_recurrence(inp["x"].double().cpu(), dt, inp["A"].double().cpu(), inp["B"].double().cpu(),
                           inp["C"].double().cpu(), None, None)
    assert rel(out, y) < REL[dtype]
    assert rel(inp["bank"][1], hf) < REL[dtype]


@pytest.mark.parametrize("device,dtype", TIERS)
def test_ssd_chunk_aligned_split_is_bitwise_identical(device, dtype):
    """One sequence in one call == the same sequence cut at chunk multiples into three calls, each packed
    with different neighbours: bitwise equal outputs and final state."""
    _skip_cpu_without_interpreter(device)
    Q, H, P, G, N = 16, 4, 16, 2, 16
    L = 3 * Q + 5
    gen = torch.Generator().manual_seed(7)
    inp = to(make_inputs(L, H, P, G, N, dtype, device, gen), device)
    other = to(make_inputs(2 * Q, H, P, G, N, dtype, device, gen), device)
    bank = inp["bank"]
    bank[2].zero_()
    ref = torch.full_like(inp["x"], float("nan"))
    ssd_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], bank, [0, L],
               torch.tensor([2], device=device), [0], torch.tensor([True], device=device), Q, out=ref)
    final_one_call = bank[2].clone()
    bank[2].zero_()
    pieces = [(0, Q), (Q, 3 * Q), (3 * Q, L)]
    for i, (lo, hi) in enumerate(pieces):
        n_other = [3, Q - 1, 9][i]                 # a neighbour before our piece changes the packing
        cat = lambda k: torch.cat([other[k][:n_other], inp[k][lo:hi]])  # noqa: E731
        out = torch.full_like(cat("x"), float("nan"))
        ssd_varlen(cat("x"), cat("dt"), inp["A"], cat("B"), cat("C"), inp["D"], inp["dt_bias"], bank,
                   [0, n_other, n_other + hi - lo], torch.tensor([5, 2], device=device), [4, lo],
                   torch.tensor([False, True], device=device), Q, out=out)
        assert torch.equal(out[n_other:], ref[lo:hi]), f"piece {i} outputs differ from the one-call run"
    assert torch.equal(bank[2], final_one_call), "final state differs from the one-call run"


@pytest.mark.parametrize("device,dtype", TIERS)
def test_ssd_sub_blocked_tiles_match_recurrence(device, dtype, monkeypatch):
    """Tiles smaller than the chunk (chunk-state sub-blocks, scan sub-chunks, P and N tiles), as the GPU
    launch rule uses at chunk 256: outputs and final states still match fp64."""
    _skip_cpu_without_interpreter(device)
    Q, H, P, G, N = 32, 2, 32, 1, 32
    with_tiles(monkeypatch, state_block_k=16, state_block_p=16, state_block_n=16, scan_block_s=16, scan_block_p=16)
    gen = torch.Generator().manual_seed(9)
    lens, start_pos, has_init, slots = [Q + 7, 5], [0, 40], [True, True], [1, 0]
    inp = to(make_inputs(sum(lens), H, P, G, N, dtype, device, gen, S=2), device)
    bank0 = inp["bank"].clone()
    cu = [0, lens[0], sum(lens)]
    out = torch.full_like(inp["x"], float("nan"))
    ssd_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], inp["bank"], cu,
               torch.tensor(slots, device=device), start_pos, torch.tensor(has_init, device=device), Q, out=out)
    for s, slot in enumerate(slots):
        y, hf = reference(inp, cu[s], cu[s + 1], bank0[slot], (0.0, math.inf))
        assert rel(out[cu[s]:cu[s + 1]], y) < REL[dtype], f"sequence {s} output"
        assert rel(inp["bank"][slot], hf) < REL[dtype], f"sequence {s} state"


@pytest.mark.parametrize("masked_pn", [False, True], ids=["whole-pn", "masked-pn"])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_ssd_chunk_size_no_power_of_two_matches_recurrence(device, dtype, masked_pn, monkeypatch):
    """A chunk size that is no power of two (48, 16-token steps; masked_pn: the scan's N tile wider than N, so its
    columns are masked) on a mixed batch with partial chunks, mid-chunk continuations and a slot -1 piece: outputs
    and final states vs fp64, unused bank entries untouched."""
    _skip_cpu_without_interpreter(device)
    Q, H, P, G, N = 48, 2, 16, 1, 16
    with_tiles(monkeypatch, scan_block_s=16, scan_block_p=16, scan_block_n=2 * N if masked_pn else N,
               state_block_k=16, state_block_p=16, state_block_n=16)
    gen = torch.Generator().manual_seed(21)
    lens, start_pos = [2 * Q + 3, 5, Q + 22, 3], [Q + 7, 0, 2, 1]
    has_init, slots = [True, False, True, False], [2, 0, 3, -1]
    inp = to(make_inputs(sum(lens), H, P, G, N, dtype, device, gen, S=5), device)
    bank0 = inp["bank"].clone()
    cu, out = run_batch(inp, lens, start_pos, slots, has_init, Q, (0.0, math.inf), device)
    for s, slot in enumerate(slots):
        h0 = bank0[slot] if has_init[s] and slot >= 0 else None
        y, hf = reference(inp, cu[s], cu[s + 1], h0, (0.0, math.inf))
        assert rel(out[cu[s]:cu[s + 1]], y) < REL[dtype], f"sequence {s} output"
        if slot >= 0:
            assert rel(inp["bank"][slot], hf) < REL[dtype], f"sequence {s} final state"
    assert torch.equal(inp["bank"][[1, 4]], bank0[[1, 4]]), "bank entries of unused slots changed"


@pytest.mark.parametrize("device,dtype", TIERS)
def test_ssd_zero_length_piece_writes_its_entering_state(device, dtype):
    """A piece of no tokens (with a slot-checked table and without) leaves its slot holding the state it entered
    with: zeros without an initial state, the bank's own state with one; the other pieces still match fp64."""
    _skip_cpu_without_interpreter(device)
    Q, H, P, G, N = 16, 2, 16, 1, 16
    lens, start_pos, has_init, slots = [0, 21, 0], [4, 3, 9], [False, True, True], [5, 1, 2]
    for table in (False, True):
        inp = to(make_inputs(sum(lens), H, P, G, N, dtype, device, torch.Generator().manual_seed(13), S=6), device)
        bank0 = inp["bank"].clone()
        cu, out = run_batch(inp, lens, start_pos, slots, has_init, Q, (0.0, math.inf), device, table=table)
        assert torch.equal(inp["bank"][5], torch.zeros_like(bank0[5])), f"table={table}: no initial state"
        assert torch.equal(inp["bank"][2], bank0[2]), f"table={table}: initial state"
        y, hf = reference(inp, cu[1], cu[2], bank0[1], (0.0, math.inf))
        assert rel(out, y) < REL[dtype] and rel(inp["bank"][1], hf) < REL[dtype], f"table={table}"


@pytest.mark.parametrize("device,dtype", TIERS)
def test_ssd_checkpoint_is_bitwise_the_state_a_piece_ending_there_leaves(device, dtype):
    """A checkpoint at a chunk start inside a piece (continued mid-chunk from a banked state) holds bitwise the
    final state of the same piece cut there; the piece's own final state still matches fp64."""
    _skip_cpu_without_interpreter(device)
    Q, H, P, G, N = 16, 2, 16, 1, 16
    L, sp, at = 4 * Q + 3, 5, 2 * Q
    inp = to(make_inputs(L, H, P, G, N, dtype, device, torch.Generator().manual_seed(12), S=4), device)
    bank0 = inp["bank"].clone()
    table = ssd_chunk_table([0, L], [sp], Q, device, slot=[1], n_slots=4, checkpoints=[(0, at, 3)])
    ssd_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], inp["bank"], [0, L],
               torch.tensor([1], device=device), [sp], torch.tensor([True], device=device), Q, table=table)
    n = at - sp                                                 # the tokens before the checkpoint
    short = {k: (v[:n] if k in ("x", "dt", "B", "C") else v) for k, v in inp.items()}
    short["bank"] = bank0.clone()
    run_batch(short, [n], [sp], [1], [True], Q, (0.0, math.inf), device)
    assert torch.equal(inp["bank"][3], short["bank"][1]), "checkpoint != the state of the piece cut there"
    _, hf = reference(inp, 0, L, bank0[1], (0.0, math.inf))
    assert rel(inp["bank"][1], hf) < REL[dtype]


def test_ssd_varlen_runs_each_stage_once_in_launch_order_through_the_module_names(monkeypatch):
    """ssd_varlen calls the functions named in STAGES once each, in order, through the module (a bench times the
    stages by wrapping those names), and a wrapper that passes through keeps the result bitwise."""
    _skip_cpu_without_interpreter("cpu")
    Q, H, P, G, N = 16, 2, 16, 1, 16
    inp = make_inputs(20, H, P, G, N, torch.float32, "cpu", torch.Generator().manual_seed(5), S=2)
    args = lambda bank: (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], bank,  # noqa: E731
                         [0, 20], torch.tensor([0]), [0], torch.tensor([False]), Q)
    bank_a, bank_b = inp["bank"].clone(), inp["bank"].clone()
    y_a = ssd_varlen(*args(bank_a))
    seen: list[str] = []
    for name in ssd_mod.STAGES:
        real = getattr(ssd_mod, name)
        monkeypatch.setattr(ssd_mod, name, lambda *a, real=real, name=name: seen.append(name) or real(*a))
    y_b = ssd_varlen(*args(bank_b))
    assert seen == list(ssd_mod.STAGES) == ["cumsum_stage", "chunk_state_stage", "scan_stage"]
    assert torch.equal(y_a, y_b) and torch.equal(bank_a, bank_b)


def test_ssd_chunk_table_cuts_at_absolute_multiples():
    """The packed chunk table equals oracle.ssd.chunk_bounds per sequence (fresh random starts/lengths)."""
    gen = torch.Generator().manual_seed(3)
    for Q in (8, 16, 256):
        lens = torch.randint(0, 3 * Q, (6,), generator=gen).tolist()
        starts = torch.randint(0, 4 * Q, (6,), generator=gen).tolist()
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        t = ssd_chunk_table(cu, starts, Q, "cpu")
        ptr, cs, cl = t.seq_chunk_ptr.tolist(), t.chunk_start.tolist(), t.chunk_len.tolist()
        for s in range(6):
            got = [(cs[c] - cu[s], cs[c] - cu[s] + cl[c]) for c in range(ptr[s], ptr[s + 1])]
            assert got == chunk_bounds(starts[s], lens[s], Q)


def test_ssd_rejects_bad_inputs_naming_the_field():
    """Repeated slots, a bf16 bank, wrong shapes and a short start_pos raise KernelInputError naming the field."""
    inp = make_inputs(4, 2, 16, 1, 16, torch.float32, "cpu", torch.Generator().manual_seed(0), S=4)
    base = dict(x=inp["x"], dt=inp["dt"], A=inp["A"], B=inp["B"], C=inp["C"], D=inp["D"], dt_bias=inp["dt_bias"],
                ssm_bank=inp["bank"], cu_seqlens=[0, 2, 4], slot=torch.tensor([1, 2]), start_pos=[0, 0],
                has_initial_state=torch.tensor([False, False]), chunk_size=16)
    cases = [("slot", dict(slot=torch.tensor([1, 1]))), ("ssm_bank", dict(ssm_bank=inp["bank"].bfloat16())),
             ("B", dict(B=inp["B"][:3])), ("start_pos", dict(start_pos=[0])), ("slot", dict(slot=torch.tensor([1, 9]))),
             ("dt", dict(dt=inp["dt"].T.contiguous()))]
    for field, change in cases:
        with pytest.raises(KernelInputError, match=field):
            ssd_varlen(**{**base, **change})
    with pytest.raises(KernelInputError, match="slot"):
        ssd_chunk_table([0, 2, 4], [0, 0], 16, "cpu", slot=torch.tensor([3, 3]), n_slots=4)
    with pytest.raises(KernelInputError, match="table"):
        ssd_varlen(**{**base, "table": ssd_chunk_table([0, 4], [0], 16, "cpu")})


@GPU
@NO_CUDA
def test_ssd_int64_offsets_beyond_2_31_elements():
    """A packed batch whose last sequence starts past 2^31 elements of x (and of the chunk states):
    that sequence and the first one still match the fp64 recurrence (int32 offsets would wrap)."""
    Q, H, P, G, N = 256, 32, 64, 1, 64
    filler = (2 ** 31) // (H * P) + 3 * Q + 17        # sequence 0 ends past element 2^31 of x
    lens = [filler, 300]
    T = sum(lens)
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev, dt_ = "cuda", torch.bfloat16
    x = torch.randn(T, H, P, device=dev, dtype=dt_, generator=gen)
    dt = (torch.randn(T, H, device=dev, generator=gen) * 0.7 - 0.5).to(dt_)
    B = torch.randn(T, G, N, device=dev, dtype=dt_, generator=gen)
    C = torch.randn(T, G, N, device=dev, dtype=dt_, generator=gen)
    A = -(torch.rand(H, device=dev, generator=gen) * 2 + 0.1)
    D, dtb = torch.randn(H, device=dev, generator=gen), torch.randn(H, device=dev, generator=gen) * 0.3
    bank = torch.randn(2, H, P, N, device=dev, generator=gen)
    bank0 = bank.clone()
    assert (filler * H * P) > 2 ** 31
    out = torch.full_like(x, float("nan"))
    try:
        ssd_varlen(x, dt, A, B, C, D, dtb, bank, [0, filler, T], torch.tensor([0, 1], device=dev), [0, 0],
                   torch.tensor([False, True], device=dev), Q, out=out)
        torch.cuda.synchronize()      # a wrapped (int32) offset shows up here as an out-of-bounds access
    except RuntimeError as e:
        pytest.fail(f"ssd_varlen faulted on offsets beyond 2^31 elements (int32 index arithmetic?): {e}")
    inp = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dtb)
    y, hf = reference(inp, filler, T, bank0[1], (0.0, math.inf))
    assert rel(out[filler:], y) < REL[dt_]
    assert rel(bank[1], hf) < REL[dt_]
    y0, _ = reference(inp, 0, 2 * Q + 7, None, (0.0, math.inf))
    assert rel(out[:2 * Q + 7], y0) < REL[dt_]
    assert torch.isfinite(out[:filler].float()).all()


@GPU
@NO_CUDA
def test_ssd_with_slot_checked_table_makes_no_host_sync():
    """With a table built with the slots, an ssd_varlen call runs under sync-debug mode "error" (no host
    sync), and gives the same bits as the call without a table."""
    Q, H, P, G, N = 64, 4, 32, 1, 32
    dev = "cuda"
    inp = to(make_inputs(3 * Q + 5, H, P, G, N, torch.bfloat16, "cpu", torch.Generator().manual_seed(4), S=3), dev)
    slot, init = torch.tensor([2, 0], device=dev), torch.tensor([True, False], device=dev)
    cu, sp = [0, Q + 3, 3 * Q + 5], [5, 0]
    args = lambda bank: (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], bank,  # noqa: E731
                         cu, slot, sp, init, Q)
    bank_a, bank_b = inp["bank"].clone(), inp["bank"].clone()
    y_a = ssd_varlen(*args(bank_a))
    table = ssd_chunk_table(cu, sp, Q, dev, slot=slot, n_slots=3)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y_b = ssd_varlen(*args(bank_b), table=table)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(y_a, y_b) and torch.equal(bank_a, bank_b)
