"""The engine builds the SSD chunk table once per prefill step from the host lists it already has (slots checked
there), so no Mamba layer's ssd_varlen / causal_conv1d_varlen reads its metadata back from the device: on CPU by
recording every host read those wrappers make, on the GPU with torch.cuda.set_sync_debug_mode("error") around
every launch of a Mamba-only model's prefill steps; a hybrid's attention wrapper reads host lists too."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fastpath.kernels.conv1d as conv_mod  # noqa: E402
import fastpath.kernels.ssd as ssd_mod  # noqa: E402
from fastpath import Engine, FastModel  # noqa: E402
from fastpath.engine import ops  # noqa: E402
from oracle import zoo  # noqa: E402
from oracle.trace import EngineConfig, Request, Trace  # noqa: E402

SMALL = dict(hidden_size=16, mamba_n_heads=2, mamba_n_groups=1)
# three prefill pieces for "a" (8 + 8 + 4 tokens), one for "b"; one new token each, so every step is a prefill step
TRACE = Trace(EngineConfig(2, 16, 8, "legacy"), (Request("a", 0, tuple(range(3, 23)), 1),
                                                  Request("b", 1, (5, 9, 11, 2, 7), 1)))


def test_prefill_steps_read_no_device_metadata_in_the_mamba_layers(monkeypatch):
    """Every ssd_varlen / causal_conv1d_varlen call of the run converts only host lists (never a device tensor)
    and the chunk table is built once per prefill step, not once per layer; without the step's table (one short
    step) the wrappers do read device metadata, so the spy can fail."""
    cfg = zoo.tiny_config("mamba2", **SMALL)
    model = FastModel(cfg, zoo.random_weights(cfg, seed=1), "cpu", torch.float32)
    reads, tables, ssd_calls = [], [], []
    for mod in (ssd_mod, conv_mod):
        real = mod.host_ints

        def spy(op, name, t, real=real):
            if isinstance(t, torch.Tensor):
                reads.append((op, name))
            return real(op, name, t)
        monkeypatch.setattr(mod, "host_ints", spy)
    real_table, real_ssd = ops.ssd_chunk_table, ops.ssd_varlen
    monkeypatch.setattr(ops, "ssd_chunk_table", lambda *a, **k: tables.append(1) or real_table(*a, **k))
    monkeypatch.setattr(ops, "ssd_varlen", lambda *a, **k: ssd_calls.append(k.get("table")) or real_ssd(*a, **k))
    got = Engine(model, TRACE.engine, max_len=32).run_trace(TRACE)
    steps = [s for s in got.schedule_log.to_json()["steps"] if s["batch"]]
    assert reads == [], f"device metadata read back on the host: {reads}"
    assert len(tables) == len(steps) >= 3 and all(b["kind"] == "prefill" for s in steps for b in s["batch"])
    assert len(ssd_calls) == len(cfg.mamba_layer_ids) * len(steps) and all(t is not None for t in ssd_calls)
    assert all(t.slots_checked for t in ssd_calls)
    monkeypatch.setattr(ops, "ssd_chunk_table", lambda *a, **k: None)       # per-call validation, per layer
    one = Trace(TRACE.engine, TRACE.requests[1:])
    Engine(model, one.engine, max_len=32).run_trace(one)
    assert {op for op, _ in reads} == {"ssd_varlen", "causal_conv1d_varlen"}, reads


def test_hybrid_prefill_steps_read_no_device_metadata_in_the_attention_layers(monkeypatch):
    """A hybrid's attention_prefill_varlen gets the step's host lists (cu_seqlens, slot, start_pos) from the
    packer, so its wrapper converts only lists (it used to read three device tensors back per layer); a call
    without them does read the tensors, so the spy can fail. The token -> piece index is built once per step by
    the packer, never per conv or attention layer."""
    import fastpath.kernels._common as common_mod
    import fastpath.kernels.attention as attn_mod
    cfg = zoo.tiny_config("bamba", pattern="M*", hidden_size=16, mamba_n_heads=2, mamba_n_groups=1, n_attn_heads=2,
                          n_kv_heads=1)
    model = FastModel(cfg, zoo.random_weights(cfg, seed=1), "cpu", torch.float32)
    reads, calls = [], []
    real = attn_mod.host_ints

    def spy(op, name, t):
        calls.append(name)
        if isinstance(t, torch.Tensor):
            reads.append(name)
        return real(op, name, t)
    monkeypatch.setattr(attn_mod, "host_ints", spy)
    built = {"step": 0, "layer": 0}
    real_index = common_mod.token_sequence_index

    def index(where):
        return lambda *a: built.__setitem__(where, built[where] + 1) or real_index(*a)
    monkeypatch.setattr(common_mod, "token_sequence_index", index("step"))
    monkeypatch.setattr(attn_mod, "token_sequence_index", index("layer"))
    monkeypatch.setattr(conv_mod, "token_sequence_index", index("layer"))
    one = Trace(TRACE.engine, TRACE.requests[1:])
    got = Engine(model, one.engine, max_len=32).run_trace(one)
    assert calls and reads == [], f"device metadata read back on the host: {reads}"
    steps = sum(1 for s in got.schedule_log.to_json()["steps"] if s["batch"])
    assert built == {"step": steps, "layer": 0}, built
    q = torch.zeros(2, 2, 8)
    kc = torch.zeros(1, 4, 1, 8)
    attn_mod.attention_prefill_varlen(q, q[:, :1], q[:, :1], kc, kc.clone(), torch.tensor([0, 2]),
                                      torch.tensor([0]), torch.tensor([0]), 1.0)
    assert reads == ["cu_seqlens", "slot", "start_pos"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["mamba2", "bamba"])
def test_prefill_step_launch_has_no_host_sync_under_sync_debug_mode(arch):
    """set_sync_debug_mode("error") around every launch (pack, one pinned H2D copy, table, forward, sample, token
    copy) of a Mamba-only model's and a hybrid's prefill steps: any synchronising CUDA call raises. Warm-up run
    first."""
    extra = dict(pattern="M*", n_attn_heads=2, n_kv_heads=1) if arch == "bamba" else {}
    cfg = zoo.tiny_config(arch, **SMALL, **extra)
    engine = Engine(FastModel(cfg, zoo.random_weights(cfg, seed=1), "cuda", torch.bfloat16), TRACE.engine,
                    max_len=32)
    want = engine.run_trace(TRACE)
    real_launch = engine.launch

    def launch(*a, **k):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real_launch(*a, **k)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    engine.launch = launch
    got = engine.run_trace(TRACE)
    assert got.tokens == want.tokens and got.digest == want.digest
    assert sum(1 for s in got.schedule_log.to_json()["steps"] if s["batch"]) >= 3
