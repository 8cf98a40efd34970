"""The truth's prefix cache (DESIGN §12, docs/scheduler.md §9): block keys, checkpoints, longest-hit lookup, LRU.

A checkpoint is a deep copy of one request's model state at a block boundary p = j·B of its prompt (conv windows,
SSM states and attention K/V for [0, p) — an `OracleState` at position p), filed under the chain hash of
prompt[0:p].  The scheduler (oracle/scheduler.py) calls three things:

    lookup(prompt, step)          at admission: the largest cached p = j·B <= len(prompt) - 1, or (0, None)
    prefill(model, st, b)         a piece's prefill, split at the block boundaries inside it to keep their states
                                  (pieces are cut exactly as without a cache: DESIGN §12)
    store(...)                    at the end of the step: for every boundary p a piece passed or ended on, file a
                                  checkpoint (LRU eviction when full)

B is the checkpoint block: the trace's block_size, or lcm(block_size, attention_block_size) when the engine declares
an attention block of its own (DESIGN §21: a resume point needs both the Mamba state and whole KV blocks).

Keys: key_0 = sha256(b"hybridqual.prefix/1"), key_j = sha256(key_{j-1} || block j as little-endian int64).
SHA-256 is collision resistant (no collision has ever been exhibited; a generic birthday collision among n keys
has probability about n^2 / 2^257), so equal keys mean equal token prefixes; the oracle also keeps each
entry's tokens and asserts them on a hit, so a collision could not pass silently here.
"""
from __future__ import annotations

import copy
import hashlib
import struct
from dataclasses import dataclass
from typing import Any

KEY_SEED = hashlib.sha256(b"hybridqual.prefix/1").digest()


