"""Speculative decoding in the fast-path engine (DESIGN §13): verify rows as one decode-shaped forward with
per-position snapshots, rollback = a snapshot copy, against the oracle and against the engine without speculation.

Most runs use the plain-torch kernel stand-ins (the scheduling, packing and rollback code under test is the same);
one scripted trace runs the Triton kernels (interpreter on CPU)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastpath import Engine, FastModel  # noqa: E402
from oracle import zoo  # noqa: E402
from oracle.model import OracleModel  # noqa: E402
from oracle.scheduler import run_trace as oracle_run  # noqa: E402
from oracle.trace import TraceError, parse_trace  # noqa: E402
from hybridqual.qualify.spec_checks import log_consistency, recompute_accepted, verify_rows, without_speculation  # noqa: E402

ENGINE_MODEL = dict(pattern="M*", hidden_size=16, mamba_n_heads=2, mamba_n_groups=1, n_attn_heads=2, n_kv_heads=1)
K = 3
BASE = {"schema": "hybridqual.trace/1", "engine": {"max_requests": 2, "max_tokens_per_step": 24, "prefill_chunk": 16},
        "requests": [
            {"id": "a", "arrival_step": 0, "prompt": [1, 2, 3, 4, 1, 2, 3], "max_new_tokens": 9},
            {"id": "b", "arrival_step": 0, "prompt": [5, 6, 7], "max_new_tokens": 4,
             "sampling": {"kind": "seeded", "temperature": 0.9, "seed": 3}},
            {"id": "c", "arrival_step": 1, "prompt": [8, 9, 8, 9, 8], "max_new_tokens": 6}]}


@pytest.fixture(scope="module")
def models():
    cfg = zoo.tiny_config("bamba", **ENGINE_MODEL)
    w = zoo.random_weights(cfg, seed=3)
    return OracleModel(cfg, w, dtype=torch.float64), FastModel(cfg, w, "cpu", torch.float32)


def _trace(proposer: dict | None, obj: dict = BASE, k: int = K):
    t = json.loads(json.dumps(obj))
    if proposer is not None:
        t["engine"]["speculative"] = {"k": k, "proposer": proposer}
    return parse_trace(t)


def _script(tokens: dict[str, list[int]], V: int) -> dict:
    """'a': full acceptance at odd lengths, no drafts at even ones (zero-draft steps after accepting steps);
    'b': rejected at the last draft; 'c': rejected at the first draft."""
    table = {}
    for rid, toks in tokens.items():
        per = {}
        for n in range(1, len(toks)):
            good = toks[n:n + K]
            if rid == "a" and n % 2 == 1:
                per[str(n)] = good
            elif rid == "b":
                per[str(n)] = good[:-1] + [(good[-1] + 1) % V]
            elif rid == "c":
                per[str(n)] = [(good[0] + 1) % V] + good[1:]
        table[rid] = per
    return {"kind": "scripted", "proposals": table}


def _finish_once(eng: Engine) -> None:
    """Invariant of every resolve: a request finishes once (a verify row's tokens after its stop or its
    max_new_tokens are never appended, so its row is never released twice)."""
    reset = eng.reset

    def wrapped(mode=None):
        reset(mode)
        release = eng.rows.release

        def once(rows):
            assert len(set(rows)) == len(rows), f"a row finished twice in one resolve: {rows}"
            return release(rows)
        eng.rows.release = once
    eng.reset = wrapped


def _run(fast, trace, mode: str, backend: str = "torch", **kw):
    need = max(len(r.prompt) + r.max_new_tokens for r in trace.requests)
    eng = Engine(fast.with_options(backend=backend), trace.engine, max_len=max(32, need), **kw)
    _finish_once(eng)
    return eng.run_trace(trace, mode), eng


def _same_log_but_mode(a, b) -> bool:
    ja, jb = a.schedule_log.to_json(), b.schedule_log.to_json()
    strip = lambda j: [{k: v for k, v in s.items() if k != "overlap"} for s in j["steps"]]  # noqa: E731
    return strip(ja) == strip(jb)


@pytest.mark.parametrize("rows_gemv", [False, True], ids=["linear", "gemv_rows"])
def test_scripted_speculation_on_triton_equals_the_oracle_and_no_speculation(models, rows_gemv):
    """Full, partial and no acceptance on the Triton kernels; gemv_rows: the verify's k+1-row projections through
    the few-row GEMV (interpreted on CPU), as on CUDA with FastOptions.gemv_rows."""
    oracle_model, fast = models
    if rows_gemv:
        fast = fast.with_options(gemv_on_cpu=True, gemv_rows=True)
    plain = oracle_run(oracle_model, _trace(None))
    trace = _trace(_script(plain.tokens, fast.config.vocab_size))
    want = oracle_run(oracle_model, trace)
    got, _ = _run(fast, trace, "legacy", backend="triton")
    assert got.tokens == want.tokens == plain.tokens
    assert got.schedule_log.to_json() == want.schedule_log.to_json()
    accepted = [v["accepted"] for v in verify_rows(got.schedule_log)]
    assert 0 in accepted and K in accepted and K - 1 in accepted


@pytest.mark.parametrize("proposer", [None, {"kind": "ngram", "min_n": 1, "max_n": 3},
                                      {"kind": "draft", "model": "goldens/models/zoo-mamba2"}],
                         ids=["scripted", "ngram", "draft"])
def test_speculative_log_and_tokens_equal_oracle_async_equals_legacy(models, proposer):
    oracle_model, fast = models
    plain = oracle_run(oracle_model, _trace(None))
    trace = _trace(proposer or _script(plain.tokens, fast.config.vocab_size))
    results = {}
    for mode in ("legacy", "async"):
        got, _ = _run(fast, trace, mode)
        want = oracle_run(oracle_model, trace, mode)
        assert got.tokens == want.tokens == plain.tokens
        assert got.schedule_log.to_json() == want.schedule_log.to_json()
        assert log_consistency(got.schedule_log) == [] and recompute_accepted(oracle_model, trace, got) == []
        results[mode] = got
    assert verify_rows(results["legacy"].schedule_log)
    assert _same_log_but_mode(results["legacy"], results["async"])
    assert results["legacy"].tokens == results["async"].tokens


def test_engine_speculation_matches_engine_without_it(models):
    """Same engine, with and without speculation: the same tokens (not bitwise logits: a verify batch runs its
    projections over every verify position at once, plain decode over one token per row)."""
    oracle_model, fast = models
    plain, _ = _run(fast, _trace(None), "legacy")
    spec, _ = _run(fast, _trace({"kind": "ngram", "min_n": 1, "max_n": 2}), "legacy")
    assert spec.tokens == plain.tokens
    assert without_speculation(_trace({"kind": "ngram", "min_n": 1, "max_n": 2})).engine == _trace(None).engine


def _states_by_length(eng, rid: str) -> dict[int, dict]:
    """Wrap resolve: after each resolve (rollback included), the request's slot state keyed by its output length."""
    seen, original = {}, eng.resolve

    def resolve(p, inflight=None):
        original(p, inflight)
        st = eng.requests.get(rid)
        if st is not None and st.output and st.finish_reason is None:
            slot = eng.rows.row_to_slot[eng.rows.row_request.index(rid)]
            seen[len(st.output)] = eng.bank.slot_state(slot)
    eng.resolve = resolve
    return seen


