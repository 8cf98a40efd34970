"""The fast path's prefix cache (DESIGN §12, docs/engine.md "Prefix cache"): checkpoints in the bank's pool slots.

Mirrors oracle/prefix_cache.py (same policy, written for the engine): a checkpoint of a prompt prefix p = j·B is
the conv windows and SSM states of every Mamba layer plus each attention layer's K/V for [0, p), copied into one
of the M pool slots R..R+M-1 of the ONE StateBank (the same tensors as the request slots, allocated once, so
the pool never moves).  The host keeps only keys and LRU bookkeeping; every copy is a device copy on the
engine's stream, ordered after the forward that produced the state and before any forward that reads it.

    admit:  longest hit p <= len(prompt) - 1  ->  copy pool slot -> the request's zeroed slot, start at p
    plan:   before a forward, every block boundary p a prefill piece passes (pos < p <= end) is filed (LRU
            eviction when full); a boundary inside the piece is written by the forward itself (the SSD kernel
            writes the state entering the chunk at p, the model the conv window at p: fastpath/model.py)
    store:  after the forward: a piece that ended on p copies its slot's whole state; an interior p copies K/V
            of [0, p) — so pieces are cut exactly as with the cache off (DESIGN §12)
B is the checkpoint block: the trace's block_size, or with an attention_block_size lcm of the two (DESIGN §21), so a
resume point always has both a Mamba state and whole KV blocks; the pool slot holds both, restored together.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

from oracle.trace import PrefixCacheConfig

from .bank import StateBank

KEY_SEED = hashlib.sha256(b"hybridqual.prefix/1").digest()


def block_keys(prompt: tuple[int, ...] | list[int], block_size: int) -> list[str]:
    """keys[j-1] = chain sha256 (hex) of prompt[0:j*block_size]: key_j = sha256(key_{j-1} || int64 LE block j)."""
    h, keys = KEY_SEED, []
    for j in range(len(prompt) // block_size):
        h = hashlib.sha256(h + struct.pack(f"<{block_size}q", *prompt[j * block_size:(j + 1) * block_size])).digest()
        keys.append(h.hex())
    return keys


def boundaries(pos: int, count: int, block_size: int) -> list[int]:
    """The block boundaries p = j*B a piece [pos, pos+count) passes or ends on: pos < p <= pos + count."""
    return list(range((pos // block_size + 1) * block_size, pos + count + 1, block_size))


@dataclass
class Entry:
    """Host record of one checkpoint: pool index, prefix length, the request that stored it, LRU fields."""
    key: str
    index: int
    pos: int
    owner: str
    stored_seq: int
    last_use: int


class PrefixCache:
    """Keys, LRU and pool-slot bookkeeping on the host; state copies in the bank on the device."""

    def __init__(self, config: PrefixCacheConfig, bank: StateBank):
        if bank.pool != config.capacity:
            raise ValueError(f"PrefixCache: the bank has {bank.pool} pool slots, the cache needs {config.capacity}")
        self.block_size, self.capacity, self.bank = config.checkpoint_block, config.capacity, bank   # DESIGN §21
        self.mamba_block_size = config.block_size                          # the Mamba checkpoint block Bm
        self.attention_block_size = config.attention_block_size or config.block_size   # whole KV blocks Ba
        self.store_decoded = config.store_decoded         # DESIGN §17: boundaries of generated tokens too
        self.reset()

    def reset(self) -> None:
        """Forget every checkpoint (the pool's memory stays where it is; stale data is never read)."""
        self.entries: dict[str, Entry] = {}
        self.free = list(range(self.capacity - 1, -1, -1))          # lowest pool index first
        self._seq = 0
        self._writes: list = []                  # this step's stores, written by after_launch
        self.hits = self.stores = self.evictions = 0

    # ---- policy --------------------------------------------------------------------------------------
    def lookup(self, prompt: tuple[int, ...], step: int) -> tuple[int, Entry | None]:
        """The largest p = j*B <= len(prompt) - 1 whose key is cached (last use := step), or (0, None)."""
        keys = block_keys(prompt, self.block_size)
        for j in range((len(prompt) - 1) // self.block_size, 0, -1):
            e = self.entries.get(keys[j - 1])
            if e is not None:
                e.last_use = step
                return j * self.block_size, e
        return 0, None

    def file(self, prompt: tuple[int, ...], pos: int, owner: str, step: int) -> tuple[Entry | None, Entry | None]:
        """The policy of a store (no copy): a pool slot for key(prompt[0:pos]) unless cached; LRU when full."""
        key = block_keys(prompt[:pos], self.block_size)[-1]
        if key in self.entries:
            return None, None
        evicted = None
        if not self.free:
            evicted = min(self.entries.values(), key=lambda e: (e.last_use, e.stored_seq))
            del self.entries[evicted.key]
            self.free.append(evicted.index)
            self.evictions += 1
        self._seq += 1
        entry = Entry(key, self.free.pop(), pos, owner, self._seq, step)
        self.entries[key] = entry
        self.stores += 1
        return entry, evicted

    # ---- engine hooks ----------------------------------------------------------------------------------
    def admit(self, st: Any, slot: int, rec: Any, step: int) -> None:
        """The request just admitted into (zeroed) `slot` resumes from its longest cached prefix, if any."""
        p, entry = self.lookup(st.req.prompt, step)
        rec.admit[-1]["cached_tokens"] = p
        if entry is not None:
            self.bank.copy_state(self.bank.pool_slot(entry.index), slot, p)
            st.done = p
            self.hits += 1
            rec.cache["hits"].append({"request": st.req.id, "pos": p})

    def plan(self, pieces: list[tuple[int, Any]], requests: dict, rec: Any, step: int) -> list[tuple[int, int, int]]:
        """Before the forward: file a checkpoint for every block boundary each prefill piece (sequence index,
        BatchRow) passes or ends on, in batch order then position (the log's store order); returns the interior
        ones as (sequence, p, pool slot) for the forward to write. A pool slot filed twice in one step (evicted
        again within it) is written only for its last store."""
        ops = []
        for seq, b in pieces:
            end = b.pos + b.count
            for p in boundaries(b.pos, b.count, self.block_size):
                entry, evicted = self.file(requests[b.request].req.prompt, p, b.request, step)
                if evicted is not None:
                    rec.cache["evicted"].append({"request": evicted.owner, "pos": evicted.pos})
                if entry is not None:
                    rec.cache["stored"].append({"request": b.request, "pos": p})
                    ops.append((seq, b.slot, entry, p, evicted, p < end))
        last = {op[2].index: i for i, op in enumerate(ops)}
        self._writes = [op for i, op in enumerate(ops) if last[op[2].index] == i]
        return [(seq, p, self.bank.pool_slot(entry.index)) for seq, _, entry, p, _, inside in self._writes if inside]

    def after_launch(self) -> None:
        """After the forward that `plan` prepared (device copies in stream order): a piece that ended on p gives
        the pool slot its whole state; an interior p only the K/V of [0, p) (the forward wrote its Mamba state)."""
        for _, slot, entry, pos, evicted, inside in self._writes:
            self.bank.copy_state(slot, self.bank.pool_slot(entry.index), pos, state=not inside)
        self._writes = []

    # ---- decode stores (DESIGN §17) ---------------------------------------------------------------------
    def blocks_overlap(self, batch: list) -> bool:
        """Async: a decode-only step with a decode row whose input reaches a boundary (pos + 1 = j·B) is not
        overlapped, so its store reads the state that row left before the next forward moves it."""
        return self.store_decoded and any(b.kind == "decode" and (b.pos + 1) % self.block_size == 0 for b in batch)

    def after_resolve(self, batch: list, emitted: dict[str, int], requests: dict, rec: Any, step: int,
                      snapshot) -> None:
        """At the resolve of `step`, before rollback and frees: for each decode/verify row (batch order) whose
        request emitted e tokens, store every boundary p with len(prompt) < p and pos < p <= pos + e — never a
        lookahead one. `snapshot(b, j)`: a verify row's (conv, ssm) after its input j, None = the slot holds it."""
        if not self.store_decoded:
            return
        for b in batch:
            if b.kind not in ("decode", "verify"):
                continue
            st = requests[b.request]
            for p in boundaries(b.pos, emitted.get(b.request, 0), self.block_size):
                if p <= len(st.req.prompt):
                    continue
                entry, evicted = self.file(tuple(st.req.prompt) + tuple(st.output), p, b.request, step)
                if evicted is not None:
                    rec.cache["evicted"].append({"request": evicted.owner, "pos": evicted.pos})
                if entry is None:
                    continue
                rec.cache["stored"].append({"request": b.request, "pos": p})
                dst = self.bank.pool_slot(entry.index)
                snap = snapshot(b, p - b.pos - 1) if b.kind == "verify" else None
                self.bank.copy_state(b.slot, dst, p, state=snap is None)
                if snap is not None:
                    self.bank.conv_state[:, dst].copy_(snap[0])
                    self.bank.ssm_state[:, dst].copy_(snap[1])
