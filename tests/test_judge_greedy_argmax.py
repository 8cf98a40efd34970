"""qualify's greedy-argmax line (hybridqual.qualify.checks.check_greedy_argmax, registry key "greedy_argmax"): every greedy token is the argmax
of the logits row the engine returned for it, the lowest index among exact maxima (DESIGN §6). The tie-aware
token check forgives an exact tie by design, so this line is what sees a wrong tie rule; zoo-bamba_wide's twin
vocabulary rows (oracle.zoo.twin_vocab_rows) make greedy steps exact ties in any precision.
"""
import json

import pytest
import torch
from hypothesis import given, seed, settings
from hypothesis import strategies as st

import oracle
from oracle import zoo
from oracle.trace import load_trace, parse_trace
from hybridqual.adapters import Capabilities, RunResult
from hybridqual.adapters.fastpath import FastpathAdapter
from hybridqual.goldens import regen as goldens
from hybridqual.paths import OUTPUTS, TRACES
from hybridqual.qualify.checks import check_instance, context, run_check
from hybridqual.scenarios.plan import Instance

WIDE = goldens.MODELS / "zoo-bamba_wide"
CAPS = Capabilities(("greedy", "seeded"), ("legacy",), logits=True)
NAME = "legacy: greedy tokens are their logits rows' argmax (lowest index on ties)"


def check_greedy_argmax(tr, run, caps=CAPS):
    """The greedy-argmax line of `run` on trace `tr` (mode legacy), from the registry as qualify runs it."""
    return run_check("greedy_argmax", context(None, "m", tr, None, caps=caps, label="t", mode="legacy", run=run))


def trace_of(n_tokens: dict[str, int], seeded: tuple[str, ...] = ()):
    return parse_trace({"schema": "hybridqual.trace/1",
                        "engine": {"max_requests": 4, "max_tokens_per_step": 16, "prefill_chunk": 16},
                        "requests": [{"id": rid, "arrival_step": 0, "prompt": [1, 2], "max_new_tokens": n,
                                      **({"sampling": {"kind": "seeded", "temperature": 1.0, "seed": 3}}
                                         if rid in seeded else {})} for rid, n in n_tokens.items()]})


@st.composite
def rows_with_ties(draw):
    """Logits rows [n, 12] with a planted exact maximum shared by 1-3 indices; the lowest one is the rule's token."""
    n = draw(st.integers(1, 5))
    rows, want = [], []
    for _ in range(n):
        row = torch.tensor(draw(st.lists(st.floats(-4, 4, width=32), min_size=12, max_size=12)))
        tied = sorted(draw(st.lists(st.integers(0, 11), min_size=1, max_size=3, unique=True)))
        row[tied] = row.max() + 1.0
        rows.append(row)
        want.append(tied)
    return torch.stack(rows), want


@seed(31)
@settings(max_examples=60, deadline=None)
@given(rows_with_ties())
def test_the_lowest_maximum_passes_and_any_other_token_fails_naming_the_position(case):
    logits, tied = case
    tr = trace_of({"r0": len(tied)})
    good = [t[0] for t in tied]
    ok = check_greedy_argmax(tr, RunResult({"r0": good}, logits={"r0": logits}), CAPS)
    assert ok.status == "PASS" and ok.data["exact_ties"] == sum(len(t) > 1 for t in tied), ok.detail
    for i, t in enumerate(tied):
        for other in (t[-1] if len(t) > 1 else None, (t[0] + 1) % 12 if t[0] + 1 not in t else None):
            if other is None or other == t[0]:
                continue
            bad = good[:i] + [other] + good[i + 1:]
            got = check_greedy_argmax(tr, RunResult({"r0": bad}, logits={"r0": logits}), CAPS)
            assert got.status == "FAIL" and got.name == NAME, got.detail
            assert f"request r0 position {i}: token {other}" in got.detail, got.detail
            assert ("lowest index" in got.detail) == (other in t), got.detail


def test_no_line_without_logits_or_without_a_greedy_request():
    tr = trace_of({"s": 2}, seeded=("s",))
    rows = torch.zeros(2, 12)
    assert check_greedy_argmax(tr, RunResult({"s": [5, 7]}, logits={"s": rows}), CAPS) is None
    tr = trace_of({"g": 2})
    no_logits = Capabilities(("greedy",), ("legacy",), logits=False)
    assert check_greedy_argmax(tr, RunResult({"g": [0, 0]}), no_logits) is None


def test_seeded_rows_are_not_judged_by_the_argmax_rule():
    tr = trace_of({"g": 1, "s": 1}, seeded=("s",))
    rows = torch.tensor([[0.0, 2.0, 1.0]])
    run = RunResult({"g": [1], "s": [2]}, logits={"g": rows, "s": rows})     # s sampled a non-argmax token
    assert check_greedy_argmax(tr, run, CAPS).status == "PASS"


def test_twin_vocabulary_rows_are_exact_ties_in_fp64_and_the_shipped_model_has_them():
    cfg = zoo.tiny_config(zoo.SHIPPED["bamba_wide"][0], **zoo.SHIPPED["bamba_wide"][1])
    assert cfg.mlp_intermediate_size == 4096            # the K where split matmuls split
    head = oracle.load_checkpoint(WIDE)[1]["lm_head.weight"]
    assert all(torch.equal(head[t], head[t - 1]) for t in range(5, cfg.vocab_size, 2))
    assert not torch.equal(head[4], head[6]) and not torch.equal(head[3], head[4])
    model = oracle.load(WIDE)
    trace = load_trace(TRACES / "async_drain.json")
    golden = json.loads((OUTPUTS / "zoo-bamba_wide" / "async_drain.json").read_text())
    from hybridqual.qualify.compare import teacher_forced_logits
    ties = 0
    for req in trace.requests:
        if req.sampling.kind != "greedy":
            continue
        toks = golden["requests"][req.id]["tokens"]
        rows = teacher_forced_logits(model, req.prompt, toks)
        for i, tok in enumerate(toks):
            maxima = (rows[i] == rows[i].max()).nonzero().flatten().tolist()
            assert tok == maxima[0]
            ties += len(maxima) > 1
    assert ties >= 3


def test_twin_rows_refuse_tied_embeddings():
    cfg = zoo.tiny_config("mamba2")
    assert cfg.tie_word_embeddings
    with pytest.raises(oracle.ConfigError, match="tied embeddings"):
        zoo.twin_vocab_rows(cfg, zoo.random_weights(cfg, 0))


def test_the_fast_path_passes_every_line_on_the_twin_rows_model():
    trace = load_trace(TRACES / "async_drain.json")
    inst = Instance("async_drain", "file", trace, None, trace.to_json())
    checks = check_instance(FastpathAdapter, WIDE, inst, ["legacy"], oracle.load(WIDE), "cpu")
    assert all(c.status in ("PASS", "SKIP") for c in checks), [(c.name, c.status, c.detail) for c in checks]
    [line] = [c for c in checks if c.name == NAME]
    assert line.status == "PASS" and line.data["exact_ties"] >= 3, line.detail
