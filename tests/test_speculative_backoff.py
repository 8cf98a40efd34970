"""Speculative backoff (DESIGN §13, `engine.speculative.backoff`): a request whose drafts keep missing proposes
nothing for 1, 2, 4, ... up to `backoff` decode steps; an accepted draft resets it. The fast path's schedule log
equals the oracle's (the policy is implemented once per side), tokens equal no speculation, and the draft
proposer keeps a paused request's draft state (its catch-up resumes where it stopped)."""
from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastpath import Engine, FastModel  # noqa: E402
from fastpath.engine.draft import DraftModel  # noqa: E402
from oracle import zoo  # noqa: E402
from oracle.model import OracleModel  # noqa: E402
from oracle.scheduler import run_trace as oracle_run  # noqa: E402
from oracle.trace import parse_trace  # noqa: E402
from hybridqual.qualify.spec_checks import log_consistency, recompute_accepted, verify_rows  # noqa: E402

ENGINE_MODEL = dict(pattern="M*", hidden_size=16, mamba_n_heads=2, mamba_n_groups=1, n_attn_heads=2, n_kv_heads=1)
K = 2
BASE = {"schema": "hybridqual.trace/1", "engine": {"max_requests": 2, "max_tokens_per_step": 24, "prefill_chunk": 16},
        "requests": [
            {"id": "a", "arrival_step": 0, "prompt": [1, 2, 3, 4, 1, 2, 3], "max_new_tokens": 24},
            {"id": "b", "arrival_step": 2, "prompt": [5, 6, 7], "max_new_tokens": 14,
             "sampling": {"kind": "seeded", "temperature": 0.9, "seed": 3}}]}


@pytest.fixture(scope="module")
def models():
    cfg = zoo.tiny_config("bamba", **ENGINE_MODEL)
    w = zoo.random_weights(cfg, seed=3)
    return OracleModel(cfg, w, dtype=torch.float64), FastModel(cfg, w, "cpu", torch.float32)


def _trace(proposer: dict | None, backoff: int = 0):
    t = json.loads(json.dumps(BASE))
    if proposer is not None:
        t["engine"]["speculative"] = {"k": K, "proposer": proposer, **({"backoff": backoff} if backoff else {})}
    return parse_trace(t)


def _wrong_everywhere(tokens: dict[str, list[int]], V: int, right_at: dict[str, set[int]] = None) -> dict:
    """Scripted proposals at every output length: the first draft wrong, except at the lengths in right_at."""
    table = {}
    for rid, toks in tokens.items():
        per = {}
        for n in range(1, len(toks)):
            good = toks[n:n + K]
            per[str(n)] = good if n in (right_at or {}).get(rid, ()) else [(good[0] + 1) % V] + good[1:]
        table[rid] = per
    return {"kind": "scripted", "proposals": table}


def _run(fast, trace, mode: str = "legacy"):
    need = max(len(r.prompt) + r.max_new_tokens for r in trace.requests)
    eng = Engine(fast.with_options(backend="torch"), trace.engine, max_len=max(32, need))
    return eng.run_trace(trace, mode), eng


def _verify_lengths(result, rid: str) -> list[int]:
    """The output lengths at which `rid` had a verify row."""
    return [v["pos"] + 1 - len(BASE["requests"][0 if rid == "a" else 1]["prompt"])
            for v in verify_rows(result.schedule_log) if v["request"] == rid]


def test_backoff_pauses_one_two_four_then_the_cap_after_misses(models):
    """Every draft wrong, cap 4: verify rows at output lengths 1, 3, 6, 11, 16, 21 (paused 1, 2, 4, 4, 4 steps;
    each step emits one token); without backoff every length verifies."""
    oracle_model, fast = models
    plain = oracle_run(oracle_model, _trace(None))
    proposer = _wrong_everywhere(plain.tokens, fast.config.vocab_size)
    off = oracle_run(oracle_model, _trace(proposer))
    assert _verify_lengths(off, "a") == list(range(1, 24))
    for mode in ("legacy", "async"):
        want = oracle_run(oracle_model, _trace(proposer, backoff=4), mode)
        got, _ = _run(fast, _trace(proposer, backoff=4), mode)
        assert _verify_lengths(want, "a") == [1, 3, 6, 11, 16, 21]
        assert _verify_lengths(want, "b") == [1, 3, 6, 11]
        assert got.schedule_log.to_json() == want.schedule_log.to_json()
        assert got.tokens == want.tokens == plain.tokens


