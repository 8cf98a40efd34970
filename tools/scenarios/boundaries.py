"""Engine-aware boundary scenarios: the conditions an engine's *own* scheduler creates.

An external engine picks its own prefill pieces (Megatron rounds its budget to 64 and shortens a one-token
remainder; vLLM and SGLang cut at their block size, 16 or 64), so a corpus aimed only at our scheduler's piece
boundaries (multiples of the model's chunk) never gives it a short last piece. These scenarios sweep every
granularity in play instead: `GRANULARITIES` (16 and 64, the block sizes and budget roundings of the engines
we know) plus the model's chunk C and its prefix-cache block, and put a prompt = 1..d_conv past each, so whichever
of them the engine cuts at, its last piece has every length from 1 to d_conv; and the shapes the public 2026
reports needed (tools/mutants/zoo_reports.py cites them):

    piece_tails      last pieces 1..d_conv long (prompts 2C+1..2C+d_conv under prefill_chunk 2C), prompts = 1 mod
                     C, 16 and 64, one-token prompts co-batched and one admitted into a slot freed the step before
    cobatch_reuse    identical prompts co-batched (greedy twice, seeded with equal seeds), a freed slot reused at once
                     (LIFO) by a waiting request, a one-token prompt and a late twin of a co-batched prompt in
                     reused slots
    prefix_lru       prefix cache with capacity 2: an older entry hit after a newer store, then an eviction (store
                     order and last-use order disagree: LRU evicts the newer one), prefix hits whose suffix is
                     1 (prompt = 1 mod the block) and 2 tokens (shorter than d_conv - 1), several hits on different
                     checkpoints admitted in one step
    decode_buckets   decode-only batches of every row count from R = 8 down to 1 (a late admission between), so a
                     bucketed engine (CUDA graphs captured at 1, 2, 4, 8 rows, as ours and vLLM's) pads 7, 6, 5 and 3
                     rows; slot 0's request outlives every other, so a pad row that aliases slot 0 (or a stale slot)
                     writes the state of a live request; finishes out of row order compact with moves
    long_context     a prompt of LONG_KEYS + 76 tokens: a first piece of LONG_KEYS, then a short piece whose queries
                     see more than LONG_KEYS keys, the length where split-key attention starts (ours at 1024;
                     split-KV / flash-decoding partitions in other engines), so a merge that drops a split shows
    spec_accept      (a shipped trace, not a scenario: its scripted drafts are the target model's own greedy tokens,
                     see `spec_accept_trace`) full acceptance at every k, rejection at the last draft at every k,
                     a zero-draft step after an accepting one, with compaction in the same steps

Every request of the scenarios finishes by length, so their schedules do not depend on the model.
"""
from __future__ import annotations

from pathlib import Path

from hybridqual.scenarios.edges import small
from hybridqual.scenarios.step_rule import OURS
from hybridqual.scenarios.tails import add_rule_tails
from hybridqual.scenarios.units import ScenarioError, Skip, Tokens, Units, request, seeded, seq, trace

GRANULARITIES = (16, 64)     # block sizes / budget roundings of the engines we know (vLLM, SGLang, Megatron)
MIN_CHUNK = 4


def _small(u: Units, i: int, n: int) -> list[int]:
    """A literal prompt of n ids, distinct per i (the corpus' pattern)."""
    return seq((5 * i + 7) % 61, n, step=7)


def granularities(u: Units) -> list[int]:
    """The piece granularities the sweep covers: the model's chunk, GRANULARITIES and the engine's declared ones
    (`u.granularities`: its block size or budget rounding, Capabilities.piece_granularities), ascending, once each."""
    return sorted({u.chunk, *GRANULARITIES, *u.granularities})


