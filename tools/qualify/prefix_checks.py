"""Qualification checks of a prefix cache (DESIGN §12): "cache on == cache off" and "hits, stores and evictions
as the policy predicts" — so a cache that corrupts outputs fails the first, and a silently inert one the second.

    from hybridqual.qualify.prefix_checks import prefix_cache_checks
    checks = prefix_cache_checks("my_trace", trace, oracle_model, run)   # run(trace) -> tokens (+ events)

The truth of the events is the oracle's schedule log (oracle/prefix_cache.py models the cache exactly).  A
candidate reports its events in `RunResult.prefix_cache` (tools/adapters/__init__.py): a `CacheEvents`, or its JSON form in
the schedule log's vocabulary (docs/scheduler.md §9; `CacheEvents.from_report`) built from what the engine exposes —
at the least the cached prompt tokens of every admission (vLLM's `num_cached_tokens`, SGLang's `cached_tokens`),
optionally per step the checkpoints stored and evicted as {"request", "pos"} entries.  An adapter that reports
nothing gets SKIP ("adapter reports no prefix-cache facts"), never a pass.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from hybridqual.qualify.report import SKIP, Check

NO_FACTS = "adapter reports no prefix-cache facts (RunResult.prefix_cache is None)"


@dataclass
class CacheEvents:
    """What a run's prefix cache did: cached_tokens per admitted request, stores and evictions in order."""
    cached_tokens: dict[str, int] = field(default_factory=dict)
    stored: list[tuple[str, int]] | None = None      # (request that stored, prefix length); None: not reported
    evicted: list[tuple[str, int]] | None = None     # (request that had stored it, prefix length)

    @property
    def hits(self) -> dict[str, int]:
        """Requests that started from a checkpoint, and where."""
        return {r: p for r, p in self.cached_tokens.items() if p > 0}

    @classmethod
    def from_report(cls, obj: Any, where: str = "RunResult.prefix_cache") -> "CacheEvents":
        """A CacheEvents as is, or parsed from the JSON form an adapter may return (errors name the field):
        {"admit": [{"request": id, "cached_tokens": p}, ...],                      # per admission, in order
         "steps": [{"stored": [{"request": id, "pos": p}], "evicted": [...]}, ...]} # optional: per engine step"""
        if isinstance(obj, cls):
            return obj
        if not isinstance(obj, dict):
            raise FactsError(f"{where}: expected a CacheEvents or a dict with 'admit' (and optional 'steps'), "
                             f"got {type(obj).__name__}")
        unknown = sorted(set(obj) - {"admit", "steps"})
        if unknown:
            raise FactsError(f"{where}.{unknown[0]}: unknown field (expected 'admit', 'steps')")
        admit = _list(obj.get("admit"), f"{where}.admit")
        ev = cls({}, None, None)
        for i, a in enumerate(admit):
            at = f"{where}.admit[{i}]"
            rid, p = _field(a, "request", str, at), _field(a, "cached_tokens", int, at)
            if p < 0:
                raise FactsError(f"{at}.cached_tokens: must be >= 0, got {p}")
            ev.cached_tokens[rid] = p
        if obj.get("steps") is not None:
            ev.stored, ev.evicted = [], []
            for k, st in enumerate(_list(obj["steps"], f"{where}.steps")):
                for what in ("stored", "evicted"):
                    at = f"{where}.steps[{k}].{what}"
                    items = _list(st.get(what, []) if isinstance(st, dict) else None, at)
                    getattr(ev, what).extend((_field(e, "request", str, f"{at}[{j}]"),
                                              _field(e, "pos", int, f"{at}[{j}]")) for j, e in enumerate(items))
        return ev


class FactsError(ValueError):
    """An adapter's prefix-cache report is malformed; the message starts with the field's path."""


def _list(v: Any, where: str) -> list:
    if not isinstance(v, list):
        raise FactsError(f"{where}: expected a list, got {type(v).__name__}")
    return v


def _field(obj: Any, name: str, kind: type, where: str) -> Any:
    if not isinstance(obj, dict) or name not in obj:
        raise FactsError(f"{where}.{name}: missing")
    v = obj[name]
    if not isinstance(v, kind) or isinstance(v, bool):
        raise FactsError(f"{where}.{name}: expected {kind.__name__}, got {type(v).__name__}")
    return v


def events_from_log(log: Any) -> CacheEvents:
    """CacheEvents from a schedule log (ScheduleLog or its JSON) of a run with a prefix cache."""
    obj = log.to_json() if hasattr(log, "to_json") else log
    ev = CacheEvents({}, [], [])
    for s in obj["steps"]:
        for a in s["admit"]:
            ev.cached_tokens[a["request"]] = a.get("cached_tokens", 0)
        pc = s.get("prefix_cache", {})
        ev.stored += [(e["request"], e["pos"]) for e in pc.get("stored", [])]
        ev.evicted += [(e["request"], e["pos"]) for e in pc.get("evicted", [])]
    return ev


def check_cache_on_equals_off(trace: str, on: dict[str, list[int]], off: dict[str, list[int]]) -> Check:
    """Every request's tokens with the cache on equal those with it off (a cache changes when, never what)."""
    bad = [r for r in sorted(off) if on.get(r) != off[r]]
    if not bad:
        return Check.of(trace, "prefix cache on == off", True, f"{len(off)} requests, same tokens")
    r = bad[0]
    a, b = on.get(r, []), off[r]
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return Check.of(trace, "prefix cache on == off", False,
                    f"{len(bad)} of {len(off)} requests differ; first {r!r} at output {i}: on "
                    f"{a[i] if i < len(a) else 'end'} vs off {b[i] if i < len(b) else 'end'}", requests=bad)


