"""Speculative decoding through the llama.cpp adapter (DESIGN §13): scripted, ngram and draft-model proposals
verified in llama.cpp's own batches, a rejection rolled back to the sequence-state snapshot taken before the step.
The worker's scheduler and draft on stand-ins for llama.cpp give the tokens of plain decode and the draft's greedy
continuations (default tier); the shipped speculative traces qualify through the real llama.cpp, draft counts
against the oracle's (marker llamacpp)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from hybridqual.adapters.llamacpp import convert as conv
from hybridqual.adapters.llamacpp import speculation
from hybridqual.adapters.llamacpp.adapter import draft_gguf, speculative_config
from hybridqual.adapters.llamacpp.speculation import Draft
from oracle.trace import load_trace
from llamacpp_standin import StandIn
from test_llamacpp_prefix_cache import _qualify, _requests

ROOT = Path(__file__).resolve().parents[1]
TRACES = ["spec_accept", "spec_scripted", "spec_ngram"]
needs_venv = pytest.mark.skipif(conv.available() is not None, reason=str(conv.available()))


def _run(trace, spec: dict | None) -> dict:
    e = trace.engine
    eng = StandIn(10)                      # a small vocab: ngram matches come often
    return eng.run(_requests(trace), e.max_requests, e.max_tokens_per_step, e.prefill_chunk, 8, None, spec)


@pytest.mark.parametrize("name", TRACES)
def test_verified_proposals_give_the_tokens_of_plain_decode_and_rejections_roll_back(name):
    """The stand-in's logits are a function of the sequence's whole token list and it asserts every row's position,
    so a kept rejected draft, a missing restore or a wrong re-decode changes the tokens or fails."""
    trace = load_trace(ROOT / "goldens" / "traces" / f"{name}.json")
    spec = speculative_config(trace.engine.speculative)
    assert spec is not None
    plain, fast = _run(trace, None), _run(trace, spec)
    assert fast["tokens"] == plain["tokens"] and fast["logits"] == plain["logits"]
    counts = fast["speculation"]
    assert sum(c["proposed"] for c in counts.values()) > 0
    assert sum(c["rollbacks"] for c in counts.values()) > 0          # random logits: drafts are rejected


def test_full_acceptance_keeps_the_verify_state_and_emits_the_bonus():
    """Scripted drafts equal to plain decode's own tokens: all accepted, no rollback, the bonus token emitted."""
    trace = load_trace(ROOT / "goldens" / "traces" / "spec_scripted.json")
    plain = _run(trace, None)
    k = 3
    table = {rid: {str(n): toks[n:n + k] for n in range(1, len(toks) - 1, k + 1)}
             for rid, toks in plain["tokens"].items()}
    spec = {"k": k, "proposer": {"kind": "scripted", "proposals": table}}
    fast = _run(trace, spec)
    assert fast["tokens"] == plain["tokens"]
    counts = fast["speculation"]
    assert sum(c["accepted"] for c in counts.values()) == sum(c["proposed"] for c in counts.values()) > 0
    assert all(c["rollbacks"] == 0 for c in counts.values())


def test_a_draft_trace_carries_its_gguf_and_a_bad_draft_names_the_field(tmp_path):
    trace = load_trace(ROOT / "goldens" / "traces" / "spec_draft.json")
    spec = trace.engine.speculative
    assert speculative_config(spec, Path("/d.gguf"))["draft_gguf"] == "/d.gguf"
    assert speculative_config(dataclasses.replace(trace.engine, speculative=None).speculative) is None
    with pytest.raises(ValueError, match="engine.speculative.proposer.model"):
        speculative_config(spec)
    with pytest.raises(ValueError, match=r"engine\.speculative\.proposer\.model: .*vocab_size 96, the target 16"):
        draft_gguf(spec, 16, "f32")                     # checked before any conversion
    with pytest.raises(ValueError, match="engine.speculative.proposer.model"):
        draft_gguf(_with_draft(spec, tmp_path / "nowhere"), 96, "f32")


def _with_draft(spec, folder):
    return dataclasses.replace(spec, proposer=dataclasses.replace(spec.proposer, model=str(folder)))


class _Recorder(Draft):
    """The worker's Draft, its proposals logged with the tokens it was asked after."""
    log: list = []

    def propose(self, want):
        out = super().propose(want)
        self.log += [(list(toks), room, out[rid]) for rid, _, toks, room in want]
        return out


