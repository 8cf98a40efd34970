"""fastpath.kernels.gemv_rows (1..8-row projections) vs F.linear; for K a multiple of K_MULTIPLE a row's bits are
the one-row GEMV's and do not depend on the call's other rows (the tile is the one-row GEMV's, keyed on (N, K))."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_tiers import TIERS  # noqa: E402  (sets TRITON_INTERPRET on CPU)

from fastpath.kernels._common import KernelInputError  # noqa: E402
from fastpath.kernels.gemv import gemv  # noqa: E402
from fastpath.kernels.gemv_rows import K_MULTIPLE, MAX_ROWS, ROWS_PER_PROGRAM, gemv_rows  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.parametrize("M,N,K", [(2, 40, 96), (3, 33, 1000), (5, 130, 64), (8, 7, 4096 + 24), (1, 9, 16)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_gemv_rows_matches_linear(device, dtype, M, N, K, bias):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
    b = torch.randn(N, generator=g).to(device, dtype) if bias else None
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(gemv_rows(x, w, b).double(), want, **TOL[dtype])


@pytest.mark.parametrize("device,dtype", TIERS)
def test_a_rows_bits_do_not_depend_on_the_other_rows_of_the_call(device, dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(MAX_ROWS, 4096, generator=g).to(device, dtype)
    w = torch.randn(24, 4096, generator=g).to(device, dtype)
    full = gemv_rows(x, w)
    for m in range(1, MAX_ROWS + 1):
        assert torch.equal(gemv_rows(x[:m].contiguous(), w), full[:m]), m
    assert torch.equal(gemv_rows(x[5:7].contiguous(), w), full[5:7])


@pytest.mark.parametrize("M,N,K", [(3, 37, 4096 + 32), (MAX_ROWS, 9, 8192), (5, 130, 1008), (2, 6, 16)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("device,dtype", TIERS)
def test_each_row_has_the_bits_of_the_one_row_gemv(device, dtype, M, N, K, bias):
    """Row r of a few-row call == gemv(x[r]) bitwise for K a multiple of K_MULTIPLE (both tiles with a partial last
    K tile here): the verify's k+1 positions get the decode step's bits; a row block's bits are its own."""
    assert K % K_MULTIPLE == 0
    g = torch.Generator().manual_seed(M * 100 + K)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
    b = torch.randn(N, generator=g).to(device, dtype) if bias else None
    got = gemv_rows(x, w, b)
    for r in range(M):
        assert torch.equal(got[r:r + 1], gemv(x[r:r + 1], w, b)), r
    assert M <= ROWS_PER_PROGRAM or torch.equal(got[ROWS_PER_PROGRAM:], gemv_rows(x[ROWS_PER_PROGRAM:], w, b))


def test_the_engine_takes_the_few_row_gemv_only_where_its_bits_are_the_one_row_gemvs():
    """FastModel routes 2..MAX_ROWS rows to gemv_rows only for K % K_MULTIPLE == 0 (other K: fp32 rows can differ
    from the one-row GEMV's in the last bits on a GPU, which would break speculative == not)."""
    from fastpath.model import FastModel
    from oracle import zoo
    cfg = zoo.tiny_config("bamba")
    fast = FastModel(cfg, zoo.random_weights(cfg, seed=0), "cpu", torch.float32).with_options(
        gemv_on_cpu=True, gemv_rows=True)
    assert fast._gemv_rows_ok(torch.zeros(3, 2 * K_MULTIPLE))
    assert not fast._gemv_rows_ok(torch.zeros(3, 2 * K_MULTIPLE + 8))
    assert not fast._gemv_rows_ok(torch.zeros(MAX_ROWS + 1, 2 * K_MULTIPLE))


def test_bad_inputs_are_refused_naming_the_field():
    w = torch.zeros(4, 8)
    with pytest.raises(KernelInputError, match="rows"):
        gemv_rows(torch.zeros(MAX_ROWS + 1, 8), w)
    with pytest.raises(KernelInputError, match="weight"):
        gemv_rows(torch.zeros(2, 8), torch.zeros(4, 9))
    with pytest.raises(KernelInputError, match="out"):
        gemv_rows(torch.zeros(2, 8), w, out=torch.zeros(2, 5))
    with pytest.raises(KernelInputError, match="contiguous"):
        gemv_rows(torch.zeros(8, 2).T, torch.zeros(4, 8))
    assert torch.equal(gemv_rows(torch.zeros(2, 0), torch.zeros(3, 0), torch.ones(3)), torch.ones(2, 3))
