"""`python -m hybridqual.qualify --model <a chunk-256 HF folder>` runs the whole corpus: every
scenario is instantiated in the model's units and either runs or is skipped with its reason — no crash, no
TraceError. The default tier instantiates every scenario (and checks each against the model); one scenario through
the fast path and the whole corpus through qualify (oracle engine, then the fast path) are slow-marked
(docs/qualification.md has their timing)."""
import json

import pytest

from oracle.zoo import write_hf_folder
from hybridqual.qualify import runner as qualify
from hybridqual.scenarios.plan import SCENARIOS

# Widths tiny enough for the Triton interpreter; chunk 256 as in HF's default and real Bamba / Granite-4.0-H.
CHUNK256 = dict(chunk_size=256, mamba_n_heads=2, mamba_head_dim=4, mamba_n_groups=1, mamba_d_state=4, n_attn_heads=2,
                n_kv_heads=1, attn_head_dim=4, attn_scale=0.5, rope_dim=2, hidden_size=8, mlp_intermediate_size=16,
                pattern="M*")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("chunk256") / "zoo256-bamba"
    write_hf_folder(path, "bamba", seed=0, **CHUNK256)
    return path


def run(folder, out, *extra):
    rc = qualify.main(["--model", str(folder), "--quiet", "--out", str(out), *extra])
    return rc, json.loads((out / "report.json").read_text())


def assert_whole_corpus(rep, names):
    assert [i["scenario"] for i in rep["instances"]] == names
    for inst in rep["instances"]:
        assert inst["skip_reason"] or inst["truth"], inst                  # ran against a truth, or said why not
    assert not [c for c in rep["checks"] if c["status"] == "FAIL"], [c for c in rep["checks"] if c["status"] == "FAIL"]


def test_every_scenario_instantiates_on_a_chunk_256_folder_or_says_why_not(folder):
    import oracle
    from oracle.trace import check_against_model
    cfg = oracle.from_hf_config(folder)
    insts = qualify.instances_for(folder, cfg, None, folder.name)
    assert [i.scenario for i in insts] == list(SCENARIOS)            # no ScenarioError line among them
    for inst in insts:
        assert inst.trace is not None or inst.skip_reason, inst.scenario
        if inst.trace is not None:
            check_against_model(inst.trace, cfg.vocab_size, cfg.chunk_size)     # the TraceError qualify used to hit


@pytest.mark.slow
def test_qualify_runs_the_whole_corpus_on_a_chunk_256_folder_with_the_oracle_engine(folder, tmp_path):
    """The harness end to end (truth, every check, report) on every scenario (slow: docs/qualification.md, "Current figures")."""
    rc, rep = run(folder, tmp_path / "oracle", "--engine", "oracle")
    assert rc == 0 and rep["status"] == "finished"
    assert_whole_corpus(rep, list(SCENARIOS))


@pytest.mark.slow
def test_the_fast_path_qualifies_a_chunk_256_scenario(folder, tmp_path):
    """The fast path in the interpreter qualifies one chunk-256 scenario end to end (slow on loaded cores)."""
    rc, rep = run(folder, tmp_path / "fast", "--scenario", "async_drain")
    assert rc == 0 and rep["passed"] >= 7, rep["checks"]


@pytest.mark.slow
def test_the_fast_path_qualifies_the_whole_corpus_on_a_chunk_256_folder(folder, tmp_path):
    rc, rep = run(folder, tmp_path / "fast-all")
    assert rc == 0
    assert_whole_corpus(rep, list(SCENARIOS))