def test_state_after_each_step_is_the_state_of_the_accepted_tokens(models):
    """After resolving a verify step (the accepted position's snapshot copied back where a draft was rejected) the
    slot's conv window, SSM state and KV hold exactly the prompt and every emitted token but the last: compared with
    the engine without speculation at the same output length (close, not bitwise: other GEMM shapes)."""
    oracle_model, fast = models
    solo = {**BASE, "requests": [dict(BASE["requests"][0], max_new_tokens=10)]}
    toks = oracle_run(oracle_model, _trace(None, solo)).tokens["a"]
    V = fast.config.vocab_size
    script = {"a": {"1": toks[1:4],                          # full acceptance -> 5 tokens; n = 5: no drafts
                    "6": [(toks[6] + 1) % V, 1],               # rejected at the first draft
                    "7": [toks[7], (toks[8] + 1) % V],         # rejected at the last draft
                    "9": [toks[9]]}}                           # max_new_tokens reached at the draft
    states = {}
    for name, proposer in (("plain", None), ("spec", {"kind": "scripted", "proposals": script})):
        trace = _trace(proposer, solo)
        eng = Engine(fast.with_options(backend="torch"), trace.engine, max_len=24)
        states[name] = _states_by_length(eng, "a")
        assert eng.run_trace(trace).tokens["a"] == toks
    common = sorted(set(states["plain"]) & set(states["spec"]))
    assert {5, 6, 7, 9} <= set(common), common          # after full accept, zero drafts, rejections
    for n in common:
        p, s = states["plain"][n], states["spec"][n]
        kv = len(solo["requests"][0]["prompt"]) + n - 1   # positions [0, kv) hold valid K/V
        for key in ("conv", "ssm"):
            assert torch.allclose(p[key], s[key], atol=1e-5, rtol=1e-4), (n, key, (p[key] - s[key]).abs().max())
        for key in ("k", "v"):
            assert torch.allclose(p[key][:, :kv], s[key][:, :kv], atol=1e-5, rtol=1e-4), (n, key)


