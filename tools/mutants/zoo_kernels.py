"""Kernel defects: conv/SSM and dt math, pad rows, attention, sampling, offsets, batch invariance, GEMV folds, norms."""
from __future__ import annotations

from hybridqual.mutants.runner import Mutant
from hybridqual.mutants.zoo_paths import (ENGINE, MODEL, GRAPHS, TORCH_OPS, K, T_GEN, T_ARCH, T_CORPUS, T_PAD_ROWS,
                                         T_CONV_STEP, T_CONV, T_SSM_STEP, T_GEMV_CONV, T_ROW_GEMV, T_GEMV_RMS,
                                         T_GEMV_RES, T_GAINS, T_SSD_MIXED, T_SAMPLING, T_SAMPLING_DT, T_OFFSETS,
                                         T_ATTN, T_ROPE, T_ATTN_DEC, T_ATTN_SPLIT)


# ------------------------------------------------ conv / ssm arithmetic
CONV_SSM: list[Mutant] = [
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
           K + "ssd_chunk_scan.py", "        acc += d * xs.to(tl.float32)\n    return acc",
           "        acc += 0.0 * d\n    return acc",
           (T_SSD_MIXED,)),
    Mutant("gated_norm_ungrouped", "gated norm",
           "the Mamba gated RMSNorm is normalised over all of d_inner although the architecture groups it",
           MODEL, "y, z, weight, c.mamba_n_groups, c.norm_eps", "y, z, weight, 1, c.norm_eps",
           (T_ARCH,)),
    Mutant("ssm_state_bf16_between_steps", "state precision",
           "the decode state is rounded to bf16 when written back to the bank",
           K + "ssm_step.py", "    tl.store(tile, state, mask=m3)", "    tl.store(tile, state.to(tl.bfloat16).to(tl.float32), mask=m3)",
           (T_SSM_STEP,)),
]

# ------------------------------------------------ pad rows / null slot
PAD_ROWS: list[Mutant] = [
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
           TORCH_OPS, "    write_rows(conv_bank, idx, valid, u[:, :, 1:])",
           "    write_rows(conv_bank, idx, torch.ones_like(valid), u[:, :, 1:])",
           (T_PAD_ROWS,)),
    Mutant("graph_pad_rows_slot_zero", "pad rows",
           "a bucket's pad rows get slot 0 (a zero-filled buffer's default) instead of -1, so they decode into "
           "whichever request holds slot 0",
           GRAPHS, "slot + [-1] * pad", "slot + [0] * pad",
           (T_PAD_ROWS,)),
]

# ------------------------------------------------ attention / KV
ATTENTION_KV: list[Mutant] = [
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
]

# ------------------------------------------------ sampling
SAMPLING: list[Mutant] = [
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
]

# ------------------------------------------------ offsets
OFFSETS: list[Mutant] = [
    Mutant("chunk_offsets_int32", "int32 overflow",
           "packed token offsets of the SSD chunk table stored as int32: they wrap past 2^31 tokens·elements",
           K + "ssd.py", "    return SSDChunkTable(dev[:n], dev[n:2 * n].to(torch.int32),",
           "    return SSDChunkTable(dev[:n].to(torch.int32), dev[n:2 * n].to(torch.int32),",
           (T_OFFSETS,)),
    Mutant("ssd_scan_token_offset_int32", "int32 overflow",
           "the scan kernel computes its chunk's first token offset in int32: x/y addresses wrap past 2^31 elements",
           K + "ssd_chunk_scan.py",
           "    start = tl.load(chunk_start_ptr + c).to(tl.int64)\n    length = tl.load(chunk_len_ptr + c)\n    offs_s",
           "    start = tl.load(chunk_start_ptr + c).to(tl.int32)\n    length = tl.load(chunk_len_ptr + c)\n    offs_s",
           ("tests/test_kernel_ssd.py::test_ssd_int64_offsets_beyond_2_31_elements",), gpu_only=True),
]

# ------------------------------------------------ batch invariance / launch order
BATCH_INVARIANCE: list[Mutant] = [
    Mutant("matmul_split_by_m", "batch invariance",
           "the batch-invariant matmul drops its K split for small M (as cuBLAS picks split-K by M): a token's "
           "projection then depends on how many rows share its step",
           K + "matmul.py", '    bk, split = r["BK"], r["SPLIT"]\n', '    bk, split = r["BK"], (r["SPLIT"] if M >= 4 else 1)\n',
           ("tests/test_batch_invariance.py::test_fixed_split_matmul_rows_do_not_depend_on_m_and_match_the_product",)),
    Mutant("gemv_pdl_no_wait", "launch order",
           "the PDL-launched GEMV never waits for the kernel that writes its input (reads x while the norm runs)",
           K + "gemv.py", "    pdl_enter(PDL)\n", "    pass                # no gdc_wait: x is read whenever\n",
           ("tests/test_kernel_gemv.py::test_gemv_launched_early_waits_for_its_producer",), gpu_only=True),
]

# ------------------------------------------------ folds into the one-row GEMV
GEMV_FOLDS: list[Mutant] = [
    Mutant("gemv_conv_channel_off_by_one", "conv window",
           "the conv step folded into in_proj's epilogue maps GEMV column n to conv channel n - first - 1 (an "
           "off-by-one at the z | xBC boundary): each column is convolved with its neighbour's taps and window",
           K + "gemv.py", "        c = n - c0\n", "        c = n - c0 - 1\n",
           (T_GEMV_CONV, T_ROW_GEMV)),
    Mutant("gemv_rms_mean_over_tile", "norm fold",
           "the RMSNorm folded into a one-row projection divides Σx² by the tile width instead of the row length "
           "(right whenever one tile covers the row; wrong for every real hidden size)",
           K + "gemv.py", "ssum / K + eps", "ssum / BLOCK_K + eps",
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
    Mutant("gemv_rows_last_row_dropped", "row blocks",
           "the few-row GEMV is launched with M - 1 rows: the last row of every call is never stored and keeps "
           "whatever the output buffer held (a verify's last position, a small batch's last request)",
           K + "gemv_rows.py", "out, M, N, K, x.stride(0)", "out, M - 1, N, K, x.stride(0)",
           ("tests/test_kernel_gemv_rows.py",)),
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
    Mutant("attn_prefill_split_max_base2", "split-KV merge",
           "with base-2 exponentials the split-key prefill attention stores each split's running max in base-2 "
           "units (the × ln 2 back to natural units dropped), so the merge rescales the splits' partial sums by the "
           "wrong factors: a prefix-cache hit's suffix past one split mixes its splits wrongly",
           K + "attention.py", "            m_i = m_i * 0.6931471805599453\n", "            m_i = m_i * 1.0\n",
           (T_ATTN_SPLIT,)),
]

# ------------------------------------------------ norm eps placement and grouping (found by the blind run)
NORM_EPS: list[Mutant] = [
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
]

# ------------------------------------------------ head mapping (found by the blind run)
HEAD_MAPPING: list[Mutant] = [
    Mutant("gqa_decode_heads_modulo", "attention heads",
           "the decode attention maps query head h to KV head h % n_kv (interleaved) instead of h // q_per_kv",
           K + "attention_decode.py", "    qh = kvh * q_per_kv + qi\n", "    qh = qi * Hkv + kvh\n",
           (T_ATTN_DEC, T_ATTN),
           more=((K + "attention_decode.py", "        oh = kvh * q_per_kv + c\n", "        oh = c * Hkv + kvh\n"),)),
]