def test_the_draft_proposes_the_greedy_continuation_of_every_token_so_far(monkeypatch):
    """A stand-in draft (logits a function of its sequence, every row's position asserted): each proposal is the
    greedy continuation a fresh draft computes from the request's tokens, so a missed catch-up token or a draft
    state not restored after drafting fails; speculation leaves the target's tokens unchanged."""
    trace = _greedy("spec_draft")
    e = trace.engine
    draft = StandIn(10)
    eng = StandIn(10)
    eng.draft = lambda gguf: draft
    monkeypatch.setattr(speculation, "Draft", _Recorder)
    _Recorder.log = []
    plain = _run(trace, None)
    spec = {**trace.engine.speculative.to_json(), "draft_gguf": "stand-in"}
    fast = eng.run(_requests(trace), e.max_requests, e.max_tokens_per_step, e.prefill_chunk, 8, None, spec)
    assert fast["tokens"] == plain["tokens"]
    assert _Recorder.log and all(len(d) == room for _, room, d in _Recorder.log)
    fresh = StandIn(10)
    for toks, room, got in _Recorder.log:
        fresh.state = {}
        out = [int(np.argmax(fresh._decode([(t, p, 0, True) for p, t in enumerate(toks)])[-1]))]
        while len(out) < room:
            out.append(int(np.argmax(fresh._decode([(out[-1], len(toks) + len(out) - 1, 0, True)])[0])))
        assert got == out, (toks, room)
    counts = fast["speculation"]
    assert sum(c["proposed"] for c in counts.values()) == sum(room for _, room, _ in _Recorder.log)
    assert not draft.state                              # finished requests freed their draft sequences


def _greedy(name: str):
    """A shipped speculative trace with every request greedy (the llama.cpp adapter samples greedily only)."""
    from oracle.trace import parse_trace
    obj = load_trace(ROOT / "goldens" / "traces" / f"{name}.json").to_json()
    for r in obj["requests"]:
        r["sampling"] = {"kind": "greedy"}
    return parse_trace(obj)


@pytest.mark.llamacpp
@needs_venv
@pytest.mark.parametrize("model", ["zoo-mamba2", "zoo-granitemoehybrid"])
def test_spec_accept_qualifies_through_llama_cpp(model, tmp_path):
    rc, checks = _qualify("hybridqual.adapters.llamacpp.adapter:LlamaCppAdapter", model, tmp_path, ["spec_accept"])
    assert rc == 0, checks
    lines = checks[f"{model}/spec_accept"]
    for name in ("legacy: tokens match the truth", "legacy: logits match the oracle's"):
        assert lines[name]["status"] == "PASS", (name, lines[name]["detail"])


@pytest.mark.llamacpp
@needs_venv
@pytest.mark.parametrize("name", [*TRACES, "spec_draft"])
@pytest.mark.parametrize("model", ["zoo-mamba2", "zoo-granitemoehybrid"])
def test_llama_cpp_speculation_equals_plain_decode_and_rolls_back(model, name):
    from hybridqual.adapters.llamacpp.adapter import LlamaCppAdapter
    from hybridqual.qualify.spec_checks import without_speculation
    folder, trace = ROOT / "goldens" / "models" / model, _greedy(name)
    a = LlamaCppAdapter(folder, trace, "legacy")
    on = a.run_trace()
    off = LlamaCppAdapter(folder, without_speculation(trace), "legacy").run_trace()
    assert on.tokens == off.tokens
    for rid, lg in off.logits.items():
        assert (on.logits[rid] - lg).abs().max().item() < 1e-4, rid
    counts = a.speculation
    assert sum(c["proposed"] for c in counts.values()) > 0, counts
    assert on.schedule_facts[0] == {"speculation": counts}
    assert all(set(f) == {"batches"} for f in on.schedule_facts[1:])     # then the pieces, step by step
    if name == "spec_accept":         # full acceptance and rejections at the last draft, on the model's own tokens
        assert sum(c["rollbacks"] for c in counts.values()) > 0, counts


def _trace_file(path: Path, name: str, draft: str | Path | None = None) -> Path:
    """A shipped speculative trace, every request greedy (optionally another draft folder), written as a file."""
    import json
    obj = _greedy(name).to_json()
    if draft is not None:
        obj["engine"]["speculative"]["proposer"]["model"] = str(draft)
    path.write_text(json.dumps(obj))
    return path


