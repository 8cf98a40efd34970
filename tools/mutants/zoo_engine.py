"""Engine/scheduler defects: row table, admission, chunked prefill, async, finishing, order, budget, sampler keys."""
from __future__ import annotations

from hybridqual.mutants.runner import Mutant
from hybridqual.mutants.zoo_paths import (ENGINE, ROWS, MODEL, ORACLE_SCHED, K, T_ROWS, T_TRACE, T_GEN, T_ASYNC,
                                         T_CORPUS, T_CHUNKED, T_CHUNKED_KV, T_SSD_TABLE)


# ------------------------------------------------ compaction / row table
ROW_TABLE: list[Mutant] = [
    Mutant("compact_slot_not_moved", "compaction",
           "compaction moves the request id and position to the hole but forgets its row_to_slot entry",
           ROWS, "            self.row_to_slot[m.dst] = self.row_to_slot[m.src]\n", "",
           (T_ROWS,)),
    Mutant("compact_device_slot_not_moved", "compaction",
           "the host table is compacted but the device mirror row_to_slot_dev (read by overlapped launches) is not",
           ROWS, "            apply_moves_(self.row_to_slot_dev, src, dst, fill=-1)\n", "            pass\n",
           (T_ROWS, T_ASYNC)),
    Mutant("vacated_row_not_cleared", "compaction",
           "the row a request moved out of keeps its old slot instead of -1",
           ROWS, "            self.row_to_slot[m.src], self.row_request[m.src], self.row_pos[m.src] = -1, None, 0",
           "            self.row_request[m.src], self.row_pos[m.src] = None, 0",
           (T_ROWS,)),
    Mutant("vacated_device_row_not_cleared", "compaction",
           "device mirror: vacated and trailing finished rows keep their stale slot instead of -1",
           ROWS, "            apply_moves_(self.row_to_slot_dev, src, dst, fill=-1)\n"
                 "        if n_live < self.active:   # finished rows at the right end need no move, only clearing\n"
                 "            self.row_to_slot_dev[n_live:self.active] = -1\n",
           "            apply_moves_(self.row_to_slot_dev, src, dst)\n",
           (T_ROWS,)),
    Mutant("compaction_moves_state", "compaction",
           "the engine keeps row == slot by copying the moved row's Mamba state into the hole's slot (KV forgotten)",
           ENGINE, "        moves = rt.compact()\n",
           "        moves = rt.compact()\n"
           "        for m in moves:\n"
           "            old, new = rt.row_to_slot[m.dst], m.dst\n"
           "            if new in rt.free_slots:\n"
           "                self.bank.conv_state[:, new] = self.bank.conv_state[:, old]\n"
           "                self.bank.ssm_state[:, new] = self.bank.ssm_state[:, old]\n"
           "                rt.free_slots[rt.free_slots.index(new)] = old\n"
           "                rt.row_to_slot[m.dst] = new\n"
           "                rt.row_to_slot_dev[m.dst] = new\n",
           (T_GEN,)),
    Mutant("hole_fill_off_by_one", "compaction",
           "the hole-filling loop stops one early: a hole right before the last live row is never filled",
           ROWS, "        if lo >= hi:\n            return moves", "        if lo + 1 >= hi:\n            return moves",
           (T_ROWS,)),
    Mutant("free_stack_fifo", "slot allocation",
           "free slots handed out oldest-first (queue) instead of LIFO: the schedule no longer matches the spec",
           ROWS, "        slot = self.free_slots.pop()\n", "        slot = self.free_slots.pop(0)\n",
           (T_ROWS,)),
]

# ------------------------------------------------ admission
ADMISSION: list[Mutant] = [
    Mutant("admit_without_drain", "async admission",
           "async keeps overlapping while requests wait and admits them into just-freed slots without draining",
           ENGINE, "self.rows.active > 0 and not self.waiting(self.k)\n", "self.rows.active > 0\n",
           (T_GEN,),
           more=((ENGINE, "            self.resolve(prev, inflight=launched)\n",
                  "            self.resolve(prev, inflight=launched)\n            self.admit(rec)\n"),)),
    Mutant("admitted_slot_not_zeroed", "stale state",
           "a reused slot keeps the previous owner's conv/ssm state (zeroing dropped as 'redundant')",
           ENGINE, "            self.bank.zero_slot(slot)\n", "",
           (T_GEN,)),
]

