"""The truth of speculative decoding (DESIGN §13) in the oracle scheduler: tokens identical to no speculation,
acceptance recomputable from the logged proposals, the ngram rule, and bad input named by field."""
from __future__ import annotations

import dataclasses
import json

import pytest

from oracle import zoo
from oracle.schedule_log import canonical_json
from oracle.scheduler import run_trace
from oracle.speculative import accepted_count, ngram_propose, proposal_room
from oracle.trace import TraceError, parse_trace
from test_scheduler_fake import FakeModel
from hybridqual.goldens import regen as goldens
from hybridqual.qualify.spec_checks import log_consistency, recompute_accepted, verify_rows, without_speculation

K = 4
BASE = {"schema": "hybridqual.trace/1", "engine": {"max_requests": 3, "max_tokens_per_step": 32, "prefill_chunk": 16},
        "requests": [
            {"id": "full", "arrival_step": 0, "prompt": [1, 2, 3, 4], "max_new_tokens": 14},
            {"id": "first", "arrival_step": 0, "prompt": [5, 6, 7], "max_new_tokens": 9},
            {"id": "last", "arrival_step": 1, "prompt": [8, 9], "max_new_tokens": 11,
             "sampling": {"kind": "seeded", "temperature": 0.8, "seed": 11}},
            {"id": "mid", "arrival_step": 2, "prompt": [3, 1, 4, 1, 5], "max_new_tokens": 7,
             "sampling": {"kind": "seeded", "temperature": 1.3, "seed": 5}}]}


def _trace(obj: dict, proposer: dict | None, k: int = K, **engine):
    t = json.loads(json.dumps(obj))
    t["engine"].update(engine)
    if proposer is not None:
        t["engine"]["speculative"] = {"k": k, "proposer": proposer}
    return parse_trace(t)


def _plain(model, obj: dict) -> dict[str, list[int]]:
    return run_trace(model, _trace(obj, None)).tokens


def _wrong(t: int, V: int) -> int:
    return (t + 1) % V


def _script(plain: dict[str, list[int]], V: int) -> dict:
    """Proposals at every output length: 'full' always right (full acceptance, then the bonus), 'first' wrong at
    the first draft, 'last' wrong at the last, 'mid' right twice then wrong; 'full' also gets zero-draft steps."""
    out: dict[str, dict[str, list[int]]] = {}
    for rid, toks in plain.items():
        per = {}
        for n in range(1, len(toks)):
            good = list(toks[n:n + K])
            if rid == "full":
                props = good if n % 2 == 1 else []          # accepting steps, then steps with no drafts
            elif rid == "first":
                props = [_wrong(toks[n], V)] + good[1:]
            elif rid == "last":
                props = good[:-1] + [_wrong(good[-1], V)] if len(good) > 1 else [_wrong(good[0], V)]
            else:
                props = good[:2] + [_wrong(good[2], V)] + good[3:] if len(good) > 2 else good
            if props:
                per[str(n)] = props
        out[rid] = per
    return {"kind": "scripted", "proposals": out}


@pytest.fixture(scope="module")
def bamba():
    return zoo.build("bamba", seed=0)


@pytest.mark.parametrize("mode", ["legacy", "async"])
def test_scripted_speculation_gives_the_non_speculative_tokens(bamba, mode):
    plain = _plain(bamba, BASE)
    trace = _trace(BASE, _script(plain, bamba.config.vocab_size))
    got = run_trace(bamba, trace, mode)
    assert got.tokens == plain
    assert log_consistency(got.schedule_log) == []
    assert recompute_accepted(bamba, trace, got) == []
    rows = verify_rows(got.schedule_log)
    by = {rid: [v["accepted"] for v in rows if v["request"] == rid] for rid in plain}
    assert by["first"] and set(by["first"]) == {0}                       # rejected at the first draft
    assert by["full"] and all(a == len(v["proposals"]) for v in rows if v["request"] == "full" for a in [v["accepted"]])
    assert any(a == 3 for a in by["last"])                                # rejected at the last of 4
    assert 2 in by["mid"]
    assert not any(s.overlap for s in got.schedule_log.steps)             # speculative steps never overlap


def test_zero_draft_steps_follow_accepting_steps_and_are_plain_decode_rows(bamba):
    plain = _plain(bamba, BASE)
    trace = _trace(BASE, _script(plain, bamba.config.vocab_size))
    got = run_trace(bamba, trace)
    asyn = run_trace(bamba, trace, "async")            # decode-only zero-draft steps still never overlap
    assert not any(s.overlap for s in asyn.schedule_log.steps)
    assert asyn.schedule_log.to_json()["steps"] == got.schedule_log.to_json()["steps"]
    solo = {**BASE, "requests": [BASE["requests"][0]]}   # one verify step, then only zero-draft decode steps
    one = _trace(solo, {"kind": "scripted", "proposals": {"full": {"1": plain["full"][1:3]}}})
    a_log, l_log = run_trace(bamba, one, "async").schedule_log, run_trace(bamba, one, "legacy").schedule_log
    assert not any(s.overlap for s in a_log.steps) and a_log.to_json()["steps"] == l_log.to_json()["steps"]
    kinds = [next((b.kind for b in s.batch if b.request == "full"), None) for s in got.schedule_log.steps]
    pairs = [(a, b) for a, b in zip(kinds, kinds[1:]) if a == "verify" and b == "decode"]
    assert pairs, kinds
    for s in got.schedule_log.steps:
        for b in s.batch:
            assert (b.kind == "verify") == (b.proposals is not None)
            assert b.count == (len(b.proposals) + 1 if b.kind == "verify" else b.count)


