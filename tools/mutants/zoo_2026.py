"""Where hybrid engines break in 2026 (DESIGN §17-21): one mutant per public report, its mechanism as reported.

Prefix caching × speculative decoding (DESIGN §17; traces goldens/traces/prefix_spec{,_async}.json, in qualify's
default plan): each mutant lets a checkpoint hold state that is not the verified state of its key.
Preemption by recompute (DESIGN §18; goldens/traces/preempt_recompute.json, in the default plan): the resumed
request's state, or its slot, outlives the preemption.
Reduced-precision state (DESIGN §20): the engine declares an fp32 state bank (the default) but rounds the SSM state
(or the conv window) more coarsely where it is written back; judged with fp32's constants, as the declaration
requires.
Cache geometry (DESIGN §21; goldens/traces/prefix_geometry.json, in the default plan: Mamba block 8, attention
block 16): a resume restores the Mamba state of a position computed with the other block size, or checkpoints fall
where no whole KV block ends.
"""
from __future__ import annotations

from hybridqual.mutants.runner import Mutant
from hybridqual.mutants.zoo_paths import ENGINE, PC

T_PS = "tests/test_prefix_spec.py"
T_PS_FAST = T_PS + "::test_fast_path_decode_stores_equal_the_oracle"
T_PS_STATE = T_PS + "::test_fast_path_decode_checkpoint_is_the_verified_state"
T_PRE = "tests/test_preemption.py::test_fast_path_preempts_as_the_oracle_does"

_BOUNDS = "            for p in boundaries(b.pos, emitted.get(b.request, 0), self.block_size):\n"
_SNAP = "                snap = snapshot(b, p - b.pos - 1) if b.kind == \"verify\" else None\n"

PREFIX_SPEC: list[Mutant] = [
    Mutant("pcspec_final_block_not_dropped", "prefix cache x speculation",
           "vLLM #43559 / #53912 (mechanism as PR #43650 and PR #57128 state it: with speculative decoding the last "
           "block, which holds only part of the accepted tokens, must be dropped; the Mamba path kept it and later "
           "requests reused a recurrent state written over rejected draft positions): a verify row that rejected a "
           "draft also stores the block boundary one past its emitted tokens, from the state the verify forward left "
           "after the first rejected draft, under the key of the request's real tokens",
           PC, _BOUNDS,
           "            e = emitted.get(b.request, 0)\n"
           "            e += int(b.kind == \"verify\" and e <= len(b.proposals))\n"
           "            for p in boundaries(b.pos, e, self.block_size):\n",
           (T_PS_FAST,)),
    Mutant("pcspec_lookahead_block_kept", "prefix cache x speculation",
           "vLLM PR #48375 (not in the stored report corpus; mechanism as the issue states it: the lookahead block is "
           "kept in the cache with its unverified recurrent state): a verify row keeps the state at each block "
           "boundary inside its drafts past the emitted tokens, and when the request's real tokens later reach that "
           "boundary the kept lookahead state is what is stored",
           PC, _BOUNDS,
           "            e, ahead = emitted.get(b.request, 0), self.__dict__.setdefault('_ahead', {})\n"
           "            for q in (boundaries(b.pos + e, len(b.proposals) + 1 - e, self.block_size)\n"
           "                      if b.kind == 'verify' else ()):\n"
           "                s = snapshot(b, q - b.pos - 1)\n"
           "                ahead[(b.request, q)] = (tuple(x.clone() for x in s) if s is not None else\n"
           "                    (self.bank.conv_state[:, b.slot].clone(), self.bank.ssm_state[:, b.slot].clone()))\n"
           + _BOUNDS,
           (T_PS_FAST,),
           more=((PC, _SNAP,
                  "                snap = self.__dict__.get('_ahead', {}).pop((b.request, p), None) or (\n"
                  "                    snapshot(b, p - b.pos - 1) if b.kind == \"verify\" else None)\n"),)),
    Mutant("pcspec_async_store_after_next_forward", "prefix cache x speculation (async)",
           "vLLM PR #33997 (align mode + async scheduling + speculative decoding: the async scheduler's computed "
           "count runs ahead of what is verified, and it released a block still in the verify window): the engine "
           "overlaps the step after a decode row reached a block boundary (DESIGN §17's drain dropped), so the next "
           "forward advances the slot before that boundary's checkpoint is taken: the entry holds the state one "
           "token later under the boundary's key",
           ENGINE, "                and (self.prefix is None or not self.prefix.blocks_overlap(prev.batch))       "
                   "# DESIGN §17\n", "",
           (T_PS_FAST,)),
    Mutant("pcspec_checkpoint_before_rollback", "prefix cache x speculation",
           "vLLM #47194 (prefix caching + MTP3 on a Qwen3.6 hybrid: the cache-hit path fails, no-MTP is correct; "
           "PR #47861 is not in the stored report corpus, so the mechanism is the issue's class): the checkpoint of "
           "a block boundary reached inside a verify row is copied from the slot as the verify forward left it (the "
           "last draft's state, before rollback) instead of the accepted position's snapshot",
           PC, _SNAP, "                snap = None\n",
           (T_PS_STATE, T_PS_FAST)),
]

