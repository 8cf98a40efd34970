"""DESIGN §19's state transfer inside the llama.cpp worker: one llama.cpp context per engine instance of the trace
(worker.Engine.peer: a second context on the same loaded model), run in lock step as oracle/transfer.py describes,
with the worker's own scheduler in each (docs/scheduler.md: independent on purpose).

    step k of every instance ("main" first, then the others in id order): admit (handed-over requests first, into
        the lowest free seq id, zeroed, then llama_state_seq_set_data of the moved state), plan, decode, retire
    hand-overs at the end of step k, in trace order: the sender reads the sequence with llama_state_seq_get_data,
        removes it (llama_memory_seq_rm) and frees the seq id as at a finish, rows compact; the receiver queues it

A request handed over while waiting joins the receiver's queue in its arrival place; a finished one stays.
Imports nothing of the worker's: its Engine and RunState class are passed in.
"""
from __future__ import annotations

FIRST_ENGINE = "main"            # DESIGN §19: every request starts on it (oracle.trace.FIRST_ENGINE)


def engine_names(requests: list[dict]) -> list[str]:
    """The trace's engine instances: "main", then every transfer target in sorted order."""
    return [FIRST_ENGINE] + sorted({t["to"] for r in requests for t in r.get("transfer", ())} - {FIRST_ENGINE})


def run_instances(engine, state_type: type, requests: list[dict], max_requests: int, max_tokens_per_step: int,
                  prefill_chunk: int, chunk_size: int) -> dict:
    """The run op for a trace with transfers: `engine` (a worker.Engine) is "main", its peers the other instances,
    each with a `state_type` (worker.RunState); tokens, logits and finish reasons are shared by all. The reply is
    Engine.run's, plus `placements` (where each request ran: engine, seq id, step admitted, positions imported)."""
    names = engine_names(requests)
    engines = {n: engine if n == FIRST_ENGINE else engine.peer(n) for n in names}
    tokens = {r["id"]: [] for r in requests}
    logits = {r["id"]: [] for r in requests}
    finish: dict[str, str] = {}
    states = {}
    for n, e in engines.items():
        e.lc.llama_memory_clear(e.mem, True)
        n_slots = min(max_requests, e.n_seq)
        mine = [r for r in requests if n == FIRST_ENGINE]
        states[n] = state_type(pending=sorted(mine, key=lambda r: (r["arrival_step"], r["id"])),
                             free=list(range(n_slots)), rows=[None] * n_slots, tokens=tokens, logits=logits,
                             cache=None, spec=None, finish=finish, transit=[])
    where = {r["id"]: FIRST_ENGINE for r in requests}
    k = 0
    while any(st.pending or st.waiting or st.live or st.transit for st in states.values()):
        for n, e in engines.items():
            st = states[n]
            st.step = k
            e._admit(st)
            plan = e._plan(st, max_tokens_per_step, prefill_chunk, chunk_size)
            e._forward(plan.decode, plan.pieces, st.live, tokens, logits, None)
            e._retire(st)
        for r in requests:
            t = next((t for t in r.get("transfer", ()) if t["step"] == k), None)
            if t is not None and r["id"] not in finish:
                hand_over(r["id"], engines[where[r["id"]]], states[where[r["id"]]], states[t["to"]])
                where[r["id"]] = t["to"]
        k += 1
        if k > 100_000:
            raise RuntimeError("the trace did not finish within 100000 steps")
    placements: dict[str, list[dict]] = {r["id"]: [] for r in requests}
    for n, st in states.items():
        for a in st.admits:
            placements[a["request"]].append({"engine": n, **{x: a[x] for x in a if x != "request"}})
    for p in placements.values():
        p.sort(key=lambda a: a["step"])
    seq_ids = {rid: p[-1]["seq"] for rid, p in placements.items() if p}
    return {**type(engine)._reply(states[FIRST_ENGINE]), "steps": k, "seq_ids": seq_ids, "placements": placements}


def hand_over(rid: str, src_engine, src, dst) -> None:
    """Move request `rid` from instance `src` to `dst` (RunStates) at a step boundary: a live one with its
    sequence's state (Engine._release: read, removed, seq id freed as at a finish), one in transit with the state
    it carries, a waiting or not yet arrived one as a request (it joins in its arrival place)."""
    if rid in src.live:
        dst.transit.append(src_engine._release(src, rid))
        return
    moving = next((m for m in src.transit if m[0]["req"]["id"] == rid), None)
    if moving is not None:
        src.transit.remove(moving)
        dst.transit.append(moving)
        return
    for queue in (src.waiting, src.pending):
        req = next((q for q in queue if q["id"] == rid), None)
        if req is not None:
            queue.remove(req)
            dst.pending.append(req)
            dst.pending.sort(key=lambda r: (r["arrival_step"], r["id"]))
            return
    raise RuntimeError(f"request {rid}: handed over from an instance that does not hold it")
