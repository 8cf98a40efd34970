"""fastpath.kernels.attention (KV-cache prefill/decode, GQA) and rope vs oracle/attention.py in fp64."""
from __future__ import annotations


import pytest
import torch

from kernel_tiers import TIERS, skip_cpu_without_interpreter as _skip_cpu_without_interpreter, rel  # noqa: E402  (sets TRITON_INTERPRET on CPU)

from fastpath.kernels._common import KernelInputError  # noqa: E402
from fastpath.kernels.attention import attention_prefill_varlen  # noqa: E402
from fastpath.kernels.attention_decode import attention_decode  # noqa: E402
from fastpath.kernels.rope import rope  # noqa: E402
from oracle.attention import attention as oracle_attention  # noqa: E402
from oracle.attention import rope as oracle_rope  # noqa: E402

REL = {torch.float32: 5e-6, torch.bfloat16: 1e-2}   # docs/kernels.md


@pytest.mark.parametrize("d", [16, 32])
@pytest.mark.parametrize("n_kv", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_attention_prefill_pieces_then_decode_match_oracle(device, dtype, n_kv, d):
    """Three requests prefilled in two packed calls (the second continues two of them mid-prompt), then two
    decode steps with a -1 pad row: every output vs fp64 causal attention over the whole history; the cache
    holds exactly the written K/V; other slots bitwise untouched. Head dims 16 and 32 (zoo-granite_hd32's)."""
    _skip_cpu_without_interpreter(device)
    Hq, S, M, scale = 4, 6, 64, 0.3
    gen = torch.Generator().manual_seed(60 + n_kv)
    prompt = [21, 1, 40]
    slots = [4, 0, 2]
    total = [p + 2 for p in prompt]
    q_all = [torch.randn(n, Hq, d, generator=gen).to(dtype) for n in total]
    k_all = [torch.randn(n, n_kv, d, generator=gen).to(dtype) for n in total]
    v_all = [torch.randn(n, n_kv, d, generator=gen).to(dtype) for n in total]
    kc = torch.randn(S, M, n_kv, d, generator=gen).to(dtype).to(device)
    vc = torch.randn(S, M, n_kv, d, generator=gen).to(dtype).to(device)
    kc0, vc0 = kc.clone(), vc.clone()
    got = [torch.full((n, Hq, d), float("nan"), dtype=dtype) for n in total]
    # call 1: first 16 tokens of request 0, all of request 1, first 7 of request 2; call 2: the rest.
    calls = [[(0, 0, 16), (1, 0, 1), (2, 0, 7)], [(2, 7, 40), (0, 16, 21)]]
    for pieces in calls:
        cu = [0]
        for _, lo, hi in pieces:
            cu.append(cu[-1] + hi - lo)
        cat = lambda a: torch.cat([a[r][lo:hi] for r, lo, hi in pieces]).to(device)  # noqa: E731
        out = torch.full((cu[-1], Hq, d), float("nan"), dtype=dtype, device=device)
        attention_prefill_varlen(cat(q_all), cat(k_all), cat(v_all), kc, vc, torch.tensor(cu, device=device),
                                 torch.tensor([slots[r] for r, _, _ in pieces], device=device),
                                 torch.tensor([lo for _, lo, _ in pieces], device=device), scale, out=out)
        for i, (r, lo, hi) in enumerate(pieces):
            got[r][lo:hi] = out[cu[i]:cu[i + 1]].cpu()
    for step in range(2):
        rows = [2, -1, 0, 1]                                      # request per row; -1 = pad
        pos = [prompt[r] + step if r >= 0 else 0 for r in rows]
        def pick(a):
            return torch.stack([a[r][p] if r >= 0 else a[0][0] for r, p in zip(rows, pos)]).to(device)
        out = torch.full((4, Hq, d), float("nan"), dtype=dtype, device=device)
        attention_decode(pick(q_all), pick(k_all), pick(v_all), kc, vc,
                         torch.tensor([slots[r] if r >= 0 else -1 for r in rows], device=device),
                         torch.tensor(pos, device=device), scale, out=out)
        assert torch.equal(out[1].cpu(), torch.zeros(Hq, d, dtype=dtype)), "pad row output"
        for i, r in enumerate(rows):
            if r >= 0:
                got[r][pos[i]] = out[i].cpu()
    for r in range(3):
        n = total[r]
        ref = oracle_attention(q_all[r].double(), k_all[r].double(), v_all[r].double(),
                               torch.arange(n), torch.arange(n), scale)
        assert rel(got[r], ref) < REL[dtype], f"request {r}"
        assert torch.equal(kc[slots[r], :n].cpu(), k_all[r]) and torch.equal(vc[slots[r], :n].cpu(), v_all[r])
        assert torch.equal(kc[slots[r], n:], kc0[slots[r], n:]), "cache written past the sequence"
    assert torch.equal(kc[[1, 3, 5]], kc0[[1, 3, 5]]) and torch.equal(vc[[1, 3, 5]], vc0[[1, 3, 5]])


@pytest.mark.parametrize("rot", ["none", "partial", "full"])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_rope_matches_oracle_in_and_out_of_place(device, dtype, rot):
    """RoPE none / partial (half the head dim, Bamba) / full vs fp64; in place equals out of place bitwise."""
    _skip_cpu_without_interpreter(device)
    d = 32
    rot_dim = {"none": 0, "partial": d // 2, "full": d}[rot]
    gen = torch.Generator().manual_seed(70)
    x = torch.randn(9, 3, d, generator=gen).to(dtype)
    pos = torch.randint(0, 300, (9,), generator=gen)
    out = torch.full_like(x, float("nan")).to(device)
    rope(x.to(device), pos.to(device), rot_dim, 10000.0, out=out)
    ref = oracle_rope(x.double(), pos, rot_dim, 10000.0)
    assert rel(out, ref) < REL[dtype]
    inplace = x.clone().to(device)
    rope(inplace, pos.to(device), rot_dim, 10000.0, out=inplace)
    assert torch.equal(inplace, out)


def test_attention_rejects_bad_inputs_naming_the_field():
    """Non-divisible GQA heads, a sequence past max_len, repeated slots raise KernelInputError."""
    q, k = torch.randn(4, 3, 16), torch.randn(4, 2, 16)
    kc = torch.zeros(3, 8, 2, 16)
    args = (torch.tensor([0, 4]), torch.tensor([1]), torch.tensor([0]), 1.0)
    with pytest.raises(KernelInputError, match="n_kv_heads"):
        attention_prefill_varlen(q, k, k, kc, kc.clone(), *args)
    q = torch.randn(4, 4, 16)
    with pytest.raises(KernelInputError, match="start_pos"):
        attention_prefill_varlen(q, k, k, kc, kc.clone(), torch.tensor([0, 4]), torch.tensor([1]), torch.tensor([6]),
                                 1.0)
    with pytest.raises(KernelInputError, match="slot"):
        attention_prefill_varlen(q, k, k, kc, kc.clone(), torch.tensor([0, 2, 4]), torch.tensor([1, 1]),
                                 torch.tensor([0, 0]), 1.0)


def test_attention_plan_keys_its_tiles_on_the_dtype_and_refuses_another():
    """The launch rule's tiles depend on the element size (128 × 128 for bf16 would overflow an sm_90 block's shared memory
    in fp32): a plan built for bf16 passed to an fp32 call raises KernelInputError naming dtype, not a launch error."""
    import fastpath.kernels.attention as attn
    assert attn.attention_launch_rule(80, 2)["BLOCK_N"] == 128 and attn.attention_launch_rule(80, 4)["BLOCK_N"] == 64
    q, k = torch.randn(4, 4, 16), torch.randn(4, 2, 16)
    kc = torch.zeros(3, 8, 2, 16)
    plan = attn.attention_prefill_plan([0, 4], [1], [0], 3, 8, 4, 16, "cpu", dtype=torch.bfloat16)
    assert plan.rule["BLOCK_M"] == 128
    with pytest.raises(KernelInputError, match="dtype"):
        attention_prefill_varlen(q, k, k, kc, kc.clone(), torch.tensor([0, 4]), torch.tensor([1]), torch.tensor([0]),
                                 1.0, plan=plan)
    plan = attn.attention_prefill_plan([0, 4], [1], [0], 3, 8, 4, 16, "cpu", dtype=torch.float32)
    assert plan.rule["BLOCK_M"] == 64


@pytest.mark.parametrize("rot", ["none", "partial", "full"])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_attention_decode_split_context_with_rope_matches_oracle(device, dtype, rot):
    """The one-launch decode: a 300-key cache (5 splits of 64) and rows at positions 0, 63, 64, 130, 299 (first,
    last, across split edges) plus a pad row; q/k rotated inside (none / Bamba's half / full): outputs vs fp64
    rope + attention over the history, the new K (rotated) and V in the cache at pos and nothing else written; a
    row's bits are the same alone as in the batch."""
    _skip_cpu_without_interpreter(device)
    Hq, Hkv, d, S, M, scale = 8, 2, 32, 7, 300, 0.2
    rot_dim = {"none": 0, "partial": d // 2, "full": d}[rot]
    gen = torch.Generator().manual_seed(80 + rot_dim)
    pos = [0, 63, 64, 130, 0, 299]
    slots = [3, 0, 6, 2, -1, 5]
    R = len(pos)
    q = torch.randn(R, Hq, d, generator=gen).to(dtype)
    k = torch.randn(R, Hkv, d, generator=gen).to(dtype)
    v = torch.randn(R, Hkv, d, generator=gen).to(dtype)
    kc = torch.randn(S, M, Hkv, d, generator=gen).to(dtype).to(device)
    vc = torch.randn(S, M, Hkv, d, generator=gen).to(dtype).to(device)
    kc0, vc0 = kc.clone(), vc.clone()
    args = (torch.tensor(slots, device=device), torch.tensor(pos, device=device), scale)
    out = torch.full((R, Hq, d), float("nan"), dtype=dtype, device=device)
    attention_decode(q.to(device), k.to(device), v.to(device), kc, vc, *args, out=out, rope_dim=rot_dim)
    assert torch.equal(out[4].cpu(), torch.zeros(Hq, d, dtype=dtype)), "pad row output"
    P = torch.tensor(pos)
    qr, kr = (oracle_rope(t.double(), P, rot_dim, 10000.0) if rot_dim else t.double() for t in (q, k))
    for i, (p, s) in enumerate(zip(pos, slots)):
        if s < 0:
            continue
        keys = torch.cat([kc0[s, :p].cpu().double(), kr[i:i + 1]])
        vals = torch.cat([vc0[s, :p].cpu().double(), v[i:i + 1].double()])
        ref = oracle_attention(qr[i:i + 1], keys, vals, torch.tensor([p]), torch.arange(p + 1), scale)
        assert rel(out[i], ref[0]) < REL[dtype], f"row {i} at {p}"
        assert rel(kc[s, p], kr[i]) < REL[dtype] and torch.equal(vc[s, p].cpu(), v[i]), f"row {i}: new K/V"
        kc0[s, p], vc0[s, p] = kc[s, p], vc[s, p]
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0), "cache written outside the rows' positions"
    if rot_dim and device == "cpu":                     # the rotation rounds as the rope kernel does
        want = rope(k.to(device), P.to(device), rot_dim, 10000.0)
        for i, s in enumerate(slots):
            if s >= 0:
                assert torch.equal(kc[s, pos[i]], want[i])
    for i in (3, 5):                                    # alone: same bits (the split depends on the cache only)
        one = torch.empty(1, Hq, d, dtype=dtype, device=device)
        attention_decode(q[i:i + 1].to(device), k[i:i + 1].to(device), v[i:i + 1].to(device), kc, vc,
                         args[0][i:i + 1], args[1][i:i + 1], scale, out=one, rope_dim=rot_dim)
        assert torch.equal(one[0], out[i])


@pytest.mark.parametrize("device,dtype", TIERS)
def test_attention_prefill_split_over_keys_matches_unsplit_and_oracle(device, dtype):
    """Short pieces over long contexts split over the keys (split_keys=48 forces it at small shapes): a 5-token
    suffix at 150 (the prefix-cache hit's shape), a 66-token piece at 100 (2 query blocks, splits of unequal
    count per block), an unsplit 3-token piece at 0, a 6-token piece starting on a split edge (96): outputs vs
    the unsplit kernel within fp32 rounding and vs fp64 attention; split pieces bitwise equal in another packing,
    run from host lists (the plan is per sequence, deterministic)."""
    _skip_cpu_without_interpreter(device)
    Hq, Hkv, d, S, M, scale = 4, 2, 16, 5, 192, 0.3
    gen = torch.Generator().manual_seed(91)
    pieces = [(3, 150, 5), (0, 100, 66), (1, 0, 3), (4, 96, 6)]            # (slot, start, length)
    cu = [0]
    for _, _, n in pieces:
        cu.append(cu[-1] + n)
    T = cu[-1]
    q, k, v = (torch.randn(T, h, d, generator=gen).to(dtype).to(device) for h in (Hq, Hkv, Hkv))
    kc0 = torch.randn(S, M, Hkv, d, generator=gen).to(dtype).to(device)
    vc0 = torch.randn(S, M, Hkv, d, generator=gen).to(dtype).to(device)
    meta = [cu, [p[0] for p in pieces], [p[1] for p in pieces]]

    def run(split_keys, sel=None, host=False):
        idx = list(range(len(pieces))) if sel is None else sel
        c = [0]
        for i in idx:
            c.append(c[-1] + pieces[i][2])
        rows = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in idx]).to(device)
        lists = (c, [meta[1][i] for i in idx], [meta[2][i] for i in idx])
        kc, vc = kc0.clone(), vc0.clone()
        out = attention_prefill_varlen(q[rows], k[rows], v[rows], kc, vc, *(torch.tensor(x, device=device)
                                       for x in lists), scale, host=lists if host else None, split_keys=split_keys)
        return out, kc, vc
    split, kc, vc = run(48)
    whole, _, _ = run(None)                               # default rule: chunk 1024 > every context: no split
    assert rel(split, whole) < REL[dtype]
    for i, (s, st, n) in enumerate(pieces):
        ref = oracle_attention(q[cu[i]:cu[i + 1]].double().cpu(), kc[s, :st + n].double().cpu(),
                               vc[s, :st + n].double().cpu(), torch.arange(st, st + n), torch.arange(st + n), scale)
        assert rel(split[cu[i]:cu[i + 1]].cpu(), ref) < REL[dtype], f"piece {i}"
    again = run(48, sel=[3, 0], host=True)[0]               # another packing, from host lists: the same bits
    assert torch.equal(again, torch.cat([split[cu[3]:cu[4]], split[cu[0]:cu[1]]])), "repacked run differs"


