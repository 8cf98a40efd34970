"""The llama.cpp path can FAIL: a llama.cpp whose seq_rm leaves a freed recurrent cell's state to the next sequence
(hybridqual.adapters.llamacpp.mutant, built by `python -m hybridqual.adapters.llamacpp.mutant build`) fails qualify
on the shipped slot_exhaustion trace, where the unmutated build passes, and on the prefix traces with a miss in a
freed cell."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import oracle
from hybridqual.adapters.llamacpp import convert as conv
from hybridqual.adapters.llamacpp import mutant
from oracle.trace import load_trace

pytestmark = [pytest.mark.llamacpp,
              pytest.mark.skipif(mutant.available() is not None, reason=str(mutant.available()))]
ROOT = Path(__file__).resolve().parents[1]
TRACE = "slot_exhaustion"          # 6 requests on 2 sequences: freed sequences (and their cells) are reused


def _qualify(engine: str, model: str, out: Path) -> tuple[int, dict]:
    r = subprocess.run([sys.executable, "-m", "hybridqual.qualify", "--engine", engine, "--model", model,
                        "--trace", TRACE, "--mode", "legacy", "--quiet", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    report = json.loads((out / "report.json").read_text())
    return r.returncode, {c["name"].split(" (")[0]: c for c in report["checks"]}


@pytest.mark.parametrize("model", ["zoo-mamba2"])
def test_the_mutant_fails_qualify_where_the_install_passes(model, tmp_path):
    rc, checks = _qualify("hybridqual.adapters.llamacpp.adapter:LlamaCppAdapter", model, tmp_path / "ok")
    assert rc == 0
    assert checks["legacy: tokens match the truth"]["status"] == "PASS"
    assert checks["legacy: logits match the oracle's"]["status"] == "PASS"
    rc, checks = _qualify("hybridqual.adapters.llamacpp.mutant:LlamaCppMutantAdapter", model, tmp_path / "mutant")
    assert rc == 1
    assert checks["legacy: logits match the oracle's"]["status"] == "FAIL"
    assert checks["legacy: tokens match the truth"]["status"] == "FAIL"


def test_the_mutant_hybrid_diverges_only_after_a_cell_is_reused():
    """Through llama_memory_hybrid (Granite-4.0-H): requests that ran before any sequence finished are exact; a
    request that starts in a freed cell is not."""
    model_dir = ROOT / "goldens" / "models" / "zoo-granitemoehybrid"
    trace = load_trace(ROOT / "goldens" / "traces" / f"{TRACE}.json")
    run = mutant.LlamaCppMutantAdapter(model_dir, trace, "legacy").run_trace()
    model = oracle.load(model_dir)
    worst = {}
    for r in trace.requests:
        logits, _ = model.prefill(list(r.prompt) + run.tokens[r.id][:-1])
        worst[r.id] = (run.logits[r.id].double() - logits[len(r.prompt) - 1:]).abs().max().item()
    assert worst["a"] < 1e-4 and worst["b"] < 1e-4, worst      # admitted first, into cleared cells
    assert min(worst[r] for r in "cdef") > 0.05, worst         # each started in a freed cell


def test_the_mutant_adapter_loads_the_mutant_library():
    assert mutant.LlamaCppMutantAdapter.lib_path() == str(mutant.lib_dir())
    assert "MUTATED" in mutant.LlamaCppMutantAdapter.version()
    rec = json.loads((mutant.mutant_dir() / "mutant.json").read_text())
    assert rec["compiled"] == ["src/CMakeFiles/llama.dir/llama-memory-recurrent.cpp.o"]   # an incremental rebuild
    assert rec["llama_cpp_commit"] == conv.install_info()["llama_cpp_commit"]
    src = mutant.mutant_dir() / "src"
    patched = next(src.glob("*/vendor/llama.cpp")) / mutant.DEFECT["file"]
    assert mutant.DEFECT["new"] in patched.read_text()


def test_the_mutant_is_caught_through_the_prefix_cache(tmp_path):
    """With the prefix cache on, a request that hits gets its state from llama_state_seq_set_data (the freed
    cell's leftover is overwritten) and one that misses in a freed cell still inherits it: the prefix traces with
    such a miss FAIL, and so does a hit on a checkpoint stored by a corrupted request (prefix_eviction's a3); on
    prefix_multi_turn every reused cell receives a checkpoint, so the defect cannot show there."""
    from test_llamacpp_prefix_cache import TRACES, _qualify
    rc, checks = _qualify("hybridqual.adapters.llamacpp.mutant:LlamaCppMutantAdapter", "zoo-mamba2", tmp_path, TRACES)
    assert rc == 1
    for trace in ("prefix_shared_system", "prefix_eviction", "prefix_lru"):
        assert checks[f"zoo-mamba2/{trace}"]["legacy: logits match the oracle's"]["status"] == "FAIL", trace
    assert checks["zoo-mamba2/prefix_multi_turn"]["legacy: logits match the oracle's"]["status"] == "PASS"
    for lines in checks.values():               # the schedule is the policy's: only the arithmetic is wrong
        assert lines["legacy: prefix cache events as the policy predicts"]["status"] == "PASS"
