"""State transfer between engine instances (DESIGN §19): export a row's whole state at a step boundary, import it
into another Engine's zeroed slot, and run a trace's instances in lock step (as oracle/transfer.py does).

    SlotState: every Mamba layer's conv window and SSM state, every attention layer's K/V of [0, positions)
    step k of every instance:  drain(k-1) where step k is not overlapped     (a sender's step k never is)
                               hand-overs at the end of step k-1: export, the sender frees the slot ("transfer")
                               step k of each instance ("main" first, then the others in id order): the receiver
                               admits what it was handed before its arrivals: zeroed slot, then the import

The host state (output, done, the sampler's position) is the request's RequestState, shared by the instances.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from oracle.schedule_log import StepRecord, TraceResult, digest
from oracle.trace import FIRST_ENGINE, Trace, transfer_at, transfer_engines

from .bank import StateBank


@dataclass
class SlotState:
    """One request's state out of a bank: conv [n_mamba, conv_dim, d_conv-1], ssm [n_mamba, H, P, N], and K/V
    [n_attn, positions, Hkv, d] (None without attention layers); `positions` = tokens fed so far."""
    conv: torch.Tensor
    ssm: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    positions: int


def export_state(bank: StateBank, slot: int, positions: int) -> SlotState:
    """A copy of what `slot` holds for a request that has fed `positions` tokens."""
    kv = bank.k_cache.numel() > 0
    return SlotState(bank.conv_state[:, slot].clone(), bank.ssm_state[:, slot].clone(),
                     bank.k_cache[:, slot, :positions].clone() if kv else None,
                     bank.v_cache[:, slot, :positions].clone() if kv else None, positions)


def import_state(bank: StateBank, slot: int, s: SlotState) -> None:
    """Write an exported state into `slot` (already zeroed by admission): conv windows, SSM states, K/V."""
    bank.conv_state[:, slot].copy_(s.conv)
    bank.ssm_state[:, slot].copy_(s.ssm)
    if s.k is not None:
        bank.k_cache[:, slot, :s.positions].copy_(s.k)
        bank.v_cache[:, slot, :s.positions].copy_(s.v)


def admit_moved(engine: Any, st: Any, row: int, slot: int, rec: StepRecord) -> None:
    """The receiver's admission of a handed-over request (Engine.admit, after zeroing the slot): import its state;
    it continues where it stopped (no prefill of what was moved)."""
    engine.transit.remove(st)
    import_state(engine.bank, slot, st.moved)
    rec.admit.append({"request": st.req.id, "row": row, "slot": slot, "imported": st.moved.positions})
    st.admitted, st.moved = True, None


def hand_over(engine: Any, rid: str) -> SlotState:
    """The sender's side: export the live request's state, free its slot as at a finish (reason "transfer", in the
    record of the step just resolved), compact the rows."""
    st, rt, rec = engine.requests[rid], engine.rows, engine.log.steps[-1]
    row = rt.row_of(rid)
    moved = export_state(engine.bank, rt.row_to_slot[row], st.held)
    (_, slot), = rt.release([row])
    st.admitted = False
    rec.free.append({"request": rid, "row": row, "slot": slot, "reason": "transfer"})
    rec.moves.extend({"from_row": m.src, "to_row": m.dst, "request": rt.row_request[m.dst],
                      "slot": rt.row_to_slot[m.dst]} for m in rt.compact())
    rec.row_to_slot = list(rt.row_to_slot)
    return moved


class EngineInstances:
    """A trace's engine instances: `main` (the Engine run_trace was called on) and one peer Engine per transfer target
    (same model, same engine config, kept on main for its next run), sharing the requests."""

    def __init__(self, main: Any, trace: Trace, mode: str):
        self.main, self.trace = main, trace
        peers = main.__dict__.setdefault("_peers", {})
        self.by_name = {FIRST_ENGINE: main}
        for name in transfer_engines(trace)[1:]:
            if name not in peers:
                g = main.graphs
                peers[name] = type(main)(main.model, main.ec, max_len=main.bank.max_len,
                                         graphs=g is not None and g.capture, pad_decode=g is not None)
            self.by_name[name] = peers[name]
        main.reset(mode)
        main._instances = True
        for req in trace.requests:
            main.add_request(req)
        for name, e in self.by_name.items():
            if e is not main:
                e.reset(mode)
                e.name, e.requests, e.arrival_order, e.on_logits = name, main.requests, main.arrival_order, main.on_logits

    def hand_over(self, step: int) -> None:
        """Every transfer at the end of `step`, in trace order: the sender exports and frees, the receiver queues."""
        for r in self.trace.requests:
            t, st = transfer_at(r, step), self.main.requests[r.id]
            if t is None or st.finish_reason is not None:
                continue
            src, dst = self.by_name[st.engine], self.by_name[t.to]
            if st.admitted:
                st.moved = hand_over(src, r.id)
            elif st.moved is not None:
                src.transit.remove(st)
            st.engine = t.to
            if st.moved is not None:
                dst.transit.append(st)

    def run(self, max_steps: int = 1_000_000) -> TraceResult:
        """Step every instance until all requests finished; the log is main's with the others' under `instances`."""
        insts, k = list(self.by_name.values()), 0
        try:
            while True:
                for e in insts:
                    e.k = k
                    if e.pending is not None and not e.can_overlap():
                        e.drain()
                self.hand_over(k - 1)
                stepped = [e.step() for e in insts]
                for e in insts[1:]:                        # what a streaming client of main receives
                    for rid, toks in e.take_emitted().items():
                        self.main.emitted.setdefault(rid, []).extend(toks)
                if not any(stepped):
                    break
                k += 1
                if k > max_steps:
                    raise RuntimeError(f"engine made no progress within {max_steps} steps")
        finally:
            del self.main._instances
        log = self.main.log
        log.instances = {n: e.log.steps for n, e in self.by_name.items() if n != FIRST_ENGINE}
        reqs = self.main.requests
        return TraceResult({rid: list(s.output) for rid, s in reqs.items()},
                           {rid: s.finish_reason for rid, s in reqs.items()}, log, digest(log))
