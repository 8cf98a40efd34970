"""zoo-corners (oracle/zoo.py SHIPPED["corners"]): the corners no other shipped model sets are really set, the
oracle clamps dt to time_step_limit (not time_step_min), and the fast path follows the oracle through them."""
from __future__ import annotations

import json

import pytest
import torch

import oracle
from oracle.trace import load_trace
from hybridqual.paths import MODELS, OUTPUTS, TRACES

CORNERS = MODELS / "zoo-corners"


def test_the_corner_model_sets_one_group_a_conv_of_three_and_dt_below_time_step_min():
    cfg = json.loads((CORNERS / "config.json").read_text())
    assert cfg["n_groups"] == 1 and cfg["conv_kernel"] == 3
    assert cfg["time_step_min"] == 0.001 and cfg["time_step_limit"][0] == 0.0     # as Nemotron-H's real configs
    c = oracle.from_hf_config(CORNERS / "config.json")
    assert (c.mamba_n_groups, c.mamba_d_conv, c.dt_limit) == (1, 3, (0.0, float("inf")))
    others = [p for p in MODELS.iterdir() if (p / "config.json").exists() and p != CORNERS]
    zoo = [p for p in others if p.name.startswith("zoo-")]      # (the trained tiny-sort has one group too)
    assert zoo and all(oracle.from_hf_config(p / "config.json").mamba_n_groups != 1 for p in zoo)
    assert all(oracle.from_hf_config(p / "config.json").mamba_d_conv == 4 for p in others)


def test_the_oracle_keeps_dt_below_time_step_min_where_the_limit_allows_it(monkeypatch):
    """The processed dt of the shifted heads goes below 0.001 in a prefill (the oracle applies time_step_limit);
    floored there instead, the logits change."""
    import oracle.mamba2 as m2
    seen = []
    orig = m2.process_dt
    monkeypatch.setattr(m2, "process_dt", lambda *a: seen.append(orig(*a)) or seen[-1])
    model = oracle.load(CORNERS)
    prompt = list(range(3, 30))
    want, _ = model.prefill(prompt)
    dts = torch.cat([d.flatten() for d in seen])
    assert 0.1 < (dts < 1e-3).double().mean() < 0.9
    monkeypatch.setattr(m2, "process_dt", lambda raw, bias, lim: orig(raw, bias, (1e-3, lim[1])))
    floored, _ = oracle.load(CORNERS).prefill(prompt)
    assert (floored - want).abs().max() > 1e-4


@pytest.mark.parametrize("name", ["seed_compaction", "chunked_prefill"])
def test_the_corner_model_through_the_engine_equals_the_oracle(name):
    """The fast path (plain-torch kernels) on zoo-corners, both modes: tokens as the shipped goldens, and every
    sampled row's logits within qualify's fp32 bound of the fp64 oracle's (teacher-forced on the same tokens)."""
    import fastpath
    from fastpath.options import FastOptions
    from hybridqual.qualify.compare import LOGITS_C, teacher_forced_logits
    trace = load_trace(TRACES / f"{name}.json")
    golden = json.loads((OUTPUTS / "zoo-corners" / f"{name}.json").read_text())
    eng = fastpath.Engine.from_pretrained(CORNERS, trace.engine, max_len=128, options=FastOptions(backend="torch"))
    truth = oracle.load(CORNERS)
    for mode in ("legacy", "async"):
        rows: dict[tuple[str, int], torch.Tensor] = {}

        def record(batch, logits):
            for j, b in enumerate(batch):
                if b.kind in ("decode", "prefill"):
                    rows[(b.request, b.pos + b.count)] = logits[j].detach().double().clone()
        eng.on_logits = record
        got = eng.run_trace(trace, mode)
        eng.on_logits = None
        assert got.tokens == {rid: v["tokens"] for rid, v in golden["requests"].items()}, mode
        for r in trace.requests:
            want = teacher_forced_logits(truth, r.prompt, got.tokens[r.id])
            mine = torch.stack([rows[(r.id, len(r.prompt) + i)] for i in range(len(got.tokens[r.id]))])
            bound = LOGITS_C[torch.float32] * max(1.0, want.std().item())
            assert (mine - want).abs().max().item() <= bound, (mode, r.id)
