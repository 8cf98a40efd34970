"""The bs1 step account (hybridqual.bench.account): every parameter but the embedding table is counted once in
exactly one group's bytes, our kernels land in their groups, and the account's arithmetic (floor = bytes / copy
bandwidth, gap, time between kernels) holds on a made-up kernel table. The figures themselves come from a GPU."""
import dataclasses
import math

import pytest

from fastpath.engine.configs import named_config
from oracle.checkpoint import expected_shapes
from hybridqual.bench.account import GROUPS, OTHER, account, bytes_needed, group_of


@pytest.mark.parametrize("layers", [None, 4], ids=["anchor-3b", "its-4-layer-draft"])
def test_every_parameter_but_the_embedding_is_in_exactly_one_group(layers):
    c = named_config("anchor-3b")
    if layers:                                             # bench account --layers 4: bench spec's draft
        c = dataclasses.replace(c, layers=c.layers[:layers])
    need = bytes_needed(c, ctx=0)
    shapes = expected_shapes(c)
    params = sum(2 * math.prod(s) for n, s in shapes.items() if not n.startswith("embed"))
    state = len(c.mamba_layer_ids) * 2 * (c.mamba_n_heads * c.mamba_head_dim * c.mamba_d_state * 4
                                          + (c.d_inner + 2 * c.mamba_n_groups * c.mamba_d_state) * (c.mamba_d_conv - 1) * 2)
    kv = len(c.attention_layer_ids) * 2 * c.n_kv_heads * c.attn_head_dim * 2          # one written KV row, ctx 0
    assert sum(need.values()) == params + state + kv + c.vocab_size * 2 + c.hidden_size * 2
    assert bytes_needed(c, ctx=100)["attention decode + KV write"] == 101 * kv


def test_our_kernels_land_in_their_groups():
    want = {"gemv_kernel": GROUPS[0][0], "matmul_kernel": GROUPS[0][0], "ssm_step_kernel": "SSM state update",
            "conv1d_step_kernel": "conv step", "attention_decode_kernel": "attention decode + KV write",
            "kv_cache_write_kernel": "attention decode + KV write", "add_rms_norm_kernel": "norms",
            "rms_norm_gated_kernel": "norms", "act_mul_kernel": OTHER, "rope_kernel": OTHER}
    assert {k: group_of(k) for k in want} == want


def test_the_account_adds_up_on_a_made_up_table():
    need = {g: 0 for g, _ in GROUPS} | {OTHER: 0}
    need[GROUPS[0][0]] = 4_000_000                     # 4 MB at 4 TB/s: a 1 µs floor
    table = {"graphs": True, "wall_ms_per_step": 0.010,
             "top": [["gemv_kernel", 3.0, 5.0], ["ssm_step_kernel", 1.0, 2.0], ["weird", 2.0, 1.0]]}
    acc = account(table, need, copy_bps=4e12, param_bytes=8_000_000)
    rows = {r["group"]: r for r in acc["rows"]}
    assert rows[GROUPS[0][0]]["floor_us"] == 1.0 and rows[GROUPS[0][0]]["gap_us"] == 4.0
    assert rows[OTHER]["us"] == 1.0 and rows[OTHER]["launches"] == 2.0
    assert acc["kernel_sum_us"] == 8.0 and acc["between_kernels_us"] == 2.0 and acc["roofline_us"] == 2.0


def test_exclusive_times_add_up_to_the_union_of_overlapping_spans():
    from hybridqual.bench.engine import exclusive_us
    # b starts early (programmatic dependent launch) and waits in a's span; c nests in b; d after a gap.
    spans = [("a", 0.0, 10.0), ("b", 8.0, 15.0), ("c", 9.0, 12.0), ("d", 20.0, 21.0), ("a", 21.0, 23.0)]
    ex = exclusive_us(spans)
    assert ex == {"a": 12.0, "b": 5.0, "c": 0.0, "d": 1.0}
    assert sum(ex.values()) == 18.0                               # the union: [0, 15] + [20, 23]


