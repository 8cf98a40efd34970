"""Megatron-Core 0.19.2's pause / evict path under a small KV budget (DESIGN §18 through Megatron; marker `megatron`,
run in .venv-megatron, docs/megatron.md "Preemption"): the adapter's budget gives Megatron exactly the trace's
engine.kv_tokens in blocks; with no paused blocks a request that needs a block is evicted and recomputed from
prompt + its tokens in a fresh, zeroed Mamba slot; with paused blocks it is paused in place and resumes from the
state it kept. Either way each request's tokens are the golden ones (each request alone)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridqual.adapters.megatron import available

pytestmark = [pytest.mark.megatron,
              pytest.mark.skipif(available() is not None, reason=f"megatron-core not importable: {available()}")]

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "goldens" / "models" / "zoo-bamba"
TRACE = ROOT / "goldens" / "traces" / "preempt_recompute.json"


def _golden() -> dict[str, list[int]]:
    golden = json.loads((ROOT / "goldens" / "outputs" / "zoo-bamba" / "preempt_recompute.json").read_text())
    return {rid: r["tokens"] for rid, r in golden["requests"].items()}


def _lives(facts: list[dict]) -> dict[str, list[list[dict]]]:
    """Each request's rows split where it starts again at position 0 (a recompute after an eviction)."""
    from hybridqual.adapters.megatron.schedule_facts import rows_by_request
    out: dict[str, list[list[dict]]] = {}
    for name, rows in rows_by_request(facts).items():
        lives: list[list[dict]] = []
        for r in rows:
            if not lives or r["pos"] == 0:
                lives.append([])
            lives[-1].append(r)
        out[name] = lives
    return out


@pytest.mark.parametrize("name,paused", [("MegatronPreemptAdapter", 0), ("MegatronPauseAdapter", 2)])
def test_the_kv_budget_is_the_traces_kv_tokens_in_blocks(name, paused):
    """kv_tokens 40 in blocks of 8: 5 active blocks, and the paused blocks the adapter reserves."""
    from oracle.trace import load_trace
    from hybridqual.adapters import megatron
    adapter = getattr(megatron, name)(MODEL, load_trace(TRACE), "legacy", "cpu")
    alloc = adapter.engine.context.kv_block_allocator
    assert (alloc.active_count, alloc.paused_count) == (5, paused)


def test_an_evicted_request_is_recomputed_in_a_fresh_slot_and_keeps_the_golden_tokens():
    """megatron-preempt: at least one request is evicted after it generated tokens, comes back at position 0 with
    prompt + those tokens as its prompt (in the slot Megatron gives it then), and every request's tokens are the
    golden ones."""
    from oracle.trace import load_trace
    from hybridqual.adapters.megatron import MegatronPreemptAdapter
    trace = load_trace(TRACE)
    result = MegatronPreemptAdapter(MODEL, trace, "legacy", "cpu").run_trace()
    assert sum(f["evicted"] for f in result.schedule_facts) >= 1, result.schedule_facts
    recomputed = {name: lives for name, lives in _lives(result.schedule_facts).items() if len(lives) > 1}
    assert recomputed, "no request was recomputed"
    for name, lives in recomputed.items():
        first_len = len(trace.request(name).prompt)
        done_before = sum(r["tokens"] for r in lives[0]) - first_len + 1      # tokens emitted in the first life
        assert lives[1][0]["tokens"] == first_len + done_before, (name, lives)  # one piece: prompt + its tokens
    assert result.tokens == _golden()