def test_an_accepted_draft_resets_the_backoff(models):
    """Drafts right at output length 6 (a verify length after misses at 1 and 3): the run of misses ends there
    (K + 1 tokens emitted), so the pauses start again at 1 step: verify at 1, 3, 6, then 9, 11, 14, 19."""
    oracle_model, fast = models
    plain = oracle_run(oracle_model, _trace(None))
    proposer = _wrong_everywhere(plain.tokens, fast.config.vocab_size, right_at={"a": {6}})
    trace = _trace(proposer, backoff=8)
    want = oracle_run(oracle_model, trace)
    got, _ = _run(fast, trace)
    lengths = _verify_lengths(want, "a")
    accepted = {v["pos"]: v["accepted"] for v in verify_rows(want.schedule_log) if v["request"] == "a"}
    assert lengths[:3] == [1, 3, 6] and accepted[6 + 7 - 1] == K
    assert lengths[3:] == [9, 11, 14, 19]
    assert got.schedule_log.to_json() == want.schedule_log.to_json()
    assert got.tokens == plain.tokens


@pytest.mark.parametrize("proposer", [{"kind": "ngram", "min_n": 1, "max_n": 3},
                                      {"kind": "draft", "model": "goldens/models/zoo-mamba2"}], ids=["ngram", "draft"])
def test_backoff_log_equals_the_oracle_and_tokens_equal_no_speculation(models, proposer):
    oracle_model, fast = models
    plain = oracle_run(oracle_model, _trace(None))
    trace = _trace(proposer, backoff=3)
    for mode in ("legacy", "async"):
        got, _ = _run(fast, trace, mode)
        want = oracle_run(oracle_model, trace, mode)
        assert got.tokens == want.tokens == plain.tokens
        assert got.schedule_log.to_json() == want.schedule_log.to_json()
        assert log_consistency(got.schedule_log) == [] and recompute_accepted(oracle_model, trace, got) == []
    n_off = len(verify_rows(oracle_run(oracle_model, _trace(proposer)).schedule_log))
    assert 0 < len(verify_rows(want.schedule_log)) < n_off


def test_draft_state_of_a_paused_request_is_kept_and_caught_up_from_where_it_stopped(models, monkeypatch):
    """Paused steps skip the draft pass; the next pass catches each row up from the tokens its draft state covers
    (never from position 0 again), and its drafts equal the oracle's draft proposer's."""
    oracle_model, fast = models
    starts: list[tuple[str, int]] = []
    orig = DraftModel._prefill_catch_up

    def spy(self, rows, st):
        starts.extend((r.rid, s) for r, s in zip(rows, st))
        return orig(self, rows, st)
    monkeypatch.setattr(DraftModel, "_prefill_catch_up", spy)
    trace = _trace({"kind": "draft", "model": "goldens/models/zoo-mamba2"}, backoff=4)
    got, eng = _run(fast, trace)
    want = oracle_run(oracle_model, trace)
    assert got.schedule_log.to_json() == want.schedule_log.to_json()
    firsts = {}
    for rid, s in starts:
        firsts.setdefault(rid, []).append(s)
    assert all(s[0] == 0 and all(x > 0 for x in s[1:]) for s in firsts.values()), firsts
    assert any(len(s) > 2 for s in firsts.values())       # paused and resumed more than once


@pytest.mark.parametrize("proposer", [{"kind": "ngram", "min_n": 1, "max_n": 3},
                                      {"kind": "draft", "model": "goldens/models/zoo-mamba2"}], ids=["ngram", "draft"])
def test_device_drafts_with_backoff_keep_the_oracles_log(models, proposer):
    """Drafts on the device (pad_decode: the graphs' shapes, eager on CPU): a paused row is a plain decode row of
    the device step, a step of paused rows only a plain decode step; log and tokens == the oracle's."""
    oracle_model, fast = models
    fast = fast.with_options(backend="torch", spec_device_drafts=True)
    trace = _trace(proposer, backoff=2)
    plain = oracle_run(oracle_model, _trace(None))
    for mode in ("legacy", "async"):
        eng = Engine(fast, trace.engine, max_len=48, pad_decode=True)
        got = eng.run_trace(trace, mode)
        want = oracle_run(oracle_model, trace, mode)
        assert eng.spec.device_drafts.steps > 0
        assert got.tokens == want.tokens == plain.tokens
        assert got.schedule_log.to_json() == want.schedule_log.to_json()


def test_catch_up_after_a_pause_runs_through_the_draft_decode_graphs(models):
    """pad_decode (the decode graphs' shapes, eager on CPU): the catch-up after a pause of up to B steps (k + 1 + B
    new tokens at most, within catch_up_width) runs through the draft's graphs (a decode replay or one catch-up
    forward), not as a packed prefill; only each request's first pass (its prompt) is a prefill; log and tokens ==
    the oracle's."""
    oracle_model, fast = models
    trace = _trace({"kind": "draft", "model": "goldens/models/zoo-mamba2"}, backoff=4)
    eng = Engine(fast.with_options(backend="torch"), trace.engine, max_len=48, pad_decode=True)
    got = eng.run_trace(trace, "legacy")
    want = oracle_run(oracle_model, trace)
    assert got.schedule_log.to_json() == want.schedule_log.to_json() and got.tokens == want.tokens
    assert eng.spec.draft.catch_up_max == K + 1 + 4                  # k + 1 + B <= CATCH_UP_MAX: every pause
    c = eng.spec.draft.catch_ups
    assert c["prefill"] <= 2 + 1 and c["graph"] > 2 * c["prefill"], c    # prompts (+ one pass joining a prefill)


