"""fastpath.kernels.gemv (the bs1 decode projection) vs the fp64 product."""
from __future__ import annotations

import pytest
import torch

from kernel_tiers import TIERS, rel, skip_cpu_without_interpreter  # noqa: E402  (sets TRITON_INTERPRET on CPU)

from fastpath.kernels._common import KernelInputError  # noqa: E402
from fastpath.kernels.gemv import gemv  # noqa: E402

REL = {torch.float32: 5e-6, torch.bfloat16: 1e-2}


def shapes(device: str, full: tuple, cpu: tuple) -> tuple:
    """The (N, K) cases: all of them compiled on the GPU; on the CPU interpreter (hundreds of programs cost minutes)
    the ones that keep a ragged N, a ragged K and a multi-tile K, not the many-row-block case."""
    return full if device == "cuda" else cpu


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_gemv_matches_fp64_product(device, dtype, bias):
    """N × K with N not a multiple of the row block and K both even and ragged; output NaN-poisoned."""
    skip_cpu_without_interpreter(device)
    for N, K in shapes(device, ((37, 64), (600, 200), (8, 2100)), ((37, 64), (8, 2100))):
        gen = torch.Generator().manual_seed(N + K + bias)
        x, w = torch.randn(1, K, generator=gen).to(dtype), torch.randn(N, K, generator=gen).to(dtype)
        b = torch.randn(N, generator=gen).to(dtype) if bias else None
        out = torch.full((1, N), float("nan"), dtype=dtype, device=device)
        gemv(x.to(device), w.to(device), b.to(device) if bias else None, out=out)
        ref = x.double() @ w.double().T + (b.double() if bias else 0.0)
        assert rel(out, ref) < REL[dtype]
        assert rel(out, x.double() @ w.double()[torch.arange(N).roll(1)].T) > 0.1   # rows not permuted
        for rule in (dict(SPLIT=3, BLOCK_K=64),                          # fixed K split, partials summed
                     dict(BLOCK_N=2, BLOCK_K=4096, num_warps=8),          # one tile covers K (whole row up front)
                     dict(BLOCK_N=4, BLOCK_K=1024, num_warps=8, num_stages=3),
                     dict(BLOCK_K=64, SPLIT=2)):
            other = torch.full((1, N), float("nan"), dtype=dtype, device=device)
            gemv(x.to(device), w.to(device), b.to(device) if bias else None, out=other, rule=rule)
            assert rel(other, ref) < REL[dtype], rule


@pytest.mark.parametrize("act", ["silu", "relu2"])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_gemv_act_fold_equals_act_mul_then_gemv_bitwise(device, dtype, act):
    """act(gate)·up folded into the x load gives the bits of act_mul followed by the GEMV (same rounding points),
    for even and ragged K, small tiles, and a fixed K split."""
    skip_cpu_without_interpreter(device)
    from fastpath.kernels.act_mul import act_mul
    for N, F in ((37, 64), (40, 1000)):
        gen = torch.Generator().manual_seed(N + F)
        gu = (2 * torch.randn(1, 2 * F, generator=gen)).to(dtype).to(device)
        w = torch.randn(N, F, generator=gen).to(dtype).to(device)
        for rule in (None, dict(BLOCK_K=64), dict(BLOCK_K=128, SPLIT=2)):
            want = gemv(act_mul(gu, act), w, rule=rule)
            got = gemv(gu, w, rule=rule, act=act)
            assert torch.equal(got, want), (N, F, rule)
        ref = act_mul(gu, act).double() @ w.double().T
        assert rel(gemv(gu, w, act=act), ref) < REL[dtype]