def _near_draft(folder: Path, scale: float = 0.2) -> Path:
    """zoo-granitemoehybrid with seeded noise on every weight: a draft that the target accepts only in part. Its
    file's size and mtime are fixed, so cached_gguf converts it once across runs."""
    import os
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    src = ROOT / "goldens" / "models" / "zoo-granitemoehybrid"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", folder / "config.json")
    g = torch.Generator().manual_seed(0)
    w = load_file(src / "model.safetensors")
    save_file({k: (v + scale * v.abs().mean() * torch.randn(v.shape, generator=g).to(v.dtype)).contiguous()
               for k, v in sorted(w.items())}, folder / "model.safetensors")
    os.utime(folder / "model.safetensors", ns=(0, 0))
    return folder


@pytest.mark.llamacpp
@needs_venv
@pytest.mark.parametrize("model", ["zoo-mamba2", "zoo-granitemoehybrid"])
def test_draft_traces_qualify_through_llama_cpp_with_the_oracles_counts(model, tmp_path):
    """spec_draft (draft zoo-mamba2; greedy) through qualify: tokens, logits and the per-request proposed/accepted
    counts against the oracle's all PASS, with speculation running (proposals, and acceptance on each model)."""
    files = [_trace_file(tmp_path / "spec_draft.json", "spec_draft")]
    if model == "zoo-granitemoehybrid":               # zoo-mamba2 drafts are all rejected here: a near draft too
        files.append(_trace_file(tmp_path / "spec_draft_near.json", "spec_draft",
                                 _near_draft(tmp_path / "zoo-granitemoehybrid-near")))
    rc, checks = _qualify("llamacpp", model, tmp_path / "out", [str(f) for f in files])
    assert rc == 0, checks
    proposed = accepted = 0
    for f in files:
        lines = checks[f"{model}/{f.stem}"]
        for name in ("legacy: tokens match the truth", "legacy: logits match the oracle's",
                     "legacy: speculation counts match the oracle's"):
            assert lines[name]["status"] == "PASS", (f.stem, name, lines[name]["detail"])
        data = lines["legacy: speculation counts match the oracle's"]["data"]
        proposed, accepted = proposed + data["proposed"], accepted + data["accepted"]
    assert proposed > 0 and accepted > 0, (proposed, accepted)


_CORRUPT = """import sys
sys.path.insert(0, {dir!r})
import speculation
propose = speculation.Draft.propose
def corrupt(self, want):        # every row's first draft token moved by one: rejected where the draft was right
    return {{rid: [(d[0] + 1) % self.eng.n_vocab, *d[1:]] for rid, d in propose(self, want).items()}}
speculation.Draft.propose = corrupt
import worker
worker.main()
"""


@pytest.mark.llamacpp
@needs_venv
def test_a_corrupted_draft_keeps_the_tokens_but_fails_the_counts_check(tmp_path, monkeypatch):
    """Speculation cannot change a token, so only the counts show a wrong proposer: the check against the oracle's
    counts FAILs while the tokens equal plain decode's."""
    import oracle
    from hybridqual.adapters.llamacpp import adapter
    from hybridqual.qualify.spec_checks import without_speculation
    script = tmp_path / "corrupt_worker.py"
    script.write_text(_CORRUPT.format(dir=str(adapter.WORKER.parent)))
    folder, trace = ROOT / "goldens" / "models" / "zoo-mamba2", _greedy("spec_draft")
    off = adapter.LlamaCppAdapter(folder, without_speculation(trace), "legacy").run_trace()
    honest = adapter.LlamaCppAdapter(folder, trace, "legacy").run_trace()
    monkeypatch.setattr(adapter, "WORKER", script)
    bad = adapter.LlamaCppAdapter(folder, trace, "legacy").run_trace()
    assert bad.tokens == honest.tokens == off.tokens
    model = oracle.load(folder)
    ok = adapter.speculation_check("t", "legacy", trace, honest, model)
    assert ok.status == "PASS" and ok.data["accepted"] > 0, ok.detail
    check = adapter.speculation_check("t", "legacy", trace, bad, model)
    assert check.status == "FAIL" and "the oracle's" in check.detail, check.detail


@pytest.mark.llamacpp
@needs_venv
def test_a_draft_that_does_not_convert_names_the_field():
    """zoo-nemotron_h does not convert (findings L3): the adapter refuses the trace, naming the draft's field."""
    from hybridqual.adapters.llamacpp.adapter import LlamaCppAdapter
    trace = _greedy("spec_draft")
    trace = dataclasses.replace(trace, engine=dataclasses.replace(
        trace.engine, speculative=_with_draft(trace.engine.speculative, "goldens/models/zoo-nemotron_h")))
    with pytest.raises(ValueError, match=r"engine\.speculative\.proposer\.model: .*does not convert"):
        LlamaCppAdapter(ROOT / "goldens" / "models" / "zoo-mamba2", trace, "legacy")
