"""The multi-head chunk scans (fastpath/kernels/ssd_scan_mh.py, ssd_scan_blk_mh.py: HEADS heads of a group per
program sharing C·Bᵀ), selected through the launch rule's scan kind: vs the fp64 recurrence and vs the one-head
scans on varlen pieces starting mid-chunk with bank initial states, a slot -1 piece and a checkpoint; bitwise
across runs; at the model shape in bf16 on CUDA."""
from __future__ import annotations

import math

import pytest
import torch

from kernel_tiers import GPU, NO_CUDA, TIERS, skip_cpu_without_interpreter as _skip_cpu_without_interpreter  # noqa: E402  (sets TRITON_INTERPRET on CPU)

from fastpath.kernels.ssd import ssd_chunk_table, ssd_launch_rule, ssd_varlen  # noqa: E402
from test_kernel_ssd_fused import REL, assert_matches_reference, cumulative, make_inputs, reference, rel  # noqa: E402

LENS, START = [2 * 48 + 3, 5, 48 + 22, 3], [48 + 7, 0, 2, 1]
INIT, SLOTS = [True, False, True, False], [2, 0, 3, -1]


def scan_rule(H, G, P, N, Q, dtype, **scan):
    rule = ssd_launch_rule(H, G, P, N, Q, dtype)
    rule["scan"].update(scan)
    rule["state"].update(BLOCK_K=16, BLOCK_P=16, BLOCK_N=16)
    return rule


def run(inp, bank, rule, lens, start_pos, slots, has_init, Q, device, checkpoints=None):
    cu = cumulative(lens)
    out = torch.full_like(inp["x"], float("nan"))
    table = ssd_chunk_table(cu, start_pos, Q, device, slot=slots, n_slots=bank.shape[0], checkpoints=checkpoints)
    ssd_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], bank, cu,
               torch.tensor(slots, device=device), start_pos, torch.tensor(has_init, device=device), Q, out=out,
               table=table, fused=False, _rule=rule)
    return cu, out


# (kind, HEADS, the one-head kind it must match); G=2 at H=4: HEADS 4 falls back to 2 (a block never spans groups)
CASES = [("rec_mh", 2, "rec", 1), ("rec_mh", 4, "rec", 1), ("rec_mh", 4, "rec", 2),
         ("blocked_mh", 2, "blocked", 1), ("blocked_mh", 4, "blocked", 1), ("blocked_mh", 4, "blocked", 2)]


@pytest.mark.parametrize("kind,heads,base,G", CASES, ids=[f"{k}-h{h}-g{g}" for k, h, _, g in CASES])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_multihead_scan_matches_recurrence_and_one_head_scan(device, dtype, kind, heads, base, G):
    """Chunk 48 (three 16-token steps / blocks), a mixed varlen batch with a checkpoint inside piece 0: outputs,
    final states and the checkpoint vs fp64; outputs vs the one-head kind (bitwise in the fp32 interpreter, where
    every head runs the same sums); two runs bitwise equal; unused bank entries untouched."""
    _skip_cpu_without_interpreter(device)
    Q, H, P, N = 48, 4, 16, 16
    gen = torch.Generator().manual_seed(40 + heads + G)
    inp = make_inputs(sum(LENS), H, P, G, N, dtype, device, gen, S=6)
    bank0 = inp["bank"].clone()
    tiles = dict(BLOCK_S=16, BLOCK_M=16, BLOCK_K=16, BLOCK_P=16)
    ck = [(0, 2 * Q, 5)]                               # piece 0 spans [55, 154): chunk start 96 is inside
    banks, outs = [], []
    for _ in range(2):
        bank = bank0.clone()
        cu, out = run(inp, bank, scan_rule(H, G, P, N, Q, dtype, kind=kind, HEADS=heads, **tiles), LENS, START,
                      SLOTS, INIT, Q, device, ck)
        banks.append(bank)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(banks[0], banks[1]), "two runs differ"
    out, bank = outs[0], banks[0]
    assert_matches_reference(inp, out, bank, bank0, cu, SLOTS, INIT, dtype)
    _, hck = reference(inp, cu[0], cu[0] + 2 * Q - START[0], bank0[SLOTS[0]], (0.0, math.inf))
    assert rel(bank[5], hck) < REL[dtype], "checkpoint state"
    assert torch.equal(bank[1], bank0[1]) and torch.equal(bank[4], bank0[4]), "bank entries of unused slots changed"
    bank_b = bank0.clone()
    _, out_b = run(inp, bank_b, scan_rule(H, G, P, N, Q, dtype, kind=base, **tiles), LENS, START, SLOTS, INIT, Q,
                   device, ck)
    assert torch.equal(bank, bank_b), "final states differ from the one-head scan's run (same state stage)"
    if device == "cpu":
        assert torch.equal(out, out_b), f"{kind} differs from {base}"
    else:
        assert rel(out, out_b) < REL[dtype], f"{kind} vs {base}"


@GPU
@NO_CUDA
def test_multihead_scans_bf16_at_model_shape():
    """H32 P64 G1 N128 Q256, bf16, the launch rule's tiles, each multi-head kind at HEADS 2 and 4: a 3-piece varlen
    batch (mid-chunk start, initial state, a slot -1 piece) vs fp64 and vs the default staged scan; three runs
    bitwise equal; final states bitwise those of the default path (the same state stage)."""
    Q, H, P, G, N = 256, 32, 64, 1, 128
    dev, dtype = "cuda", torch.bfloat16
    lens, start_pos, has_init, slots = [5 * Q + 37, 300, 2 * Q], [100, 0, 0], [True, False, False], [1, -1, 0]
    gen = torch.Generator().manual_seed(2)
    inp = make_inputs(sum(lens), H, P, G, N, dtype, dev, gen, S=3)
    bank0 = inp["bank"].clone()
    cu = cumulative(lens)
    refs = [reference(inp, cu[s], cu[s + 1], bank0[slot] if has_init[s] and slot >= 0 else None, (0.0, math.inf))
            for s, slot in enumerate(slots)]
    bank_s = bank0.clone()
    _, out_s = run(inp, bank_s, ssd_launch_rule(H, G, P, N, Q, dtype), lens, start_pos, slots, has_init, Q, dev)
    for kind, heads in [("rec_mh", 2), ("rec_mh", 4), ("blocked_mh", 2), ("blocked_mh", 4)]:
        rule = ssd_launch_rule(H, G, P, N, Q, dtype)
        rule["scan"].update(kind=kind, HEADS=heads)
        outs, banks = [], []
        for _ in range(3):
            bank = bank0.clone()
            _, out = run(inp, bank, rule, lens, start_pos, slots, has_init, Q, dev)
            outs.append(out)
            banks.append(bank)
        for i in (1, 2):
            assert torch.equal(outs[i], outs[0]) and torch.equal(banks[i], banks[0]), f"{kind} h{heads}: run {i}"
        out, bank = outs[0], banks[0]
        for s, slot in enumerate(slots):
            y, hf = refs[s]
            assert rel(out[cu[s]:cu[s + 1]], y) < REL[dtype], f"{kind} h{heads}: sequence {s} output"
            if slot >= 0:
                assert rel(bank[slot], hf) < REL[dtype], f"{kind} h{heads}: sequence {s} final state"
        assert rel(out, out_s) < 5e-3 and torch.equal(bank, bank_s), f"{kind} h{heads} vs the default staged scan"
