"""Prefix-cache defects (DESIGN §12): keys and lookup, restores, pool copies, LRU, checkpoints inside a piece."""
from __future__ import annotations

from hybridqual.mutants.runner import Mutant
from hybridqual.mutants.zoo_paths import (ENGINE, MODEL, K, PC, BANK, ORACLE_PC, T_PC_TRACES, T_PC_POOL, T_PC_LOOKUP,
                                         T_PC_LATE, T_PC_INERT, T_PC_INSIDE_BITS, T_PC_INSIDE_HYBRID, PB, PG,
                                         T_PB_PADDED, T_PB_STORING)


_RESTORE = "            self.bank.copy_state(self.bank.pool_slot(entry.index), slot, p)\n"

PREFIX_CACHE: list[Mutant] = [
    Mutant("pc_restore_wrong_block", "prefix cache",
           "a hit restores pool slot 0 (the first checkpoint's) whatever entry the key found",
           PC, _RESTORE, "            self.bank.copy_state(self.bank.pool_slot(0), slot, p)\n",
           (T_PC_TRACES, T_PC_POOL)),
    Mutant("pc_block_off_by_one", "prefix cache",
           "the checkpoint taken at p is filed under the key of p + block_size (keys[j] for keys[j-1])",
           PC, "        key = block_keys(prompt[:pos], self.block_size)[-1]\n",
           "        key = block_keys(prompt[:pos + self.block_size], self.block_size)[-1]\n",
           (T_PC_TRACES,)),
    Mutant("pc_hit_whole_prompt", "prefix cache",
           "the lookup accepts p = len(prompt): a prompt equal to a cached prefix has no token left to compute",
           PC, "        for j in range((len(prompt) - 1) // self.block_size, 0, -1):\n",
           "        for j in range(len(prompt) // self.block_size, 0, -1):\n",
           (T_PC_LOOKUP,)),
    Mutant("pc_restore_at_first_piece", "prefix cache",
           "the restore copy is made when the request's first piece runs, not at admission, and nothing pins the "
           "entry: a store in between (capacity reached) evicts and overwrites the entry being restored",
           PC, _RESTORE, "            st.restore_from = (entry.index, p)        # copied when its first piece runs\n",
           (T_PC_LATE,),
           more=((ENGINE, "        rec.batch = [b for b in batch if b.kind != \"shadow\"]\n",
                  "        rec.batch = [b for b in batch if b.kind != \"shadow\"]\n"
                  "        for b in batch:\n"
                  "            src = getattr(self.requests[b.request], 'restore_from', None)\n"
                  "            if src is not None and b.kind == 'prefill':\n"
                  "                self.bank.copy_state(self.bank.pool_slot(src[0]), b.slot, src[1])\n"
                  "                self.requests[b.request].restore_from = None\n"),)),
    Mutant("pc_never_consulted", "prefix cache",
           "admission never looks the prompt up: the cache stores checkpoints but is inert (0% hits, no warning)",
           PC, "        p, entry = self.lookup(st.req.prompt, step)\n", "        p, entry = 0, None\n",
           (T_PC_INERT, T_PC_TRACES)),
    Mutant("pc_kv_prefix_not_copied", "prefix cache",
           "store and restore copy the Mamba conv/SSM state only: the attention layers' K/V for [0, p) is not "
           "copied, so a hit attends to whatever its slot held",
           BANK, "        if self.k_cache.numel() and kv_len:\n"
                 "            self.k_cache[:, dst, :kv_len].copy_(self.k_cache[:, src, :kv_len])\n"
                 "            self.v_cache[:, dst, :kv_len].copy_(self.v_cache[:, src, :kv_len])\n", "",
           (T_PC_POOL, T_PC_TRACES)),
    Mutant("pc_ssm_state_not_restored", "prefix cache",
           "store and restore copy conv windows and K/V but not the SSM state (a hit resumes from a zero state)",
           BANK, "            self.ssm_state[:, dst].copy_(self.ssm_state[:, src])\n", "            pass\n",
           (T_PC_POOL, T_PC_TRACES)),
    Mutant("pc_conv_window_wrong_position", "prefix cache",
           "the conv window is copied one position late (oldest-first window shifted by one): the state of "
           "positions p-4..p-2 where p-3..p-1 belong",
           BANK, "            self.conv_state[:, dst].copy_(self.conv_state[:, src])\n",
           "            self.conv_state[:, dst, :, 1:].copy_(self.conv_state[:, src, :, :-1])\n",
           (T_PC_TRACES, T_PC_POOL)),
    Mutant("pc_hit_recomputes_prefix", "prefix cache",
           "a hit restores the checkpoint but the request's prefill still starts at 0: right tokens, the cache saves "
           "nothing (a silently useless cache; the log's pieces and the policy check show it)",
           PC, "            st.done = p\n", "",
           (T_PC_TRACES,)),
    Mutant("pc_stale_checkpoint_kv", "prefix cache",
           "a store into a reused pool slot (after an eviction) rewrites the recurrent state but not the K/V: the "
           "checkpoint keeps the evicted prefix's keys and values",
           PC, "            self.bank.copy_state(slot, self.bank.pool_slot(entry.index), pos, state=not inside)\n",
           "            self.bank.copy_state(slot, self.bank.pool_slot(entry.index), pos if evicted is None else 0,\n"
           "                                 state=not inside)\n",
           (T_PC_POOL, T_PC_TRACES)),
    Mutant("pc_lru_evicts_most_recent", "prefix cache",
           "eviction takes the most recently used checkpoint instead of the least recently used",
           PC, "            evicted = min(self.entries.values(), key=lambda e: (e.last_use, e.stored_seq))\n",
           "            evicted = max(self.entries.values(), key=lambda e: (e.last_use, e.stored_seq))\n",
           (T_PC_TRACES,)),
    Mutant("pc_store_before_forward", "prefix cache",
           "checkpoints are copied when the step is built, before its forward: the state at the piece's start "
           "is filed under the boundary the piece ends on",
           ENGINE, "        ckpts = self.prefix.plan(list(enumerate(pre)), self.requests, rec, self.k) if self.prefix "
                   "and pre else []\n",
           "        ckpts = self.prefix.plan(list(enumerate(pre)), self.requests, rec, self.k) if self.prefix "
           "and pre else []\n"
           "        if self.prefix is not None:\n"
           "            self.prefix.after_launch()\n",
           (T_PC_TRACES,)),
    Mutant("oracle_prefix_inside_not_stored", "spec: prefix cache",
           "the truth stores only the boundaries prefill pieces happen to end on, not those inside a piece (the "
           "fast path, which stores both, disagrees with it)",
           ORACLE_PC, "            for p in boundaries(b.pos, b.count, self.block_size):\n"
                      "                state = st.model_state if p == end else inside[(b.request, p)]\n",
           "            for p in [end] if end % self.block_size == 0 else []:\n"
           "                state = st.model_state if p == end else inside[(b.request, p)]\n",
           ("tests/test_prefix_cache_oracle.py", T_PC_TRACES)),
    Mutant("pc_inside_conv_window_late", "prefix cache",
           "a checkpoint taken inside a piece copies the conv window one position late (inputs p-2..p instead of "
           "p-3..p-1)",
           MODEL, "            rows = xBC[lo + max(rel - K1, 0):lo + rel].t().to(conv_bank.dtype)\n",
           "            rows = xBC[lo + max(rel - K1, 0) + 1:lo + rel + 1].t().to(conv_bank.dtype)\n",
           (T_PC_INSIDE_BITS, T_PC_TRACES)),
    Mutant("pc_inside_state_one_chunk_early", "prefix cache",
           "the chunk table files an interior checkpoint on the chunk before p: the pool slot gets the SSM state "
           "entering chunk p - chunk_size",
           K + "ssd.py", "        ckpt[c] = b\n", "        ckpt[max(c - 1, ptr[s])] = b\n",
           (T_PC_INSIDE_BITS + "[triton]",)),
    Mutant("pc_inside_kv_not_copied", "prefix cache",
           "a checkpoint taken inside a piece gets its Mamba state from the forward but its attention K/V of "
           "[0, p) is never copied into the pool slot",
           PC, "            self.bank.copy_state(slot, self.bank.pool_slot(entry.index), pos, state=not inside)\n",
           "            self.bank.copy_state(slot, self.bank.pool_slot(entry.index), 0 if inside else pos,\n"
           "                                 state=not inside)\n",
           (T_PC_INSIDE_HYBRID, T_PC_TRACES)),
    Mutant("prefill_bucket_stale_start", "stale graph metadata",
           "a bucket's kept batch (its CUDA graph's inputs) gets the step's ids, positions and chunk table but keeps "
           "the piece start it was built with: the replay's attention and conv read the wrong start",
           PB, '_FIELDS = ("ids", "pos", "pre_cu", "pre_slot", "pre_start", "pre_init", "last", "pre_tok_seq")\n',
           '_FIELDS = ("ids", "pos", "pre_cu", "pre_slot", "pre_init", "last", "pre_tok_seq")\n',
           (T_PB_PADDED,)),
    Mutant("prefill_bucket_storing_step_unpadded", "batch invariance",
           "a step storing a checkpoint inside its piece skips its bucket and runs unpadded: in the default mode its "
           "projections run at another M than the same piece's in a run without the cache, so cache on != off",
           PG, "        if n_dec or not pieces or tokens > self.max_tokens:\n",
           "        if n_dec or checkpoints or not pieces or tokens > self.max_tokens:\n",
           (T_PB_STORING,)),
]