def test_compaction_while_rows_are_in_verify(models):
    """Rows finish out of order while others verify: compaction moves verify rows, their slots keep the state."""
    oracle_model, fast = models
    obj = {**BASE, "engine": dict(BASE["engine"], max_requests=3, max_tokens_per_step=24)}
    plain = oracle_run(oracle_model, _trace(None, obj))
    trace = _trace(_script(plain.tokens, fast.config.vocab_size), obj)
    got, _ = _run(fast, trace, "legacy")
    assert got.tokens == plain.tokens
    assert got.schedule_log.to_json() == oracle_run(oracle_model, trace).schedule_log.to_json()
    moved = {m["request"] for s in got.schedule_log.steps for m in s.moves}
    verifying_after_move = any(b.kind == "verify" and b.request in moved for s in got.schedule_log.steps
                               for b in s.batch)
    assert moved and verifying_after_move


def test_verify_rows_and_prefill_pieces_share_the_budget(models):
    """A verify row costs m+1 tokens: the prefill piece admitted in the same step gets what is left."""
    oracle_model, fast = models
    obj = {**BASE, "engine": dict(BASE["engine"], max_requests=2, max_tokens_per_step=18, prefill_chunk=16),
           "requests": [dict(BASE["requests"][0], max_new_tokens=6),
                        dict(BASE["requests"][2], arrival_step=1, prompt=list(range(10, 30)))]}
    toks = oracle_run(oracle_model, _trace(None, obj)).tokens
    trace = _trace({"kind": "scripted", "proposals": {"a": {"1": toks["a"][1:4]}}}, obj)
    got, _ = _run(fast, trace, "legacy")
    assert got.tokens == toks
    step = next(s for s in got.schedule_log.steps if any(b.kind == "verify" for b in s.batch))
    assert sum(b.count for b in step.batch) <= 18 and any(b.kind == "prefill" for b in step.batch)
    assert [b.count for b in step.batch if b.kind == "prefill"] == [8]     # 18 - 4 = 14 left: one chunk, not two
    assert got.schedule_log.to_json() == oracle_run(oracle_model, trace).schedule_log.to_json()


def test_engine_rejects_bad_speculative_configs(models):
    _, fast = models
    with pytest.raises(TraceError) as e:
        Engine(fast, _trace({"kind": "ngram", "min_n": 1, "max_n": 2}, k=3).engine, max_len=3)
    assert e.value.field == "engine.speculative.k"
    with pytest.raises(TraceError) as e:
        Engine(fast, _trace({"kind": "draft", "model": "goldens/models/tiny-sort"}).engine, max_len=24)
    assert e.value.field == "engine.speculative.proposer.model"
    with pytest.raises(TraceError) as e:                                       # 2 rows x (12+1) > 24
        Engine(fast, _trace({"kind": "ngram", "min_n": 1, "max_n": 2}, k=12).engine, max_len=24)
    assert e.value.field == "engine.speculative.k"
    with pytest.raises(TraceError) as e:
        Engine(fast, _trace({"kind": "scripted", "proposals": {"a": {"1": [7, 960]}}}).engine, max_len=24)
    assert e.value.field == "engine.speculative.proposer.proposals.a.1[1]"
    eng = Engine(fast, _trace(None).engine, max_len=24)
    with pytest.raises(TraceError) as e:
        eng.run_trace(_trace({"kind": "ngram", "min_n": 1, "max_n": 2}))
    assert e.value.field == "engine"


TRACES = Path(__file__).parent.parent / "goldens" / "traces"
SPEC_TRACES = sorted(p.stem for p in TRACES.glob("spec_*.json"))


