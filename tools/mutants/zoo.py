"""The bug zoo (DESIGN §9): each entry is one realistic engine/kernel defect and the fast tests expected to kill it.

Patches are anchored on stable lines and must match exactly once (tests/test_mutants.py checks that every
patch still applies, so a refactor that moves an anchor is caught at once). Tests are listed fastest first;
the runner stops at the first failure (-x).
"""
from __future__ import annotations

from hybridqual.mutants.runner import Mutant

ENGINE, ROWS, MODEL = "fastpath/engine/engine.py", "fastpath/engine/rows.py", "fastpath/model.py"
GRAPHS, TORCH_OPS = "fastpath/engine/graphs.py", "fastpath/engine/torch_ops.py"
ORACLE_SCHED = "oracle/scheduler.py"
K = "fastpath/kernels/"

# Test selections (fast tests only; node ids).
T_ROWS = "tests/test_engine_rows.py"
T_TRACE = "tests/test_engine_trace.py"
T_GEN = T_TRACE + "::test_generated_traces_log_and_tokens_equal_oracle_async_equals_legacy"
T_ASYNC = T_TRACE + "::test_async_overlaps_and_discards_extra_rows"
T_ARCH = T_TRACE + "::test_other_architectures_follow_the_oracle_through_the_engine"
T_CORPUS = T_TRACE + "::test_corpus_trace_log_and_tokens_equal_oracle_in_both_modes"
T_CHUNKED = "tests/test_engine_graphs.py::test_chunked_prefill_equals_unchunked_bitwise"
T_PADDED = "tests/test_engine_graphs.py::test_padded_decode_rows_skip_their_slot_and_match_unpadded"
T_PAD_ROWS = "tests/test_engine_pad_rows.py"
T_CHUNKED_KV = "tests/test_engine_chunked_kv.py"
T_CONV_STEP = "tests/test_kernel_conv1d.py::test_conv1d_step_rows_match_oracle_and_pad_rows_touch_nothing"
T_CONV = "tests/test_kernel_conv1d.py"
T_SSM_STEP = "tests/test_kernel_ssm_step.py"
T_GEMV_CONV = "tests/test_kernel_gemv.py::test_gemv_conv_epilogue_equals_conv1d_step_bitwise"
T_ROW_GEMV = "tests/test_engine_row_gemv.py"
T_GEMV_RMS = "tests/test_kernel_gemv.py::test_gemv_rms_eps_normalises_the_row_first"
T_GEMV_RES = "tests/test_kernel_gemv.py::test_gemv_residual_epilogue_is_add_rms_norms_residual_add"
T_GAINS = "tests/test_engine_row_gemv.py::test_folded_norm_gains_keep_the_function"
T_SSD_TABLE = "tests/test_kernel_ssd.py::test_ssd_chunk_table_cuts_at_absolute_multiples"
T_SSD_MIXED = "tests/test_kernel_ssd.py::test_ssd_varlen_mixed_batch_matches_recurrence"
T_SAMPLING = "tests/test_kernel_sampling.py"
T_SAMPLING_DT = "tests/test_sampling_dtypes.py"
T_OFFSETS = "tests/test_kernel_offsets_int64.py"
T_ATTN = "tests/test_kernel_attention.py::test_attention_prefill_pieces_then_decode_match_oracle"
T_ROPE = "tests/test_kernel_attention.py::test_rope_matches_oracle_in_and_out_of_place"
T_ATTN_DEC = "tests/test_kernel_attention.py::test_attention_decode_split_context_with_rope_matches_oracle"
T_ATTN_SPLIT = "tests/test_kernel_attention.py::test_attention_prefill_split_over_keys_matches_unsplit_and_oracle"


