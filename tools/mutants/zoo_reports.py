"""The public 2026 reports of hybrid-model engine bugs: one class each, reproduced on our fast path."""
from __future__ import annotations

from hybridqual.mutants.runner import Mutant
from hybridqual.mutants.zoo_paths import (ENGINE, K, OPS, ROWS, PC, SPEC, T_ROWS, T_SPEC_STATE, T_TAILS, T_COBATCH,
                                         T_PC_LRU, T_SPEC_ACCEPT, T_PC_INSIDE, T_PC_TRACES)
from hybridqual.mutants.zoo_spec import _RESTORE           # the rollback's restore line, as zoo_spec patches it


_PIECES = "        pieces = [(b.pos, b.count, b.slot) for b in pre]\n"

PUBLIC_REPORTS: list[Mutant] = [
    Mutant("pc_short_piece_into_prefix_block", "prefix cache",
           "vLLM #56196: a piece shorter than d_conv - 1 that continues a prefix hit runs on the checkpoint's pool "
           "slot (the shared prefix block) instead of the request's own slot: its conv window and state land in the "
           "shared block, the request decodes from the unchanged prefix state and later hits read a corrupted block",
           ENGINE, _PIECES,
           "        pieces = [(b.pos, b.count, getattr(self.requests[b.request], 'hit_slot', b.slot)\n"
           "                   if b.count < self.config.mamba_d_conv - 1 and\n"
           "                   b.pos == getattr(self.requests[b.request], 'hit_pos', -1) else b.slot) for b in pre]\n",
           (T_PC_LRU,),
           more=((PC, "            st.done = p\n",
                  "            st.done = p\n            st.hit_slot, st.hit_pos = self.bank.pool_slot(entry.index), p\n"),)),
    Mutant("one_token_tail_fresh_path", "prefix cache",
           "a one-token piece that starts on a chunk/block boundary (a prefix hit with prompt = 1 mod the block, "
           "or the last piece of a prompt = 1 mod the piece size) takes the fresh-sequence path: it is packed "
           "without its initial state. The trigger (a one-token piece) is SGLang PR #29633's; its reported "
           "mechanism is another (an MoE kernel given one token, M = 1, returning NaN), which no shipped dense or "
           "MoE path of ours has the shape for",
           "fastpath/engine/packing.py", "[int(s > 0) for s in starts]",
           "[int(s > 0 and not (c == 1 and s % chunk_size == 0)) for s, c, _ in pieces]",
           (T_PC_LRU, T_TAILS)),
    Mutant("one_token_prompt_decode_path", "stale state",
           "vLLM #57720 (CPU analogue of the full-CUDA-graph path): a one-token prompt runs like a decode step, which "
           "continues the slot's state, and its slot is not reset at admission (the graph batch never registers "
           "it as a new sequence): it starts from the previous owner's state",
           "fastpath/engine/packing.py", "[int(s > 0) for s in starts]",
           "[int(s > 0 or c == 1) for s, c, _ in pieces]",
           (T_TAILS, T_COBATCH),
           more=((ENGINE, "            self.bank.zero_slot(slot)\n",
                  "            if len(st.req.prompt) > 1:\n                self.bank.zero_slot(slot)\n"),)),
    Mutant("cobatched_twins_share_a_slot", "batch building",
           "identical prompts co-batched are computed once (deduplicated): the twin's piece runs on the first one's "
           "slot, so its own slot never gets the prompt's state and the twins diverge. One mechanism for the symptom "
           "the reports describe without naming this one: a comment on vLLM PR #16942 (the same input repeated "
           "across a batch gives varying greedy outputs with chunked prefill on) and llama.cpp #29002 (co-batching "
           "sequences of a hybrid model corrupts the recurrent / short-conv state, for any prompts: its reported "
           "mechanism is the mutant cobatched_conv_reads_neighbour)",
           ENGINE, _PIECES,
           "        first: dict = {}\n"
           "        pieces = [(b.pos, b.count, first.setdefault((b.pos, tuple(self.requests[b.request].req.prompt)), "
           "b.slot))\n                  for b in pre]\n",
           (T_COBATCH,)),
    Mutant("popped_slot_still_live", "slot allocation",
           "tpu-inference #3358: compaction pushes a moved row's old slot onto the free stack (as if the row's move "
           "freed it), so a freshly popped slot still holds, and is still used by, another request",
           ROWS, "            self.row_pos[m.dst] = self.row_pos[m.src]\n",
           "            self.row_pos[m.dst] = self.row_pos[m.src]\n"
           "            if self.row_to_slot[m.src] not in self.free_slots:\n"
           "                self.free_slots.append(self.row_to_slot[m.src])\n",
           (T_COBATCH, T_ROWS)),
    Mutant("pc_batch_restores_first_hit", "prefix cache",
           "every request after the first prefix hit admitted in a step restores the first one's checkpoint (its "
           "own hit length kept): a restore-side analogue of SGLang #31833, whose reported mechanism is on the store "
           "side: the checkpoint of each request of a multi-request prefill batch is read from the SSD's per-chunk "
           "states at an index that assumes a chunk grid per request, while the kernel chunks the flattened batch, "
           "so every request not starting chunk-aligned in the batch stores the state of an earlier flat boundary "
           "(the mutant pc_store_at_flat_chunk_offset)",
           PC, "        p, entry = self.lookup(st.req.prompt, step)\n",
           "        p, entry = self.lookup(st.req.prompt, step)\n"
           "        first = getattr(self, '_step_hit', None)\n"
           "        if entry is not None and first is not None and first[0] == step:\n"
           "            entry = first[1]\n"
           "        elif entry is not None:\n"
           "            self._step_hit = (step, entry)\n",
           (T_PC_LRU,)),
    Mutant("spec_zero_draft_skips_rollback", "speculative rollback",
           "vLLM #39273: after a step that accepted drafts and rejected one, a row whose next step has zero drafts is "
           "not rolled back (the plain decode is assumed to continue the verify kernel's state): that zero-draft "
           "step reads the state of the rejected drafts",
           SPEC, "            if self.runner.replaying:                      # FastOptions.spec_replay: re-run the "
                 "accepted steps\n",
           "            if not self.proposals(eng.requests[b.request]):\n                continue\n"
           "            if self.runner.replaying:\n",
           (T_SPEC_ACCEPT,)),
    Mutant("spec_accepted_read_after_condense", "speculative rollback",
           "vLLM #51571: the rollback runs after compaction and reads each row's accepted count and snapshot by the "
           "row's index after the rows were condensed, not by its row in the verify batch",
           ENGINE, "        if self.spec is not None:\n            self.spec.rollback()                       # rows that "
                   "rejected a draft: copy their accepted snapshot\n", "",
           (T_SPEC_ACCEPT, "tests/test_speculative_engine.py::test_compaction_while_rows_are_in_verify"),
           more=((ENGINE, "        moves = rt.compact()\n",
                  "        moves = rt.compact()\n        if self.spec is not None:\n            self.spec.rollback()\n"),
                 (SPEC, _RESTORE,
                  "            row = eng.rows.row_of(b.request)\n"
                  "            acc = {x.snap: x.accepted for _, x in verified}.get(row, v.accepted)\n"
                  "            self.snap.restore(acc, row, b.slot)\n"))),
    Mutant("spec_full_accept_drops_bonus", "speculative verify",
           "a row that accepted every draft emits the drafts but drops the bonus token (the target's choice after the "
           "last draft); a defect that passed qualify before spec_accept",
           SPEC, "                samples.append(i <= a)\n",
           "                samples.append(i <= a and (i < a or a < len(b.proposals)))\n",
           (T_SPEC_ACCEPT,)),
    Mutant("spec_no_snapshot_last_draft", "speculative rollback",
           "the verify forward's conv and SSM steps keep no snapshot after the last draft position (only after "
           "positions 0..w-3), so a row of full width rejected at its last draft is restored from a stale snapshot; "
           "a defect that passed qualify before spec_accept",
           K + "ssm_steps.py", "                     mask=m3 & live & (j < W - 1))\n",
           "                     mask=m3 & live & (j < W - 2))\n",
           (T_SPEC_ACCEPT, T_SPEC_STATE),
           more=((K + "conv1d_steps.py", "            ms = tl.where(j < W - 1, ml, False)",
                  "            ms = tl.where(j < W - 2, ml, False)"),
                 (OPS, "dt_limit=dt_limit, out=out[j],\n                 backend=backend, snap=snap[j] if snap is not "
                       "None and j < x.shape[0] - 1 else None)",
                  "dt_limit=dt_limit, out=out[j],\n                 backend=backend, snap=snap[j] if snap is not "
                  "None and j < x.shape[0] - 2 else None)"),
                 (OPS, "backend=backend,\n                    snap=snap[j] if snap is not None and j < x.shape[0] - 1 "
                       "else None)",
                  "backend=backend,\n                    snap=snap[j] if snap is not None and j < x.shape[0] - 2 "
                  "else None)"))),
    Mutant("cobatched_conv_reads_neighbour", "batch building",
           "llama.cpp #29002 (hybrid LFM2: co-batching sequences corrupts the recurrent / short-conv state; greedy "
           "output diverges): in a packed prefill, a sequence that starts fresh (no initial state) reads its "
           "first d_conv - 1 conv inputs from the tokens packed before it (the previous sequence's tail) instead of "
           "zeros, so only co-batched prompts after the first are wrong and each alone is right",
           K + "conv1d.py", "mask=(mt & (j >= 0))[:, None] & md[None, :], other=0.0).to(tl.float32)",
           "mask=(mt & ((j >= 0) | (~from_bank & (offs_t + (k - (K - 1)) >= 0))))[:, None] & md[None, :],\n"
           "                     other=0.0).to(tl.float32)",
           ("tests/test_kernel_conv1d.py::test_conv1d_varlen_matches_oracle_windows_in_bank", T_COBATCH)),
    Mutant("pc_store_at_flat_chunk_offset", "prefix cache",
           "SGLang #31833 (Nemotron-H, extra_buffer radix cache: the SSD's per-chunk states chunk the flattened "
           "batch, but each request's checkpoint is read as if it had its own chunk grid, so the first request of a "
           "multi-request prefill stores the right state and the others the state of an earlier boundary): a "
           "checkpoint inside a piece that is not the step's first is written from one block before its position "
           "(where that is still inside the piece), filed under the key of the position",
           PC, "        return [(seq, p, self.bank.pool_slot(entry.index)) for seq, _, entry, p, _, inside in "
               "self._writes if inside]",
           "        first, row = pieces[0][0] if pieces else 0, dict(pieces)\n"
           "        return [(seq, p - self.block_size if seq != first and p - self.block_size > row[seq].pos else p,\n"
           "                 self.bank.pool_slot(entry.index)) for seq, _, entry, p, _, inside in self._writes if inside]",
           ("tests/test_prefix_cache_batch_store.py", T_PC_INSIDE, T_PC_TRACES)),
    Mutant("pc_lru_not_touched_on_hit", "prefix cache",
           "a hit does not update the entry's last use, so LRU evicts by store order: an older entry hit after a newer "
           "store is evicted before the newer one; a defect that passed qualify before prefix_lru",
           PC, "                e.last_use = step\n", "",
           (T_PC_LRU,)),
]
