"""Speculative-decoding defects (DESIGN §13): rollback, verify, budget, sampler keys, draft model, device drafts."""
from __future__ import annotations

from hybridqual.mutants.runner import Mutant
from hybridqual.mutants.zoo_paths import (ENGINE, ORACLE_SCHED, SPEC, VERIFY, T_DRAFT_CATCH_UP, T_SPEC_STATE,
                                         T_SPEC_LOG, T_SPEC_CORPUS, T_SPEC_BUDGET)


_RESTORE = "            self.snap.restore(v.accepted, v.snap, b.slot)\n"

SPECULATIVE: list[Mutant] = [
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
    Mutant("spec_snapshot_row_zero", "speculative rollback",
           "the SSM step kernel stores every row's per-position snapshot at row 0 of the snapshot buffer, so a "
           "rejecting row other than the first is restored to row 0's state (or to an old snapshot)",
           "fastpath/kernels/ssm_step.py", "        tl.store(snap_ptr + r * stride_snap_r + ",
           "        tl.store(snap_ptr + 0 * stride_snap_r + ",
           ("tests/test_kernel_step_snapshots.py", T_SPEC_STATE)),
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
           VERIFY, "vals = pack_rows(inputs, pos, slot, nb, w)",
           "vals = pack_rows([list(t) + [0] * (w - len(t)) for t in inputs], pos, slot, nb, w)",
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
           ORACLE_SCHED, "                and (self.spec is None or self.spec.overlappable(p.batch))   # §10: only "
                         "steps backoff pauses\n", "",
           ("tests/test_speculative_oracle.py::test_zero_draft_steps_follow_accepting_steps_and_are_plain_decode_rows",
            )),
    Mutant("spec_backoff_overlap_keeps_pause", "speculative backoff",
           "async overlaps a step that backoff pauses but builds its rows without counting the paused step off: the "
           "request stays paused one step longer per overlapped step, so its next verify row comes late (tokens are "
           "right; the schedule is not the one the policy defines)",
           ENGINE, "            if self.spec is not None:\n                self.spec.overlapped(batch)\n", "",
           ("tests/test_speculative_backoff.py::test_backoff_pauses_one_two_four_then_the_cap_after_misses",)),
]