# ------------------------------------------------ chunked prefill
CHUNKED_PREFILL: list[Mutant] = [
    Mutant("chunked_drops_initial_state", "chunked prefill",
           "continuation pieces start the SSD from a zero state instead of bank[slot]",
           MODEL, "b.pre_start_host, b.pre_init, c.chunk_size", "b.pre_start_host, torch.zeros_like(b.pre_init), c.chunk_size",
           (T_CHUNKED,)),
    Mutant("chunked_drops_conv_window", "chunked prefill",
           "continuation pieces start the causal conv from a zero window instead of the slot's last K-1 inputs",
           MODEL, "bank.conv(i), b.pre_cu, b.pre_slot, b.pre_init,", "bank.conv(i), b.pre_cu, b.pre_slot, 0 * b.pre_init,",
           (T_CHUNKED,)),
    Mutant("chunk_table_restarts_at_piece", "chunked prefill",
           "SSD chunk boundaries counted from the piece start, not at absolute multiples of chunk_size",
           K + "ssd.py", "hi = min(hi_seq, lo + chunk_size - pos % chunk_size)",
           "hi = min(hi_seq, lo + chunk_size - (pos - sp[s]) % chunk_size)",
           (T_SSD_TABLE,)),
    Mutant("piece_not_chunk_aligned", "chunked prefill",
           "a prefill piece is cut at the token budget instead of the last whole chunk that fits",
           ENGINE, "    return cap - cap % chunk_size\n", "    return cap\n",
           (T_GEN,)),
    Mutant("rope_pos_off_by_one_after_chunk", "positions",
           "continuation pieces number their tokens from start+1 (position of the last token prefilled + 1, twice)",
           ENGINE, "                pos.extend(range(b.pos, b.pos + b.count))",
           "                pos.extend(range(b.pos + (b.pos > 0), b.pos + b.count + (b.pos > 0)))",
           (T_CHUNKED_KV,)),
]

# ------------------------------------------------ async bookkeeping / finishing
ASYNC_FINISHING: list[Mutant] = [
    Mutant("async_extra_token_appended", "async",
           "the token computed for a request in the step after it finished is appended to its output",
           ENGINE, "        live = [(j, row_of[b.request]) for j, b in enumerate(p.batch) if b.request in row_of]",
           "        live = [(j, row_of.get(b.request, -1)) for j, b in enumerate(p.batch)]",
           (T_ASYNC,),
           more=((ENGINE, "            if st.finish_reason is not None:\n                finished.append(r)",
                  "            if st.finish_reason is not None and r >= 0:\n                finished.append(r)"),
                 # the defect also drops the guard that skips tokens of an already finished request (verify rows
                 # need it too); with the guard kept the patch above is equivalent
                 (ENGINE, "            if self.requests[b.request].finish_reason is not None:       # a verify row's tokens after its stop\n                continue\n", ""))),
    Mutant("pending_outputs_not_compacted", "async",
           "rows are compacted but the in-flight step's sampled tokens (fed to the next launch) are not",
           ENGINE, "            apply_moves_(self.sampled, src, dst)\n", "            pass\n",
           (T_ASYNC,)),
    Mutant("stop_ignored_at_last_step", "finishing",
           "a stop token sampled at the max_new_tokens-th step is reported as 'length'",
           ENGINE, "            if tok in st.req.stop_token_ids:\n",
           "            if tok in st.req.stop_token_ids and len(st.output) < st.req.max_new_tokens:\n",
           (T_GEN,)),
    Mutant("max_new_tokens_off_by_one", "finishing",
           "length finish tested before the append: one token too many",
           ENGINE, "            elif len(st.output) == st.req.max_new_tokens:\n",
           "            elif len(st.output) == st.req.max_new_tokens + 1:\n",
           (T_ASYNC, T_GEN)),
    Mutant("decode_rows_not_in_budget", "batch building",
           "decode tokens are not counted against max_tokens_per_step before prefill pieces are added",
           ENGINE, "        used = len(batch)\n", "        used = 0\n",
           (T_TRACE + "::test_decode_rows_count_against_the_token_budget",)),
    Mutant("async_overlap_position_stale", "async",
           "the overlapped launch reuses the previous step's positions instead of advancing them by one",
           ENGINE, '"decode", pos[rid] + 1, 1)', '"decode", pos[rid], 1)',
           (T_ASYNC,)),
    Mutant("streaming_drops_tokens", "streaming",
           "tokens are appended to the output but not to the streaming buffer that take_emitted() drains",
           ENGINE, "            self.emitted.setdefault(b.request, []).append(tok)\n", "",
           (T_TRACE + "::test_from_pretrained_streaming_matches_run_trace",)),
]

