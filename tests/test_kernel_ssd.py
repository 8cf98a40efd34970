"""fastpath.kernels.ssd_varlen vs the fp64 per-token recurrence (oracle/ssd.py), on the state bank."""
from __future__ import annotations

import math

import pytest
import torch

from kernel_tiers import GPU, NO_CUDA, TIERS, skip_cpu_without_interpreter as _skip_cpu_without_interpreter  # noqa: E402  (sets TRITON_INTERPRET on CPU)

from fastpath.kernels._common import KernelInputError  # noqa: E402
from fastpath.kernels.ssd import ssd_chunk_table, ssd_launch_rule, ssd_varlen  # noqa: E402
from oracle.mamba2 import process_dt  # noqa: E402
from oracle.ssd import chunk_bounds, ssm_recurrence  # noqa: E402

# ‖Δ‖/‖ref‖ bounds per dtype (docs/kernels.md): fp32 measured ≈ 1e-7..4e-7 (CPU interpreter); the bf16 bound
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


def run_batch(inp, lens, start_pos, slots, has_init, Q, limit, use_cb, device):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    out = torch.full_like(inp["x"], float("nan"))
    ssd_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], inp["bank"],
               torch.tensor(cu, device=device), torch.tensor(slots, device=device),
               torch.tensor(start_pos, device=device),
               torch.tensor(has_init, device=device), Q, dt_limit=limit, out=out, use_cb=use_cb)
    return cu, out


@pytest.mark.parametrize("use_cb", [False, True], ids=["cb-inline", "cb-precomputed"])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_ssd_varlen_mixed_batch_matches_recurrence(device, dtype, use_cb):
    """Lengths 1/Q-1/Q/Q+1/several chunks, mid-chunk continuations, mixed initial states, permuted slots,
    a slot -1 piece, n_groups=2, dt clamp: every output and final state vs fp64; other bank entries untouched."""
    _skip_cpu_without_interpreter(device)
    Q, H, P, G, N = 16, 4, 16, 2, 16
    gen = torch.Generator().manual_seed(11 + use_cb)
    lens = [1, Q - 1, Q, Q + 1, 3 * Q + 5, 7]
    start_pos = [0, 5, Q, 3, Q + 9, 0]          # pieces 1, 3 and 4 start mid-chunk
    has_init = [False, True, True, False, True, False]
    slots = [6, 0, 3, 1, 4, -1]                  # permuted, gaps (2, 5, 7 unused), one padding piece
    limit = (1e-3, 1.5)
    inp = to(make_inputs(sum(lens), H, P, G, N, dtype, device, gen), device)
    bank0 = inp["bank"].clone()
    cu, out = run_batch(inp, lens, start_pos, slots, has_init, Q, limit, use_cb, device)
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
def test_ssd_sub_blocked_tiles_match_recurrence(device, dtype):
    """Tiles smaller than the chunk (state sub-blocks, scan row/column blocks, P and N tiles), as the GPU
    launch rule uses at chunk 256: outputs and final states still match fp64."""
    _skip_cpu_without_interpreter(device)
    Q, H, P, G, N = 32, 2, 32, 1, 32
    rule = ssd_launch_rule(H, G, P, N, Q, dtype)
    rule["state"].update(BLOCK_K=16, BLOCK_P=16, BLOCK_N=16)
    rule["scan"].update(BLOCK_M=16, BLOCK_K=16, BLOCK_P=16, BLOCK_S=16)
    rule["bmm"].update(BLOCK_M=16)
    gen = torch.Generator().manual_seed(9)
    lens, start_pos, has_init, slots = [Q + 7, 5], [0, 40], [True, True], [1, 0]
    for use_cb in (False, True):
        inp = to(make_inputs(sum(lens), H, P, G, N, dtype, device, gen, S=2), device)
        bank0 = inp["bank"].clone()
        cu = [0, lens[0], sum(lens)]
        out = torch.full_like(inp["x"], float("nan"))
        ssd_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], inp["bank"], cu,
                   torch.tensor(slots, device=device), start_pos, torch.tensor(has_init, device=device), Q,
                   out=out, use_cb=use_cb, _rule=rule)
        for s, slot in enumerate(slots):
            y, hf = reference(inp, cu[s], cu[s + 1], bank0[slot], (0.0, math.inf))
            assert rel(out[cu[s]:cu[s + 1]], y) < REL[dtype], f"sequence {s} output (use_cb={use_cb})"
            assert rel(inp["bank"][slot], hf) < REL[dtype], f"sequence {s} state (use_cb={use_cb})"