def block_keys(prompt: tuple[int, ...] | list[int], block_size: int) -> list[str]:
    """keys[j-1] = hex chain hash of prompt[0:j*block_size], for every j*block_size <= len(prompt)."""
    h, keys = KEY_SEED, []
    for j in range(len(prompt) // block_size):
        block = prompt[j * block_size:(j + 1) * block_size]
        h = hashlib.sha256(h + struct.pack(f"<{block_size}q", *block)).digest()
        keys.append(h.hex())
    return keys


def boundaries(pos: int, count: int, block_size: int) -> list[int]:
    """The block boundaries p = j*B that a piece [pos, pos+count) passes or ends on: pos < p <= pos + count."""
    return list(range((pos // block_size + 1) * block_size, pos + count + 1, block_size))


@dataclass
class Entry:
    """One checkpoint: the state of `owner`'s prompt[0:pos] and the LRU bookkeeping."""

    key: str
    pos: int
    owner: str
    tokens: tuple[int, ...]
    state: Any
    stored_seq: int
    last_use: int


class PrefixCache:
    """The cache of one run: at most `capacity` checkpoints of block-aligned prefixes (keys of `block_size`)."""

    def __init__(self, block_size: int, capacity: int):
        self.block_size, self.capacity = block_size, capacity
        self.entries: dict[str, Entry] = {}
        self._seq = 0

    def lookup(self, prompt: tuple[int, ...], step: int) -> tuple[int, Entry | None]:
        """Longest hit: the largest p = j*B <= len(prompt) - 1 whose key is cached (its last use becomes `step`);
        (0, None) on a miss.  At least one prompt token is always left to compute (it produces the logits)."""
        keys = block_keys(prompt, self.block_size)
        for j in range((len(prompt) - 1) // self.block_size, 0, -1):
            e = self.entries.get(keys[j - 1])
            if e is not None:
                p = j * self.block_size
                assert e.tokens == tuple(prompt[:p]), f"prefix key collision at p={p}"
                e.last_use = step
                return p, e
        return 0, None

    def store(self, prompt: tuple[int, ...], pos: int, owner: str, state: Any,
              step: int) -> tuple[Entry | None, Entry | None]:
        """File a checkpoint of prompt[0:pos] (pos a block boundary) unless one exists; returns (stored entry or
        None, evicted entry or None).  A full cache evicts its least recently used entry (ties: earliest stored)."""
        key = block_keys(prompt[:pos], self.block_size)[-1]
        if key in self.entries:
            return None, None
        evicted = None
        if len(self.entries) >= self.capacity:
            evicted = min(self.entries.values(), key=lambda e: (e.last_use, e.stored_seq))
            del self.entries[evicted.key]
        self._seq += 1
        entry = Entry(key, pos, owner, tuple(prompt[:pos]), copy.deepcopy(state), self._seq, step)
        self.entries[key] = entry
        return entry, evicted

    @staticmethod
    def restore(entry: Entry) -> Any:
        """The state a hitting request starts from: a deep copy, so it never depends on the entry again."""
        return copy.deepcopy(entry.state)


class SchedulerCache(PrefixCache):
    """The cache as oracle/scheduler.py drives it: admission lookups, split prefills, stores after the forward;
    every event goes into the step's log record (`rec.cache`: hits, stored, evicted; `cached_tokens` on
    admissions)."""

    def __init__(self, block_size: int, capacity: int, store_decoded: bool = False):
        super().__init__(block_size, capacity)
        self.inside: dict[tuple[str, int], Any] = {}     # (request, p): the state at a boundary inside a piece
        self.store_decoded = store_decoded               # DESIGN §17: boundaries of generated tokens too
        self.decoded: dict[tuple[str, int], Any] = {}    # (request, p): a verify row's state at a boundary

    def decode_boundary(self, st: Any, p: int) -> bool:
        """Whether position p of a request's generated tokens is a decode-store boundary (DESIGN §17)."""
        return self.store_decoded and p % self.block_size == 0 and p > len(st.req.prompt)

    def keep(self, st: Any, p: int, state: Any) -> None:
        """Verify hook: the state after an accepted input ends at p; kept while p is a boundary, stored at resolve
        only if the step's outcome proves it verified."""
        if self.decode_boundary(st, p):
            self.decoded[(st.req.id, p)] = copy.deepcopy(state)

    def blocks_overlap(self, batch: list) -> bool:
        """Async (DESIGN §17): a decode-only step with a row reaching a decode boundary is not overlapped, so its
        store is filed from the state that row left before the next forward moves it."""
        return self.store_decoded and any(b.kind == "decode" and (b.pos + 1) % self.block_size == 0 for b in batch)

    def after_resolve(self, batch: list, emitted: dict[str, int], requests: dict, rec: Any, step: int) -> None:
        """DESIGN §17 decode stores, at the resolve of `step`: for each decode/verify row (batch order) whose request
        emitted e tokens, every boundary p with len(prompt) < p and pos < p <= pos + e (never a lookahead one)."""
        kept, self.decoded = self.decoded, {}
        if not self.store_decoded:
            return
        for b in batch:
            if b.kind not in ("decode", "verify"):
                continue
            st = requests[b.request]
            for p in boundaries(b.pos, emitted.get(b.request, 0), self.block_size):
                if not self.decode_boundary(st, p):
                    continue
                state = kept[(b.request, p)] if b.kind == "verify" else st.model_state
                assert getattr(state, "position", p) == p, "decode checkpoint state is not at the boundary"
                tokens = tuple(st.req.prompt) + tuple(st.output)
                entry, evicted = self.store(tokens, p, b.request, state, step)
                if evicted is not None:
                    rec.cache["evicted"].append({"request": evicted.owner, "pos": evicted.pos})
                if entry is not None:
                    rec.cache["stored"].append({"request": b.request, "pos": p})

    def admit(self, st: Any, rec: Any, step: int) -> None:
        """The request just admitted (rec.admit[-1]) starts from the longest cached prefix, if any."""
        p, entry = self.lookup(st.req.prompt, step)
        rec.admit[-1]["cached_tokens"] = p
        if entry is not None:
            st.model_state, st.done = self.restore(entry), p
            rec.cache["hits"].append({"request": st.req.id, "pos": p})

    def prefill(self, model: Any, st: Any, b: Any) -> tuple[Any, Any]:
        """model.prefill of the piece b from the request's state, as consecutive prefills split at the block
        boundaries inside it (their states kept for after_forward): the same chunked arithmetic, at fp64."""
        prompt, state, start, end = st.req.prompt, st.model_state, b.pos, b.pos + b.count
        for p in boundaries(b.pos, b.count, self.block_size):
            if p < end:
                _, state = model.prefill(list(prompt[start:p]), state)
                self.inside[(b.request, p)], start = copy.deepcopy(state), p   # (a model may reuse it)
        return model.prefill(list(prompt[start:end]), state)

    def after_forward(self, batch: list, requests: dict, rec: Any, step: int) -> None:
        """Store a checkpoint for every block boundary each prefill piece of this step passed or ended on (batch
        order, then position)."""
        inside, self.inside = self.inside, {}
        for b in batch:
            if b.kind != "prefill":
                continue
            st, end = requests[b.request], b.pos + b.count
            for p in boundaries(b.pos, b.count, self.block_size):
                state = st.model_state if p == end else inside[(b.request, p)]
                assert getattr(state, "position", p) == p, "checkpoint state is not at the boundary"
                entry, evicted = self.store(st.req.prompt, p, b.request, state, step)
                if evicted is not None:
                    rec.cache["evicted"].append({"request": evicted.owner, "pos": evicted.pos})
                if entry is not None:
                    rec.cache["stored"].append({"request": b.request, "pos": p})