def piece_tails(u: Units, tok: Tokens) -> dict:
    """Last prefill pieces of every length 1..d_conv, prompts = 1 mod every granularity, one-token prompts."""
    C, D = u.chunk, u.d_conv
    if C < MIN_CHUNK:
        raise Skip(f"chunk_size {C} < {MIN_CHUNK}: a last piece of d_conv tokens is not shorter than the chunk")
    P = 2 * C
    reqs = [request("one_a", 0, tok([9]), 2), request("one_b", 0, tok([40]), 2)]          # co-batched
    reqs += [request(f"tail{j}", j - 1, tok(_small(u, j, P + j)), 2) for j in range(1, D + 1)]
    for i, g in enumerate(granularities(u)):
        reqs.append(request(f"mod{g}", D + i, tok(_small(u, 10 + i, g + 1)), 2))
    reqs.append(request("one_late", D + len(granularities(u)), tok([23]), 2))     # into a freed slot
    obj = trace(f"Last prefill pieces of every length 1..d_conv ({D}): prompts of 2C+1..2C+{D} tokens under "
                 f"prefill_chunk {P} (pieces 2C then the rest); prompts of g+1 tokens for every granularity g in "
                 f"{granularities(u)} (the chunk, the block sizes and budget roundings engines use: whichever they "
                 "cut at, a one-token last piece); two one-token prompts co-batched with the first long prompt, and a "
                 "third admitted later into a freed slot. Length-only finishes: the schedule is model-independent.",
                 3, 4 * C + 8, P, "legacy", reqs)
    rule = u.rule or OURS
    out, shape = add_rule_tails(obj, rule, C, D, lambda i, n: tok(_small(u, i, n)), _room(u))
    if len(out["requests"]) > len(reqs):
        out["description"] += (f" Under the engine's step rule ({shape.rule}) the prompts above do not all end "
                               "with a short piece; the rtail requests (after an rfill prompt where the rule needs "
                               "one to leave a sliver of the budget) arrive into an idle engine and do.")
    return {**out, "shape": shape.to_json()}


def _room(u: Units) -> int | None:
    """The longest prompt a request of 2 new tokens may have on this model (None: no limit declared)."""
    return None if u.positions is None else u.positions - 2


def cobatch_reuse(u: Units, tok: Tokens) -> dict:
    """Identical prompts in one batch, a freed slot reused at once, twins in reused slots."""
    C = u.chunk
    same = _small(u, 3, C + 3)
    reqs = [request("same_a", 0, tok(same), 4), request("same_b", 0, tok(same), 4),
            request("same_s", 0, tok(same), 2, sampling=seeded(0.9, 5)),
            request("same_t", 1, tok(same), 3, sampling=seeded(0.9, 5)),     # waits; the first freed slot
            request("reuse_one", 1, tok([31]), 3),                           # a one-token prompt, next freed slot
            request("same_late", 2, tok(same), 4)]                           # a twin of same_a, in a reused slot
    return trace("Identical prompts co-batched: same_a and same_b (greedy) and same_s (seeded) share one prefill "
                 "step and must each give the tokens it gives alone; the waiting reuse_one (a one-token prompt), "
                 "same_t (same_s's prompt and seed) and same_late (same_a's twin) are admitted at once into the "
                 "slots the others free (LIFO), same_t and same_late co-batched again: a slot that still held its "
                 "previous owner's state, or twins that share one computation, differ. Length-only finishes.",
                 3, 3 * (C + 3), 2 * C, "legacy", reqs)


def prefix_lru(u: Units, tok: Tokens) -> dict:
    """Capacity-2 LRU with store and last-use orders that disagree; short suffixes after hits; hits in one step."""
    C, D = u.chunk, u.d_conv
    if C < MIN_CHUNK:
        raise Skip(f"chunk_size {C} < {MIN_CHUNK}: suffixes of 1..d_conv tokens are not shorter than a block")
    K = (u.rule or OURS).cache_block(C)       # the engine's cache blocks (Mamba, KV): hits land on multiples of all
    x1, x2, x3 = small(0, K), small(1, K), small(2, K)           # ids < 16: one concrete trace for every shipped model
    t = lambda i, n: small(4 + i, n)                                        # noqa: E731 - distinct tails
    reqs = [request("s1", 0, tok(x1 + t(0, 2)), 2),      # stores X1 (seq 1)
            request("s2", 2, tok(x2 + t(1, 3)), 2),      # stores X2 (seq 2, newer)
            request("h1", 4, tok(x1 + t(2, 1)), 2),      # hits X1 after the newer store; suffix 1 (= 1 mod block)
            request("s3", 6, tok(x3 + t(3, 2)), 2),      # stores X3: full, LRU evicts X2 (last used before X1)
            request("h1b", 8, tok(x1 + t(4, 2)), 2),    # hits X1 (a cache that never touched it on a hit misses)
            request("h3b", 8, tok(x3 + t(5, 1)), 2),    # hits X3 in the same step; suffix 1
            request("h2b", 8, tok(x2 + t(6, D)), 2)]    # misses (X2 was evicted), stores it again
    what = "= chunk" if K == C else "a multiple of the chunk and of the engine's cache blocks"
    return {**trace(f"Prefix cache, block {K} ({what}), capacity 2: s1 stores X1, s2 stores X2 later, h1 hits X1 "
                    "after that newer store (last use X1 > X2 while store order is X1 < X2), s3's store evicts the "
                    "least recently used, X2; then h1b and h3b hit X1 and X3 in one admission step (each must "
                    "restore its own checkpoint) and h2b misses and stores X2 again. Suffixes after a hit are 1 "
                    f"(prompt = 1 mod the block) and 2 tokens (shorter than d_conv - 1 = {D - 1}). Length-only "
                    "finishes: the schedule and the cache's hits, stores and evictions are model-independent.",
                    3, 3 * C, 2 * C, "legacy", reqs),
            "engine": {"max_requests": 3, "max_tokens_per_step": 3 * C, "prefill_chunk": 2 * C, "mode": "legacy",
                       "prefix_cache": {"block_size": K, "capacity": 2}}}