@pytest.mark.parametrize("scan,state_mode", [("rec", "parallel"), ("rec", "fused"), ("rec", "flat"),
                                              ("blocked", "parallel"), ("blocked", "flat"), ("walk", "fused"),
                                              ("rec_masked_pn", "fused")])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_ssd_every_scan_and_state_kernel_matches_recurrence(device, dtype, scan, state_mode):
    """Both scan kernels (sub-chunk recurrence, 16-token steps — also with a wider N tile than N, so masked
    columns; row x column blocks) and the three
    chunk-state paths (fused walk, flat walk, parallel chunk states + passing) at a chunk size that is no power of
    two (48), on a mixed batch with partial chunks, mid-chunk continuations and a slot -1 piece: outputs and
    final states vs fp64, unused bank entries untouched."""
    _skip_cpu_without_interpreter(device)
    Q, H, P, G, N = 48, 2, 16, 1, 16
    rule = ssd_launch_rule(H, G, P, N, Q, dtype)
    rule["scan"].update(kind=scan, BLOCK_S=16, BLOCK_M=32, BLOCK_K=16, BLOCK_P=16)
    if scan == "rec_masked_pn":
        rule["scan"].update(kind="rec", BLOCK_N=2 * N)
    rule["state"].update(mode=state_mode, BLOCK_K=16, BLOCK_P=16, BLOCK_N=16, PASS_BLOCK=64)
    gen = torch.Generator().manual_seed(21)
    lens, start_pos = [2 * Q + 3, 5, Q + 22, 3], [Q + 7, 0, 2, 1]
    has_init, slots = [True, False, True, False], [2, 0, 3, -1]
    inp = to(make_inputs(sum(lens), H, P, G, N, dtype, device, gen, S=5), device)
    bank0 = inp["bank"].clone()
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    out = torch.full_like(inp["x"], float("nan"))
    ssd_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], inp["bank"], cu,
               torch.tensor(slots, device=device), start_pos, torch.tensor(has_init, device=device), Q,
               out=out, _rule=rule)
    for s, slot in enumerate(slots):
        h0 = bank0[slot] if has_init[s] and slot >= 0 else None
        y, hf = reference(inp, cu[s], cu[s + 1], h0, (0.0, math.inf))
        assert rel(out[cu[s]:cu[s + 1]], y) < REL[dtype], f"sequence {s} output"
        if slot >= 0:
            assert rel(inp["bank"][slot], hf) < REL[dtype], f"sequence {s} final state"
    assert torch.equal(inp["bank"][[1, 4]], bank0[[1, 4]]), "bank entries of unused slots changed"


