"""Cache geometry (DESIGN §21): a Mamba checkpoint block Bm beside an attention block Ba; checkpoints exist only where
both a Mamba state and whole KV blocks do, at multiples of lcm(Bm, Ba), and a hit restores the state of its own
position (goldens/traces/prefix_geometry.json: Bm 8, Ba 16)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import oracle  # noqa: E402
from fastpath import Engine  # noqa: E402
from oracle.scheduler import run_request_alone, run_trace  # noqa: E402
from oracle.schedule_log import first_difference  # noqa: E402
from oracle.trace import TraceError, load_trace, parse_trace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BAMBA = ROOT / "goldens" / "models" / "zoo-bamba"
TRACE = ROOT / "goldens" / "traces" / "prefix_geometry.json"


@pytest.fixture(scope="module")
def truth():
    return oracle.load(BAMBA)


def _events(result) -> tuple[dict[str, int], list[int]]:
    steps = result.schedule_log.to_json()["steps"]
    cached = {a["request"]: a["cached_tokens"] for s in steps for a in s.get("admit", [])}
    stored = [e["pos"] for s in steps for e in (s.get("prefix_cache") or {}).get("stored", [])]
    return cached, stored


def test_stores_and_hits_only_at_multiples_of_the_lcm_of_both_blocks(truth):
    """With Bm 8 and Ba 16 the oracle stores only at 16 and 32, resumes hit32 at 32 and hit16b at 16 (not 24), and
    caches nothing for miss8, whose 12 shared tokens cover a Mamba block but no whole KV block."""
    res = run_trace(truth, load_trace(TRACE), "legacy")
    cached, stored = _events(res)
    assert cached == {"r0": 0, "hit32": 32, "hit16": 16, "miss8": 0, "hit16b": 16}
    assert sorted(stored) == [16, 16, 32] and all(p % 16 == 0 for p in stored)


def test_geometry_hits_keep_each_requests_own_tokens(truth):
    """Every request's tokens with the cache equal its run alone (DESIGN §12 truth), at both granularities."""
    t = load_trace(TRACE)
    res = run_trace(truth, t, "legacy")
    for r in t.requests:
        assert res.tokens[r.id] == run_request_alone(truth, r)[0], r.id


def test_fast_path_geometry_log_and_tokens_equal_the_oracle(truth):
    """The fast path files the same checkpoints and hits at lcm(Bm, Ba) as the oracle, with the same tokens."""
    t = load_trace(TRACE)
    eng = Engine.from_pretrained(BAMBA, t.engine, device="cpu", dtype=torch.float32, max_len=64)
    got, want = eng.run_trace(t, "legacy"), run_trace(truth, t, "legacy")
    assert first_difference(got.schedule_log, want.schedule_log) is None
    assert got.tokens == want.tokens


@pytest.mark.parametrize("attn, ok", [(16, True), (4, True), (8, True), (12, False), (0, False), ("16", False)])
def test_attention_block_size_divides_the_mamba_block_or_is_a_multiple(attn, ok):
    obj = {"schema": "hybridqual.trace/1",
           "engine": {"max_requests": 1, "max_tokens_per_step": 16, "prefill_chunk": 8,
                      "prefix_cache": {"block_size": 8, "capacity": 1, "attention_block_size": attn}},
           "requests": [{"id": "a", "arrival_step": 0, "prompt": [1, 2, 3], "max_new_tokens": 1}]}
    if ok:
        pc = parse_trace(obj).engine.prefix_cache
        assert pc.checkpoint_block == max(8, attn) and pc.to_json()["attention_block_size"] == attn
    else:
        with pytest.raises(TraceError, match=r"^engine\.prefix_cache\.attention_block_size: "):
            parse_trace(obj)