def test_catch_up_width_is_k_plus_1_plus_backoff_within_the_width_and_token_caps():
    """catch_up_width(k, B, R) = min(k+1+B, max(k+1, min(CATCH_UP_MAX, CATCH_UP_TOKENS // R))), values by hand."""
    from fastpath.engine.draft import CATCH_UP_MAX, CATCH_UP_TOKENS, catch_up_width
    assert (CATCH_UP_MAX, CATCH_UP_TOKENS) == (128, 2048)
    cases = {(2, 0, 1): 3, (2, 4, 1): 7, (2, 64, 1): 67, (2, 125, 1): 128, (2, 200, 1): 128, (2, 64, 16): 67,
             (2, 64, 64): 32, (2, 64, 256): 8, (8, 64, 1024): 9, (1, 3, 2048): 2}
    assert {key: catch_up_width(*key) for key in cases} == cases


def test_a_catch_up_longer_than_catch_up_max_is_one_packed_prefill(models, monkeypatch):
    """CATCH_UP_MAX at 16, backoff 40, one request of 44 tokens: verify at output lengths 1, 3, 6, 11, 20, 37; the
    catch-ups after the pauses of up to 8 steps (at most 16 new tokens) go through the graphs, the one after the
    16-step pause (17 new tokens) is a packed prefill (with the prompt's: 2); log == the oracle's."""
    from fastpath.engine import draft
    monkeypatch.setattr(draft, "CATCH_UP_MAX", 16)
    oracle_model, fast = models
    t = json.loads(json.dumps(BASE))
    t["requests"] = [dict(t["requests"][0], max_new_tokens=44)]
    t["engine"]["speculative"] = {"k": K, "proposer": {"kind": "draft", "model": "goldens/models/zoo-mamba2"},
                                  "backoff": 40}
    trace = parse_trace(t)
    eng = Engine(fast.with_options(backend="torch"), trace.engine, max_len=64, pad_decode=True)
    got = eng.run_trace(trace, "legacy")
    assert got.schedule_log.to_json() == oracle_run(oracle_model, trace).schedule_log.to_json()
    assert eng.spec.draft.catch_up_max == 16 and eng.spec.draft.catch_up.widths == [2, 3, 5, 9, 16]
    assert _verify_lengths(got, "a") == [1, 3, 6, 11, 20, 37]
    assert eng.spec.draft.catch_ups == {"graph": 4, "prefill": 2}


@pytest.mark.parametrize("proposer", ["wrong", {"kind": "draft", "model": "goldens/models/zoo-mamba2"}],
                         ids=["scripted_wrong", "draft"])
def test_async_overlaps_the_steps_backoff_pauses_and_verifies_the_rows_legacy_verifies(models, proposer):
    """Async: a decode-only step whose requests are all paused is followed by an overlapped step (it needs no
    resolved token: nothing is proposed), never a verify step or the step after one; the same rows verify as in
    legacy mode; each mode's log == the oracle's; tokens == no speculation."""
    oracle_model, fast = models
    plain = oracle_run(oracle_model, _trace(None))
    if proposer == "wrong":
        proposer = _wrong_everywhere(plain.tokens, fast.config.vocab_size)
    trace = _trace(proposer, backoff=8)
    runs, logs = {}, {}
    for mode in ("legacy", "async"):
        got, _ = _run(fast, trace, mode)
        assert got.schedule_log.to_json() == oracle_run(oracle_model, trace, mode).schedule_log.to_json()
        assert got.tokens == plain.tokens
        runs[mode] = got.schedule_log.to_json()["steps"]
        logs[mode] = got.schedule_log
    over = [s for s in runs["async"] if s.get("overlap")]
    assert over and all(b["kind"] in ("decode", "extra") for s in over for b in s["batch"])
    after_verify = {s["step"] + 1 for s in runs["async"] if any(b["kind"] == "verify" for b in s["batch"])}
    assert not after_verify & {s["step"] for s in over}
    verifies = {m: [(v["request"], v["pos"], v["proposals"], v["accepted"]) for v in verify_rows(logs[m])]
                for m in logs}
    assert verifies["legacy"] == verifies["async"]               # the same rows verify, whatever overlaps
    off = [s for s in oracle_run(oracle_model, _trace(proposer), "async").schedule_log.to_json()["steps"]
           if s.get("overlap")]
    assert off == []                                          # without backoff a speculative trace never overlaps