def poison_scratch(monkeypatch) -> None:
    """Every float tensor torch.empty makes is NaN from here on: a kernel that reads scratch it never wrote
    (e.g. C·Bᵀ blocks above the diagonal) puts NaN in its outputs instead of reading whatever memory held."""
    real = torch.empty

    def empty(*a, **k):
        t = real(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.parametrize("use_cb", [False, True], ids=["cb-inline", "cb-precomputed"])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_ssd_walk_scan_has_the_bits_of_the_blocked_scan(device, dtype, use_cb, monkeypatch):
    """Scan kind "walk" (one program walks a chunk's row blocks; holding the entering state, or reading it again
    per row block) == "blocked" (a program per row block) bitwise: outputs and final states, on a batch with
    partial chunks, a continuation and a slot -1 piece; with row blocks coarser than the C·Bᵀ kernel's (which
    leaves blocks above the diagonal unwritten) and NaN-poisoned scratch."""
    _skip_cpu_without_interpreter(device)
    Q, H, P, G, N = 48, 4, 16, 2, 16
    gen = torch.Generator().manual_seed(31 + use_cb)
    lens, start_pos, has_init, slots = [2 * Q + 5, 7, Q - 1], [Q + 3, 0, 2], [True, False, True], [1, -1, 2]
    inp = to(make_inputs(sum(lens), H, P, G, N, dtype, device, gen, S=4), device)
    cu = [0, lens[0], lens[0] + lens[1], sum(lens)]
    poison_scratch(monkeypatch)
    got = {}
    for name in ("blocked", "walk"):
        rule = ssd_launch_rule(H, G, P, N, Q, dtype)
        rule["scan"].update(kind=name, BLOCK_M=32, BLOCK_K=16, BLOCK_P=16)    # K >= 16: tl.dot's minimum on a GPU
        rule["bmm"].update(BLOCK_M=16)
        bank = inp["bank"].clone()
        out = torch.full_like(inp["x"], float("nan"))
        ssd_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], bank, cu,
                   torch.tensor(slots, device=device), start_pos, torch.tensor(has_init, device=device), Q,
                   out=out, use_cb=use_cb, _rule=rule)
        assert torch.isfinite(out).all(), f"{name}: output rows unwritten or read from unwritten scratch"
        got[name] = (out, bank)
    assert torch.equal(got["walk"][0], got["blocked"][0]) and torch.equal(got["walk"][1], got["blocked"][1])


@pytest.mark.parametrize("entry,key,value,field", [("state", "mode", "pair", "state mode 'pair'"),
                                                   ("scan", "kind", "nope", "scan kind 'nope'")])
def test_ssd_unknown_state_mode_or_scan_kind_is_refused_by_name(entry, key, value, field):
    """A launch rule naming a chunk-state mode or scan kind that does not exist is refused with the name, before
    any launch (an unknown state mode used to fall through to the fused walk)."""
    _skip_cpu_without_interpreter("cpu")
    Q, H, P, G, N = 16, 2, 16, 1, 16
    inp = make_inputs(20, H, P, G, N, torch.float32, "cpu", torch.Generator().manual_seed(6), S=2)
    rule = ssd_launch_rule(H, G, P, N, Q, torch.float32)
    rule[entry][key] = value
    bank = inp["bank"].clone()
    with pytest.raises(KernelInputError, match=field):
        ssd_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], bank, [0, 20],
                   torch.tensor([0]), [0], torch.tensor([False]), Q, fused=False, _rule=rule)
    assert torch.equal(bank, inp["bank"]), "the bank was written before the refusal"


@pytest.mark.parametrize("slot,has_init", [(1, True), (-1, False)], ids=["banked", "slot-1"])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_ssd_segmented_walk_has_the_bits_of_one_walk(device, dtype, slot, has_init, monkeypatch):
    """State key `segment_chunks` (the walk of one sequence cut into segments carried in fp32, each segment's scan
    launched after it; on CUDA the walk runs on a side stream) == the uncut walk bitwise: outputs, the final bank
    state and a checkpoint inside the piece, for segments of 1, 2 and 3 chunks of a mid-chunk continuation of 7
    chunks (the last segment partial), vs fp64 too; NaN-poisoned scratch catches an unwritten carry."""
    _skip_cpu_without_interpreter(device)
    Q, H, P, G, N, S = 48, 2, 16, 1, 16, 4
    L, sp = 6 * Q - 5, Q + 3                                            # 7 chunks: 45 + 5 × 48 + 4 tokens
    gen = torch.Generator().manual_seed(47 + has_init)
    inp = to(make_inputs(L, H, P, G, N, dtype, device, gen, S=S), device)
    bank0 = inp["bank"].clone()
    poison_scratch(monkeypatch)
    got = {}
    for seg in (0, 1, 2, 3):
        rule = ssd_launch_rule(H, G, P, N, Q, dtype)
        rule["scan"].update(BLOCK_S=16, BLOCK_P=16)
        rule["state"].update(BLOCK_K=16, BLOCK_P=16, BLOCK_N=16, segment_chunks=seg)
        bank = bank0.clone()
        table = ssd_chunk_table([0, L], [sp], Q, device, slot=[slot], n_slots=S, checkpoints=[(0, 3 * Q, 3)])
        out = torch.full_like(inp["x"], float("nan"))
        ssd_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], bank, [0, L],
                   torch.tensor([slot], device=device), [sp], torch.tensor([has_init], device=device), Q,
                   out=out, table=table, _rule=rule)
        got[seg] = (out, bank)
    y, hf = reference(inp, 0, L, bank0[slot] if has_init else None, (0.0, math.inf))
    assert rel(got[0][0], y) < REL[dtype]
    if slot >= 0:
        assert rel(got[0][1][slot], hf) < REL[dtype]
    for seg in (1, 2, 3):
        assert torch.equal(got[seg][0], got[0][0]), f"segments of {seg} chunks: outputs differ from one walk"
        assert torch.equal(got[seg][1], got[0][1]), f"segments of {seg} chunks: bank (final state, checkpoint)"


