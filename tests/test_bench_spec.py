"""tools/bench/spec.py's CPU smoke mode: every row of the GPU benchmark (baseline, ngram, upper bound, last draft
wrong under both rollbacks, draft) runs through the same code on a tiny zoo model with the torch stand-ins, so a GPU
run cannot die on a typo."""
from __future__ import annotations

import json

from hybridqual.bench.spec import main, upper_bound_spec


def test_bench_spec_smoke_prints_every_row_and_the_upper_bound_accepts_everything(capsys, tmp_path):
    out = tmp_path / "spec.json"
    assert main(["--smoke", "--spec-k", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    lines = {ln.split(":")[0].split(" async")[0].strip(): ln for ln in text.splitlines() if ln.startswith("spec ")}
    for label in ("spec none (bs1, no speculation)", "spec ngram k=1", "spec upper bound k=1 (drafts=own)",
                  "spec last draft wrong k=1 snapshots", "spec last draft wrong k=1 replay", "spec draft1 k=1 (6 tok)"):
        assert label in lines, (label, list(lines))
    assert "= 100.0%" in lines["spec upper bound k=1 (drafts=own)"]
    assert "FAILED" not in text
    rows = json.loads(out.read_text())
    assert [r["kind"] for r in rows] == ["baseline", "ngram", "upper_bound", "draft", "last_wrong_snapshots",
                                         "last_wrong_replay"]
    ub, snap, rep = rows[2], rows[4], rows[5]
    assert ub["accepted"] == ub["proposed"] > 0 and ub["verify_steps"] > 0
    assert snap["accepted"] == rep["accepted"] == 0 < snap["proposed"] == rep["proposed"]   # k=1: the one draft
    assert snap["tokens_equal_baseline"] and rep["tokens_equal_baseline"]


def test_upper_bound_script_proposes_the_continuation_for_every_request():
    spec = upper_bound_spec(2, [5, 6, 7, 8], n_req=2)
    table = spec.proposer.table()
    assert set(table) == {"q0", "q1", "timed"}
    assert table["q0"] == {1: (6, 7), 2: (7, 8), 3: (8,)}
    assert upper_bound_spec(2, [5, 6, 7, 8], n_req=1, wrong_last=9).proposer.table()["q0"] == {1: (6, 8), 2: (7, 0),
                                                                                                3: (0,)}
