"""The llama.cpp worker's prefix cache (DESIGN §12, §17, §21) over llama.cpp sequence-state snapshots: the policy of
oracle/prefix_cache.py rewritten for the worker (it imports only the standard library, numpy and llama_cpp).

Entries are keyed by the exact token prefix (a block multiple). Prompt stores (§12) are filed for every boundary a
prefill piece passes or ends on; with `store_decoded` (§17) a decode or verify row also stores the boundaries of
generated tokens its step proved verified: pos < p <= pos + e (e: the tokens the row emitted), never a lookahead
one. Within a step the prompt stores come first, then the decode stores in batch order and increasing p.
"""
from __future__ import annotations

import math


def checkpoint_block(prefix_cache: dict) -> int:
    """Where checkpoints fall: block_size, or lcm(block_size, attention_block_size) when the trace declares an attention
    block of its own (DESIGN §21)."""
    block = int(prefix_cache["block_size"])
    return math.lcm(block, int(prefix_cache.get("attention_block_size") or block))


class Checkpoints:
    """DESIGN §12's prefix cache over llama.cpp sequence-state snapshots: entries keyed by the exact token prefix
    (a block multiple), longest hit leaving one prompt token to compute, LRU eviction (ties: earliest stored) —
    the policy of oracle/prefix_cache.py; with `store_decoded`, DESIGN §17's decode stores of verified state."""

    def __init__(self, block_size: int, capacity: int, store_decoded: bool = False) -> None:
        self.block_size, self.capacity, self.store_decoded = block_size, capacity, store_decoded
        self.entries: dict[tuple, dict] = {}
        self._seq = 0

    @classmethod
    def from_config(cls, prefix_cache: dict) -> "Checkpoints":
        """The cache of a trace's engine.prefix_cache block (JSON form)."""
        return cls(checkpoint_block(prefix_cache), int(prefix_cache["capacity"]),
                   bool(prefix_cache.get("store_decoded", False)))

    def boundaries(self, pos: int, count: int) -> list[int]:
        """The block boundaries p a piece [pos, pos+count) passes or ends on: pos < p <= pos + count."""
        b = self.block_size
        return list(range((pos // b + 1) * b, pos + count + 1, b))

    def decode_cuts(self, pos: int, count: int, prompt_len: int) -> list[int]:
        """Where a decode or verify row feeding [pos, pos+count) is snapshotted (§17): every boundary it passes or
        ends on past the prompt, when decode stores are on (else none)."""
        if not self.store_decoded:
            return []
        return [p for p in self.boundaries(pos, count) if p > prompt_len]

    def lookup(self, prompt: list[int], step: int) -> tuple[int, bytes | None]:
        """The largest cached p = j*B <= len(prompt) - 1 and its snapshot (its last use becomes `step`); (0, None)."""
        for j in range((len(prompt) - 1) // self.block_size, 0, -1):
            e = self.entries.get(tuple(prompt[:j * self.block_size]))
            if e is not None:
                e["last_use"] = step
                return j * self.block_size, e["data"]
        return 0, None

    def _file(self, key: tuple, p: int, rid: str, data: bytes, step: int, ev: dict) -> None:
        """Store one checkpoint unless its prefix is cached; a full cache evicts its least recently used entry."""
        if key in self.entries:
            return
        if len(self.entries) >= self.capacity:
            old = min(self.entries.values(), key=lambda e: (e["last_use"], e["stored_seq"]))
            del self.entries[old["key"]]
            ev["evicted"].append({"request": old["owner"], "pos": old["pos"]})
        self._seq += 1
        self.entries[key] = {"key": key, "pos": p, "owner": rid, "data": data, "stored_seq": self._seq,
                             "last_use": step}
        ev["stored"].append({"request": rid, "pos": p})

    def store_step(self, pieces: list, live: dict, snaps: dict, step: int, decoded: list | None = None,
                   tokens: dict | None = None) -> dict:
        """File this step's snapshots: the prompt pieces' boundaries (batch order, then position), then with
        `store_decoded` the decode rows' (`decoded`: (rid, pos, emitted) in batch order; `tokens`: each request's
        output so far) at pos < p <= pos + emitted past the prompt. The step's stored/evicted events."""
        ev: dict[str, list] = {"stored": [], "evicted": []}
        for rid, start, n in pieces:
            prompt = live[rid]["req"]["prompt"]
            for p in self.boundaries(start, n):
                self._file(tuple(prompt[:p]), p, rid, snaps[(rid, p)], step, ev)
        for rid, pos, emitted in decoded or ():
            seq = live[rid]["req"]["prompt"] + tokens[rid]
            for p in self.decode_cuts(pos, emitted, len(live[rid]["req"]["prompt"])):
                self._file(tuple(seq[:p]), p, rid, snaps[(rid, p)], step, ev)
        return ev