DECODE_ROWS = 8                           # max_requests: buckets 1, 2, 4, 8 pad 3, 5, 6 and 7 live rows
DECODE_LENGTHS = (16, 4, 12, 6, 10, 8, 14, 3)   # max_new_tokens of d0..d7: d0 (slot 0) last, others out of row order


def decode_buckets(u: Units, tok: Tokens) -> dict:
    """Decode-only batches of every row count 8..1, slot 0's request live to the end, a late admission between."""
    C = u.chunk
    reqs = [request(f"d{i}", 0, tok(_small(u, 20 + i, 3)), n) for i, n in enumerate(DECODE_LENGTHS)]
    reqs.append(request("late", 9, tok(_small(u, 30, 3)), 4))             # into a freed slot, then decode-only again
    return trace(f"Decode-only batches of every row count from {DECODE_ROWS} down to 1: eight 3-token prompts "
                 "admitted in one step, finishing one by one out of row order (compactions with moves), and a late "
                 "request admitted into a freed slot between; an engine that runs decode steps at bucketed sizes "
                 "(CUDA graphs at 1, 2, 4, 8 rows) pads batches of 7, 6, 5 and 3 rows, while d0, in slot 0, "
                 "outlives every other request: a pad row that writes slot 0 (a zero-filled slot table) or a stale "
                 "slot corrupts a live request. Length-only finishes: the schedule is model-independent.",
                 DECODE_ROWS, max(3 * C, 3 * DECODE_ROWS), 2 * C, "legacy", reqs)     # all 8 prompts in step 0


LONG_KEYS = 1024      # keys past which split-key attention starts (fastpath's SPLIT_MIN_KEYS; other engines' partitions)
LONG_TAIL = 76        # the second piece: short (<= 256 queries, the pieces that split) and past LONG_KEYS keys