@pytest.mark.parametrize("device,dtype", TIERS)
def test_gemv_conv_epilogue_equals_conv1d_step_bitwise(device, dtype):
    """The decode conv step of a column range, done in the GEMV's epilogue: output, conv output and rolled window
    bitwise those of the GEMV followed by conv1d_step; a padding slot (-1) leaves the bank untouched."""
    skip_cpu_without_interpreter(device)
    from fastpath.kernels.conv1d import conv1d_step
    from fastpath.kernels.gemv import ConvStep
    for N, K, c0, Dc in ((37, 100, 5, 20), (300, 128, 100, 190)):
        gen = torch.Generator().manual_seed(N + Dc)
        x = torch.randn(1, K, generator=gen).to(dtype).to(device)
        w = torch.randn(N, K, generator=gen).to(dtype).to(device)
        cw, cb = torch.randn(Dc, 4, generator=gen).to(dtype).to(device), torch.randn(Dc, generator=gen).to(device)
        bank = torch.randn(3, Dc, 3, generator=gen).to(device)
        slot = torch.tensor([1], dtype=torch.int32, device=device)
        y_want = gemv(x, w)
        bank_want = bank.clone()
        conv_want = conv1d_step(y_want[:, c0:c0 + Dc].contiguous(), cw, cb, bank_want, slot)
        conv_got = torch.full((1, Dc), float("nan"), dtype=dtype, device=device)
        bank_got = bank.clone()
        y_got = gemv(x, w, conv=ConvStep(cw, cb, bank_got, slot, conv_got, c0))
        assert torch.equal(y_got, y_want) and torch.equal(conv_got, conv_want) and torch.equal(bank_got, bank_want)
        assert not torch.equal(bank_got, bank)
        pad = bank.clone()
        gemv(x, w, conv=ConvStep(cw, cb, pad, torch.tensor([-1], device=device), conv_got, c0))
        assert torch.equal(pad, bank) and not conv_got.any()


@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_gemv_rms_eps_normalises_the_row_first(device, dtype, act):
    """rms_eps: (x / rms(x)) · (W·diag(g))ᵀ + b equals rmsnorm(x)·g · Wᵀ + b (the gain folded into W, as FastModel
    folds it); every program sees the whole row (a K split in the rule is overridden), ragged K and small tiles."""
    skip_cpu_without_interpreter(device)
    from fastpath.kernels.act_mul import act_mul
    eps = 1e-5
    for N, K in shapes(device, ((37, 64), (600, 200), (8, 2100)), ((37, 64), (8, 2100))):
        gen = torch.Generator().manual_seed(N * K)
        x = (3 * torch.randn(1, 2 * K if act else K, generator=gen)).to(dtype).to(device)
        w, g = torch.randn(N, K, generator=gen), 1 + 0.3 * torch.randn(K, generator=gen)
        b = torch.randn(N, generator=gen).to(dtype).to(device)
        xin = (act_mul(x, act) if act else x).double().cpu()
        ref = (xin / (xin.pow(2).mean() + eps).sqrt() * g.double()) @ w.double().T + b.double().cpu()
        wg = (w * g).to(dtype).to(device)
        for rule in (None, dict(BLOCK_K=64), dict(BLOCK_K=64, SPLIT=3), dict(BLOCK_N=4, BLOCK_K=1024, num_warps=8)):
            out = torch.full((1, N), float("nan"), dtype=dtype, device=device)
            gemv(x, wg, b, out=out, rule=rule, act=act, rms_eps=eps)
            assert rel(out, ref) < REL[dtype], (N, K, rule)
        assert rel(gemv(x, wg, b, act=act), ref) > 0.05          # the normalisation is not a no-op here