MUTANTS: list[Mutant] = [
    # ---------------------------------------------------------------- compaction / row table
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
    # ---------------------------------------------------------------- admission
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
    # ---------------------------------------------------------------- chunked prefill
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
    # ---------------------------------------------------------------- conv / ssm arithmetic
    Mutant("conv_decode_window_shifted", "conv window",
           "decode reads the window one tap late (window[k+1] against weight[k])",
           K + "conv1d.py", "        acc += wk * tl.load(base + k * stride_bank_k, mask=ml, other=0.0).to(tl.float32)",
           "        acc += wk * tl.load(base + (k + 1) * stride_bank_k, mask=ml & (k + 1 < K - 1), other=0.0)"
           ".to(tl.float32)",
           (T_CONV_STEP,)),
    Mutant("conv_decode_window_not_rolled", "conv window",
           "decode overwrites the newest window entry but never shifts the older ones left",
           K + "conv1d.py", "        tl.store(base[:, None] + (j - 1)[None, :] * stride_bank_k, win,",
           "        tl.store(base[:, None] + j[None, :] * stride_bank_k, win,",
           (T_CONV_STEP, T_GEMV_CONV)),
    Mutant("conv_prefill_stale_window", "stale state",
           "a piece without initial state still reads the slot's old window when it is shorter than K-1",
           K + "conv1d.py", "    old_m = tl.where(init, ", "    old_m = tl.where(live, ",
           (T_CONV,)),
    Mutant("dt_bias_twice_decode", "dt processing",
           "the decode kernel adds dt_bias although the caller already folded it into dt",
           K + "ssm_step.py", "        dt += bias\n", "        dt += 2.0 * bias\n",
           (T_SSM_STEP,)),
    Mutant("dt_bias_twice_prefill", "dt processing",
           "the model adds dt_bias before the SSD prefill kernel, which adds it again",
           MODEL, "ops.ssd_varlen(x[n:], dt[n:], A,", "ops.ssd_varlen(x[n:], dt[n:] + dt_bias, A,",
           (T_ARCH,)),
    Mutant("softplus_skipped", "dt processing",
           "decode clamps the raw dt instead of softplus(dt + bias)",
           K + "ssm_step.py", "dt = tl.minimum(tl.maximum(softplus(dt), dt_lo), dt_hi)",
           "dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)",
           (T_SSM_STEP,)),
    Mutant("softplus_skipped_prefill", "dt processing",
           "the SSD cumsum stage uses dt + bias without softplus",
           K + "ssd_chunk_cumsum.py", "    dt = softplus(v)\n", "    dt = v\n",
           (T_SSD_MIXED,)),
    Mutant("d_skip_dropped_decode", "D skip",
           "decode forgets the D * x skip connection",
           K + "ssm_step.py", "        y += Dh[:, None] * x", "        y += 0.0 * x",
           (T_SSM_STEP,)),
    Mutant("d_skip_dropped_prefill", "D skip",
           "the sub-chunk scan forgets the D * x skip connection",
           K + "ssd_chunk_scan.py", "            acc += d * xs.to(tl.float32)\n", "            acc += 0.0 * d\n",
           (T_SSD_MIXED,)),
    Mutant("gated_norm_ungrouped", "gated norm",
           "the Mamba gated RMSNorm is normalised over all of d_inner although the architecture groups it",
           MODEL, "y, z, weight, c.mamba_n_groups, c.norm_eps", "y, z, weight, 1, c.norm_eps",
           (T_ARCH,)),
    Mutant("ssm_state_bf16_between_steps", "state precision",
           "the decode state is rounded to bf16 when written back to the bank",
           K + "ssm_step.py", "    tl.store(tile, state, mask=m3)", "    tl.store(tile, state.to(tl.bfloat16).to(tl.float32), mask=m3)",
           (T_SSM_STEP,)),
    # ---------------------------------------------------------------- pad rows / null slot
    Mutant("ssm_step_pad_aliases_slot0", "pad rows",
           "slot -1 is clamped to 0 (null slot aliasing slot 0): pad rows read and write slot 0's state",
           K + "ssm_step.py", "    live = slot >= 0\n", "    slot = tl.maximum(slot, 0)\n    live = slot >= 0\n",
           (T_SSM_STEP,)),
    Mutant("conv_step_pad_aliases_slot0", "pad rows",
           "slot -1 is clamped to 0 in the decode conv: pad rows roll slot 0's window",
           K + "conv1d.py", "    ml = tl.where(slot >= 0, md, False)\n",
           "    slot = tl.maximum(slot, 0)\n    ml = tl.where(slot >= 0, md, False)\n",
           (T_CONV_STEP,)),
    Mutant("torch_conv_step_pad_writes", "pad rows",
           "the torch stand-in writes back every row's window, pad rows (clamped to slot 0) included",
           TORCH_OPS, "    conv_bank.index_copy_(0, idx[valid], new[valid])", "    conv_bank.index_copy_(0, idx, new)",
           (T_PAD_ROWS,)),
    Mutant("graph_pad_rows_slot_zero", "pad rows",
           "a bucket's pad rows get slot 0 (a zero-filled buffer's default) instead of -1, so they decode into "
           "whichever request holds slot 0",
           GRAPHS, "slot + [-1] * pad", "slot + [0] * pad",
           (T_PAD_ROWS,)),
    # ---------------------------------------------------------------- attention / KV
    Mutant("kv_written_to_row_not_slot", "KV cache",
           "prefill K is written at cache[sequence index] instead of cache[slot]",
           K + "attention.py", "tl.store(kc_ptr + slot * stride_kc_s + pos", "tl.store(kc_ptr + s * stride_kc_s + pos",
           (T_ATTN,)),
    Mutant("rope_kernel_pos_off_by_one", "positions",
           "the RoPE kernel rotates by position + 1",
           K + "rope.py", "d, m, tl.load(pos_ptr + t).to(tl.float32)", "d, m, (tl.load(pos_ptr + t) + 1).to(tl.float32)",
           (T_ROPE,)),
    Mutant("causal_mask_excludes_self", "attention mask",
           "the causal mask is strict (key < query): a token never attends to its own key",
           K + "attention.py", "vis = (offs_n[None, :] <= qpos[:, None])", "vis = (offs_n[None, :] < qpos[:, None])",
           (T_ATTN,)),
    # ---------------------------------------------------------------- sampling
    Mutant("sampling_max_out_bf16", "sampling dtype",
           "greedy through torch.max(out=(values_bf16, idx)): works for bf16 logits, fails for fp32",
           K + "sampling.py", "    torch.argmax(logits, dim=-1, out=out)\n",
           "    torch.max(logits, dim=-1, out=(torch.empty(out.shape, dtype=torch.bfloat16, device=out.device), out))\n",
           (T_SAMPLING_DT,)),
    Mutant("argmax_after_bf16_cast", "sampling dtype",
           "fp32 logits cast to bf16 before argmax: near-equal logits become ties and the lower index wins",
           K + "sampling.py", "    torch.argmax(logits, dim=-1, out=out)\n",
           "    torch.argmax(logits.to(torch.bfloat16), dim=-1, out=out)\n",
           (T_SAMPLING_DT,)),
    Mutant("ties_highest_index", "sampling ties",
           "argmax over the reversed vocabulary: the highest index wins ties",
           K + "sampling.py", "    torch.argmax(logits, dim=-1, out=out)\n",
           "    torch.argmax(logits.flip(-1), dim=-1, out=out)\n    out.neg_().add_(logits.shape[-1] - 1)\n",
           (T_SAMPLING,)),
    Mutant("seeded_position_off_by_one", "sampling seed",
           "the seeded draw is keyed on the position of the last input token instead of the sampled one",
           ENGINE, "int(st.req.sampling.seed), b.pos + b.count))", "int(st.req.sampling.seed), b.pos + b.count - 1))",
           (T_GEN,)),
    Mutant("seeded_temperature_multiplies", "sampling seed",
           "seeded rows scale logits by the temperature instead of dividing by it",
           "fastpath/engine/sample.py", "to(torch.float64) / temps[:, None]", "to(torch.float64) * temps[:, None]",
           ("tests/test_sampling_fastpath_agrees.py::test_fastpath_batched_draws_equal_oracle_per_row",)),
    # ---------------------------------------------------------------- offsets
    Mutant("chunk_offsets_int32", "int32 overflow",
           "packed token offsets of the SSD chunk table stored as int32: they wrap past 2^31 tokens·elements",
           K + "ssd.py", "    return SSDChunkTable(dev[:n], dev[n:2 * n].to(torch.int32),",
           "    return SSDChunkTable(dev[:n].to(torch.int32), dev[n:2 * n].to(torch.int32),",
           (T_OFFSETS,)),
    Mutant("ssd_scan_token_offset_int32", "int32 overflow",
           "the scan kernel computes token offsets in int32: x/y addresses wrap past 2^31 elements",
           K + "ssd_chunk_scan.py", "        tok = start + s0 + offs_s\n        e = tl.minimum",
           "        tok = (start + s0 + offs_s).to(tl.int32)\n        e = tl.minimum",
           ("tests/test_kernel_ssd.py::test_ssd_int64_offsets_beyond_2_31_elements",), gpu_only=True),
    # ---------------------------------------------------------------- batch invariance / launch order
    Mutant("matmul_split_by_m", "batch invariance",
           "the batch-invariant matmul drops its K split for small M (as cuBLAS picks split-K by M): a token's "
           "projection then depends on how many rows share its step",
           K + "matmul.py", '    bk, split = r["BK"], r["SPLIT"]\n', '    bk, split = r["BK"], (r["SPLIT"] if M >= 4 else 1)\n',
           ("tests/test_batch_invariance.py::test_fixed_split_matmul_rows_do_not_depend_on_m_and_match_the_product",)),
    Mutant("gemv_pdl_no_wait", "launch order",
           "the PDL-launched GEMV never waits for the kernel that writes its input (reads x while the norm runs)",
           K + "gemv.py", "    pdl_enter(PDL)\n", "    pass                # no gdc_wait: x is read whenever\n",
           ("tests/test_kernel_gemv.py::test_gemv_launched_early_waits_for_its_producer",), gpu_only=True),
    # ---------------------------------------------------------------- folds into the one-row GEMV
    Mutant("gemv_conv_channel_off_by_one", "conv window",
           "the conv step folded into in_proj's epilogue maps GEMV column n to conv channel n - first - 1 (an "
           "off-by-one at the z | xBC boundary): each column is convolved with its neighbour's taps and window",
           K + "gemv.py", "        c = n - c0\n", "        c = n - c0 - 1\n",
           (T_GEMV_CONV, T_ROW_GEMV)),
    Mutant("gemv_rms_mean_over_tile", "norm fold",
           "the RMSNorm folded into a one-row projection divides Σx² by the tile width instead of the row length "
           "(right whenever one tile covers the row; wrong for every real hidden size)",
           K + "gemv.py", "tl.sum(ss, axis=0) / K + eps", "tl.sum(ss, axis=0) / BLOCK_K + eps",
           (T_GEMV_RMS, T_ROW_GEMV)),
    Mutant("residual_epilogue_drops_multiplier", "norm fold",
           "the residual add in a projection's epilogue ignores the residual multiplier (Granite-style models scale "
           "each sublayer's output before adding it)",
           K + "gemv.py", "                d = (d * mult).to(y_ptr.dtype.element_ty).to(tl.float32)\n",
           "                d = d.to(y_ptr.dtype.element_ty).to(tl.float32)\n",
           (T_GEMV_RES,)),
    Mutant("norm_gain_applied_twice", "norm fold",
           "the norm gain is folded into the projections but the norm keeps it too (g² on every normalised row)",
           "fastpath/model.py", "            w[norm] = torch.ones_like(w[norm])\n", "",
           (T_GAINS,)),
    Mutant("attn_decode_merge_drops_last_split", "split-KV merge",
           "the decode attention's merge counts the splits up to pos exclusive: the split holding the newest keys "
           "(the whole context for a short one) is left out",
           K + "attention_decode.py", "tl.minimum(p // CHUNK + 1, n_split)", "tl.minimum(p // CHUNK, n_split)",
           (T_ATTN_DEC, T_ATTN)),
    Mutant("attn_prefill_merge_drops_last_split", "split-KV merge",
           "the split-key prefill attention merges a query row's splits up to its position exclusive: the split "
           "holding the row's own and newest keys is left out (a prefix-cache hit's suffix sees a stale context)",
           K + "attention.py", "triton.cdiv(sp[s] + i + 1, chunk)", "(sp[s] + i) // chunk",
           (T_ATTN_SPLIT,)),
    # ---------------------------------------------------------------- async bookkeeping / finishing
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
    # ---------------------------------------------------------------- model (architecture details)
    Mutant("gqa_heads_interleaved", "attention heads",
           "query head h reads KV head h % q_per_kv (repeat vs repeat_interleave confusion)",
           K + "attention.py", "    kvh = hq // q_per_kv\n", "    kvh = hq % q_per_kv\n",
           (T_ATTN,)),
    Mutant("moe_softmax_before_topk", "MoE routing",
           "router softmax over all experts, then top-k, without renormalising (the other family's convention)",
           MODEL, "            gates = torch.softmax(top_logits, dim=-1)\n",
           "            gates = torch.softmax(logits, dim=-1).gather(1, idx)\n",
           (T_ARCH,)),
    Mutant("residual_multiplier_dropped", "multipliers",
           "Granite's residual_multiplier is not applied to the mixer/FFN outputs",
           MODEL, "        return h + (out if m == 1.0 else out * m).to(self.stream_dtype)",
           "        return h + out.to(self.stream_dtype)",
           (T_ARCH,)),
    # ---------------------------------------------------------------- the oracle's scheduler (spec bugs)
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
    # ---------------------------------------------------------------- classes the blind run found
    # scheduling order
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
           ENGINE, "if r.arrival_step <= k and not self.requests[r.id].admitted]",
           "if r.arrival_step < k and not self.requests[r.id].admitted]",
           (T_GEN, T_CORPUS + "[request_order]")),
    Mutant("prefill_pieces_in_id_order", "scheduling order",
           "prefill pieces are handed the budget in request-id order instead of row order (after a compaction "
           "the right-most row moved left, so the orders differ)",
           ENGINE, "        used = len(batch)\n        for r, st in live:\n",
           "        used = len(batch)\n        for r, st in sorted(live, key=lambda rs: rs[1].req.id):\n",
           (T_GEN,)),
    # budget edges of the piece splitter
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
    # logit transforms (greedy tokens unchanged: only seeded sampling or a logits-level check can see them)
    Mutant("logits_scaling_multiplied", "logit transform",
           "Granite's logits_scaling multiplies the final logits instead of dividing them (argmax unchanged)",
           MODEL, "return logits / c.logits_scaling if c.logits_scaling != 1.0 else logits",
           "return logits * c.logits_scaling if c.logits_scaling != 1.0 else logits",
           (T_ARCH + "[granitemoehybrid]",)),
    Mutant("final_logit_softcap", "logit transform",
           "a Gemma-style final-logit softcap (30·tanh(x/30)) applied although no hybrid config asks for one "
           "(monotone: greedy tokens unchanged)",
           MODEL, "return logits / c.logits_scaling if c.logits_scaling != 1.0 else logits",
           "logits = 30.0 * torch.tanh(logits / 30.0)\n"
           "        return logits / c.logits_scaling if c.logits_scaling != 1.0 else logits",
           (T_CORPUS + "[seeded_sampling]", T_GEN)),
    # sampler keys
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
    # multipliers
    Mutant("attention_multiplier_ignored", "multipliers",
           "Granite's attention_multiplier is ignored: the fast path scales scores by the default head_dim^-0.5",
           MODEL, "c.attn_scale, out=o[:n],", "c.attn_head_dim ** -0.5, out=o[:n],",
           (T_ARCH + "[granitemoehybrid]",),
           more=((MODEL, "c.attn_scale, out=o[n:]", "c.attn_head_dim ** -0.5, out=o[n:]"),)),
    Mutant("embedding_multiplier_prefill_only", "multipliers",
           "Granite's embedding_multiplier is applied to the prefill tokens only (decode rows' embeddings skip it)",
           MODEL, "            h = h * c.embedding_multiplier\n",
           "            h = torch.cat([h[:b.n_dec], h[b.n_dec:] * c.embedding_multiplier])\n",
           (T_ARCH + "[granitemoehybrid]",)),
    Mutant("residual_multiplier_on_sum", "multipliers",
           "the fused add+norm applies the residual multiplier to the sum h + out instead of to the sublayer "
           "output alone",
           K + "fused_add_norm.py", "            d = (d * mult).to(d_ptr.dtype.element_ty).to(tl.float32)\n"
                                    "        x = (x + d).to(hout_ptr.dtype.element_ty)\n",
           "            x = x * mult\n            d = (d * mult).to(d_ptr.dtype.element_ty).to(tl.float32)\n"
           "        x = (x + d).to(hout_ptr.dtype.element_ty)\n",
           ("tests/test_kernel_fused_add_norm.py::test_add_rms_norm_matches_fp64_math",)),
    # norm eps placement and grouping
    Mutant("rms_eps_outside_sqrt", "norm eps",
           "the fused add+RMSNorm adds eps outside the square root: 1/(sqrt(mean x²) + eps)",
           K + "fused_add_norm.py", "normed = x * (1.0 / tl.sqrt(var + eps))", "normed = x * (1.0 / (tl.sqrt(var) + eps))",
           ("tests/test_kernel_norm_eps.py::test_add_rms_norm_keeps_eps_inside_the_root_for_rows_near_zero",
            "tests/test_kernel_fused_add_norm.py")),
    Mutant("gated_norm_eps_outside_sqrt", "norm eps",
           "the gated RMSNorm adds eps outside the square root: 1/(sqrt(mean g²) + eps)",
           K + "gated_norm.py", "normed = g * (1.0 / tl.sqrt(var + eps))", "normed = g * (1.0 / (tl.sqrt(var) + eps))",
           ("tests/test_kernel_norm_eps.py::test_rms_norm_gated_keeps_eps_inside_the_root_for_rows_near_zero",
            "tests/test_kernel_gated_norm.py")),
    Mutant("gated_norm_per_head", "gated norm",
           "the Mamba gated RMSNorm is normalised per head (n_heads groups) instead of per B/C group",
           MODEL, "y, z, weight, c.mamba_n_groups, c.norm_eps", "y, z, weight, c.mamba_n_heads, c.norm_eps",
           (T_ARCH + "[mamba2]", T_CORPUS + "[seed_compaction]")),
    # head mapping
    Mutant("gqa_decode_heads_modulo", "attention heads",
           "the decode attention maps query head h to KV head h % n_kv (interleaved) instead of h // q_per_kv",
           K + "attention_decode.py", "    qh = kvh * q_per_kv + qi\n", "    qh = qi * Hkv + kvh\n",
           (T_ATTN_DEC, T_ATTN),
           more=((K + "attention_decode.py", "        oh = kvh * q_per_kv + c\n", "        oh = c * Hkv + kvh\n"),)),
]