@pytest.mark.parametrize("blocks", [(64, 64, 4, False), (128, 128, 8, False), (128, 128, 8, True)],
                         ids=["b64", "b128", "b128_exp2"])
@pytest.mark.parametrize("split_keys", [None, 2], ids=["whole", "split"])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_attention_prefill_unmasked_full_blocks_keep_the_bits_of_the_masked_loop(device, dtype, split_keys, blocks,
                                                                                 monkeypatch):
    """The key blocks every query row of a block sees run without the key and causal masks (UNMASKED_FULL); the
    blocks run in the same order, so the output is bitwise the masked loop's: pieces from 0 and mid-context, query
    blocks with 0, 1 and 2 full key blocks, a start two keys short of a block edge, unsplit and split over the keys
    (splits of two key blocks), at the launch rule's block shape and the 64 × 64 one, and with the EXP2 key."""
    _skip_cpu_without_interpreter(device)
    import fastpath.kernels.attention as attn
    bm, bn, warps, exp2 = blocks
    rule0 = attn.attention_launch_rule
    assert rule0(16)["UNMASKED_FULL"] and (rule0(16)["BLOCK_M"], rule0(16)["BLOCK_N"]) in ((64, 64), (128, 128))
    Hq, Hkv, d, S, M, scale = 4, 2, 16, 3, 5 * bn, 0.3
    gen = torch.Generator().manual_seed(17)
    pieces = [(0, 0, 2 * bn + 22), (2, bn + 36, 2 * bn + 38), (1, 2 * bn - 2, 40)]   # (slot, start, length);
    cu = [0, 2 * bn + 22, 4 * bn + 60, 4 * bn + 100]     # 2·bn − 2: where one more key block would be unmasked
    split_keys = split_keys and split_keys * bn
    q, k, v = (torch.randn(cu[-1], h, d, generator=gen).to(dtype).to(device) for h in (Hq, Hkv, Hkv))
    kc0 = torch.randn(S, M, Hkv, d, generator=gen).to(dtype).to(device)
    vc0 = torch.randn(S, M, Hkv, d, generator=gen).to(dtype).to(device)
    updates = [{"UNMASKED_FULL": u, "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "EXP2": exp2}
               for u in (True, False)]
    outs, _ = _run_rule_variants(monkeypatch, updates, q, k, v, kc0, vc0, cu, pieces, scale, split_keys)
    assert torch.equal(outs[0], outs[1])


def _run_rule_variants(monkeypatch, updates, q, k, v, kc0, vc0, cu, pieces, scale, split_keys):
    """attention_prefill_varlen once per dict of launch-rule updates, each on fresh copies of the caches ->
    (outputs, caches)."""
    import fastpath.kernels.attention as attn
    rule0, device = attn.attention_launch_rule, q.device
    outs, caches = [], []
    for u in updates:
        monkeypatch.setattr(attn, "attention_launch_rule", lambda hd, eb=2, u=u: {**rule0(hd, eb), **u})
        kc, vc = kc0.clone(), vc0.clone()
        outs.append(attention_prefill_varlen(q, k, v, kc, vc, torch.tensor(cu, device=device),
                                             torch.tensor([p[0] for p in pieces], device=device),
                                             torch.tensor([p[1] for p in pieces], device=device), scale,
                                             split_keys=split_keys))
        caches.append((kc, vc))
    monkeypatch.setattr(attn, "attention_launch_rule", rule0)
    return outs, caches


def _assert_matches_fp64_attention(out, q, kc, vc, cu, pieces, scale, dtype):
    """Each piece's output vs the fp64 oracle's attention over the cache it wrote."""
    for i, (s, st, n) in enumerate(pieces):
        ref = oracle_attention(q[cu[i]:cu[i + 1]].double().cpu(), kc[s, :st + n].double().cpu(),
                               vc[s, :st + n].double().cpu(), torch.arange(st, st + n), torch.arange(st + n), scale)
        assert rel(out[cu[i]:cu[i + 1]].cpu(), ref) < REL[dtype], f"piece {i}"


@pytest.mark.parametrize("d", [80, 48])
@pytest.mark.parametrize("split_keys", [None, 32], ids=["whole", "split"])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_attention_prefill_head_dim_in_two_chunks_matches_one_chunk_and_oracle(device, dtype, split_keys, d,
                                                                               monkeypatch):
    """A head dim that is not a power of two runs its dots in two chunks (80 = 64 + 16, 48 = 32 + 16) instead of
    one zero-padded chunk: outputs (and the split partials, merged) vs the one-chunk kernel within rounding and vs
    fp64 attention."""
    _skip_cpu_without_interpreter(device)
    import fastpath.kernels.attention as attn
    assert attn.head_dim_chunks(d) == ({80: 64, 48: 32}[d], 16) and attn.head_dim_chunks(128) == (128, 0)
    Hq, Hkv, S, M, scale = 4, 2, 3, 128, d ** -0.5
    gen = torch.Generator().manual_seed(23)
    pieces = [(0, 0, 70), (2, 30, 40)]                                      # (slot, start, length)
    cu = [0, 70, 110]
    q, k, v = (torch.randn(cu[-1], h, d, generator=gen).to(dtype).to(device) for h in (Hq, Hkv, Hkv))
    kc0 = torch.randn(S, M, Hkv, d, generator=gen).to(dtype).to(device)
    vc0 = torch.randn(S, M, Hkv, d, generator=gen).to(dtype).to(device)
    updates = [dict(zip(("BLOCK_DQ", "BLOCK_D2"), attn.head_dim_chunks(d, split_d))) for split_d in (True, False)]
    outs, caches = _run_rule_variants(monkeypatch, updates, q, k, v, kc0, vc0, cu, pieces, scale, split_keys)
    assert rel(outs[0], outs[1]) < REL[dtype]
    _assert_matches_fp64_attention(outs[0], q, *caches[0], cu, pieces, scale, dtype)


@pytest.mark.parametrize("split_keys", [None, 48], ids=["whole", "split"])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_attention_prefill_base_2_exponentials_match_the_rule_and_oracle(device, dtype, split_keys, monkeypatch):
    """The rule's EXP2 (log2 e folded into the scale, exp2 for the weights; the split partials' max stored back in
    natural units for the merge) vs natural exponentials: within rounding of each other and of fp64 attention,
    unsplit and split."""
    _skip_cpu_without_interpreter(device)
    import fastpath.kernels.attention as attn
    Hq, Hkv, d, S, M, scale = 4, 2, 16, 3, 192, 0.3
    gen = torch.Generator().manual_seed(31)
    pieces = [(0, 0, 70), (2, 100, 5), (1, 60, 66)]                       # (slot, start, length)
    cu = [0, 70, 75, 141]
    q, k, v = (torch.randn(cu[-1], h, d, generator=gen).to(dtype).to(device) for h in (Hq, Hkv, Hkv))
    kc0 = torch.randn(S, M, Hkv, d, generator=gen).to(dtype).to(device)
    vc0 = torch.randn(S, M, Hkv, d, generator=gen).to(dtype).to(device)
    assert attn.attention_launch_rule(d)["EXP2"] is True
    outs, caches = _run_rule_variants(monkeypatch, [{}, {"EXP2": False}], q, k, v, kc0, vc0, cu, pieces, scale,
                                      split_keys)
    assert rel(outs[0], outs[1]) < REL[dtype]
    for out, cache in zip(outs, caches):
        _assert_matches_fp64_attention(out, q, *cache, cu, pieces, scale, dtype)


@pytest.mark.parametrize("device,dtype", TIERS)
def test_attention_split_merge_has_the_same_bits_whatever_heads_a_program_merges(device, dtype, monkeypatch):
    """The merge of split-key partials (attention_combine) run with 1, 2 or all 4 heads a program: each head's
    merge is its own, so the outputs are bitwise equal (a 5-token suffix and a 66-token piece over split keys)."""
    _skip_cpu_without_interpreter(device)
    import fastpath.kernels.attention as attn
    Hq, Hkv, d, S, M, scale = 4, 2, 16, 2, 192, 0.3
    gen = torch.Generator().manual_seed(29)
    cu, pieces = [0, 5, 71], [(1, 150, 5), (0, 100, 66)]                   # (slot, start, length)
    q, k, v = (torch.randn(cu[-1], h, d, generator=gen).to(dtype).to(device) for h in (Hq, Hkv, Hkv))
    kc0 = torch.randn(S, M, Hkv, d, generator=gen).to(dtype).to(device)
    vc0 = torch.randn(S, M, Hkv, d, generator=gen).to(dtype).to(device)
    outs, _ = _run_rule_variants(monkeypatch, [{"COMBINE_H": h} for h in (None, 1, 2)], q, k, v, kc0, vc0, cu,
                                 pieces, scale, 48)
    rule = attn.attention_launch_rule
    assert rule(d, 2)["COMBINE_H"] == 1 and rule(d, 4)["COMBINE_H"] is None
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
