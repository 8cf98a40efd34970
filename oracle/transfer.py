"""State transfer between engine instances (DESIGN §19): several schedulers run a trace in lock step, one per engine
id, and a request with a `transfer` moves from one to another at a step boundary, with its whole state.

The oracle's model state lives with the request (RequestState.model_state), so the hand-over is bookkeeping only:

    step k of every instance:  resolve(k-1) where step k is not overlapped   (a sender's step k never is)
                               hand-overs at the end of step k-1: the sender frees the slot (reason "transfer")
                               step k of each instance ("main" first, then the others in id order): the receiver
                               admits what it was handed, before its own arrivals, into a zeroed slot of its own
                               ("imported": the positions moved), and the request decodes (or prefills) on

A request handed over while still waiting moves to the receiver's queue (nothing logged); a finished one stays.
"""
from __future__ import annotations

from typing import Any

from .schedule_log import TraceResult, digest
from .trace import FIRST_ENGINE, Trace, transfer_at, transfer_engines


class Instances:
    """The engine instances of one trace: `main` and one scheduler per transfer target, sharing the requests
    (`scheduler`: oracle.scheduler.Scheduler, passed in by its run_trace)."""

    def __init__(self, scheduler: type, model: Any, trace: Trace, mode: str,
                 forced_tokens: dict[str, list[int]] | None = None):
        names = transfer_engines(trace)
        self.main = scheduler(model, trace, mode, forced_tokens, instance=FIRST_ENGINE)
        self.trace = self.main.trace                       # normalised
        self.by_name = {FIRST_ENGINE: self.main}
        for name in names[1:]:
            peer = scheduler(model, trace, mode, forced_tokens, instance=name)
            peer.requests, peer.arrival_order = self.main.requests, self.main.arrival_order
            self.by_name[name] = peer

    def hand_over(self, step: int) -> None:
        """Every transfer at the end of `step`, in trace order: sender frees, receiver queues the request."""
        for r in self.trace.requests:
            t = transfer_at(r, step)
            st = self.main.requests[r.id]
            if t is None or st.finish_reason is not None:
                continue
            src, dst = self.by_name[st.engine], self.by_name[t.to]
            if st.admitted:
                src.hand_over(r.id)
                st.moving = True
            elif st.moving:
                src.transit.remove(st)
            st.engine = t.to
            if st.moving:
                dst.transit.append(st)

    def run(self, max_steps: int = 1_000_000) -> TraceResult:
        """Step every instance until all requests finished; the log is main's with the others' under `instances`."""
        insts, k = list(self.by_name.values()), 0
        while True:
            for s in insts:
                s.k = k
                if s.pending is not None and not s.can_overlap(k):
                    s.resolve(s.pending)
                    s.pending = None
            self.hand_over(k - 1)
            if not any([s.step() for s in insts]):
                break
            k += 1
            if k > max_steps:
                raise RuntimeError(f"scheduler made no progress within {max_steps} steps")
        log = self.main.log
        log.instances = {name: s.log.steps for name, s in self.by_name.items() if name != FIRST_ENGINE}
        reqs = self.main.requests
        return TraceResult({rid: list(s.output) for rid, s in reqs.items()},
                           {rid: s.finish_reason for rid, s in reqs.items()}, log, digest(log))
