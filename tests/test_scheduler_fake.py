"""A tiny deterministic stand-in for OracleModel (same prefill/decode/config interface) and its own checks.

State is per request and position-dependent, so a scheduler that feeds a wrong token, skips or repeats a piece,
or mixes two requests' states produces different tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from oracle.sampling import greedy


@dataclass(frozen=True)
class FakeConfig:
    """The two config fields the scheduler reads."""

    vocab_size: int = 32
    chunk_size: int = 4


@dataclass
class FakeState:
    """Per-request state: a hidden vector and the next absolute position."""

    h: torch.Tensor
    position: int = 0


class FakeModel:
    """h_t = tanh(0.9 h_{t-1} + E[token_t] + P[t mod 7]); logits_t = W h_t (fp64, seeded)."""

    def __init__(self, vocab_size: int = 32, chunk_size: int = 4, dim: int = 16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.config = FakeConfig(vocab_size, chunk_size)
        self.E = torch.randn(vocab_size, dim, generator=g, dtype=torch.float64)
        self.P = torch.randn(7, dim, generator=g, dtype=torch.float64)
        self.W = torch.randn(vocab_size, dim, generator=g, dtype=torch.float64) * 3
        self.dim = dim

    def new_state(self) -> FakeState:
        """A zeroed state."""
        return FakeState(torch.zeros(self.dim, dtype=torch.float64))

    def _step(self, token: int, state: FakeState) -> torch.Tensor:
        if not 0 <= token < self.config.vocab_size:
            raise ValueError(f"token {token} out of range")
        state.h = torch.tanh(0.9 * state.h + self.E[token] + self.P[state.position % 7])
        state.position += 1
        return self.W @ state.h

    def prefill(self, tokens: list[int], state: FakeState | None = None):
        """Logits [len, vocab] for `tokens`, continuing from `state`."""
        state = self.new_state() if state is None else state
        return torch.stack([self._step(t, state) for t in tokens]), state

    def decode(self, token: int, state: FakeState):
        """Logits [vocab] for one token."""
        return self._step(token, state), state


def test_fake_model_chunked_prefill_equals_whole_prefill():
    m = FakeModel(seed=3)
    toks = [5, 1, 7, 7, 2, 9, 30, 4, 4]
    whole, _ = m.prefill(toks)
    a, st = m.prefill(toks[:4])
    b, st = m.prefill(toks[4:], st)
    assert torch.equal(torch.cat([a, b]), whole)


def test_fake_model_depends_on_history():
    m = FakeModel(seed=3)
    x, _ = m.prefill([1, 2, 3])
    y, _ = m.prefill([2, 2, 3])
    assert greedy(x[-1]) != greedy(y[-1]) or not torch.equal(x[-1], y[-1])