# ---------------------------------------------------------------- prefix cache (DESIGN §12)
PC, BANK, ORACLE_PC = "fastpath/engine/prefix_cache.py", "fastpath/engine/bank.py", "oracle/prefix_cache.py"
T_PC = "tests/test_prefix_cache_engine.py"
T_PC_TRACES = T_PC + "::test_prefix_traces_follow_the_oracle_on_the_torch_stand_ins"
T_PC_POOL = T_PC + "::test_checkpoints_live_in_the_bank_pool_which_never_moves"
T_PC_LOOKUP = T_PC + "::test_lookup_always_leaves_a_prompt_token_to_compute"
T_PC_LATE = T_PC + "::test_hit_admitted_without_a_piece_survives_the_eviction_of_its_entry"
T_PC_INERT = T_PC + "::test_inert_cache_fails_the_policy_check_with_zero_of_n_hits"
T_PC_INSIDE = "tests/test_prefix_cache_inside.py"
T_PC_INSIDE_BITS = T_PC_INSIDE + "::test_a_checkpoint_inside_a_piece_is_bitwise_the_state_a_piece_ending_there_leaves"
T_PC_INSIDE_HYBRID = T_PC_INSIDE + "::test_a_hybrid_checkpoint_inside_a_piece_is_the_oracles_state_at_p"
_RESTORE = "            self.bank.copy_state(self.bank.pool_slot(entry.index), slot, p)\n"

