"""tools/bench/spec.py's CPU smoke mode: every row of the GPU benchmark (baseline, ngram, upper bound, last draft
wrong under both rollbacks, draft, self-draft) runs through the same code on a tiny zoo model with the torch stand-ins, so a GPU
run cannot die on a typo."""
from __future__ import annotations

import json

import pytest

from hybridqual.bench.spec import bytes_ceiling, draft_pass_bytes, main, smoke_model, upper_bound_spec


def test_bench_spec_smoke_prints_every_row_and_the_upper_bound_accepts_everything(capsys, tmp_path):
    out = tmp_path / "spec.json"
    assert main(["--smoke", "--spec-k", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    lines = {ln.split(":")[0].split(" async")[0].strip(): ln for ln in text.splitlines() if ln.startswith("spec ")}
    for label in ("spec none (bs1, no speculation)", "spec ngram k=1", "spec upper bound k=1 (drafts=own)",
                  "spec last draft wrong k=1 snapshots", "spec last draft wrong k=1 replay", "spec draft1 k=1 (6 tok)",
                  "spec draft1 k=1 eager catch-up (6 tok)", "spec draft1 k=1 device drafts (6 tok)"):
        assert label in lines, (label, list(lines))
    assert "= 100.0%" in lines["spec upper bound k=1 (drafts=own)"]
    assert "FAILED" not in text
    rows = json.loads(out.read_text())
    assert [r["kind"] for r in rows] == ["baseline", "ngram", "upper_bound", "draft", "draft_eager_catch_up",
                                         "draft_device", "draft_right", "draft_full_length", "draft_backoff",
                                         "upper_bound_short", "self_draft", "last_wrong_snapshots", "last_wrong_replay"]
    ub, snap, rep = rows[2], rows[11], rows[12]
    assert ub["accepted"] == ub["proposed"] > 0 and ub["verify_steps"] > 0
    assert snap["accepted"] == rep["accepted"] == 0 < snap["proposed"] == rep["proposed"]   # k=1: the one draft
    assert snap["tokens_equal_baseline"] and rep["tokens_equal_baseline"]


def test_bench_spec_draft_rows_show_where_the_draft_proposers_time_goes(capsys, tmp_path):
    """--spec-rows draft: the baseline and the three draft rows only, each with the draft proposer's time per step
    by phase and its share of the step; the default row catches up through the decode graphs after the first
    (prefill) catch-up, the eager row only by prefill, and every row keeps the baseline's tokens."""
    out = tmp_path / "spec.json"
    assert main(["--smoke", "--spec-k", "2", "--spec-rows", "draft", "--out", str(out)]) == 0
    assert "draft proposer" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert [r["kind"] for r in rows] == ["baseline", "draft", "draft_eager_catch_up", "draft_device"]
    for r in rows[1:]:
        p = r["draft_profile"]
        assert 0 < p["draft_ms"] < p["step_ms"] and 0 < p["share"] < 1 and r["tokens_equal_baseline"]
        assert set(p["phases_ms"]) >= {"drafts", "restore", "catch_up_prefill"}
    graph, eager, device = (r["draft_profile"]["catch_ups"] for r in rows[1:])
    assert graph["graph"] > 0 and device["graph"] > 0 and eager["graph"] == 0 < eager["prefill"]


def test_bench_spec_backoff_row_verifies_less_than_the_same_draft_without_it(capsys, tmp_path):
    """--spec-rows draft_backoff: the draft at the full length without and with backoff; where drafts miss, the
    backoff row proposes fewer drafts (fewer verify steps) and keeps the baseline's tokens."""
    out = tmp_path / "spec.json"
    assert main(["--smoke", "--spec-k", "2", "--spec-rows", "draft_backoff", "--out", str(out)]) == 0
    assert "backoff 16" in capsys.readouterr().out
    base, full, back = json.loads(out.read_text())
    assert (base["kind"], full["kind"], back["kind"]) == ("baseline", "draft_full_length", "draft_backoff")
    assert full["accepted"] < full["proposed"] and back["proposed"] < full["proposed"]
    assert full["tokens_equal_baseline"] and back["tokens_equal_baseline"]


def test_bench_spec_forced_right_drafts_are_all_accepted_beside_the_upper_bound(capsys, tmp_path):
    """--spec-rows upper_bound,draft_right: the draft's passes run, their drafts replaced by the upper bound's, so
    every draft is accepted; the row carries its ratio to the upper bound and the draft proposer's profile."""
    out = tmp_path / "spec.json"
    assert main(["--smoke", "--spec-k", "2", "--spec-rows", "upper_bound,draft_right", "--out", str(out)]) == 0
    assert "forced right:" in capsys.readouterr().out
    base, ub, right = json.loads(out.read_text())
    assert (ub["kind"], right["kind"]) == ("upper_bound", "draft_right")
    assert right["accepted"] == right["proposed"] == ub["proposed"] > 0 and right["tokens_equal_baseline"]
    assert right["vs_upper_bound"] > 0 and right["draft_profile"]["draft_ms"] > 0
    assert 0 < right["bytes_ceiling"] < 1


def test_bytes_ceiling_adds_k_draft_forwards_to_the_upper_bounds_step():
    """k = 2 at 961.6 tok/s (3 tokens in 3.120 ms) plus 2 forwards of 0.86 GB at 3.01 TB/s (0.571 ms): 0.845 of
    the upper bound; no draft bytes: 1; more draft bytes: lower."""
    assert bytes_ceiling(2, 961.6, 860_000_000, 3.01e12) == pytest.approx(3.11980 / (3.11980 + 0.57143), rel=1e-4)
    assert bytes_ceiling(2, 961.6, 0, 3.01e12) == 1.0
    assert bytes_ceiling(2, 961.6, 2 * 860_000_000, 3.01e12) < bytes_ceiling(2, 961.6, 860_000_000, 3.01e12)


def test_draft_pass_bytes_counts_the_drafts_layers_norm_and_head_not_the_embedding_table():
    """The tiny zoo model (fp32, untied head): one layer's tensors + final norm + head, and not the embedding rows."""
    m = smoke_model()
    size = lambda n: m.w[n].numel() * m.w[n].element_size()  # noqa: E731
    layer0 = sum(size(n) for n in m.w if n.startswith("layers.0."))
    assert draft_pass_bytes(m, 1) == layer0 + size("final_norm.weight") + size("lm_head.weight")
    assert draft_pass_bytes(m, 2) > draft_pass_bytes(m, 1)


def test_upper_bound_script_proposes_the_continuation_for_every_request():
    spec = upper_bound_spec(2, [5, 6, 7, 8], n_req=2)
    table = spec.proposer.table()
    assert set(table) == {"q0", "q1", "timed"}
    assert table["q0"] == {1: (6, 7), 2: (7, 8), 3: (8,)}
    assert upper_bound_spec(2, [5, 6, 7, 8], n_req=1, wrong_last=9).proposer.table()["q0"] == {1: (6, 8), 2: (7, 0),
                                                                                                3: (0,)}


def test_bench_spec_self_draft_rows_accept_every_draft_and_compare_with_the_upper_bound(capsys, tmp_path):
    """--spec-rows self_draft: the target as its own draft proposes its own greedy continuation (fp32: every draft
    accepted), beside the scripted upper bound at the same k and length, with the ratio of the two."""
    out = tmp_path / "spec.json"
    assert main(["--smoke", "--spec-k", "2", "--spec-rows", "self_draft", "--out", str(out)]) == 0
    assert "of the upper bound at the same k and length" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert [r["kind"] for r in rows] == ["baseline", "upper_bound_short", "self_draft"]
    ub, sd = rows[1], rows[2]
    assert sd["proposed"] > 0 and sd["accepted"] == sd["proposed"] and ub["accepted"] == ub["proposed"]
    assert sd["vs_upper_bound"] > 0 and sd["tokens_equal_baseline"] and sd["osl"] == ub["osl"]