_RESOLVE = "        toks = p.host_tokens[: len(p.batch)].tolist()\n"

STATE_PRECISION: list[Mutant] = [
    Mutant("state_f16_auto_for_nemotron_h", "reduced-precision state",
           "vLLM PR #39032 (an automatic float16 SSM cache for Nemotron-H was wrong): on a nemotron_h model the "
           "engine keeps the SSM state as float16 (rounded at every step's write-back) while it declares the fp32 "
           "state bank",
           ENGINE, _RESOLVE,
           _RESOLVE + "        if self.config.model_type == 'nemotron_h':\n"
                      "            self.bank.ssm_state.copy_(self.bank.ssm_state.to(torch.float16))\n",
           ("tests/test_state_precision.py::test_fp32_state_bank_stays_within_the_fp32_logits_constant",)),
    Mutant("state_int8_below_declared", "reduced-precision state",
           "vLLM RFC #55196 (INT8 recurrent state: GSM8K 81% -> 41%): the SSM state is stored as INT8 with one absmax "
           "scale per (layer, slot, head), quantized at every step's write-back, more coarsely than the fp32 state "
           "the engine declares",
           ENGINE, _RESOLVE,
           _RESOLVE + "        s = self.bank.ssm_state.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(1e-30) / 127\n"
                      "        self.bank.ssm_state.copy_((self.bank.ssm_state / s).round().clamp(-127, 127) * s)\n",
           ("tests/test_engine_trace.py::test_corpus_trace_log_and_tokens_equal_oracle_in_both_modes[seed_compaction]",)),
    Mutant("state_fp8_row_scale_below_declared", "reduced-precision state",
           "vLLM PR #52962 (quantized FlashInfer ReplaySSM state cache: INT8 and FP8 E4M3 SSM-cache dtypes, one FP32 "
           "decode scale per (head, head_dim), state and scale updated together across prefill and decode, conv state "
           "kept at its dtype): the SSM state is stored as FP8 E4M3 with one absmax scale per (layer, slot, head, "
           "head_dim row) over d_state, rounded to nearest at every step's write-back, while the engine declares the "
           "fp32 state bank",
           ENGINE, _RESOLVE,
           _RESOLVE + "        s = self.bank.ssm_state.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / 448\n"
                      "        q8 = (self.bank.ssm_state / s).to(torch.float8_e4m3fn)\n"
                      "        self.bank.ssm_state.copy_(q8.float() * s)\n",
           ("tests/test_state_precision.py::test_fp32_state_bank_stays_within_the_fp32_logits_constant",)),
    Mutant("state_fp8_tile_scale_below_declared", "reduced-precision state",
           "SGLang #40706 (an FP8 e4m3 SSM state pool, `--mamba-ssm-dtype float8`, with per-tile dynamic scales: one "
           "fp32 scale per (head, 32-row V-tile x K), scale = amax / 240): the SSM state [H, P, N] is stored as FP8 "
           "e4m3 with one scale per (layer, slot, head, tile of 32 head_dim rows x all d_state) = amax / 240, rounded "
           "at every step's write-back, while the engine declares the fp32 state bank",
           ENGINE, _RESOLVE,
           _RESOLVE + "        st = self.bank.ssm_state\n"
                      "        for r in range(0, st.shape[-2], 32):\n"
                      "            t = st[..., r:r + 32, :]\n"
                      "            s = t.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(1e-30) / 240\n"
                      "            t.copy_((t / s).to(torch.float8_e4m3fn).float() * s)\n",
           ("tests/test_state_precision.py::test_fp32_state_bank_stays_within_the_fp32_logits_constant",)),
    Mutant("state_conv_window_model_dtype", "reduced-precision state",
           "vLLM PR #26301 (not in the stored report corpus, and no stored page states its mechanism; this mutant is "
           "the split of state dtypes vLLM PR #22928 states: `mamba_ssm_cache_dtype` float32 stores the SSM state in "
           "fp32 while the conv state keeps the model's dtype): the conv window is rounded to bfloat16 at every step's "
           "write-back, the SSM state kept fp32, while the engine declares an fp32 state (conv window included)",
           ENGINE, _RESOLVE,
           _RESOLVE + "        self.bank.conv_state.copy_(self.bank.conv_state.to(torch.bfloat16))\n",
           ("tests/test_state_precision.py::test_fp32_state_bank_stays_within_the_fp32_logits_constant",)),
]