def test_stop_token_inside_accepted_drafts_cuts_the_emitted_list(bamba):
    long = {**BASE, "requests": [dict(BASE["requests"][0], max_new_tokens=10)]}
    toks = _plain(bamba, long)["full"]
    j = next(i for i in range(2, len(toks)) if toks[i] not in toks[:i])
    stopped = {**BASE, "requests": [dict(BASE["requests"][0], max_new_tokens=10, stop_token_ids=[toks[j]])]}
    want = run_trace(bamba, _trace(stopped, None))
    assert want.finish_reasons["full"] == "stop" and want.tokens["full"] == toks[:j + 1]
    proposer = {"kind": "scripted", "proposals": {"full": {"1": toks[1:1 + K]}}}   # covers position j (j <= 4)
    assert 1 < j < 1 + K
    got = run_trace(bamba, _trace(stopped, proposer))
    assert got.tokens == want.tokens and got.finish_reasons == want.finish_reasons
    (v,) = verify_rows(got.schedule_log)
    assert v["accepted"] == K and v["emitted"] == toks[1:j + 1]          # accepted past the stop, emitted cut at it
    assert log_consistency(got.schedule_log) == []


def test_max_new_tokens_reached_mid_draft_ends_the_request_there(bamba):
    short = {**BASE, "requests": [dict(BASE["requests"][0], max_new_tokens=3)]}
    long = {**BASE, "requests": [dict(BASE["requests"][0], max_new_tokens=9)]}
    toks = _plain(bamba, long)["full"]
    got = run_trace(bamba, _trace(short, {"kind": "scripted", "proposals": {"full": {"1": toks[1:5]}}}))
    assert got.tokens["full"] == toks[:3] and got.finish_reasons["full"] == "length"
    (v,) = verify_rows(got.schedule_log)
    assert v["proposals"] == toks[1:3] and v["accepted"] == 2 and v["emitted"] == toks[1:3]   # bonus cut
    assert proposal_room(K, 3, 1) == 2


@pytest.mark.parametrize("proposer", [{"kind": "ngram", "min_n": 1, "max_n": 3},
                                      {"kind": "draft", "model": "goldens/models/zoo-mamba2"}], ids=["ngram", "draft"])
def test_ngram_and_draft_proposers_keep_the_tokens(bamba, proposer):
    rep = {**BASE, "requests": [dict(r, prompt=[3, 4, 5, 3, 4, 5, 3, 4]) for r in BASE["requests"]]}
    plain = _plain(bamba, rep)
    for mode in ("legacy", "async"):
        trace = _trace(rep, proposer)
        got = run_trace(bamba, trace, mode)
        assert got.tokens == plain
        assert verify_rows(got.schedule_log)
        assert log_consistency(got.schedule_log) == [] and recompute_accepted(bamba, trace, got) == []


def test_a_draft_equal_to_the_target_has_every_greedy_draft_accepted():
    model = goldens.MODELS / "zoo-mamba2"
    import oracle
    m = oracle.load(model)
    greedy = {**BASE, "requests": [BASE["requests"][0]]}
    got = run_trace(m, _trace(greedy, {"kind": "draft", "model": str(model)}))
    rows = verify_rows(got.schedule_log)
    assert rows and all(v["accepted"] == len(v["proposals"]) for v in rows)
    assert got.tokens == _plain(m, greedy)


def test_fake_model_speculation_is_token_invariant_in_both_modes():
    fake = FakeModel(vocab_size=32, chunk_size=4, seed=1)
    plain = _plain(fake, BASE)
    trace = _trace(BASE, _script(plain, 32))
    for mode in ("legacy", "async"):
        assert run_trace(fake, trace, mode).tokens == plain


def test_checks_catch_a_wrong_accepted_count_and_a_wrong_token(bamba):
    plain = _plain(bamba, BASE)
    trace = _trace(BASE, _script(plain, bamba.config.vocab_size))
    got = run_trace(bamba, trace)
    j = got.schedule_log.to_json()
    step = next(s for s in j["steps"] if any(v["accepted"] > 0 for v in s.get("verify", [])))
    v = next(v for v in step["verify"] if v["accepted"] > 0)
    v["accepted"] -= 1                                                        # accepted count off by one
    assert log_consistency(j)
    from oracle.schedule_log import from_json
    bad = dataclasses.replace(got, schedule_log=from_json(j))
    assert recompute_accepted(bamba, trace, bad)