def test_the_account_charges_overlap_once_and_counts_a_folded_groups_bytes_in_the_projections():
    need = {g: 0 for g, _ in GROUPS} | {OTHER: 0}
    need[GROUPS[0][0]], need["conv step"] = 4_000_000, 4_000_000
    table = {"graphs": True, "wall_ms_per_step": 0.010,
             "top": [["gemv_kernel", 3.0, 9.0], ["ssm_step_kernel", 1.0, 2.0]],
             "exclusive_us": {"gemv_kernel": 6.0, "ssm_step_kernel": 2.0}}
    acc = account(table, need, copy_bps=4e12, param_bytes=8_000_000)
    rows = {r["group"]: r for r in acc["rows"]}
    assert "conv step" not in rows and rows[GROUPS[0][0]]["folded_in"] == ["conv step"]
    assert rows[GROUPS[0][0]]["us"] == 6.0 and rows[GROUPS[0][0]]["floor_us"] == 2.0
    assert acc["kernel_sum_us"] == 8.0 and acc["between_kernels_us"] == 2.0


def test_the_verify_accounts_proposer_makes_every_step_verify_k_plus_1_positions_and_reject():
    """bench account's speculative step: scripted drafts that are all wrong, so each step pays a k+1-position
    verify and a rollback (the cost at 0% acceptance), on the fast path's own engine."""
    import torch
    from fastpath import Engine, FastModel
    from hybridqual.bench.account import missing_drafts
    from hybridqual.qualify.spec_checks import acceptance_rate
    from oracle import zoo
    from oracle.trace import EngineConfig, Request
    cfg = zoo.tiny_config("bamba")
    fast = FastModel(cfg, zoo.random_weights(cfg, seed=1), "cpu", torch.float32).with_options(backend="torch")
    eng = Engine(fast, EngineConfig(1, 64, 64, "async", missing_drafts(2, cfg.vocab_size, 40)), max_len=64)
    eng.add_request(Request("p", 0, tuple(range(1, 9)), 12))
    res = eng.run()
    accepted, proposed = acceptance_rate(eng.log)
    assert len(res.tokens["p"]) == 12 and proposed >= 2 * 10 and accepted <= proposed // 4, (accepted, proposed)


def test_versus_matches_groups_by_name_whatever_was_folded_into_them():
    from hybridqual.bench.account import versus
    need = {g: 1_000_000 for g, _ in GROUPS} | {OTHER: 0}
    dec = account({"graphs": True, "wall_ms_per_step": 0.010, "top": [["gemv_kernel", 3.0, 6.0]]}, need, 4e12, 1)
    ver = account({"graphs": True, "wall_ms_per_step": 0.020,
                   "top": [["gemv_kernel", 3.0, 7.0], ["conv1d_step_kernel", 3.0, 2.0]]}, need, 4e12, 1)
    lines = {ln[:56].strip(): float(ln[56:]) for ln in versus(dec, ver)[1:]}
    assert lines[GROUPS[0][0]] == 1.0 and lines["conv step"] == 2.0 and lines["step"] == 10.0
    assert lines["idle between kernels"] == (20.0 - 9.0) - (10.0 - 6.0)


@pytest.mark.parametrize("bad", ["-1", "999"])
def test_layers_out_of_range_is_refused_by_name(bad, capsys):
    from hybridqual.bench.account import main
    assert main(["--layers", bad]) == 2
    assert f"--layers {bad}: must be in [0, " in capsys.readouterr().err


def test_flip_takes_only_run_time_switches_and_names_a_bad_one(capsys):
    from hybridqual.bench.account import main
    for bad in ("nope", "fold_gains", "backend"):
        assert main(["--flip", bad]) == 2
        assert f"--flip {bad}: not one of " in capsys.readouterr().err