def long_context(u: Units, tok: Tokens) -> dict:
    """One prompt past LONG_KEYS tokens in two pieces: the second's queries see more keys than one split holds."""
    C = u.chunk
    P = max(C, LONG_KEYS // C * C)
    n = P + LONG_TAIL
    if u.positions is not None and n + 2 > u.positions:
        raise Skip(f"max_position_embeddings {u.positions} < {n + 2}: no room for a prompt past {LONG_KEYS} keys")
    return trace(f"A {n}-token prompt in two pieces under prefill_chunk {P}: the second, {LONG_TAIL} tokens, attends to "
                 f"more than {LONG_KEYS} keys, where split-key attention starts (a merge that drops the split "
                 "holding a query's newest keys is wrong only there); the first piece cycles through 8 ids and the "
                 "second uses others, so the newest keys are unlike every older one; then two decode steps.",
                 1, P, P, "legacy", [request("long", 0, tok(seq(2, P, step=1, mod=8) + seq(20, LONG_TAIL, step=7)), 2)])


BOUNDARIES = {"piece_tails": ("piece_tails", piece_tails), "cobatch_reuse": ("cobatch_reuse", cobatch_reuse),
              "prefix_lru": ("prefix_cache", prefix_lru), "decode_buckets": ("decode_buckets", decode_buckets),
              "long_context": ("long_context", long_context)}


# ------------------------------------------------------------------------------- spec_accept (a shipped trace)

SPEC_MODEL = "zoo-bamba"      # the model the main job runs the shipped speculative traces on (plan.DEFAULT_TRACES)
SPEC_K = 3


def _plans(g: dict[str, list[int]]) -> dict[str, dict[int, list[int]]]:
    """The scripted drafts: per request, n generated -> drafts, from its greedy tokens g[rid] (a wrong draft is
    g + 1 mod 64 ... any id that is not the greedy one). Acceptance pattern (k = 3):
        fa: n=1 3 drafts all accepted -> n=5: 2 accepted -> n=8: 1 accepted -> n=10 zero drafts (after accepting)
            -> n=11: 3 drafts, last rejected -> n=14 zero drafts (after a rollback) -> n=15: 1 draft rejected
        rl: n=1: 2 drafts, last rejected -> n=3: 1 draft rejected -> n=4: 3 accepted -> n=8 zero -> n=9: 2 accepted
        rk: n=1: 3 drafts, last rejected -> n=4: 2 drafts, last rejected -> n=6: 1 accepted -> n=8 zero"""
    def wrong(t: int) -> int:
        return (t + 1) % 64
    out: dict[str, dict[int, list[int]]] = {}
    a = g["fa"]
    out["fa"] = {1: a[1:4], 5: a[5:7], 8: [a[8]], 11: [a[11], a[12], wrong(a[13])], 15: [wrong(a[15])]}
    b = g["rl"]
    out["rl"] = {1: [b[1], wrong(b[2])], 3: [wrong(b[3])], 4: b[4:7], 9: b[9:11]}
    c = g["rk"]
    out["rk"] = {1: [c[1], c[2], wrong(c[3])], 4: [c[4], wrong(c[5])], 6: [c[6]]}
    return out


def _spec_requests() -> list[dict]:
    """The requests of spec_accept: three verifying requests and short fillers in the rows below them, so that
    the fillers' finishes compact the verifying rows in the steps they verify."""
    return [request("f0", 0, seq(2, 3), 2), request("fa", 0, seq(30, 5), 16), request("rl", 0, seq(41, 4), 12),
            request("f1", 2, seq(7, 2), 3), request("rk", 3, seq(52, 6), 9), request("f2", 4, seq(13, 3), 2),
            request("f3", 6, seq(17, 2), 2)]


def spec_accept_trace(greedy: dict[str, list[int]]) -> dict:
    """The spec_accept trace from the target's greedy tokens per verifying request (`spec_accept_greedy`)."""
    plans = _plans(greedy)
    props = {rid: {str(n): list(d) for n, d in sorted(p.items())} for rid, p in sorted(plans.items())}
    reqs = _spec_requests()
    obj = trace("Speculative decoding, scripted drafts made from the target's own greedy tokens (k=3, model "
                f"{SPEC_MODEL}; tools/scenarios/boundaries.py): full acceptance of 3, 2 and 1 drafts, rejection at "
                "the last draft of 3, 2 and 1, zero-draft steps right after accepting steps and after a rollback; "
                "short fillers in the rows below finish in several of those steps, so rows that verify are compacted "
                "in the step they verify (one that rejected its last draft among them). Written by `python -m hybridqual.scenarios.boundaries spec_accept`.",
                4, 24, 8, "legacy", reqs)
    obj["engine"]["speculative"] = {"k": SPEC_K, "proposer": {"kind": "scripted", "proposals": props}}
    return obj


def spec_accept_greedy(model_dir: Path) -> dict[str, list[int]]:
    """Each verifying request's greedy tokens alone under the fp64 oracle on `model_dir` (the drafts' source)."""
    import oracle
    from oracle.scheduler import run_request_alone
    from oracle.trace import parse_trace
    model = oracle.load(model_dir)
    tr = parse_trace(trace("", 4, 24, 8, "legacy", _spec_requests()))
    return {r.id: run_request_alone(model, r)[0] for r in tr.requests if r.id in ("fa", "rl", "rk")}


def write_spec_accept(path: Path | None = None) -> Path:
    """goldens/traces/spec_accept.json from the shipped SPEC_MODEL's greedy tokens."""
    from oracle.trace import dump_trace, parse_trace
    from hybridqual.paths import MODELS, TRACES
    tr = parse_trace(spec_accept_trace(spec_accept_greedy(MODELS / SPEC_MODEL)))
    path = path or TRACES / "spec_accept.json"
    path.write_text(dump_trace(tr) + "\n")
    return path


# ------------------------------------------------------------------------------- spec_device (a shipped trace)

DEVICE_K, DEVICE_N = 3, (1, 2)     # ngram proposer: k drafts, n from 2 down to 1


def oldest_match(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup with the OLDEST earlier occurrence of the suffix (the rule DESIGN §13 does not take): where
    it differs from oracle.speculative.ngram_propose, an engine that searches the wrong way proposes otherwise."""
    L = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= L:
            continue
        for i in range(0, L - n):
            if tokens[i:i + n] == tokens[L - n:]:
                return list(tokens[i + n:i + n + k])
    return []


def decode_loop_verifies(trace_obj, result) -> list[dict]:
    """Every verify row of an oracle run in a step with no prefill row (where an engine may search drafts on the
    device): {step, request, history, proposals, accepted, seeded}; history = prompt + tokens before the row."""
    from oracle.schedule_log import verify_rows
    reqs = {r.id: r for r in trace_obj.requests}
    log = result.schedule_log.to_json()
    with_prefill = {s["step"] for s in log["steps"] if any(b["kind"] == "prefill" for b in s["batch"])}
    out = []
    for v in verify_rows(log):
        if v["step"] in with_prefill:
            continue
        r = reqs[v["request"]]
        full = list(r.prompt) + list(result.tokens[r.id])
        out.append({"step": v["step"], "request": r.id, "history": full[:v["pos"] + 1], "proposals": v["proposals"],
                    "accepted": v["accepted"], "seeded": r.sampling.kind == "seeded"})
    return out


def spec_device_trace(seed: int) -> dict:
    """A candidate spec_device trace: two greedy and one seeded request whose prompts repeat 1- and 2-token
    patterns with different continuations (drawn from `seed`), all prefilled in step 0, so every later step is a
    decode-loop step of ngram drafts."""
    import random
    rnd = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rnd.choice((3, 4, 5, 6, 7)) for _ in range(n)]
    reqs = [request("g0", 0, prompt(7), 16), request("s0", 0, prompt(6), 24, sampling=seeded(0.5, 11 + seed)),
            request("s1", 0, prompt(5), 24, sampling=seeded(0.8, 12 + seed))]
    obj = trace("Speculative decoding, ngram drafts in decode-loop steps (k=3, n 2..1, model "
                f"{SPEC_MODEL}; tools/scenarios/boundaries.py, candidate {seed}): all prompts prefilled in step 0, "
                "so every verify row after it is in a step without prefill (where an engine may search drafts on the "
                "device); the histories hold suffixes whose most recent and oldest earlier occurrences continue "
                "differently, and the seeded requests accept drafts there. Written by `python -m "
                "hybridqual.scenarios.boundaries spec_device`.", 3, 24, 8, "legacy", reqs)
    obj["engine"]["speculative"] = {"k": DEVICE_K, "proposer": {"kind": "ngram", "min_n": DEVICE_N[0],
                                                                "max_n": DEVICE_N[1]}}
    return obj


def spec_device_conditions(trace_obj, result) -> dict[str, int]:
    """What spec_device must reach, counted on an oracle run: decode-loop verify rows, those where the oldest
    match would propose otherwise, and seeded rows there that accept at least one draft."""
    rows = decode_loop_verifies(trace_obj, result)
    left = {r.id: r.max_new_tokens for r in trace_obj.requests}

    def room(v: dict) -> int:          # drafts are capped by the tokens the request may still emit
        return min(DEVICE_K, left[v["request"]] - (len(v["history"]) - len(trace_obj.request(v["request"]).prompt)))
    return {"decode_loop_verifies": len(rows),
            "oldest_differs": sum(oldest_match(v["history"], room(v), *DEVICE_N) != v["proposals"] for v in rows),
            "seeded_accepting": sum(v["seeded"] and v["accepted"] > 0 for v in rows)}


def write_spec_device(path: Path | None = None, tries: int = 1000) -> Path:
    """goldens/traces/spec_device.json: the first candidate whose oracle run on SPEC_MODEL reaches every condition
    (at least 2 rows where the oldest match differs and 3 accepting seeded rows, in each mode)."""
    import oracle
    from oracle.trace import dump_trace, parse_trace
    from hybridqual.paths import MODELS, TRACES
    model = oracle.load(MODELS / SPEC_MODEL)
    for seed in range(tries):
        tr = parse_trace(spec_device_trace(seed))
        got = [spec_device_conditions(tr, oracle.run_trace(model, tr, mode=m)) for m in ("legacy", "async")]
        if all(g["oldest_differs"] >= 2 and g["seeded_accepting"] >= 3 for g in got):
            path = path or TRACES / "spec_device.json"
            path.write_text(dump_trace(tr) + "\n")
            return path
    raise ScenarioError(f"spec_device: none of {tries} candidates reaches every condition on {SPEC_MODEL}")


def main(argv: list[str] | None = None) -> int:
    import sys
    args = sys.argv[1:] if argv is None else argv
    writers = {"spec_accept": write_spec_accept, "spec_device": write_spec_device}
    if len(args) != 1 or args[0] not in writers:
        print("usage: python -m hybridqual.scenarios.boundaries spec_accept|spec_device   "
              "# writes goldens/traces/<name>.json", file=sys.stderr)
        return 2
    print(f"wrote {writers[args[0]]()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