def test_a_paused_request_resumes_from_the_state_it_kept_and_keeps_the_golden_tokens():
    """megatron-pause: a request is left out of at least one step while it lives (paused), resumes at the position
    it stopped at in the same Mamba slot, and every request's tokens are the golden ones."""
    from oracle.trace import load_trace
    from hybridqual.adapters.megatron import MegatronPauseAdapter
    result = MegatronPauseAdapter(MODEL, load_trace(TRACE), "legacy", "cpu").run_trace()
    assert any(f["paused"] for f in result.schedule_facts)
    resumed = []
    for name, lives in _lives(result.schedule_facts).items():
        for life in lives:
            resumed += [(name, a["step"], b["step"]) for a, b in zip(life, life[1:])
                        if b["step"] > a["step"] + 1 and b["pos"] == a["pos"] + a["tokens"]
                        and b["mamba_slot"] == a["mamba_slot"]]
    assert resumed, _lives(result.schedule_facts)
    assert result.tokens == _golden()


def test_limit_an_evicted_requests_recompute_has_no_prefix_hashes():
    """Limit (docs/findings.md, Megatron "Limits found"): the request an eviction checkpoints (prompt + generated
    tokens, inference_request.py:657-711) is built without block_size_tokens / enable_prefix_caching, so it has no
    block hashes: with prefix caching on, the recompute neither looks up nor stores a prefix. Fails once 0.19.2's
    checkpoint carries the hashes."""
    import torch
    from megatron.core.inference.inference_request import DynamicInferenceRequest, DynamicInferenceRequestRecord
    from megatron.core.inference.sampling_params import SamplingParams
    req = DynamicInferenceRequest(request_id=0, prompt_tokens=torch.arange(3, 19), sampling_params=SamplingParams(
        num_tokens_to_generate=8), block_size_tokens=8, enable_prefix_caching=True)
    assert len(req.precomputed_block_hashes) == 2                  # 16 prompt tokens: two whole blocks hashed
    req.generated_tokens = list(range(40, 48))
    record = DynamicInferenceRequestRecord.from_request(req)
    record.checkpoint()
    resumed = record[-1]
    assert resumed.prompt_tokens.tolist() == list(range(3, 19)) + list(range(40, 48))
    assert not resumed.enable_prefix_caching and resumed.precomputed_block_hashes == []


def test_limit_an_evicted_request_recomputes_from_0_though_its_prompt_block_is_still_cached():
    """The same limit in a run: megatron-preempt with prefix caching on (blocks of 8). r0's 8-token prompt is one
    whole block whose Mamba state Megatron caches; when r0 is re-admitted after its eviction that block is still
    cached (hash and state), yet r0's recompute has no hashes and prefills all its tokens from 0: no hit."""
    import torch
    from oracle.trace import load_trace
    from megatron.core.inference.inference_request import DynamicInferenceRequest
    from megatron.core.inference.sampling_params import SamplingParams
    from hybridqual.adapters.megatron import MegatronPreemptAdapter

    class PrefixPreempt(MegatronPreemptAdapter):
        prefix_caching = True
    trace = load_trace(TRACE)
    adapter = PrefixPreempt(MODEL, trace, "legacy", "cpu")
    block0 = DynamicInferenceRequest(request_id=99, prompt_tokens=torch.tensor(trace.request("r0").prompt),
                                     sampling_params=SamplingParams(num_tokens_to_generate=1), block_size_tokens=8,
                                     enable_prefix_caching=True).precomputed_block_hashes[0]
    ctx, orig, seen = adapter.engine.context, adapter.engine.step_modern, []

    def step(*a, **k):
        bid = ctx.kv_block_allocator.kv_hash_to_block_id.get(block0)
        seen.append(bid is not None and ctx.mamba_slot_allocator.has_state(bid))
        return orig(*a, **k)
    adapter.engine.step_modern = step
    result = adapter.run_trace()
    lives = _lives(result.schedule_facts)["r0"]
    assert len(lives) == 2 and lives[1][0]["pos"] == 0 and lives[1][0]["tokens"] > 8, lives
    assert seen[lives[1][0]["step"]], "r0's prompt block was no longer cached when it came back"
    assert sum(f["prefix_cache"]["hits"] for f in result.schedule_facts) == 0
    assert result.tokens == _golden()
