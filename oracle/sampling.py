"""Token sampling, oracle side: greedy (lowest index wins ties) and seeded Gumbel-max (docs/scheduler.md §6).

The seeded draw is a function of (request seed, token position, token index) only, so it cannot depend on the batch.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

MASK64 = (1 << 64) - 1
_U64 = np.uint64


def greedy(logits: Tensor) -> int:
    """First index of the maximum of a 1-D logits vector, compared in its own dtype (fp64/fp32/bf16)."""
    if logits.dim() != 1:
        raise ValueError(f"greedy: logits must be 1-D [vocab], got shape {tuple(logits.shape)}")
    if torch.isnan(logits).any():
        raise ValueError("greedy: logits contain NaN")
    top = logits.max()
    return int(torch.nonzero(logits == top)[0, 0])


def mix64(z: int) -> int:
    """SplitMix64 finaliser on an unsigned 64-bit integer (Python ints, the literal reference)."""
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def _mix64_np(z: np.ndarray) -> np.ndarray:
    """`mix64` vectorised over uint64 (numpy wraps modulo 2^64 and shifts logically)."""
    with np.errstate(over="ignore"):
        z = z + _U64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def uniforms(seed: int, position: int, vocab_size: int) -> Tensor:
    """u_i = ((mix64(key ^ i) >> 11) + 0.5) * 2^-53 in (0, 1), fp64, key = mix64(mix64(seed) ^ position)."""
    key = mix64(mix64(seed & MASK64) ^ (position & MASK64))
    bits = _mix64_np(np.arange(vocab_size, dtype=np.uint64) ^ _U64(key))
    u = ((bits >> _U64(11)).astype(np.float64) + 0.5) * 2.0 ** -53
    return torch.from_numpy(u)


def gumbel_noise(seed: int, position: int, vocab_size: int) -> Tensor:
    """g_i = -log(-log(u_i)), fp64: the noise for the token at `position` of a request seeded with `seed`."""
    return -torch.log(-torch.log(uniforms(seed, position, vocab_size)))


def seeded(logits: Tensor, temperature: float, seed: int, position: int) -> int:
    """Gumbel-max draw: first argmax of float64(logits) / temperature + g(seed, position)."""
    if logits.dim() != 1:
        raise ValueError(f"seeded: logits must be 1-D [vocab], got shape {tuple(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"seeded: temperature must be > 0, got {temperature}")
    scores = logits.to(torch.float64) / temperature + gumbel_noise(seed, position, logits.shape[0])
    return greedy(scores)


def sample(logits: Tensor, sampling, position: int) -> int:
    """Sample one token for a request with `sampling` (oracle.trace.Sampling) at absolute `position`."""
    if sampling.kind == "greedy":
        return greedy(logits)
    if sampling.kind == "seeded":
        return seeded(logits, sampling.temperature, sampling.seed, position)
    raise ValueError(f"sample: unknown sampling kind {sampling.kind!r}")
