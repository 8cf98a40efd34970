"""State transfer between engine instances (DESIGN §19): one mutant per public report, its mechanism as reported.

The trace goldens/traces/transfer_handover.json (in qualify's default plan) hands r1 over mid-decode from row 0 /
slot 1 of engine main into slot 0 of engine decode, which still holds r0's conv window, SSM state and K/V of 16
positions (r1 moves 14); on main, r2 holds slot 0 by then. Each mutant corrupts what the receiver computes from:
a stale or zeroed recurrent state, a conv window in the wrong channel order, K/V of the wrong heads or too few
positions, a state one step early or late, or the Mamba state of another slot. Reports whose thread is not in the
stored report corpus say so; their mutant is the class the report is filed under, as its number is cited.
"""
from __future__ import annotations

from hybridqual.mutants.runner import Mutant
from hybridqual.mutants.zoo_paths import ENGINE

XFER = "fastpath/engine/transfer.py"
T_X = "tests/test_transfer.py::test_fast_path_hands_over_as_the_oracle_does"
T_STATE = "tests/test_transfer.py::test_imported_slot_holds_exactly_the_senders_state"

_CONV = "    bank.conv_state[:, slot].copy_(s.conv)\n"
_SSM = "    bank.ssm_state[:, slot].copy_(s.ssm)\n"
_KV = ("        bank.k_cache[:, slot, :s.positions].copy_(s.k)\n"
       "        bank.v_cache[:, slot, :s.positions].copy_(s.v)\n")
_IMPORT = "    import_state(engine.bank, slot, st.moved)\n"
_EXPORT = "    moved = export_state(engine.bank, rt.row_to_slot[row], st.held)\n"
_EXPORT_CONV = "    return SlotState(bank.conv_state[:, slot].clone(), bank.ssm_state[:, slot].clone(),\n"
_ZERO = ("            self.bank.zero_slot(slot)\n"
         "            if st.moved is not None:                   # DESIGN §19: the sender's state into the zeroed slot\n")
_HAND_OVER = "                self.hand_over(k - 1)\n"
_MOVED = "                st.moved = hand_over(src, r.id)\n"

