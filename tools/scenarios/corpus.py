"""The shipped corpus (goldens/traces/*.json) as scenarios in a model's units.

Engine limits are written in chunks of C = chunk_size (prefill_chunk 2C, budget 2C+4 or 3C, ...); with C = 8 (every
shipped model) each builder gives exactly the shipped trace, description included, so the shipped goldens match
by trace sha256 (tests/test_scenarios.py checks it). Prompt lengths that decide chunking are affine in C too
(the long prompt of chunked_prefill is 5C+5 tokens); short prompts (shorter than every C >= 4) stay as they are.
"""
from __future__ import annotations

from hybridqual.scenarios import task
from hybridqual.scenarios import task_traces
from hybridqual.scenarios.units import Tokens, Units, request, seeded, seq, trace


def seed_compaction(u: Units, tok: Tokens) -> dict:
    """Staggered arrivals and length-only finishes: three compactions with moves (hand table in the tests)."""
    C = u.chunk
    return trace(
        "Seed validation scenario: staggered arrivals (steps 0,1,2,3,5), length-only finishes in the order r1, r0, "
        "{r3,r4}, r2: three compactions with moves (one with two simultaneous frees), r3 and r4 wait for a slot. "
        "Schedule is model-independent (hand-derived table in tests/test_scheduler_seed_scenario.py).",
        3, 2 * C + 4, 2 * C, "legacy",
        [request("r0", 0, tok([2, 5, 8]), 6), request("r1", 1, tok([3, 6, 9, 12]), 3),
         request("r2", 2, tok([4, 7]), 8), request("r3", 3, tok([5, 8, 11]), 4), request("r4", 5, tok([6, 9]), 2)])


def async_drain(u: Units, tok: Tokens) -> dict:
    """Async overlap, compaction of pending outputs, then a drain before an admission."""
    C = u.chunk
    return trace(
        "Async overlap then drain: a finishes during decode-only steps, so b moves row 1 -> 0 while step 2 is in "
        "flight (pending outputs compacted); c arrives at step 4, the engine drains the in-flight step, and c gets "
        "slot 1 that the drained step just wrote. Length-only finishes: the schedule is model-independent (hand "
        "table in tests/test_scheduler_async_drain.py).",
        2, 2 * C + 4, 2 * C, "async",
        [request("a", 0, tok([10, 20]), 2), request("b", 0, tok([11, 21]), 4, sampling=seeded(0.9, 5)),
         request("c", 4, tok([12, 22, 32]), 2)])


def chunked_prefill(u: Units, tok: Tokens) -> dict:
    """A prompt longer than budget and prefill_chunk, split into chunk-aligned pieces while another decodes."""
    C = u.chunk
    B, P, n_long, n_late = 2 * C + 4, 2 * C, 5 * C + 5, 2 * C + 3
    return trace(
        f"A {n_long}-token prompt longer than the budget ({B}) and prefill_chunk ({P}) is split into chunk-aligned "
        f"pieces while a short request decodes; a {n_late}-token prompt arrives later and waits for a slot.",
        2, B, P, "legacy",
        [request("long", 0, tok(seq(12, n_long)), 4), request("short", 0, tok(seq(13, 3)), 8),
         request("late", 3, tok(seq(14, n_late)), 3)])


def seeded_sampling(u: Units, tok: Tokens) -> dict:
    """Seeded stochastic sampling mixed with greedy, equal seeds on different prompts, async."""
    C = u.chunk
    return trace(
        "Seeded stochastic sampling mixed with greedy; equal seeds on different prompts, async mode.",
        3, 3 * C, 2 * C, "async",
        [request("g0", 0, tok(seq(42, 4)), 8), request("t0", 0, tok(seq(42, 4)), 8, sampling=seeded(0.8, 7)),
         request("t1", 1, tok(seq(43, 6)), 10, sampling=seeded(1.5, 7)),
         request("t2", 3, tok(seq(44, 2)), 6, tok.stops([0]), seeded(1.0, 123456789))])


def slot_exhaustion(u: Units, tok: Tokens) -> dict:
    """More requests than slots: waiting, LIFO reuse of freed slots."""
    C = u.chunk
    return trace(
        "Two slots, six requests arriving at steps 0,0,0,1,1,4: requests wait for slots, freed slots are reused LIFO.",
        2, 3 * C, 2 * C, "legacy",
        [request("a", 0, tok(seq(22, 5)), 3), request("b", 0, tok(seq(23, 2)), 5), request("c", 0, tok(seq(24, 4)), 2),
         request("d", 1, tok(seq(25, 6)), 4), request("e", 1, tok(seq(26, 1)), 1), request("f", 4, tok(seq(27, 3)), 3)])


EVERY_ID_MAX_VOCAB = 1024   # up to this vocab a request may list every id as a stop token (a stop at step 1 certain)


