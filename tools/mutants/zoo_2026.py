"""Where hybrid engines break in 2026 (DESIGN §17-21): one mutant per public report, its mechanism as reported.

Prefix caching × speculative decoding (DESIGN §17; traces goldens/traces/prefix_spec{,_async}.json, in qualify's
default plan): each mutant lets a checkpoint hold state that is not the verified state of its key.
"""
from __future__ import annotations

from hybridqual.mutants.runner import Mutant
from hybridqual.mutants.zoo_paths import ENGINE, PC

T_PS = "tests/test_prefix_spec.py"
T_PS_FAST = T_PS + "::test_fast_path_decode_stores_equal_the_oracle"
T_PS_STATE = T_PS + "::test_fast_path_decode_checkpoint_is_the_verified_state"

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