@pytest.mark.parametrize("mult", [1.0, 0.25])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_gemv_residual_epilogue_is_add_rms_norms_residual_add(device, dtype, mult):
    """residual=ResidualAdd: the stream gets exactly add_rms_norm's h + y·m (same rounding points, fp32 and
    compute-dtype streams), its rounded copy is written, y itself is not stored; `out` untouched."""
    skip_cpu_without_interpreter(device)
    from fastpath.kernels.fused_add_norm import add_rms_norm
    from fastpath.kernels.gemv import ResidualAdd
    for N, K in shapes(device, ((37, 64), (300, 2100)), ((37, 64), (9, 2100))):
        gen = torch.Generator().manual_seed(N + K)
        x = torch.randn(1, K, generator=gen).to(dtype).to(device)
        w = torch.randn(N, K, generator=gen).to(dtype).to(device)
        for sdt in {torch.float32, dtype}:
            stream = (10 * torch.randn(1, N, generator=gen)).to(sdt).to(device)
            y = gemv(x, w)
            h_want, _ = add_rms_norm(stream, y, torch.ones(N, device=device), 1e-5, multiplier=mult, out_dtype=dtype)
            res = ResidualAdd(stream.clone(), torch.full((1, N), float("nan"), dtype=dtype, device=device), mult)
            got = gemv(x, w, residual=res)
            assert got is res.x
            assert torch.equal(res.stream, h_want) and torch.equal(res.x, h_want.to(dtype)), (N, K, sdt)


@pytest.mark.parametrize("device,dtype", TIERS)
def test_gemv_broadcast_x_load_keeps_every_epilogues_bits(device, dtype):
    """Launch-rule key XB (x loaded in the weight tile's layout), K a multiple of 16 with a partial last K tile: the
    product, act fold, conv epilogue and residual epilogue keep their bits; the RMS fold, whose Σx² is then reduced
    per column, matches within rounding. (Other K: fp32 bits can differ on a GPU, the compiler laying the tiles
    out differently; measured on sm_90, docs/kernels.md.)"""
    skip_cpu_without_interpreter(device)
    from fastpath.kernels.gemv import ConvStep, ResidualAdd
    for N, K, rule in ((37, 112, dict(BLOCK_K=64)), (9, 2112, dict(BLOCK_N=4, BLOCK_K=1024, num_warps=8))):
        gen = torch.Generator().manual_seed(N + K)
        x = torch.randn(1, 2 * K, generator=gen).to(dtype).to(device)
        w = torch.randn(N, K, generator=gen).to(dtype).to(device)
        b = torch.randn(N, generator=gen).to(dtype).to(device)
        xb = {**rule, "XB": True}
        assert torch.equal(gemv(x[:, :K], w, b, rule=xb), gemv(x[:, :K], w, b, rule=rule))
        assert torch.equal(gemv(x[:, :K], w, rule={**xb, "SPLIT": 2}), gemv(x[:, :K], w, rule={**rule, "SPLIT": 2}))
        assert torch.equal(gemv(x, w, rule=xb, act="silu"), gemv(x, w, rule=rule, act="silu"))
        got, want = gemv(x[:, :K], w, b, rule=xb, rms_eps=1e-5), gemv(x[:, :K], w, b, rule=rule, rms_eps=1e-5)
        assert rel(got, want) < REL[dtype]
        cw, bank = torch.randn(4, 4, generator=gen).to(dtype).to(device), torch.randn(2, 4, 3, generator=gen)
        outs = []
        for r in (rule, xb):
            c_out, bk = torch.empty(1, 4, dtype=dtype, device=device), bank.clone().to(device)
            stream = torch.ones(1, N, device=device)
            res = ResidualAdd(stream, torch.empty(1, N, dtype=dtype, device=device))
            gemv(x[:, :K], w, rule=r, residual=res)
            y = gemv(x[:, :K], w, rule=r, conv=ConvStep(cw, None, bk, torch.tensor([1], device=device), c_out, 2))
            outs.append((y, c_out, bk, stream, res.x))
        assert all(torch.equal(a, b) for a, b in zip(*outs)), (N, K)


