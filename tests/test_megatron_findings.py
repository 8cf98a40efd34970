"""Finding F2 (docs/findings.md) pinned on megatron-core 0.19.2 (marker `megatron`; run in .venv-megatron): a prompt
whose last prefill piece is shorter than d_conv - 1 tokens leaves a conv state that has lost the tokens before the
piece, so every token after the first is computed against zeros. The tests pass while Megatron behaves so; a
Megatron that carries the state across pieces makes them fail, and the finding is revisited."""
from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from hybridqual.adapters.megatron import available

pytestmark = [pytest.mark.megatron,
              pytest.mark.skipif(available() is not None, reason=f"megatron-core not importable: {available()}")]

MODEL = Path(__file__).resolve().parents[1] / "goldens" / "models" / "zoo-bamba"
CLOSE = 1e-4          # fp32 Megatron vs the fp64 oracle (measured 1.6e-6 on these rows)


def _prompt(n: int) -> list[int]:
    """piece_tails' mod64 prompt on zoo-bamba (the shipped plan's FAIL) and its longer form."""
    return [(6 + 7 * k) % 61 for k in range(n)]


# Under Megatron's budget of 64, `control` (67 tokens) is cut 64 + 3 and `short` (65 tokens) 63 + 2 (a cut of 64 would
# leave one token). `short` arrives after `control` has finished, so each runs alone.
TRACE = {"schema": "hybridqual.trace/1", "description": "F2: a 2-token last piece (short) beside a 3-token one",
         "engine": {"max_requests": 1, "max_tokens_per_step": 64, "mode": "legacy", "prefill_chunk": 64},
         "requests": [{"id": "control", "arrival_step": 0, "prompt": _prompt(67), "max_new_tokens": 2},
                      {"id": "short", "arrival_step": 4, "prompt": _prompt(65), "max_new_tokens": 2}]}


def _oracle_rows(om, prompt: list[int], pieces: list[int], tokens: list[int], forget: int) -> torch.Tensor:
    """The oracle's logits rows for a prompt prefilled in `pieces` then decoding `tokens`; `forget` > 0: the oldest
    `forget` columns of every conv window zeroed after the last piece (what Megatron's state holds)."""
    logits, state, at = None, None, 0
    for n in pieces:
        logits, state = om.prefill(prompt[at:at + n], state)
        at += n
    for window in state.conv.values():
        window[:, :forget] = 0
    rows = [logits[-1]]
    for t in tokens[:-1]:
        logits, state = om.decode(t, state)
        rows.append(logits)
    return torch.stack(rows)


def test_finding_f2_a_two_token_last_piece_leaves_a_conv_state_without_the_tokens_before_it():
    """`short`'s first token (sampled in its 2-token piece) equals the oracle's; its next row differs by > 0.5 and
    equals the oracle's with the conv-window column before the piece zeroed; `control` (3-token piece) is exact."""
    import oracle
    from oracle.trace import parse_trace
    from hybridqual.adapters.megatron.adapter import MegatronRoundedAdapter
    from hybridqual.adapters.megatron.schedule_facts import rows_by_request
    trace = parse_trace(TRACE)
    res = MegatronRoundedAdapter(MODEL, trace, "legacy").run_trace()
    om = oracle.load(MODEL)
    d_conv = om.config.mamba_d_conv
    rows = rows_by_request(res.schedule_facts)
    for req in trace.requests:
        pieces = [r["tokens"] for r in rows[req.id] if r["pos"] < len(req.prompt)]
        got = res.logits[req.id].double()
        truth = _oracle_rows(om, list(req.prompt), pieces, res.tokens[req.id], 0)
        delta = (got - truth).abs().amax(-1)
        if req.id == "control":
            assert pieces == [64, 3] and float(delta.max()) <= CLOSE, (pieces, delta)
            continue
        assert pieces == [63, 2], pieces
        assert float(delta[0]) <= CLOSE and float(delta[1]) > 0.5, delta
        forgetful = _oracle_rows(om, list(req.prompt), pieces, res.tokens[req.id], d_conv - 1 - pieces[-1])
        assert float((got - forgetful).abs().max()) <= CLOSE, (got - forgetful).abs().amax(-1)


def test_finding_f2_the_prefill_conv_state_is_the_slices_last_tokens_zero_padded():
    """The mechanism at its source: MambaMixer's dynamic prefill writes `causal_conv1d_varlen_states(xBC,
    cu_seqlens, state_len)` over the request's conv state; that kernel reads only this step's slice, so a 2-token
    slice gives a state of d_conv - 2 zero columns and the two tokens, whatever the request carried before."""
    from hybridqual.adapters.megatron import runtime
    runtime.setup("cpu")
    from causal_conv1d.causal_conv1d_varlen import causal_conv1d_varlen_states
    from megatron.core.ssm.mamba_mixer import MambaMixer
    src = inspect.getsource(MambaMixer._ssm_prefill)
    assert "causal_conv1d_varlen_states(" in src and "tensor_masked_update(conv_state" in src
    x = torch.arange(1.0, 1.0 + 5 * 3).reshape(5, 3)           # 5 tokens, 3 channels: slices of 3 and 2 tokens
    states = causal_conv1d_varlen_states(x, torch.tensor([0, 3, 5], dtype=torch.int32), state_len=4)
    assert torch.equal(states[1][:, :2], torch.zeros(3, 2)) and torch.equal(states[1][:, 2:], x[3:5].T)
    assert torch.equal(states[0][:, 0], torch.zeros(3)) and torch.equal(states[0][:, 1:], x[0:3].T)