def stop_tokens(u: Units, tok: Tokens) -> dict:
    """Requests finish on a sampled stop token (appended) or by length, async; on a small vocab one request lists
    every id as a stop token with max_new_tokens 1, so its stop falls on its last allowed step ('stop', not
    'length')."""
    C = u.chunk
    if tok.folding:
        many, few, what = u.ordinary[0::2], u.ordinary[1::2][:8], "every other ordinary id of the vocab"
    else:
        many, few, what = tok.stops(range(0, 64, 2)), tok.stops(range(1, 16, 2)), "every even id < 64"
    reqs = [request("s0", 0, tok(seq(32, 4)), 12, many), request("s1", 0, tok(seq(33, 6)), 12, many),
            request("s2", 2, tok(seq(34, 3)), 12, many), request("s3", 4, tok(seq(35, 5)), 12, few)]
    last = ""
    if u.vocab <= EVERY_ID_MAX_VOCAB:
        reqs.append(request("s4", 1, tok(seq(36, 3)), 1, list(range(u.vocab))))
        last = "; s4 stops on its only allowed step (every id a stop token)"
    return trace(
        f"Stop tokens ({what}): requests finish on a sampled stop token (appended) or by length, in async "
        f"mode{last}.", 3, 3 * C, 2 * C, "async", reqs)


def _task(name: str, R: int, B: int, P: int, description: str, u: Units, tok: Tokens) -> dict:
    """A trace of the trained model's sorting task (tools/scenarios/task_traces.py) with the engine in units of C."""
    _, arrivals, _ = task_traces.SPECS[name]
    stop = [u.eos] if u.eos is not None else tok([task.EOS])
    reqs = [request(f"q{i}", a, tok(ex.prompt), len(ex.answer) + 2, stop)
            for i, (a, ex) in enumerate(zip(arrivals, task.heldout(len(arrivals))))]
    return trace(description, R, B, P, "legacy", reqs)


def task_staggered(u: Units, tok: Tokens) -> dict:
    """Sorting prompts, 3 slots for 6 staggered requests, EOS stops (tools/scenarios/task_traces.py)."""
    C = u.chunk
    P = 2 * C
    chunking = (f"chunked prefill: prefill_chunk {P} < prompt" if P < 18 else
                f"prefill_chunk {P} >= prompt: one piece each")
    return _task("task_staggered", 3, 3 * C, P,
                 f"Sorting prompts of 18-22 tokens ({chunking}), 3 slots for 6 staggered requests (bank exhaustion), "
                 "EOS stop tokens, answers of different lengths (compactions with moves).", u, tok)


def task_burst(u: Units, tok: Tokens) -> dict:
    """Four sorting requests at once under a tight budget, one late arrival (tools/scenarios/task_traces.py)."""
    C = u.chunk
    B = C + 4
    pieces = ("prefill pieces of one chunk while others decode" if C < 18 else
              f"prompts shorter than one chunk ({C}) are prefilled whole")
    return _task("task_burst", 4, B, C,
                 f"Four requests at once under a {B}-token budget: {pieces}; one late arrival waits for a freed slot "
                 "(LIFO reuse of a just-freed slot).", u, tok)


def _short_task(R: int, B: int, P: int, arrivals: list[int], digits: int, description: str, u: Units,
                tok: Tokens) -> dict:
    """Sorting prompts cut to their first `digits` digits (answers recomputed by task_traces.answer_for): the task
    families' shapes with fewer requests, for the main job's time budget. `digits` stays within the trained range
    (task.MIN_DIGITS..MAX_DIGITS), so the trained model solves them and the task-accuracy check is a real check."""
    stop = [u.eos] if u.eos is not None else tok([task.EOS])
    reqs = []
    for i, (a, ex) in enumerate(zip(arrivals, task.heldout(len(arrivals)))):
        prompt = (task.BOS, *ex.prompt[1:1 + digits], task.SEP)
        reqs.append(request(f"q{i}", a, tok(prompt), len(task_traces.answer_for(prompt)) + 2, stop))
    return trace(description, R, B, P, "legacy", reqs)


def task_burst_short(u: Units, tok: Tokens) -> dict:
    """task_burst's shape, short: three 16-digit sorting prompts at once under budget C+4, one late arrival."""
    C = u.chunk
    return _short_task(3, C + 4, C, [0, 0, 0, 2], task.MIN_DIGITS,
                       f"Short task burst: three 18-token sorting prompts (16 digits) at once under a {C + 4}-token "
                       f"budget with prefill_chunk {C}, so prefills wait or are split while others decode; a late "
                       "arrival waits for a freed slot (LIFO reuse). EOS stop tokens.", u, tok)


def task_staggered_short(u: Units, tok: Tokens) -> dict:
    """task_staggered's shape, short: 2 slots for 4 staggered 16-digit sorting prompts, prefill_chunk C."""
    C = u.chunk
    return _short_task(2, 2 * C, C, [0, 1, 3, 4], task.MIN_DIGITS,
                       f"Short staggered task: 18-token sorting prompts (16 digits; prefill_chunk {C}), 2 slots for 4 "
                       "staggered requests (bank exhaustion), EOS stop tokens, compactions.", u, tok)


# name -> (family, builder); the family of a shipped scenario is its own name, short variants join it.
CORPUS = {f.__name__: (f.__name__, f) for f in (
    seed_compaction, async_drain, chunked_prefill, seeded_sampling, slot_exhaustion, stop_tokens, task_burst,
    task_staggered)}
CORPUS.update({"task_burst_short": ("task_burst", task_burst_short),
               "task_staggered_short": ("task_staggered", task_staggered_short)})
