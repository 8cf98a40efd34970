"""A stand-in for llama.cpp under the llama.cpp worker's own scheduler (worker.Engine), for the default tier's tests
of what the worker decides (prefix-cache checkpoints, state hand-overs) without llama.cpp installed."""
from __future__ import annotations

import json

import numpy as np

from hybridqual.adapters.llamacpp import worker


class StandIn(worker.Engine):
    """worker.Engine's scheduler over a stand-in for llama.cpp: a sequence's state is its token list (its own per
    context), a snapshot that list, the logits a function of it (so a wrong restore changes the tokens); peers (other
    engine instances) are further stand-ins."""

    def __init__(self, vocab: int) -> None:        # no llama.cpp: only what run() touches
        self.n_seq, self.n_vocab, self.mem, self.state, self._peers = 64, vocab, None, {}, {}
        self.lc = type("lc", (), {"llama_memory_clear": staticmethod(lambda *a: self.state.clear()),
                                  "llama_memory_seq_rm": staticmethod(lambda m, seq, a, b: self.state.pop(seq, None))})

    def peer(self, name: str) -> "StandIn":
        return self._peers.setdefault(name, type(self)(self.n_vocab))

    def _decode(self, rows):
        out = []
        for tok, pos, seq, want in rows:
            have = self.state.setdefault(seq, [])
            assert len(have) == pos, f"seq {seq}: row at position {pos} after {len(have)} tokens"
            have.append(tok)
            rng = np.random.default_rng(hash(tuple(have)) % 2**32)
            out.append(rng.standard_normal(self.n_vocab).astype(np.float32) if want else None)
        return out

    def snapshot(self, seq: int) -> bytes:
        return json.dumps(self.state.get(seq, [])).encode()

    def restore(self, data: bytes, seq: int) -> None:
        self.state[seq] = json.loads(data)