TRANSFER: list[Mutant] = [
    Mutant("xfer_ssm_slice_written_out_of_range", "state transfer",
           "SGLang PR #20655 (prefill TP > decode TP: several prefill ranks write one decode rank's state buffer and "
           "the destination offset came from the global TP rank, so higher-ranked writers wrote out of bounds and "
           "the Mamba state was corrupted): the SSM state arrives in two writer slices over the heads and the second "
           "lands outside the slot, so heads H/2.. keep what admission left there (zeros)",
           XFER, _SSM,
           "    half = s.ssm.shape[1] // 2\n"
           "    bank.ssm_state[:, slot, :half].copy_(s.ssm[:, :half])\n",
           (T_STATE, T_X)),
    Mutant("xfer_conv_segments_merged_as_one", "state transfer",
           "SGLang PR #22060 (Qwen3.5 PD disaggregation: conv_state's TP-sliced dimension is three concatenated "
           "segments, x | B | C, and the transfer merged each shard in one shot instead of segment by segment): the "
           "conv window of two shards [x0 B0 C0] [x1 B1 C1] is laid into the slot as one block, so its channels sit "
           "in the order x0 B0 C0 x1 B1 C1 where x0 x1 B0 B1 C0 C1 belong",
           XFER, _CONV,
           "    c = bank.config\n"
           "    x, g = c.mamba_n_heads * c.mamba_head_dim // 2, c.mamba_n_groups * c.mamba_d_state // 2\n"
           "    p = torch.split(s.conv, [x, x, g, g, g, g], dim=1)\n"
           "    bank.conv_state[:, slot].copy_(torch.cat([p[0], p[2], p[4], p[1], p[3], p[5]], dim=1))\n",
           (T_STATE, T_X)),
    Mutant("xfer_kv_heads_all_from_head_zero", "state transfer",
           "SGLang PR #23744 (#23746; heterogeneous-TP PD disaggregation: dst_heads_per_rank became 0 by integer "
           "division, so every decode rank mapped to KV head 0; the same PR fixes conv-state slicing): every KV head "
           "of the moved K/V is filled from head 0",
           XFER, _KV,
           "        bank.k_cache[:, slot, :s.positions].copy_(s.k[:, :, :1].expand_as(s.k))\n"
           "        bank.v_cache[:, slot, :s.positions].copy_(s.v[:, :, :1].expand_as(s.v))\n",
           (T_STATE, T_X)),
    Mutant("xfer_mamba_cleared_after_import", "state transfer",
           "SGLang PR #32995 (a successful disaggregated transfer initialises the destination Mamba slot, but the "
           "request stays marked mamba_needs_clear and the next initialisation discards the transferred recurrent "
           "state): after the import the receiver clears the slot's conv windows and SSM states (K/V stay)",
           XFER, _IMPORT, _IMPORT + "    engine.bank.zero_slot(slot)\n",
           (T_X,)),
    Mutant("xfer_kv_one_position_short", "state transfer",
           "vLLM PR #45096 (not in the stored report corpus; filed here as K/V moved for fewer positions than the "
           "request has fed): the last fed position's K/V is not moved, so the receiver attends to the previous "
           "owner's K/V there",
           XFER, _KV,
           "        bank.k_cache[:, slot, :s.positions - 1].copy_(s.k[:, :-1])\n"
           "        bank.v_cache[:, slot, :s.positions - 1].copy_(s.v[:, :-1])\n",
           (T_STATE, T_X)),
    Mutant("xfer_conv_window_past_placeholder", "state transfer",
           "vLLM PR #55178 (PD disaggregation with speculative decoding: a one-token prompt tail padded with K "
           "placeholder positions ran as a prefill, which persists the state after the last query position, "
           "h(N + K placeholders) instead of h(N)): the conv window leaves the sender advanced past one placeholder "
           "input (shifted by one, a zero input appended)",
           XFER, _EXPORT_CONV,
           "    w = bank.conv_state[:, slot]\n"
           "    w = torch.cat([w[..., 1:], torch.zeros_like(w[..., :1])], dim=-1)\n"
           "    return SlotState(w.clone(), bank.ssm_state[:, slot].clone(),\n",
           (T_STATE, T_X)),
    Mutant("xfer_conv_window_not_moved", "state transfer",
           "vLLM PR #55208 (not in the stored report corpus; filed here as the conv window not transferred): the SSM "
           "states and K/V move, the conv windows do not, so the receiver convolves its first inputs with the zeroed "
           "window admission left (as if recomputed from zeros)",
           XFER, _CONV, "",
           (T_STATE, T_X)),
    Mutant("xfer_mamba_state_from_block_id", "state transfer",
           "tpu-inference PR #2652 (disaggregation used vLLM's block id to select the Mamba state, while the TPU "
           "runner keeps its own request-to-Mamba-slot mapping, so the wrong request's state was transferred: "
           "garbled output echoing earlier prompts): the K/V leave from the request's slot, its conv windows and SSM "
           "states from the slot numbered like its row (r1: row 0, slot 1; slot 0 holds r2)",
           XFER, _EXPORT,
           _EXPORT + "    moved.conv, moved.ssm = engine.bank.conv_state[:, row].clone(), engine.bank.ssm_state[:, row]"
                     ".clone()\n",
           (T_X,)),
    Mutant("xfer_mamba_not_loaded_stale_slot", "state transfer",
           "LMCache PR #2863 (hybrid models: LMCache restored attention KV only and reported the whole prefix as "
           "computed, so the Mamba layers skipped those tokens and started from state that was never loaded): the "
           "receiver imports K/V only and neither zeroes nor fills the slot's conv windows and SSM states, so r1 "
           "continues from r0's recurrent state",
           XFER, _CONV + _SSM, "",
           (T_X,),
           more=((ENGINE, _ZERO, _ZERO.replace("            self.bank.zero_slot(slot)\n",
                                                "            if st.moved is None:\n"
                                                "                self.bank.zero_slot(slot)\n")),)),
    Mutant("xfer_mamba_state_one_step_early", "state transfer",
           "LMCache #4247 (LMCacheMPConnector on hybrid Mamba/GDN models: a local prefix extended by a deeper "
           "external tail composes a recurrent state of a shorter prefix with K/V of the longer one, and output "
           "silently changes): the conv windows and SSM states handed over are those of the step before the "
           "transfer step, the K/V those of the transfer step",
           XFER, _HAND_OVER,
           "                for r in self.trace.requests:\n"
           "                    st = self.main.requests[r.id]\n"
           "                    if transfer_at(r, k) is not None and st.admitted:\n"
           "                        e = self.by_name[st.engine]\n"
           "                        sl = e.rows.row_to_slot[e.rows.row_of(r.id)]\n"
           "                        st.early = (e.bank.conv_state[:, sl].clone(), e.bank.ssm_state[:, sl].clone())\n"
           + _HAND_OVER,
           (T_X,),
           more=((XFER, _MOVED, _MOVED + "                if getattr(st, 'early', None) is not None:\n"
                                         "                    st.moved.conv, st.moved.ssm = st.early\n"),)),
]
