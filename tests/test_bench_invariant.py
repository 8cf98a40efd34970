"""tools/bench/invariant.py's --tiny smoke run: the GPU bench's whole code path (speculative vs not, prefix cache on vs
off, alone vs batched, the default-mode controls, the cost) on a tiny zoo model in the Triton interpreter — and on the
CPU the batch-invariant comparisons hold bitwise, while the default-mode controls show the detector can see a
difference."""
from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hybridqual.bench.invariant import compare, main, scripted_spec  # noqa: E402


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the --tiny run needs TRITON_INTERPRET=1 set before Triton is imported")
    d = tmp_path_factory.mktemp("invariant")
    out, summary = d / "inv.json", d / "inv.summary"
    rc = main(["--tiny", "--out", str(out), "--summary", str(summary)])
    return rc, json.loads(out.read_text()), summary.read_text()


def test_tiny_run_reports_every_comparison_and_the_cost(tiny_run):
    rc, rep, summary = tiny_run
    assert rc == 0 and rep["errors"] == [] and rep["tiny"] and rep["graphs"] is False
    whats = [(c["mode"], c["what"].split(" (")[0].split(" ==")[0]) for c in rep["comparisons"]]
    assert whats == [("batch_invariant", "speculative"), ("batch_invariant", "speculative"),
                     ("batch_invariant", "prefix cache on"), ("batch_invariant", "r3 alone"),
                     ("default", "speculative"), ("default", "prefix cache on")]
    for c in rep["comparisons"]:
        assert set(c) >= {"tokens_equal", "compared", "differing", "missing", "max_abs_delta", "bitwise", "promised"}
        assert c["compared"] > 0 and c["missing"] == 0
    cost = rep["cost"]
    assert set(cost["median_s"]) == {"batch_invariant", "default"} and cost["ratio"] > 0
    lines = summary.splitlines()
    assert lines[-1].startswith("cost: batch-invariant / default") and len(lines) == 2 + len(rep["comparisons"]) + 1


def test_tiny_run_batch_invariant_comparisons_are_bitwise_and_the_workload_batches(tiny_run):
    """Every batch-invariant comparison bitwise (a prefix hit's piece holds its last rows at other tile rows than the
    cache-off piece does, [24, 35) vs [32, 35): the kernels' products do not depend on a row's place)."""
    _, rep, summary = tiny_run
    bi = [c for c in rep["comparisons"] if c["mode"] == "batch_invariant"]
    bad = [(c["what"], c["differing"], c["token_divergence"]) for c in bi if not c["bitwise"]]
    assert not bad, bad
    assert "MISMATCH" not in summary
    runs = rep["runs"]
    assert runs["batch_invariant base"]["max_rows"] >= 2 and runs["batch_invariant base"]["compositions"] >= 3
    assert runs["batch_invariant spec scripted k=2"]["accepted"] == runs["batch_invariant spec scripted k=2"][
        "proposed"] > 0
    assert runs["batch_invariant spec ngram k=2"]["proposed"] > 0
    assert sum(1 for n in runs["batch_invariant prefix cache"]["cached_tokens"] if n) >= 2


def test_compare_counts_bit_differences_and_stops_at_the_first_differing_token():
    prompt = (1, 2)
    req = type("R", (), {"id": "a", "prompt": prompt})()
    row = torch.tensor([0.0, 1.0], dtype=torch.bfloat16)
    neg = torch.tensor([-0.0, 1.0], dtype=torch.bfloat16)          # == under torch.equal, not byte for byte
    a = {"tokens": {"a": [5, 6, 7]}, "rows": {("a", 2): row, ("a", 3): row, ("a", 4): row}}
    b = {"tokens": {"a": [5, 8, 7]}, "rows": {("a", 2): row, ("a", 3): neg, ("a", 4): row + 1}}
    c = compare(a, b, (req,))
    assert not c["tokens_equal"] and c["token_divergence"] == {"a": 1}
    assert (c["compared"], c["differing"], c["bitwise"]) == (2, 1, False)     # position 4 not compared
    assert scripted_spec(2, {"a": [5, 6, 7]}).proposer.table() == {"a": {1: (6, 7), 2: (7,)}}