def test_gemv_rejects_bad_inputs_naming_the_field():
    """Two rows, a K mismatch, a mis-shaped bias raise KernelInputError naming them."""
    with pytest.raises(KernelInputError, match="`x`"):
        gemv(torch.randn(2, 8), torch.randn(4, 8))
    with pytest.raises(KernelInputError, match="weight"):
        gemv(torch.randn(1, 8), torch.randn(4, 9))
    with pytest.raises(KernelInputError, match="bias"):
        gemv(torch.randn(1, 8), torch.randn(4, 8), torch.randn(5))
    with pytest.raises(KernelInputError, match="act"):
        gemv(torch.randn(1, 8), torch.randn(4, 8), act="gelu")
    with pytest.raises(KernelInputError, match="even"):
        gemv(torch.randn(1, 9), torch.randn(4, 4), act="silu")
    from fastpath.kernels.gemv import ConvStep, ResidualAdd
    with pytest.raises(KernelInputError, match="rms_eps"):
        gemv(torch.randn(1, 8), torch.randn(4, 8), rms_eps=-1.0)
    s = torch.zeros(1, 4)
    with pytest.raises(KernelInputError, match="distinct"):
        gemv(torch.randn(1, 8), torch.randn(4, 8), residual=ResidualAdd(s, s))
    with pytest.raises(KernelInputError, match="residual.stream"):
        gemv(torch.randn(1, 8), torch.randn(4, 8), residual=ResidualAdd(torch.zeros(1, 5), torch.zeros(1, 4)))
    with pytest.raises(KernelInputError, match="conv channels"):
        gemv(torch.randn(1, 8), torch.randn(4, 8), conv=ConvStep(torch.randn(3, 4), None, torch.zeros(1, 3, 3),
                                                               torch.zeros(1, dtype=torch.int32), torch.zeros(1, 3), 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["1", "2"], ids=["wait-then-trigger", "trigger-then-wait"])
def test_gemv_launched_early_waits_for_its_producer(monkeypatch, mode):
    """Under programmatic dependent launch the GEMV starts while the norm that writes x drains: its result must
    still be bitwise that of a plain launch, eager and inside a CUDA graph, over many producer/consumer pairs —
    in both PDL orders (mode 2: the norm lets the GEMV launch before the norm itself has waited)."""
    from fastpath.kernels._common import pdl
    from fastpath.kernels.fused_add_norm import add_rms_norm
    dev = torch.device("cuda")
    if not pdl(dev):
        pytest.skip("no programmatic dependent launch on this device / Triton")
    g = torch.Generator(device=dev).manual_seed(0)
    K, N, reps = 2560, 5120, 16
    w = torch.randn(N, K, generator=g, device=dev, dtype=torch.bfloat16) * K ** -0.5
    nw = torch.rand(K, generator=g, device=dev, dtype=torch.bfloat16) + 0.5
    hs = [torch.randn(1, K, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(reps)]
    ds = [torch.randn(1, K, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(reps)]

    xs = [torch.empty(1, K, device=dev, dtype=torch.bfloat16) for _ in range(reps)]

    def chain() -> list[torch.Tensor]:      # x is NaN until its norm writes it: a read too early poisons y
        return [gemv(add_rms_norm(h, d, nw, 1e-5, out=x)[1], w) for h, d, x in zip(hs, ds, xs)]

    def poison() -> None:
        for x in xs:
            x.fill_(float("nan"))
    poison()
    monkeypatch.setenv("HQ_PDL", "0")
    want = chain()
    monkeypatch.setenv("HQ_PDL", mode)
    poison()
    eager = chain()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain()
    for _ in range(3):
        for y in captured:
            y.zero_()
        poison()
        graph.replay()
        torch.cuda.synchronize()
        for a, b, c in zip(want, eager, captured):
            assert torch.equal(a, b) and torch.equal(a, c)


def test_bad_hq_pdl_value_is_named(monkeypatch):
    """HQ_PDL accepts 0, 1, 2; anything else is an error that names the variable (not a silent default)."""
    from fastpath.kernels._common import pdl_mode
    monkeypatch.setenv("HQ_PDL", "yes")
    with pytest.raises(ValueError, match="HQ_PDL"):
        pdl_mode()
    for v in ("0", "1", "2"):
        monkeypatch.setenv("HQ_PDL", v)
        assert pdl_mode() == int(v)
