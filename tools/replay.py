"""Replay a trace and debug it: per-step schedule table, first divergence from the oracle, layer bisection.

    python -m hybridqual.replay TRACE [--model M] [--engine fastpath|oracle|hf|module:Class] [--mode legacy|async]

1. Runs the engine on the trace and prints the per-step table (rows → request, slot, positions; admissions,
   frees, compaction moves, sampled tokens) from the engine's own schedule log (else the oracle's, labelled so).
2. Compares with the oracle (fp64): first step whose schedule record differs; per request the first differing
   token (step, request, position, both tokens, oracle margin and gap).
3. Layer bisection (fast path only): re-runs the engine step by step and, after every step, compares each live
   request's state *in the slot it was admitted to* (state never moves) with the oracle's state for the same
   tokens. The first (step, request) whose state differs beyond tolerance is reported with the first layer and
   the tensors that differ, in the fixed order ssm_state, conv_state (Mamba), k_cache, v_cache (attention).
   Speculative traces (DESIGN §13): the table shows each verify row's proposals and each step's accepted counts,
   and the bisection also checks every verify row right after its rollback — the copy of its last accepted
   input's per-position snapshot into the slot, or none when every draft was accepted — against the prompt and every
   emitted token but the bonus, so a rollback defect is named by stage, layer and tensor.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridqual import adapters, paths
from hybridqual.goldens import regen as goldens

# Relative tolerance ‖engine − oracle‖ / ‖oracle‖ on a state tensor, by engine compute dtype.
STATE_RTOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


@dataclass
class StateDivergence:
    """First state tensor(s) found to differ."""
    step: int
    request: str
    slot: int
    layer: int
    kind: str                          # "mamba" | "attention"
    tensors: list[tuple[str, float]]   # (name, relative difference), in the fixed order
    stage: str = "after the step"      # speculative rollback: ROLLBACK_RESTORE or ROLLBACK_NONE

    def describe(self) -> str:
        what = ", ".join(f"{n} (rel. diff {d:.3g})" for n, d in self.tensors)
        return (f"first divergence: step {self.step} ({self.stage}), request {self.request} (slot {self.slot}), "
                f"layer {self.layer} ({self.kind}): {what}")


ROLLBACK_RESTORE = "verify rollback: after copying the last accepted input's snapshot into the slot"
ROLLBACK_NONE = "verify step: every draft accepted, no rollback"


def step_table(log: dict) -> str:
    """The per-step table of a schedule log (JSON form)."""
    lines = [f"{'step':>4} {'ov':>2}  batch (row:request@slot kind pos+count) | admit | sampled | free | moves"]
    for s in log["steps"]:
        batch = " ".join(f"{b['row']}:{b['request']}@{b['slot']} {b['kind'][0]}{b['pos']}+{b['count']}"
                         + (f"[{','.join(map(str, b['proposals']))}]" if "proposals" in b else "")   # verify rows
                         for b in s["batch"]) or "-"
        admit = " ".join(f"{a['request']}→r{a['row']}/s{a['slot']}" for a in s["admit"]) or "-"
        sampled = " ".join(f"{x['request']}:{x['token']}" for x in s["sampled"]) or "-"
        free = " ".join(f"{f['request']}(s{f['slot']},{f['reason']})" for f in s["free"]) or "-"
        moves = " ".join(f"r{m['from_row']}→r{m['to_row']}({m['request']},s{m['slot']})" for m in s["moves"]) or "-"
        accepted = (" | accepted " + " ".join(f"{v['request']}:{v['accepted']}" for v in s["verify"])
                    if "verify" in s else "")                                    # speculative steps (DESIGN §13)
        lines.append(f"{s['step']:>4} {s['overlap']:>2}  {batch} | {admit} | {sampled} | {free} | {moves}{accepted}")
    return "\n".join(lines)


def first_log_difference(a: dict, b: dict) -> str | None:
    """Where two schedule logs (JSON form) first differ, or None."""
    for x, y in zip(a["steps"], b["steps"]):
        if x != y:
            keys = [k for k in x if x.get(k) != y.get(k)]
            return f"step {x['step']}: {', '.join(keys)} differ — engine {[x[k] for k in keys]} vs oracle {[y[k] for k in keys]}"
    if len(a["steps"]) != len(b["steps"]):
        return f"engine logged {len(a['steps'])} steps, oracle {len(b['steps'])}"
    return None


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / max(‖want‖, tiny), in fp64 on the CPU (the engine's bank may live on cuda, the oracle's
    state is on the CPU)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def compare_request_state(engine, oracle_state, slot: int, n_tokens: int, rtol: float) -> tuple[int, str, list] | None:
    """First layer where the bank's slot state differs from the oracle's state, or None."""
    cfg = engine.config
    for lid in range(len(cfg.layers)):
        if lid in cfg.mamba_layer_ids:
            pairs = [("ssm_state", engine.bank.ssm(lid)[slot], oracle_state.ssm[lid]),
                     ("conv_state", engine.bank.conv(lid)[slot], oracle_state.conv[lid])]
            kind = "mamba"
        elif lid in cfg.attention_layer_ids:
            k, v = engine.bank.kv(lid)
            pairs = [("k_cache", k[slot, :n_tokens], oracle_state.k[lid]),
                     ("v_cache", v[slot, :n_tokens], oracle_state.v[lid])]
            kind = "attention"
        else:
            continue
        bad = [(name, d) for name, got, want in pairs if (d := rel_diff(got, want)) > rtol]
        if bad:
            return lid, kind, bad
    return None


def _oracle_state(oracle_model, tokens: list[int], cache: dict | None, rid: str):
    """The oracle's state after `tokens`, continued from the request's last cached state when that state's tokens
    are a prefix of these (one step's new tokens instead of the whole sequence again: O(n) not O(n²) per request)."""
    hit = cache.get(rid) if cache is not None else None
    if hit is not None and len(hit[0]) <= len(tokens) and list(hit[0]) == tokens[:len(hit[0])]:
        done, ostate = hit
        if len(done) < len(tokens):
            _, ostate = oracle_model.prefill(tokens[len(done):], ostate)
    else:
        _, ostate = oracle_model.prefill(tokens)
    if cache is not None:
        cache[rid] = (tuple(tokens), ostate)
    return ostate


def _check_slot(engine, oracle_model, rtol: float, step: int, rid: str, slot: int, n: int,
                stage: str, cache: dict | None = None) -> StateDivergence | None:
    """The slot's state vs the oracle's state after the request's first n tokens (prompt + output)."""
    st = engine.requests[rid]
    ostate = _oracle_state(oracle_model, (list(st.req.prompt) + list(st.output))[:n], cache, rid)
    found = compare_request_state(engine, ostate, slot, n, rtol)
    return StateDivergence(step, rid, slot, *found, stage=stage) if found else None


def watch_rollback(engine, oracle_model, rtol: float, found: list[StateDivergence]):
    """Wrap the engine's speculative rollback (fastpath/engine/speculative.py) so that each verify row's state is
    checked right after its snapshot copy (restore(j, r, slot): bank[slot] must hold its first pos + j + 1 tokens)
    and again after the rollback (every emitted token but the bonus; a row that accepted every draft has no copy);
    the first divergence is appended to `found`. Returns the function that removes the wrappers."""
    spec = engine.spec
    real_rollback, real_restore = spec.rollback, spec.snap.restore

    def rollback() -> None:
        verified = list(spec.verified)
        step = engine.pending.step if engine.pending is not None else engine.k
        row_of = {b.slot: b for b, _ in verified}

        def restore(j: int, r: int, slot: int) -> None:
            real_restore(j, r, slot)
            b = row_of[slot]
            if not found and (d := _check_slot(engine, oracle_model, rtol, step, b.request, slot, b.pos + j + 1,
                                               ROLLBACK_RESTORE)):
                found.append(d)
        spec.snap.restore = restore
        try:
            real_rollback()
        finally:
            del spec.snap.restore
        for b, v in verified:
            st = engine.requests[b.request]
            if found or st.finish_reason is not None:
                continue
            stage = ROLLBACK_RESTORE if v.accepted < len(b.proposals) else ROLLBACK_NONE
            n = len(st.req.prompt) + len(st.output) - 1
            if d := _check_slot(engine, oracle_model, rtol, step, b.request, b.slot, n, stage):
                found.append(d)
    spec.rollback = rollback

    def unhook() -> None:
        del spec.rollback
    return unhook


def bisect(engine, trace, mode: str, oracle_model, rtol: float) -> StateDivergence | None:
    """Step the engine; after each step compare every live request's admitted-slot state with the oracle's (and,
    with speculation, each verify row's state after its rollback's restore and after its replay)."""
    engine.reset(mode)
    for req in trace.requests:
        engine.add_request(req)
    found: list[StateDivergence] = []
    unhook = watch_rollback(engine, oracle_model, rtol, found) if getattr(engine, "spec", None) else None
    try:
        d = _bisect_steps(engine, oracle_model, rtol, found)
    finally:
        if unhook:
            unhook()
    return d or (found[0] if found else None)    # found: a rollback in the final drain diverged


def _bisect_steps(engine, oracle_model, rtol: float, found: list[StateDivergence]) -> StateDivergence | None:
    home: dict[str, int] = {}            # request -> the slot it was admitted to (state never moves)
    consumed: dict[str, int] = {}        # request -> tokens fed into its state so far (from the batches)
    states: dict = {}                     # request -> (tokens, oracle state after them): _oracle_state's cache
    while engine.step():
        if found:                         # a verify row's rollback (inside this step's resolve) diverged
            return found[0]
        rec = engine.log.steps[-1]
        for a in rec.admit:
            home[a["request"]] = a["slot"]
        for b in rec.batch:
            consumed[b.request] = b.pos + b.count
        for rid in [r for r in consumed if engine.requests[r].finish_reason is not None]:
            del consumed[rid]             # finished: its slot may already belong to someone else
        for rid in sorted(consumed):
            st = engine.requests[rid]
            n = consumed[rid]
            if n > len(st.req.prompt) + len(st.output):   # an in-flight step (async, or a verify row not yet
                continue                                   # resolved) fed tokens not yet appended: check later
            if d := _check_slot(engine, oracle_model, rtol, rec.step, rid, home[rid], n, "after the step", states):
                return d
    return None


def argument_problem(args: argparse.Namespace) -> str | None:
    """The first bad argument (one line naming it), or None: TRACE a readable trace, --model a model folder, --tau,
    --device and --engine usable; only reads, before the oracle or the engine runs."""
    import oracle
    if not args.trace.is_file():
        return f"TRACE {args.trace}: no such file"
    try:
        oracle.load_trace(args.trace)
    except (ValueError, OSError) as e:
        return f"TRACE {args.trace}: not a readable trace ({e})"
    if args.model is not None and not (args.model / "config.json").is_file():
        return f"--model {args.model}: no config.json there"
    if args.tau is not None and not (math.isfinite(args.tau) and args.tau >= 0):
        return f"--tau {args.tau}: must be a finite number >= 0"
    from hybridqual.qualify.runner import prepare_device
    problem = prepare_device(args.device)
    if problem:
        return problem
    try:
        adapters.resolve(args.engine)
    except ValueError as e:
        return str(e)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridqual.replay", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--model", type=paths.model_arg, default=None,
                    help="HF-format folder or a shipped model's name (default: tiny-sort)")
    ap.add_argument("--engine", default="fastpath")
    ap.add_argument("--mode", default="legacy", choices=["legacy", "async"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tau", type=float, default=None, help="near-tie threshold (default: the engine's dtype's)")
    ap.add_argument("--no-table", action="store_true", help="skip the per-step table")
    args = ap.parse_args(argv)
    problem = argument_problem(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2

    import oracle
    from hybridqual.qualify.compare import compare_tie_aware, tau_for, top_k_for
    model_dir = args.model or next(p for p in (goldens.MODELS / "tiny-sort", goldens.MODELS / "zoo-bamba")
                                   if (p / "config.json").exists())
    trace = oracle.load_trace(args.trace)
    omodel = oracle.load(model_dir, dtype=torch.float64)
    truth = oracle.run_trace(omodel, trace, mode=args.mode)
    try:
        engine = adapters.engine(args.engine)          # the adapter with the default options
        tau = args.tau if args.tau is not None else tau_for(engine.capabilities(args.device).compute_dtype)
        adapter = engine(model_dir, trace, args.mode, args.device)
        run = adapter.run_trace()
    except Exception as e:
        print(f"engine {args.engine} failed on {args.trace}: {type(e).__name__}: {e}")
        return 1
    truth_log = truth.schedule_log.to_json()
    log = run.schedule_log.to_json() if run.schedule_log is not None else None
    if not args.no_table:
        print(f"== schedule ({'engine' if log else 'oracle — the engine keeps no log'}, mode {args.mode}) ==")
        print(step_table(log or truth_log))
    ok = True
    if log is not None:
        where = first_log_difference(log, truth_log)
        print(f"== schedule log vs oracle: {'identical' if where is None else 'DIFFERS at ' + where}")
        ok &= where is None
    step_of = {(x["request"], x["pos"]): s["step"] for s in truth_log["steps"] for x in s["sampled"]}
    print("== tokens vs oracle (tie-aware) ==")
    for req in trace.requests:
        v = compare_tie_aware(omodel, req.id, req.prompt, run.tokens.get(req.id, []), req.stop_token_ids,
                              req.max_new_tokens, tau, sampling=req.sampling,
                              top_k=top_k_for(engine.capabilities(args.device).compute_dtype))
        if v.ok and not v.near_ties:
            print(f"  {req.id}: {len(run.tokens.get(req.id, []))} tokens exact")
            continue
        for m in v.near_ties:
            print(f"  {req.id}: near tie at position {m.position}: oracle {m.oracle_token} vs engine "
                  f"{m.candidate_token}, gap {m.oracle_gap:.3g}")
        if not v.ok:
            ok = False
            f = v.failure
            if f:
                step = step_of.get((req.id, len(req.prompt) + f.position), "?")
                print(f"  {req.id}: DIVERGES at step {step}, position {f.position}: oracle token {f.oracle_token} "
                      f"(margin {f.oracle_margin:.3g}) vs engine {f.candidate_token} (oracle gap {f.oracle_gap:.3g})")
            else:
                print(f"  {req.id}: {v.note}")
    if isinstance(adapter, adapters.FastpathAdapter):
        eng = adapter.engine
        rtol = STATE_RTOL.get(eng.model.dtype, 1e-4)
        d = bisect(eng, trace, args.mode, omodel, rtol)
        print(f"== layer bisection (state rtol {rtol:g}) ==")
        print("  " + (d.describe() if d else "every request's state matches the oracle after every step"))
        ok &= d is None
    else:
        print("== layer bisection: needs the fastpath engine (state bank access) ==")
    print("REPLAY " + ("PASSED" if ok else "FOUND A DIVERGENCE"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
