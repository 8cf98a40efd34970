"""The seeded-sampling spec (docs/scheduler.md §6) is reproducible bitwise by the fast path's device sampler."""
from __future__ import annotations

import pytest
import torch

from oracle.sampling import gumbel_noise, sample
from oracle.trace import Sampling

fp_sample = pytest.importorskip("fastpath.engine.sample")


@pytest.mark.parametrize("seed,position", [(0, 0), (7, 3), (2 ** 63 - 1, 10 ** 6), (123456789, 17), (5, 2 ** 40)])
def test_fastpath_gumbel_noise_bitwise_equals_oracle(seed, position):
    keys = torch.tensor([fp_sample.row_key(seed, position)], dtype=torch.int64)
    assert torch.equal(fp_sample.gumbel(keys, 777)[0], gumbel_noise(seed, position, 777))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fastpath_batched_draws_equal_oracle_per_row(dtype):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 96, generator=g).to(dtype)
    rows = [(r, 0.5 + 0.25 * r, 1000 + r // 2, 3 * r + 1) for r in range(0, 6, 2)]   # rows 1, 3, 5 stay greedy
    out = torch.empty(6, dtype=torch.int64)
    fp_sample.sample_rows(logits, out, rows)
    for r in range(6):
        spec = next((Sampling("seeded", t, s) for row, t, s, _ in rows if row == r), Sampling())
        pos = next((p for row, _, _, p in rows if row == r), 0)
        assert int(out[r]) == sample(logits[r], spec, pos), r