@pytest.mark.parametrize("device,dtype", TIERS)
def test_ssd_descriptor_scan_and_state_have_the_bits_of_the_pointer_kernels(device, dtype):
    """Scan kind "rec_tma" and state mode "tma" (x, B, C, y moved as tensor-descriptor boxes, which run past a
    chunk's end into the next sequence) == "rec" and the fused walk — bitwise in the interpreter (the same sums in
    the same order; compiled, the kernels' layouts may differ, so there within the tier's tolerance) — outputs and
    final states, on a batch with partial chunks, a continuation and a slot -1 piece; a NaN in the next sequence's
    x and B reaches neither the sequence before it nor its own finite rows. (The interpreter runs programs in order,
    so a box store past a chunk's end would be overwritten there: only the GPU can show that race.)"""
    _skip_cpu_without_interpreter(device)
    Q, H, P, G, N = 48, 2, 16, 1, 16
    gen = torch.Generator().manual_seed(41)
    lens, start_pos = [2 * Q + 5, 7, Q - 1, 9], [Q + 3, 0, 2, 0]
    has_init, slots = [True, False, True, False], [1, -1, 2, 3]
    inp = to(make_inputs(sum(lens), H, P, G, N, dtype, device, gen, S=4), device)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    inp["x"][cu[3]:] = float("nan")            # the last sequence: every row NaN
    inp["B"][cu[3]:] = float("nan")
    got = {}
    for kind, mode in (("rec", "fused"), ("rec_tma", "fused"), ("rec", "tma")):
        rule = ssd_launch_rule(H, G, P, N, Q, dtype)
        rule["scan"].update(kind=kind, BLOCK_S=16, BLOCK_P=16, BLOCK_N=16)
        rule["state"].update(mode=mode, BLOCK_K=16, BLOCK_P=16, BLOCK_N=16)
        kind = kind if mode == "fused" else f"state_{mode}"
        bank = inp["bank"].clone()
        out = torch.full_like(inp["x"], float("nan"))
        ssd_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], bank, cu,
                   torch.tensor(slots, device=device), start_pos, torch.tensor(has_init, device=device), Q,
                   out=out, _rule=rule)
        assert torch.isfinite(out[:cu[3]]).all(), f"{kind}: a row unwritten or reached by the next sequence's NaN"
        got[kind] = (out[:cu[3]], bank[[0, 1, 2]])
    for k in ("rec_tma", "state_tma"):
        if device == "cpu":
            assert torch.equal(got[k][0], got["rec"][0]) and torch.equal(got[k][1], got["rec"][1]), k
        else:
            assert rel(got[k][0], got["rec"][0]) < REL[dtype] and rel(got[k][1], got["rec"][1]) < REL[dtype], k


def test_ssd_stage_marks_put_the_host_set_up_before_the_first_launch():
    """The benchmark hook sees "host" once, before any stage, then the staged path's stages in launch order (so a
    bench's first-stage time excludes the host's checks and set-up)."""
    _skip_cpu_without_interpreter("cpu")
    Q, H, P, G, N = 16, 2, 16, 1, 16
    inp = make_inputs(20, H, P, G, N, torch.float32, "cpu", torch.Generator().manual_seed(5), S=2)
    seen: list[str] = []
    ssd_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], inp["bank"], [0, 20],
               torch.tensor([0]), [0], torch.tensor([False]), Q, fused=False, _mark=seen.append)
    assert seen == ["host", "cumsum", "bmm", "state", "scan"]


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
