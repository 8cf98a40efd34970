"""The replay debugger on speculative traces (DESIGN §13): the table shows each verify row's
proposals and each step's accepted counts, and the bisection checks every verify row right after its rollback (the
copy of its last accepted input's snapshot, or none), so a rollback defect is named by step, stage, layer and
tensor (conv state vs SSM state vs KV)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from fastpath import Engine, FastModel
from fastpath.engine.verify import PositionSnapshots, _attention as REAL_ATTENTION
from oracle import zoo
from oracle.model import OracleModel
from oracle.scheduler import run_trace as oracle_run
from oracle.trace import load_trace
from hybridqual.goldens import regen as goldens
from hybridqual.replay import ROLLBACK_NONE, ROLLBACK_RESTORE, bisect, step_table

TRACE = goldens.TRACES / "spec_scripted.json"      # made for this tiny Bamba (seed 3): rejections at first/last
ENGINE_MODEL = dict(pattern="M*", hidden_size=16, mamba_n_heads=2, mamba_n_groups=1, n_attn_heads=2, n_kv_heads=1)


@pytest.fixture(scope="module")
def setup():
    cfg = zoo.tiny_config("bamba", **ENGINE_MODEL)
    w = zoo.random_weights(cfg, seed=3)
    trace = load_trace(TRACE)
    fast = FastModel(cfg, w, "cpu", torch.float32).with_options(backend="torch")
    return trace, OracleModel(cfg, w, dtype=torch.float64), Engine(fast, trace.engine, max_len=32)


def restore_without_conv(self, j: int, r: int, slot: int) -> None:
    """PositionSnapshots.restore with the bug: the SSM state comes back, the conv window keeps the rejected drafts."""
    self.bank.ssm_state[:, slot].copy_(self.ssm[:, j, r])


def restore_without_ssm(self, j: int, r: int, slot: int) -> None:
    """PositionSnapshots.restore with the bug: the conv window comes back, the SSM state stays at the last draft."""
    self.bank.conv_state[:, slot].copy_(self.conv[:, j, r])


def test_table_shows_each_verify_rows_proposals_and_the_accepted_counts(setup):
    trace, omodel, _ = setup
    log = oracle_run(omodel, trace).schedule_log.to_json()
    table = step_table(log).splitlines()
    verify = [s for s in log["steps"] if "verify" in s]
    assert verify
    for s in verify:
        line = table[1 + s["step"]]
        for b in s["batch"]:
            if b["kind"] == "verify":
                assert f"{b['request']}@{b['slot']} v{b['pos']}+{b['count']}[{','.join(map(str, b['proposals']))}]" \
                    in line, line
        assert "accepted " + " ".join(f"{v['request']}:{v['accepted']}" for v in s["verify"]) in line, line


def test_bisection_passes_a_correct_speculative_engine(setup):
    trace, omodel, engine = setup
    assert bisect(engine, trace, "legacy", omodel, rtol=1e-4) is None
    assert "rollback" not in engine.spec.__dict__ and "restore" not in engine.spec.snap.__dict__   # unhooked


@pytest.mark.parametrize("bug,tensor", [(restore_without_conv, "conv_state"), (restore_without_ssm, "ssm_state")],
                         ids=["conv_not_rolled_back", "ssm_not_rolled_back"])
def test_bisection_names_the_state_a_broken_rollback_left_behind(setup, monkeypatch, bug, tensor):
    """The first rejected draft's rollback: right after the snapshot copy, only the tensor the bug forgot differs, in
    the first Mamba layer (the other Mamba tensor is still right, and the attention KV is never rolled back)."""
    trace, omodel, engine = setup
    monkeypatch.setattr(PositionSnapshots, "restore", bug)
    d = bisect(engine, trace, "legacy", omodel, rtol=1e-4)
    assert d is not None, "the broken rollback went unnoticed"
    assert d.stage == ROLLBACK_RESTORE and d.kind == "mamba" and d.layer == omodel.config.mamba_layer_ids[0]
    assert [n for n, _ in d.tensors] == [tensor], d.describe()
    assert tensor in d.describe() and "after copying the last accepted input's snapshot" in d.describe()


def attention_one_late(model, i, u, vb, bank):
    """The verify forward's attention with the bug: every draft position's K/V (and RoPE) is placed one position
    late (p+j+1 for j >= 1), so the drafts' K/V land on the wrong positions."""
    pos = vb.pos.clone()
    pos[vb.nb:] += 1
    return REAL_ATTENTION(model, i, u, dataclasses.replace(vb, pos=pos), bank)


def test_bisection_names_the_kv_when_the_verify_writes_it_at_the_wrong_positions(setup, monkeypatch):
    """The Mamba states are right (they do not depend on positions) and the attention layer's K/V is wrong: the
    bisection names k_cache at the first verify row's rollback check."""
    from fastpath.engine import verify
    trace, omodel, engine = setup
    monkeypatch.setattr(verify, "_attention", attention_one_late)
    d = bisect(engine, trace, "legacy", omodel, rtol=1e-4)
    assert d is not None and d.stage in (ROLLBACK_RESTORE, ROLLBACK_NONE), d and d.describe()
    assert d.kind == "attention" and d.layer == omodel.config.attention_layer_ids[0], d.describe()
    assert d.tensors[0][0] == "k_cache", d.describe()