MUTANTS += [
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
]

# The CI subset (tests/test_mutants.py): fast kills covering compaction, pad rows, sampling, async and offsets.
QUICK = {
    "compact_slot_not_moved", "hole_fill_off_by_one", "pending_outputs_not_compacted", "async_extra_token_appended",
    "ties_highest_index", "argmax_after_bf16_cast", "chunk_offsets_int32", "chunk_table_restarts_at_piece",
    "graph_pad_rows_slot_zero", "ssm_step_pad_aliases_slot0", "chunked_drops_initial_state",
}

# ---------------------------------------------------------------- speculative decoding (DESIGN §13)
SPEC, ORACLE_SPEC, VERIFY = "fastpath/engine/speculative.py", "oracle/speculative.py", "fastpath/engine/verify.py"
T_SPEC = "tests/test_speculative_engine.py"
T_DRAFT_CATCH_UP = ("tests/test_draft_catch_up.py::"
                    "test_graph_catch_up_proposes_what_the_prefill_catch_up_and_a_fresh_state_propose")
T_SPEC_STATE = T_SPEC + "::test_state_after_each_step_is_the_state_of_the_accepted_tokens"
T_SPEC_LOG = T_SPEC + "::test_speculative_log_and_tokens_equal_oracle_async_equals_legacy"
T_SPEC_CORPUS = T_SPEC + "::test_corpus_spec_traces_on_the_torch_stand_ins_equal_the_oracle"
T_SPEC_BUDGET = T_SPEC + "::test_verify_rows_and_prefill_pieces_share_the_budget"
_RESTORE = "            self.snap.restore(v.accepted, v.snap, b.slot)\n"