# ------------------------------------------------ the oracle's scheduler (spec bugs)
ORACLE_SCHEDULER: list[Mutant] = [
    Mutant("oracle_overlap_while_waiting", "spec: async drain",
           "the truth keeps overlapping while a request waits, so admission is late and never drains first",
           ORACLE_SCHED, "                and not self.waiting(k)\n", "\n",
           ("tests/test_scheduler_async_drain.py",)),
    Mutant("oracle_compaction_order_preserving", "spec: compaction",
           "the truth shifts the first live row after a hole into it (order-preserving) instead of the right-most",
           ORACLE_SCHED, "            src, dst = live[-1], holes[0]\n",
           "            src, dst = min(r for r in live if r > holes[0]), holes[0]\n",
           ("tests/test_scheduler_seed_scenario.py",)),
    Mutant("oracle_free_stack_fifo", "spec: slot allocation",
           "the truth hands out the oldest free slot instead of the most recently freed one",
           ORACLE_SCHED, "            slot, row = self.free_slots.pop(), self.active\n",
           "            slot, row = self.free_slots.pop(0), self.active\n",
           ("tests/test_scheduler_seed_scenario.py",)),
]

# ------------------------------------------------ scheduling order (found by the blind run)
SCHEDULING_ORDER: list[Mutant] = [
    Mutant("admission_in_list_order", "scheduling order",
           "waiting requests are admitted in submission order (a stable sort on arrival_step alone) instead of "
           "(arrival_step, id): a trace whose request list is not in id order admits the wrong request first",
           ENGINE, "key=lambda r: (r.arrival_step, r.id))", "key=lambda r: r.arrival_step)",
           (T_CORPUS + "[request_order]", T_GEN)),
    Mutant("request_ids_natural_order", "scheduling order",
           "request ids compared as numbers (natural order: 'r2' before 'r10') instead of as strings",
           ENGINE, "key=lambda r: (r.arrival_step, r.id))", "key=lambda r: (r.arrival_step, len(r.id), r.id))",
           (T_CORPUS + "[request_order]",)),
    Mutant("arrival_off_by_one", "scheduling order",
           "a request counts as arrived only after its arrival_step (`<` for `<=`): every admission one step late",
           ENGINE, "for r in self.arrival_order if r.arrival_step <= k)",
           "for r in self.arrival_order if r.arrival_step < k)",
           (T_GEN, T_CORPUS + "[request_order]")),
    Mutant("prefill_pieces_in_id_order", "scheduling order",
           "prefill pieces are handed the budget in request-id order instead of row order (after a compaction "
           "the right-most row moved left, so the orders differ)",
           ENGINE, "        used = len(batch)\n        for r, st in live:\n",
           "        used = len(batch)\n        for r, st in sorted(live, key=lambda rs: rs[1].req.id):\n",
           (T_GEN,)),
]

# ------------------------------------------------ budget edges of the piece splitter (found by the blind run)
BUDGET_EDGES: list[Mutant] = [
    Mutant("last_piece_equal_budget_split", "budget edge",
           "the rest of a prompt is taken whole only when strictly shorter than the budget left: a remainder "
           "exactly equal to it (not a chunk multiple) is cut back to whole chunks",
           ENGINE, "    if prompt_len - start <= cap:\n", "    if prompt_len - start < cap:\n",
           (T_CORPUS + "[piece_budget]", T_CORPUS + "[piece_chunk]", T_GEN)),
    Mutant("piece_end_inclusive", "budget edge",
           "a cut piece ends one token past the chunk boundary (`cap - cap % chunk + 1`, an inclusive end): pieces "
           "no longer end on chunk multiples, and one a whole number of chunks long overruns the budget by one",
           ENGINE, "    return cap - cap % chunk_size\n", "    return cap - cap % chunk_size + 1\n",
           (T_TRACE + "::test_decode_rows_count_against_the_token_budget", T_GEN)),
]

# ------------------------------------------------ sampler keys (found by the blind run)
SAMPLER_KEYS: list[Mutant] = [
    Mutant("seeded_key_by_row", "sampler key",
           "the seeded draw is keyed on the batch row instead of the absolute position: it depends on the batch",
           "fastpath/engine/sample.py", "keys = torch.tensor([row_key(s[2], s[3]) for s in seeded]",
           "keys = torch.tensor([row_key(s[2], s[0]) for s in seeded]",
           ("tests/test_sampling_fastpath_agrees.py::test_fastpath_batched_draws_equal_oracle_per_row", T_GEN)),
    Mutant("seeded_key_by_step", "sampler key",
           "the seeded draw is keyed on the engine step instead of the sampled token's position",
           ENGINE, "int(st.req.sampling.seed), b.pos + b.count))", "int(st.req.sampling.seed), self.k))",
           (T_CORPUS + "[seeded_sampling]", T_GEN)),
    Mutant("seeded_seed_of_first_row", "sampler key",
           "every seeded row of a step draws with the first seeded row's seed (the seed not taken per request)",
           "fastpath/engine/sample.py", "keys = torch.tensor([row_key(s[2], s[3]) for s in seeded]",
           "keys = torch.tensor([row_key(seeded[0][2], s[3]) for s in seeded]",
           ("tests/test_sampling_fastpath_agrees.py::test_fastpath_batched_draws_equal_oracle_per_row", T_GEN)),
]
