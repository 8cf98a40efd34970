"""FastOptions: how the fast path runs is a frozen object passed in, not class attributes or a module
global — bad fields are named, the backend reaches every op of the kernel boundary (and only that backend runs),
two models with different options coexist in one process, and batch invariance holds under TP's model too."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fastpath.engine.ops as ops  # noqa: E402
import fastpath.engine.torch_ops as torch_ops  # noqa: E402
import fastpath.model as fm  # noqa: E402
from fastpath import Engine, FastModel, FastOptions  # noqa: E402
from fastpath.options import OptionsError  # noqa: E402
from fastpath.tp import TPModel  # noqa: E402
from oracle import zoo  # noqa: E402
from oracle.trace import EngineConfig, Request, Trace  # noqa: E402

SMALL = dict(pattern="M*", hidden_size=16, mamba_n_heads=2, mamba_n_groups=1, n_attn_heads=2, n_kv_heads=1)
# prefill (a: two pieces), then decode rows beside b's prefill, then decode only: every op of the boundary runs
TRACE = Trace(EngineConfig(2, 16, 8, "legacy"), (Request("a", 0, tuple(range(3, 14)), 3),
                                                  Request("b", 1, (5, 9, 2), 2)))
TRITON_OPS = ("_conv_step", "_conv_varlen", "_ssm_step", "_ssd_varlen", "_ssd_chunk_table", "_rms_norm_gated",
              "_rope", "_attn_decode", "_attn_prefill", "_greedy_sample")
TORCH_OPS = ("conv_step", "conv_varlen", "ssm_step", "ssd_varlen", "rms_norm_gated", "attention_varlen")


@pytest.mark.parametrize("kw,field", [(dict(backend="tpu"), "backend"), (dict(backend=None), "backend"),
                                      (dict(fused=1), "fused"), (dict(fold_norm="no"), "fold_norm"),
                                      (dict(batch_invariant=None), "batch_invariant")])
def test_bad_option_values_name_the_field(kw, field):
    with pytest.raises(OptionsError, match=rf"^options\.{field}:"):
        FastOptions(**kw)


def test_options_are_frozen_and_replace_names_unknown_fields():
    o = FastOptions()
    with pytest.raises(AttributeError):
        o.fused = False                                       # frozen: nothing to flip
    with pytest.raises(OptionsError, match=r"^options\.fuse: no such option"):
        o.replace(fuse=False)
    cfg = zoo.tiny_config("bamba", **SMALL)
    with pytest.raises(OptionsError, match=r"^options: must be a fastpath.FastOptions, got dict"):
        FastModel(cfg, zoo.random_weights(cfg, seed=0), "cpu", torch.float32, {"backend": "torch"})


def _forbid(monkeypatch, module, names, calls):
    for n in names:
        def boom(*a, _n=n, **k):
            calls.append(_n)
            raise AssertionError(f"{_n} called")
        monkeypatch.setattr(module, n, boom)


def test_torch_backend_reaches_every_op_and_no_triton_kernel_runs(monkeypatch):
    """A FastModel built with backend="torch" runs a prefill + mixed + decode trace without one Triton wrapper
    call, while a default model of the same weights in the same process still runs the Triton kernels."""
    cfg = zoo.tiny_config("bamba", **SMALL)
    w = zoo.random_weights(cfg, seed=2)
    triton_model = FastModel(cfg, w, "cpu", torch.float32)
    torch_model = triton_model.with_options(backend="torch")
    assert torch_model.w is triton_model.w and triton_model.options.backend == "triton"      # shared, unchanged
    seen = []
    for n in TORCH_OPS:                                       # which stand-ins the torch model reaches
        real = getattr(torch_ops, n)
        monkeypatch.setattr(torch_ops, n, lambda *a, _r=real, _n=n, **k: seen.append(_n) or _r(*a, **k))
    calls: list[str] = []
    with monkeypatch.context() as m:
        _forbid(m, ops, TRITON_OPS, calls)
        got = Engine(torch_model, TRACE.engine, max_len=32).run_trace(TRACE)
    assert calls == [] and set(seen) == set(TORCH_OPS), (calls, set(TORCH_OPS) - set(seen))
    with monkeypatch.context() as m:                          # and the Triton model never takes a stand-in
        _forbid(m, torch_ops, TORCH_OPS, calls)
        want = Engine(triton_model, TRACE.engine, max_len=32).run_trace(TRACE)
    assert calls == [] and want.digest == got.digest


def test_with_options_cannot_change_what_was_applied_at_load():
    cfg = zoo.tiny_config("bamba", **SMALL)
    model = FastModel(cfg, zoo.random_weights(cfg, seed=0), "cpu", torch.float32)
    with pytest.raises(OptionsError, match=r"^options\.fold_gains"):
        model.with_options(fold_gains=False)
    assert model.with_options(gemv=False).options == FastOptions(gemv=False) and model.options == FastOptions()


def test_batch_invariant_option_routes_tp_models_projections_to_the_fixed_tile_matmul(monkeypatch):
    """TPModel + batch_invariant: every dense projection goes to the fixed-tile matmul and never the GEMV (the
    mixin class this replaces came after FastModel in the MRO, so TP silently kept F.linear)."""
    cfg = zoo.tiny_config("bamba", **SMALL)
    used = []
    real = fm.matmul
    monkeypatch.setattr(fm, "matmul", lambda x, w, b=None: used.append(tuple(w.shape)) or real(x, w, b))
    tp = TPModel(cfg, zoo.random_weights(cfg, seed=0), "cpu", torch.float32, rank=0, tp=1,
                 options=FastOptions(batch_invariant=True, gemv_on_cpu=True))
    assert tp.options.batch_invariant and not tp.options.fold_norm
    x = torch.randn(1, cfg.hidden_size)
    assert not tp._gemv_ok(x)
    tp._linear(x, "layers.0.mamba.in_proj")
    assert used == [tuple(tp.w["layers.0.mamba.in_proj.weight"].shape)]
    plain = TPModel(cfg, zoo.random_weights(cfg, seed=0), "cpu", torch.float32, rank=0, tp=1)
    used.clear()
    plain._dense(x, plain.w["layers.0.mamba.in_proj.weight"])
    assert used == []
