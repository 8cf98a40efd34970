"""Packed token offsets past 2^31 stay exact int64 (checked on the SSD chunk table, no large tensors needed)."""
from __future__ import annotations

import torch

from fastpath.kernels.ssd import ssd_chunk_table


def test_ssd_chunk_table_offsets_past_2_31_are_exact_int64():
    """A packed batch of 2^31 + 9 tokens (chunk 2^30): chunk starts 2^31 and 2^31 + 5 are kept exactly, as int64."""
    Q = 2 ** 30
    cu, starts = [0, 2 ** 31 + 5, 2 ** 31 + 9], [0, 3]
    t = ssd_chunk_table(cu, starts, Q, "cpu")
    assert t.chunk_start.dtype == torch.int64 and t.seq_chunk_ptr.dtype == torch.int64
    assert t.chunk_start.tolist() == [0, Q, 2 * Q, 2 ** 31 + 5]
    assert t.chunk_len.tolist() == [Q, Q, 5, 4]
    assert t.seq_chunk_ptr.tolist() == [0, 3, 4] and t.n_tokens == 2 ** 31 + 9