MUTANTS += [
    Mutant("spec_state_at_last_draft", "speculative rollback",
           "after a rejection the slot keeps the state the verify forward left: conv and SSM state at the last draft "
           "instead of the last accepted token (the accepted position's snapshot is never copied back)",
           SPEC, _RESTORE, "",
           (T_SPEC_STATE, T_SPEC_LOG)),
    Mutant("spec_conv_not_rolled_back", "speculative rollback",
           "the rollback copies the accepted position's SSM snapshot back but not its conv window, so the next step "
           "continues a window that already holds the rejected drafts",
           VERIFY, "        self.bank.conv_state[:, slot].copy_(self.conv[:, j, r])\n", "",
           (T_SPEC_STATE, T_SPEC_LOG)),
    Mutant("spec_stale_state_after_full_accept", "speculative rollback",
           "a row that accepted every draft is reset to a stale snapshot (the one after its first input, as if no "
           "draft had been accepted): the next (zero-draft) step reads a stale state (the vLLM Nemotron-H/Qwen3.5 "
           "report)",
           SPEC, "            if v.accepted == len(b.proposals):             # every draft accepted: the forward "
                 "left the right state\n                continue\n",
           "            if v.accepted == len(b.proposals):\n                self.snap.restore(0, v.snap, b.slot)\n"
           "                continue\n",
           (T_SPEC_STATE, T_SPEC_LOG)),
    Mutant("spec_snapshot_index_off_by_one", "speculative rollback",
           "the rollback copies the snapshot of the last accepted *draft's* index (a-1) instead of the last accepted "
           "*input's* (a: input 0 is the row's last token): the state is one accepted token short",
           SPEC, _RESTORE, "            self.snap.restore(max(v.accepted - 1, 0), v.snap, b.slot)\n",
           (T_SPEC_STATE, T_SPEC_LOG)),
    Mutant("spec_replay_one_position_short", "speculative rollback",
           "the replay rollback (FastOptions.spec_replay) re-runs the conv/SSM steps of inputs 0..a-1 instead of "
           "0..a: the state misses the last accepted input",
           VERIFY, "        for j in range(a + 1):\n            slots[j][r] = slot\n",
           "        for j in range(a):\n            slots[j][r] = slot\n",
           ("tests/test_speculative_verify.py::test_replay_rollback_leaves_the_snapshot_rollbacks_bits",)),
    Mutant("spec_bonus_from_wrong_position", "speculative verify",
           "after a rejected draft the bonus token is taken from the logits row after the rejected draft instead "
           "of the one after the last accepted token",
           SPEC, "                host.append(choices[i])\n",
           "                host.append(choices[min(i + (i == a), len(choices) - 1)])\n",
           (T_SPEC_LOG,)),
    Mutant("spec_accepted_off_by_one", "speculative verify",
           "the accepted count includes the first rejected draft (the bonus counted as an accepted draft)",
           SPEC, "            while a < len(b.proposals) and b.proposals[a] == choices[a]:\n                a += 1\n",
           "            while a < len(b.proposals) and b.proposals[a] == choices[a]:\n                a += 1\n"
           "            a = min(a + 1, len(b.proposals))\n",
           (T_SPEC_LOG,)),
    Mutant("spec_kv_length_not_cut", "speculative rollback",
           "a verify row's fed length is not cut at its own m+1 inputs: the batch width's padding positions run in the "
           "row's slot (not slot -1), so its conv/SSM state and K/V advance over padding tokens past its last input",
           VERIFY, "            for j, t in enumerate(toks):\n",
           "            for j, t in enumerate(list(toks) + [0] * (w - len(toks))):\n",
           (T_SPEC_STATE, T_SPEC_LOG)),
    Mutant("spec_stop_inside_drafts_ignored", "speculative finishing",
           "a stop token (or max_new_tokens) reached inside the accepted drafts does not cut the emitted list: the "
           "drafts after it are appended too",
           ENGINE, "            if self.requests[b.request].finish_reason is not None:       # a verify row's tokens "
                   "after its stop\n                continue\n", "",
           (T_SPEC_CORPUS,)),
    Mutant("spec_seeded_key_by_step", "speculative sampler key",
           "every verify position of a seeded row is sampled with the row's step key (its first position) instead "
           "of its own absolute position: seeded requests are no longer speculation-invariant",
           SPEC, "int(sp.seed), first_pos + i))", "int(sp.seed), first_pos))",
           (T_SPEC_LOG,)),
    Mutant("spec_verify_rows_not_in_budget", "speculative batch building",
           "a verify row is counted as one token of the budget instead of m+1: prefill pieces overrun the step",
           ENGINE, "        spec_extra = sum(b.count - 1 for b in batch)", "        spec_extra = 0",
           (T_SPEC_BUDGET,)),
    Mutant("spec_draft_state_not_restored", "speculative draft",
           "the draft model's own state is left after its drafting steps, so its next catch-up continues from "
           "drafted tokens that were never emitted",
           "fastpath/engine/draft.py", "            self.snap.restore()\n", "",
           (T_SPEC_LOG + "[draft]", T_DRAFT_CATCH_UP)),
    Mutant("spec_device_ngram_oldest_match", "speculative device drafts",
           "the device ngram search takes the oldest earlier occurrence of the suffix instead of the most recent one "
           "(DESIGN §13), so device drafts differ from the host proposer's and the oracle's",
           "fastpath/engine/ngram_device.py", "        i = torch.where(ok, starts[None, :], -1).amax(1)\n",
           "        i = torch.where(ok, starts[None, :], W).amin(1)\n        i = torch.where(i == W, -1, i)\n",
           ("tests/test_ngram_device.py::test_device_ngram_equals_the_oracles_prompt_lookup",)),
    Mutant("spec_device_drafts_not_masked", "speculative device drafts",
           "the device-draft verify body does not set slot -1 past a row's m drafts, so a row with fewer drafts than "
           "its room runs its padding positions in its own slot and its state advances over them",
           VERIFY, "        vb.slot[1:].copy_(torch.where(j <= m[None, :], vb.slot[1:], torch.full_like(vb.slot[1:], "
                   "-1)))\n", "",
           ("tests/test_spec_device.py::test_device_drafts_keep_the_host_proposers_log_and_the_oracles",)),
    Mutant("spec_device_eager_logits_in_graph_slot", "speculative device drafts",
           "an eager device-draft step (seeded rows) stores its logits where the bucket's graph output is kept, so "
           "a later run's replay of that bucket reports the eager step's stale logits (tokens stay right)",
           VERIFY, "            self.device_logits = self._device_body(key, seeded)\n",
           "            self._logits[key + (\"device\",)] = self.device_logits = self._device_body(key, seeded)\n",
           ("tests/test_spec_device.py::test_gpu_device_draft_logits_are_the_replayed_graphs_own_in_every_run",),
           gpu_only=True),
    Mutant("spec_device_seeded_key_by_step", "speculative device drafts",
           "a seeded row's device-draft verify positions are all sampled with the key of its first position",
           "fastpath/engine/spec_device.py", "                                   b.pos + 1 + i))\n",
           "                                   b.pos + 1))\n",
           ("tests/test_spec_device.py::test_device_draft_seeded_rows_key_every_position_by_the_position_it_predicts",
            )),
    Mutant("oracle_spec_overlapped", "spec: speculative async",
           "the truth overlaps speculative async steps like plain ones, launching decode rows from unresolved "
           "tokens (no proposals) so async and legacy schedules part",
           ORACLE_SCHED, "                and self.spec is None                            # speculative: never "
                         "overlapped (§13)\n", "",
           ("tests/test_speculative_oracle.py::test_zero_draft_steps_follow_accepting_steps_and_are_plain_decode_rows",
            )),
]

