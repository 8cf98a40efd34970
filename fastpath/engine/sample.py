"""Batched token sampling on the device: greedy for every row, seeded Gumbel-max rows overwritten in place.

Seeded draws follow docs/scheduler.md §6 exactly (SplitMix64 counter noise, fp64), computed on the device with
int64 arithmetic (wrapping multiply, logical shifts emulated by masking) so the draw depends only on
(request seed, position, token index) — never on the batch.  The row keys are computed on the host.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import ops

MASK64 = (1 << 64) - 1


def _s64(u: int) -> int:
    """Unsigned 64-bit -> the same bits as a signed int64."""
    u &= MASK64
    return u - (1 << 64) if u >= 1 << 63 else u


def mix64(z: int) -> int:
    """SplitMix64 finaliser on Python ints (host side: per-row keys)."""
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def row_key(seed: int, position: int) -> int:
    """key = mix64(mix64(seed) ^ position), as a signed int64 value."""
    return _s64(mix64(mix64(seed & MASK64) ^ (position & MASK64)))


def _shr(z: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 bits."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64_dev(z: Tensor) -> Tensor:
    z = z + _s64(0x9E3779B97F4A7C15)
    z = (z ^ _shr(z, 30)) * _s64(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _s64(0x94D049BB133111EB)
    return z ^ _shr(z, 31)


def gumbel(keys: Tensor, vocab_size: int) -> Tensor:
    """g[r, i] = -log(-log(u)), u = ((mix64(key_r ^ i) >>> 11) + 0.5) * 2^-53, fp64 [n, V]."""
    idx = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)
    bits = _mix64_dev(keys[:, None] ^ idx[None, :])
    u = (_shr(bits, 11).to(torch.float64) + 0.5) * 2.0 ** -53
    return -torch.log(-torch.log(u))


def sample_rows(logits: Tensor, out: Tensor, seeded: list[tuple[int, float, int, int]],
                backend: str = "triton") -> Tensor:
    """Greedy argmax of every row into `out`; then rows (row, temperature, seed, position) get a seeded draw."""
    ops.greedy_sample(logits, out, backend=backend)
    if seeded:
        dev = logits.device
        rows = torch.tensor([s[0] for s in seeded], dtype=torch.int64, device=dev)
        temps = torch.tensor([s[1] for s in seeded], dtype=torch.float64, device=dev)
        keys = torch.tensor([row_key(s[2], s[3]) for s in seeded], dtype=torch.int64, device=dev)
        scores = logits.index_select(0, rows).to(torch.float64) / temps[:, None] + gumbel(keys, logits.shape[1])
        out.index_copy_(0, rows, torch.argmax(scores, dim=-1))
    return out