def check_cache_policy(trace: str, expected: CacheEvents, got: CacheEvents | None) -> Check:
    """Hits (cached_tokens per request), then stores and evictions where reported, as the policy predicts."""
    name = "prefix cache events as the policy predicts"
    if got is None:
        return Check.skip(trace, name, NO_FACTS)
    want, have = expected.hits, got.hits
    n = len(want)
    right = [r for r in want if got.cached_tokens.get(r) == want[r]]
    if n and not have:
        return Check.of(trace, name, False, f"0 of {n} expected hits: the cache never hit (requests "
                        f"{', '.join(sorted(want))}) — an inert cache", expected=n, hits=0)
    wrong = [r for r in sorted(set(want) | set(have))
             if got.cached_tokens.get(r, 0) != expected.cached_tokens.get(r, 0)]
    if wrong:
        r = wrong[0]
        return Check.of(trace, name, False, f"{len(right)} of {n} expected hits; request {r!r}: expected "
                        f"cached_tokens {expected.cached_tokens.get(r, 0)}, got {got.cached_tokens.get(r, 0)}",
                        expected=n, hits=len(right))
    for what in ("stored", "evicted"):
        g, w = getattr(got, what), getattr(expected, what)
        if g is not None and g != w:
            i = next((i for i, (x, y) in enumerate(zip(g, w)) if x != y), min(len(g), len(w)))
            return Check.of(trace, name, False, f"{n} of {n} hits right, but {what} #{i}: expected "
                            f"{w[i] if i < len(w) else 'nothing'}, got {g[i] if i < len(g) else 'nothing'}")
    extra = "" if got.stored is not None else " (stores/evictions not reported)"
    return Check.of(trace, name, True, f"{n} of {n} expected hits, {len(expected.stored or [])} stores, "
                    f"{len(expected.evicted or [])} evictions{extra}", expected=n, hits=n)


def without_cache(trace: Any) -> Any:
    """The same trace with its engine's prefix_cache field removed."""
    return dataclasses.replace(trace, engine=dataclasses.replace(trace.engine, prefix_cache=None))


def prefix_cache_checks(name: str, trace: Any, oracle_model: Any,
                        run: Callable[[Any], tuple[dict[str, list[int]], CacheEvents | None]],
                        mode: str | None = None) -> list[Check]:
    """Run the candidate (`run(trace) -> (tokens, events or None)`) with the cache on and off, the oracle with it
    on; return the two checks.  A trace without a prefix_cache field gets a SKIP."""
    from oracle.scheduler import run_trace
    if trace.engine.prefix_cache is None:
        return [Check(name, "prefix cache", SKIP, "the trace has no engine.prefix_cache")]
    truth = run_trace(oracle_model, trace, mode)
    on, events = run(trace)
    off, _ = run(without_cache(trace))
    return [check_cache_on_equals_off(name, on, off),
            check_cache_policy(name, events_from_log(truth.schedule_log), events)]


def engine_runner(engine: Any, mode: str | None = None) -> Callable[[Any], tuple[dict[str, list[int]], CacheEvents]]:
    """`run` for prefix_cache_checks from a fast-path engine factory: `engine(trace)` builds the Engine for a trace
    (the cache-off run needs an engine without a pool, so one per trace)."""
    def run(trace):
        eng = engine(trace)
        r = eng.run_trace(trace, mode)
        return r.tokens, (events_from_log(r.schedule_log) if trace.engine.prefix_cache is not None else None)
    return run


def reported_events(run: Any) -> CacheEvents | None:
    """The prefix-cache facts an adapter's RunResult reports (parsed, errors naming the field), or None."""
    facts = getattr(run, "prefix_cache", None)
    return None if facts is None else CacheEvents.from_report(facts)


def adapter_runner(adapter: Any, model_dir: Any, mode: str,
                   device: str = "cpu") -> Callable[[Any], tuple[dict[str, list[int]], CacheEvents | None]]:
    """`run` for prefix_cache_checks from any adapter class or hybridqual.adapters.Engine (a class with its options):
    tokens and its reported facts (None when the adapter reports none, so the policy check is a SKIP with that
    reason)."""
    def run(trace):
        r = adapter(model_dir, trace, mode, device).run_trace()
        return r.tokens, reported_events(r)
    return run


def qualify_check(ctx: Any) -> Check | None:
    """qualify's line for a prefix-cache trace (None for others; ctx: hybridqual.qualify.context.CheckContext): the
    adapter's reported hits, stores and evictions vs the oracle's policy replayed with the engine's own tokens on a
    math-free model, as the schedule check does (hybridqual.qualify.truth.schedule_model); outputs no schedule can
    produce (finish rule broken) fail, naming that (cache on == off is the tokens check: the truth of a
    prefix-cache trace is each request alone)."""
    from oracle.scheduler import run_trace
    from hybridqual.qualify.truth import schedule_model
    trace, run, caps = ctx.trace, ctx.run, ctx.caps
    if trace.engine.prefix_cache is None:
        return None
    got = reported_events(run)
    if got is None:
        if getattr(caps, "prefix_cache_reporting", False):
            return ctx.line(False, "the adapter declares prefix_cache_reporting but returned no "
                            "RunResult.prefix_cache")
        return ctx.skip(caps.why_not("prefix_cache_reporting", NO_FACTS))
    truth = run_trace(schedule_model(ctx.oracle_model), trace, ctx.mode, forced_tokens=dict(run.tokens))
    if truth.tokens != {r.id: run.tokens.get(r.id, []) for r in trace.requests}:
        return ctx.line(False, "the engine's outputs break the finish rule, so no schedule of the policy produces "
                        "them: its cache events cannot be judged")
    c = check_cache_policy(ctx.label, events_from_log(truth.schedule_log), got)
    return dataclasses.replace(c, name=ctx.name)