# ------------------------------------------------- the public 2026 reports: one class each, our fast path
T_BOUND = "tests/test_scenarios_boundaries.py::test_boundary_scenarios_through_the_engine_equal_the_oracle"
T_TAILS, T_COBATCH = T_BOUND + "[piece_tails]", T_BOUND + "[cobatch_reuse]"
T_PC_LRU = T_PC_TRACES + "[prefix_lru]"
T_SPEC_ACCEPT = T_SPEC_CORPUS + "[spec_accept]"
_PIECES = "        pieces = [(b.pos, b.count, b.slot) for b in pre]\n"

MUTANTS += [
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
           "SGLang #29633: a one-token piece that starts on a chunk/block boundary (a prefix hit with prompt = 1 mod "
           "the block, or the last piece of a prompt = 1 mod the piece size) takes the fresh-sequence path: it is "
           "packed without its initial state",
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
           "vLLM PR #16942 / llama.cpp #29002: identical prompts co-batched are computed once (deduplicated): the twin's "
           "piece runs on the first one's slot, so its own slot never gets the prompt's state and the twins diverge",
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
           "SGLang #31833: every request after the first prefix hit admitted in a step restores the first one's "
           "checkpoint (its own hit length kept)",
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
           "the verify forward keeps no snapshot after the last draft position (only after positions 0..w-3), so a "
           "row of full width rejected at its last draft is restored from a stale snapshot; a defect that passed "
           "qualify before spec_accept",
           VERIFY, "        if snaps is not None and j < vb.w - 1:\n", "        if snaps is not None and j < vb.w - 2:\n",
           (T_SPEC_ACCEPT, T_SPEC_STATE)),
    Mutant("pc_lru_not_touched_on_hit", "prefix cache",
           "a hit does not update the entry's last use, so LRU evicts by store order: an older entry hit after a newer "
           "store is evicted before the newer one; a defect that passed qualify before prefix_lru",
           PC, "                e.last_use = step\n", "",
           (T_PC_LRU,)),
]
