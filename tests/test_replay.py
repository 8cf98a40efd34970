"""The replay debugger localises a deliberately corrupted engine: step, request, layer and tensor."""
import pytest
import torch

import oracle
from broken_engines import compact_without_moving_slots
from fastpath.engine.engine import Engine
from fastpath.engine.rows import RowTable
from hybridqual.goldens import regen as goldens
from hybridqual.replay import bisect, first_log_difference, step_table

MODEL = goldens.MODELS / "zoo-bamba"
TRACE = goldens.TRACES / "seed_compaction.json"


@pytest.fixture(scope="module")
def setup():
    trace = oracle.load_trace(TRACE)
    return trace, oracle.load(MODEL, dtype=torch.float64), Engine.from_pretrained(MODEL, trace.engine, device="cpu")


@pytest.mark.parametrize("mode", ["legacy", "async"])
def test_bisection_finds_nothing_on_a_correct_engine(setup, mode):
    trace, omodel, engine = setup
    assert bisect(engine, trace, mode, omodel, rtol=1e-4) is None


def test_bisection_names_step_request_and_ssm_state_when_slot_mapping_is_not_moved(setup, monkeypatch):
    trace, omodel, engine = setup
    monkeypatch.setattr(RowTable, "compact", compact_without_moving_slots)
    d = bisect(engine, trace, "legacy", omodel, rtol=1e-4)
    assert d is not None, "the corrupted engine went unnoticed"
    # seed scenario: r1 finishes when step 3 resolves; r2 moves row 2 -> 1 and, without its slot, is computed
    # nowhere at step 4, so its state (admitted to slot 2) is one token behind after step 4.
    assert (d.step, d.request, d.slot) == (4, "r2", 2), d.describe()
    assert d.layer == omodel.config.mamba_layer_ids[0] and d.kind == "mamba"
    assert d.tensors[0][0] == "ssm_state", d.describe()


def test_log_difference_and_table_name_the_step():
    trace = oracle.load_trace(TRACE)
    log = oracle.run_trace(oracle.load(MODEL), trace, mode="legacy").schedule_log.to_json()
    assert first_log_difference(log, log) is None
    import copy
    bad = copy.deepcopy(log)
    bad["steps"][3]["moves"][0]["slot"] = 0
    assert first_log_difference(bad, log).startswith("step 3: moves")
    table = step_table(log)
    assert "r2→r1(r2,s2)" in table and len(table.splitlines()) == len(log["steps"]) + 1


def test_rel_diff_compares_across_devices_on_the_cpu():
    from hybridqual.replay import rel_diff
    a = torch.ones(3, dtype=torch.float32)
    assert rel_diff(a, a.double()) == 0.0 and rel_diff(a * 2, a) == 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bisection_on_cuda_keeps_one_device_and_still_localises_the_defect(monkeypatch):
    trace, omodel = oracle.load_trace(TRACE), oracle.load(MODEL, dtype=torch.float64)
    engine = Engine.from_pretrained(MODEL, trace.engine, device="cuda", dtype=torch.float32)
    assert bisect(engine, trace, "legacy", omodel, rtol=1e-4) is None
    monkeypatch.setattr(RowTable, "compact", compact_without_moving_slots)
    d = bisect(engine, trace, "legacy", omodel, rtol=1e-4)
    assert d is not None and (d.step, d.request, d.slot) == (4, "r2", 2), d and d.describe()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replay_cli_runs_on_cuda_and_on_cpu_on_a_gpu_machine(capsys):
    import subprocess
    import sys
    for device in ("cuda", "cpu"):
        p = subprocess.run([sys.executable, "-m", "hybridqual.replay", str(TRACE), "--model", str(MODEL), "--device",
                            device, "--no-table"], cwd=goldens.ROOT, capture_output=True, text=True, timeout=600,
                           env={k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"})
        assert "Traceback" not in p.stderr, p.stderr[-3000:]
        assert "== layer bisection (state rtol" in p.stdout, (device, p.stdout[-3000:])
        # fp32 through the interpreter on the CPU is the CPU tier's arithmetic: it must pass; bf16 on cuda must
        # reach a verdict (its state tolerance is the bf16 one)
        assert "REPLAY PASSED" in p.stdout or device == "cuda", p.stdout[-3000:]