@pytest.mark.parametrize("name", SPEC_TRACES)
def test_corpus_spec_traces_on_the_torch_stand_ins_equal_the_oracle(models, name):
    """Every shipped speculative trace (stop inside accepted drafts, max_new_tokens at a draft, zero-draft steps
    after accepting ones, async, compaction, each proposer): log and tokens == the oracle's in both modes."""
    from oracle.trace import load_trace
    oracle_model, fast = models
    trace = load_trace(TRACES / f"{name}.json")
    for mode in ("legacy", "async"):
        got, _ = _run(fast, trace, mode)
        want = oracle_run(oracle_model, trace, mode)
        assert got.tokens == want.tokens and got.finish_reasons == want.finish_reasons
        assert got.schedule_log.to_json() == want.schedule_log.to_json(), mode


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", SPEC_TRACES)
def test_gpu_bf16_graphs_speculative_equals_non_speculative(name):
    """bf16 with CUDA graphs (decode-only steps and greedy verify steps replay graphs): async == legacy bitwise with
    speculation; speculative and plain tokens both track the oracle tie-aware; acceptance consistent."""
    from oracle.trace import load_trace
    from hybridqual.qualify.compare import TAU, compare_tie_aware
    cfg = zoo.tiny_config("bamba", **ENGINE_MODEL)
    w = zoo.random_weights(cfg, seed=3)
    oracle_model, fast = OracleModel(cfg, w, dtype=torch.float64), FastModel(cfg, w, "cuda", torch.bfloat16)
    trace = load_trace(TRACES / f"{name}.json")
    eng = Engine(fast, trace.engine, max_len=64, graphs=True)
    legacy, async_ = eng.run_trace(trace, "legacy"), eng.run_trace(trace, "async")
    assert legacy.tokens == async_.tokens and _same_log_but_mode(legacy, async_)
    assert log_consistency(legacy.schedule_log) == []
    plain_trace = without_speculation(trace)
    plain = Engine(fast, plain_trace.engine, max_len=64, graphs=True).run_trace(plain_trace, "legacy")
    for got in (legacy, plain):
        for req in trace.requests:
            if req.sampling.kind == "greedy":
                v = compare_tie_aware(oracle_model, req.id, req.prompt, got.tokens[req.id], req.stop_token_ids,
                                      req.max_new_tokens, TAU[torch.bfloat16])
                assert v.ok, f"{req.id}: {v.failure} {v.note}"
    want = oracle_run(oracle_model, trace, "legacy")
    if legacy.tokens == want.tokens:
        assert legacy.schedule_log.to_json() == want.schedule_log.to_json()


def test_speculation_composes_with_the_prefix_cache(models):
    """A trace with both engine.speculative and engine.prefix_cache: hits, stores, verify rows; log and tokens ==
    the oracle's (which models both exactly), tokens == no speculation and no cache."""
    oracle_model, fast = models
    shared = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]
    obj = {"schema": "hybridqual.trace/1",
           "engine": {"max_requests": 2, "max_tokens_per_step": 24, "prefill_chunk": 16,
                      "prefix_cache": {"block_size": 8, "capacity": 2}},
           "requests": [{"id": "p0", "arrival_step": 0, "prompt": shared + [1, 2], "max_new_tokens": 6},
                        {"id": "p1", "arrival_step": 3, "prompt": shared + [4], "max_new_tokens": 6}]}
    plain = oracle_run(oracle_model, _trace(None, {**obj, "engine": {k: v for k, v in obj["engine"].items()
                                                                     if k != "prefix_cache"}})).tokens
    trace = _trace({"kind": "ngram", "min_n": 1, "max_n": 2}, obj)
    for mode in ("legacy", "async"):
        got, _ = _run(fast, trace, mode)
        want = oracle_run(oracle_model, trace, mode)
        assert got.tokens == want.tokens == plain
        assert got.schedule_log.to_json() == want.schedule_log.to_json()
    j = got.schedule_log.to_json()
    assert any(s["prefix_cache"]["hits"] for s in j["steps"])