def test_plain_traces_keep_their_log_keys():
    fake = FakeModel(vocab_size=32, chunk_size=4, seed=1)
    text = canonical_json(run_trace(fake, _trace(BASE, None)).schedule_log)
    assert '"verify"' not in text and '"proposals"' not in text
    spec = run_trace(fake, _trace(BASE, {"kind": "ngram", "min_n": 1, "max_n": 2}))
    assert without_speculation(_trace(BASE, {"kind": "ngram", "min_n": 1, "max_n": 2})).engine.speculative is None
    assert "verify" in canonical_json(spec.schedule_log) or not verify_rows(spec.schedule_log)


def test_ngram_rule_longest_n_most_recent_occurrence():
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 1, 3) == [7, 1]      # most recent "1 2 3"
    assert ngram_propose([5, 1, 2, 8, 2, 6, 1, 2], 3, 1, 2) == [8, 2, 6]            # n=2 beats n=1 ("2" -> 6)
    assert ngram_propose([4, 2, 6, 2], 3, 1, 2) == [6, 2]                           # fewer than k at the end
    assert ngram_propose([1, 2, 3], 4, 1, 3) == []                                  # no earlier occurrence
    assert ngram_propose([7, 7], 4, 2, 3) == []                                     # n must leave an earlier one
    assert ngram_propose([7, 7, 7], 4, 1, 1) == [7]
    assert accepted_count([3, 4, 5], [3, 4, 9, 1]) == 2 and accepted_count([], [1]) == 0


@pytest.mark.parametrize("spec, field", [
    ({"k": 0, "proposer": {"kind": "ngram", "min_n": 1, "max_n": 2}}, "engine.speculative.k"),
    ({"k": 20, "proposer": {"kind": "ngram", "min_n": 1, "max_n": 2}}, "engine.speculative.k"),
    ({"k": 2, "proposer": {"kind": "medusa"}}, "engine.speculative.proposer.kind"),
    ({"k": 2, "proposer": {"kind": "ngram", "min_n": 3, "max_n": 2}}, "engine.speculative.proposer.max_n"),
    ({"k": 2, "proposer": {"kind": "scripted", "proposals": {"full": {"1": [500]}}}},
     "engine.speculative.proposer.proposals.full.1[0]"),
    ({"k": 2, "proposer": {"kind": "scripted", "proposals": {"nobody": {"1": [1]}}}},
     "engine.speculative.proposer.proposals.nobody"),
    ({"k": 2, "proposer": {"kind": "scripted", "proposals": {"full": {"1": [1, 2, 3]}}}},
     "engine.speculative.proposer.proposals.full.1"),
    ({"k": 2, "proposer": {"kind": "scripted", "proposals": {"full": {"x": [1]}}}},
     "engine.speculative.proposer.proposals.full.x"),
    ({"k": 2, "proposer": {"kind": "draft", "model": "goldens/models/tiny-sort"}}, "engine.speculative.proposer.model"),
    ({"k": 2, "proposer": {"kind": "draft", "model": "no/such/folder"}}, "engine.speculative.proposer.model"),
    ({"k": 2, "proposer": {"kind": "ngram", "min_n": 1, "max_n": 2}, "extra": 1}, "engine.speculative.extra"),
    ({"k": 2, "proposer": {"kind": "ngram", "min_n": 1, "max_n": 2}, "backoff": -1}, "engine.speculative.backoff"),
    ({"k": 2, "proposer": {"kind": "ngram", "min_n": 1, "max_n": 2}, "backoff": True}, "engine.speculative.backoff"),
    ({"k": 2, "proposer": {"kind": "ngram", "min_n": 1, "max_n": 2}, "backoff": "8"}, "engine.speculative.backoff"),
], ids=["k0", "k_budget", "kind", "max_n", "oov", "unknown_request", "more_than_k", "bad_key", "draft_vocab",
        "draft_missing", "unknown_field", "backoff_negative", "backoff_bool", "backoff_string"])
def test_bad_speculative_config_names_the_field(bamba, spec, field):
    t = json.loads(json.dumps(BASE))
    t["engine"]["speculative"] = spec
    with pytest.raises(TraceError) as e:
        run_trace(bamba, parse_trace(t))
    assert e.value.field == field, str(e.value)


def test_shipped_draft_model_path_resolves_in_an_installed_wheel_layout(tmp_path, monkeypatch):
    """spec_draft names its draft `goldens/models/zoo-mamba2`; installed, goldens/ is hybridqual/data/, so the main
    job's default run of the shipped speculative traces finds it there from any working directory."""
    import oracle.speculative as sp
    site = tmp_path / "site"
    (site / "hybridqual" / "data" / "models" / "d").mkdir(parents=True)
    (site / "hybridqual" / "data" / "models" / "d" / "config.json").write_text("{}")
    monkeypatch.setattr(sp, "ROOT", site)
    monkeypatch.chdir(tmp_path)

    class P:
        model = "goldens/models/d"

    class S:
        proposer = P()
    assert sp.model_path(S()) == site / "hybridqual" / "data" / "models" / "d"
    P.model = "goldens/models/missing"
    with pytest.raises(TraceError, match="no HF model folder"):
        sp.model_path(S())