_ADMITTED = "            st.admitted, st.done, st.ctx = True, 0, ctx\n"
_RELEASE = "        (_, slot), = self.rows.release([row])\n"

PREEMPTION: list[Mutant] = [
    Mutant("preempt_resume_from_stale_state", "preemption",
           "vllm-metal #488 (a recompute-preempted request resumes from its stale mid-sequence state): the re-admitted "
           "request is treated as resuming, not recomputing: its prefill of prompt + output is skipped and it decodes "
           "on from whatever state the slot it was given holds",
           ENGINE, _ADMITTED,
           "            st.admitted, st.done, st.ctx = True, len(ctx) if st.output else 0, ctx\n",
           (T_PRE,)),
    Mutant("preempt_slot_not_freed", "preemption",
           "tenstorrent/vllm PR #466 (the state slot of a preempted request is released only on finish: a preempted "
           "request holds a slot whose contents are dead, shrinking capacity): the victim's slot is never pushed back "
           "on the free stack, so a later admission finds no slot",
           ENGINE, _RELEASE, _RELEASE + "        self.rows.free_slots.remove(slot)\n",
           (T_PRE,)),
    Mutant("preempt_resumed_keeps_old_slot", "preemption",
           "tpu-inference PR #2779 (mamba slot lifecycle: a preempted/resumed request's slot must be reset and freed, "
           "not preserved; otherwise one request reads or overwrites another's recurrent state): the resumed request "
           "goes back to the slot it held before preemption, which another request was given meanwhile",
           ENGINE, _ADMITTED,
           _ADMITTED + "            if st.output and getattr(st, 'old_slot', None) is not None:\n"
                       "                slot = self.rows.row_to_slot[row] = st.old_slot\n"
                       "                self.rows.row_to_slot_dev[row] = slot\n",
           (T_PRE,),
           more=((ENGINE, _RELEASE, _RELEASE + "        self.requests[rid].old_slot = slot\n"),)),
]


T_GEO = "tests/test_prefix_geometry.py::test_fast_path_geometry_log_and_tokens_equal_the_oracle"
_HIT = "            self.bank.copy_state(self.bank.pool_slot(entry.index), slot, p)\n"
_BLOCK = ("        self.block_size, self.capacity, self.bank = config.checkpoint_block, config.capacity, bank"
          "   # DESIGN §21\n")

GEOMETRY: list[Mutant] = [
    Mutant("geometry_mamba_state_at_attention_block_index", "cache geometry",
           "vLLM PR #55507 (#53142: a request resumed over a cached prefix seeds its Mamba state column with "
           "(num_computed_tokens - 1) // block_size, the attention block size, although the column indexes the Mamba "
           "group's block table): on a hit at p the Mamba state (conv windows, SSM states) is restored from the "
           "checkpoint that column names in Mamba blocks, position ((p - 1) // Ba + 1) * Bm, when one is cached; K/V "
           "and the resume point stay p",
           PC, _HIT,
           _HIT + "            q = ((p - 1) // self.attention_block_size + 1) * self.mamba_block_size\n"
                  "            wrong = (self.entries.get(block_keys(st.req.prompt[:q], self.block_size)[-1])\n"
                  "                     if q != p and q % self.block_size == 0 else None)\n"
                  "            if wrong is not None:\n"
                  "                src = self.bank.pool_slot(wrong.index)\n"
                  "                self.bank.conv_state[:, slot].copy_(self.bank.conv_state[:, src])\n"
                  "                self.bank.ssm_state[:, slot].copy_(self.bank.ssm_state[:, src])\n",
           (T_GEO,)),
    Mutant("geometry_store_at_mamba_block", "cache geometry",
           "vLLM PR #55507's class (#53142: the Mamba block size confused with the attention block size): the cache "
           "stores and hits at every multiple of the Mamba block Bm, also where no whole attention block ends (DESIGN "
           "§21 requires multiples of lcm(Bm, Ba))",
           PC, _BLOCK, _BLOCK.replace("config.checkpoint_block", "config.block_size"),
           (T_GEO,)),
]