@st.composite
def scripted(draw):
    """A trace over BASE's requests with random scripted proposals: each (request, n) entry is either the true
    next tokens with one optional corruption, or random tokens, or absent."""
    k = draw(st.integers(1, 4))
    table = {}
    for rid, n_max in (("a", 9), ("b", 4), ("c", 6)):
        per = {}
        for n in range(1, n_max):
            kind = draw(st.sampled_from(["none", "true", "corrupt", "random"]))
            if kind != "none":
                per[str(n)] = [kind, draw(st.integers(1, k)), draw(st.integers(0, k - 1)),
                               draw(st.lists(st.integers(0, 95), min_size=k, max_size=k))]
        table[rid] = per
    return k, table


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scripted())
def test_generated_scripted_proposals_keep_tokens_and_follow_the_oracle(models, spec):
    oracle_model, fast = models
    k, table = spec
    obj = {**BASE, "engine": dict(BASE["engine"], max_tokens_per_step=max(24, 2 * (k + 1) + 8))}
    plain = oracle_run(oracle_model, _trace(None, obj)).tokens
    V = fast.config.vocab_size
    props = {}
    for rid, per in table.items():
        props[rid] = {}
        for n, (kind, m, bad, rnd) in per.items():
            true = plain[rid][int(n):int(n) + m] or [0]
            if kind == "true":
                props[rid][n] = true
            elif kind == "corrupt":
                props[rid][n] = [(t + 1) % V if i == min(bad, len(true) - 1) else t for i, t in enumerate(true)]
            else:
                props[rid][n] = rnd[:m]
    trace = _trace({"kind": "scripted", "proposals": props}, obj, k=k)
    got, _ = _run(fast, trace, "legacy")
    want = oracle_run(oracle_model, trace, "legacy")
    assert got.tokens == want.tokens == plain
    assert got.schedule_log.to_json() == want.schedule_log.to_json()
    assert log_consistency(got.schedule_log) == []


def test_padded_graph_decode_steps_between_verify_steps(models):
    """pad_decode=True (the CUDA-graph bucket shapes, eager on CPU): zero-draft steps take the decode-graph path,
    verify steps the verify buckets; tokens and log == the oracle's."""
    oracle_model, fast = models
    greedy = {**BASE, "requests": [r for r in BASE["requests"] if "sampling" not in r]}
    plain = oracle_run(oracle_model, _trace(None, greedy))
    t, V = plain.tokens, fast.config.vocab_size
    trace = _trace({"kind": "scripted", "proposals": {"a": {"1": t["a"][1:4], "6": [(t["a"][6] + 1) % V]},
                                                      "c": {"2": t["c"][2:4]}}}, greedy)
    got, eng = _run(fast, trace, "legacy", pad_decode=True)
    assert eng.graphs is not None
    assert got.tokens == plain.tokens
    assert got.schedule_log.to_json() == oracle_run(oracle_model, trace).schedule_log.to_json()
    kinds = [{b.kind for b in s.batch} for s in got.schedule_log.steps]
    assert any("verify" in k for k in kinds) and any(k == {"decode"} for k in kinds)


def test_every_speculative_forward_packs_through_the_engines_step_packer(models, monkeypatch):
    """The prefill pieces of verify steps and the draft passes build their chunk table in the engine's one packer
    (fastpath/engine/packing.py), slots checked against the bank they run on: no twin of the builder (verify
    batches themselves are decode-shaped: no chunk table)."""
    import fastpath.engine.ops as ops
    from fastpath.engine import draft, packing, speculative
    oracle_model, fast = models
    calls, real = [], ops.ssd_chunk_table
    monkeypatch.setattr(ops, "ssd_chunk_table", lambda cu, starts, C, dev, slot=None, n_slots=None, **kw:
                        calls.append((tuple(slot or ()), n_slots)) or real(cu, starts, C, dev, slot, n_slots, **kw))
    for module in (speculative, draft):                                         # no builder of their own
        assert "ssd_chunk_table" not in Path(module.__file__).read_text()
    packed, real_pack = [], packing.pack_step
    monkeypatch.setattr(packing, "pack_step", lambda *a, **k: packed.append(a[-1]) or real_pack(*a, **k))
    plain = oracle_run(oracle_model, _trace(None))
    for proposer in (_script(plain.tokens, fast.config.vocab_size), {"kind": "draft", "model":
                                                                     "goldens/models/zoo-mamba2"}):
        got, eng = _run(fast, _trace(proposer), "legacy")
        assert got.tokens == plain.tokens
    assert packed and calls and all(slots and n is not None for slots, n in calls)
