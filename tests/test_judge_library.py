"""Library edges refused by name before any work: max_new_tokens beyond the model's positions or absurd, prompt
length vs positions, a temperature floor, integer-only token ids in prefill/decode, a request-id grammar; the fast
path uses the same trace rules (oracle/trace.py), and refuses a bank that exceeds memory before allocating."""
import json
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, seed, settings
from hypothesis import strategies as st

import oracle
from oracle.trace import MAX_ID_LENGTH, MAX_POSITIONS, Request, Sampling, TraceError, parse_trace
from hybridqual.goldens import regen as goldens

BAMBA = goldens.MODELS / "zoo-bamba"
ENGINE = {"max_requests": 2, "max_tokens_per_step": 16, "prefill_chunk": 16}


def trace(**req):
    r = {"id": "r0", "arrival_step": 0, "prompt": [1, 2, 3], "max_new_tokens": 2, **req}
    return {"schema": "hybridqual.trace/1", "engine": ENGINE, "requests": [r]}


@pytest.fixture(scope="module")
def bamba():
    return oracle.load(BAMBA)


def test_absurd_max_new_tokens_is_refused_before_running(bamba):
    with pytest.raises(TraceError, match=r"requests\[0\].max_new_tokens \(request 'r0'\): 1000000000 with a 3-token "
                                         r"prompt exceeds oracle.trace.MAX_POSITIONS"):
        oracle.run_trace(bamba, parse_trace(trace(max_new_tokens=10 ** 9)))
    ok = parse_trace(trace(max_new_tokens=MAX_POSITIONS - 3))       # the bound itself is a valid trace
    assert ok.requests[0].max_new_tokens == MAX_POSITIONS - 3


def test_positions_follow_the_models_max_position_embeddings(tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(BAMBA, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 12}))
    model = oracle.load(folder)
    with pytest.raises(TraceError, match=r"max_new_tokens .*: 10 with a 3-token prompt exceeds the model's "
                                         r"max_position_embeddings 12 \(at most 9\)"):
        oracle.run_trace(model, parse_trace(trace(max_new_tokens=10)))
    with pytest.raises(TraceError, match=r"requests\[0\].prompt .*: 12 tokens leave no position"):
        oracle.run_trace(model, parse_trace(trace(prompt=[1] * 12, max_new_tokens=1)))
    assert oracle.run_trace(model, parse_trace(trace(max_new_tokens=9))).tokens["r0"]
    from fastpath import Engine, FastOptions                         # the fast path: the same rule, by name
    eng = Engine.from_pretrained(folder, parse_trace(trace()).engine, device="cpu", max_len=64,
                                 options=FastOptions(backend="torch"))
    with pytest.raises(TraceError, match="max_position_embeddings 12"):
        eng.run_trace(parse_trace(trace(max_new_tokens=10)))
    with pytest.raises(TraceError, match="max_position_embeddings 12"):
        eng.add_request(Request("x", 0, (1, 2, 3), 10))


@pytest.mark.parametrize("t,ok", [(5e-324, False), (1e-7, False), (1e-6, True), (0.7, True)])
def test_a_temperature_below_the_floor_is_refused_by_name(t, ok):
    obj = trace(sampling={"kind": "seeded", "temperature": t, "seed": 1})
    if ok:
        assert parse_trace(obj).requests[0].sampling.temperature == t
    else:
        with pytest.raises(TraceError, match=r"requests\[0\].sampling.temperature \(request 'r0'\): must be >= 1e-06"):
            parse_trace(obj)


@pytest.mark.parametrize("tokens", [[1.0, 2], [1, 2.7], [True, 2], torch.tensor([1.0, 2.0]), [torch.tensor(1.5)],
                                    np.array([1.0, 2.0])])
def test_prefill_and_decode_take_integer_token_ids_only(bamba, tokens):
    with pytest.raises(ValueError, match="tokens.*must be integers"):
        bamba.prefill(tokens)
    _, state = bamba.prefill([1, 2])
    with pytest.raises(ValueError, match="must be integers"):
        bamba.decode(2.0, state)


def test_integer_token_ids_of_every_kind_agree(bamba):
    ref = bamba.prefill([1, 5, 9])[0]
    for kind in (np.array([1, 5, 9]), torch.tensor([1, 5, 9]), [np.int64(1), 5, torch.tensor(9)], (1, 5, 9)):
        assert torch.equal(bamba.prefill(kind)[0], ref)


BAD_CHARS = ["\x00", "\x1b", "\x07", "\n", "\u202e", "\u2066", "\u200f", "\ud800", "\udfff", "\x85", "\u2028"]


@seed(31)
@settings(max_examples=200, deadline=None)
@given(st.text(min_size=0, max_size=20), st.sampled_from(BAD_CHARS), st.text(max_size=20))
def test_request_ids_with_control_bidi_or_surrogate_characters_are_refused(a, bad, b):
    with pytest.raises(TraceError, match=r"requests\[0\].id: must be printable text"):
        parse_trace(trace(id=a + bad + b))


@seed(31)
@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")), min_size=1,
               max_size=MAX_ID_LENGTH))
def test_printable_request_ids_are_accepted_and_run_everywhere(rid):
    if not rid.isprintable():              # a Zs space other than " " is not printable: refused too
        with pytest.raises(TraceError):
            parse_trace(trace(id=rid))
        return
    assert parse_trace(trace(id=rid)).requests[0].id == rid


def test_request_id_length_is_bounded_and_hand_built_requests_are_checked_too(bamba):
    with pytest.raises(TraceError, match=f"at most {MAX_ID_LENGTH} characters"):
        parse_trace(trace(id="x" * (MAX_ID_LENGTH + 1)))
    tr = parse_trace(trace())
    bad = type(tr)(tr.engine, (Request("a\x00b", 0, (1, 2), 2),))
    with pytest.raises(TraceError, match=r"requests\[0\].id: must be printable"):
        oracle.run_trace(bamba, bad)
    with pytest.raises(TraceError, match="sampling.temperature"):
        oracle.run_trace(bamba, type(tr)(tr.engine, (Request("a", 0, (1,), 2, (), Sampling("seeded", 1e-300, 1)),)))


def test_a_bank_that_exceeds_memory_is_refused_before_allocating(monkeypatch):
    from fastpath import Engine, FastOptions
    from fastpath.engine import memory
    allocated = []
    real_zeros = torch.zeros
    monkeypatch.setattr(memory, "available_bytes", lambda device: 64 << 20)      # a 64 MiB machine
    ec = parse_trace(trace()).engine
    with pytest.raises(MemoryError, match="engine_config/max_len: the state bank"):
        Engine.from_pretrained(BAMBA, ec, device="cpu", max_len=1 << 20, options=FastOptions(backend="torch"))

    def spy(*a, **k):
        allocated.append(a)
        return real_zeros(*a, **k)
    monkeypatch.setattr(torch, "zeros", spy)
    with pytest.raises(MemoryError):
        Engine.from_pretrained(BAMBA, ec, device="cpu", max_len=1 << 20, options=FastOptions(backend="torch"))
    assert not any(isinstance(s, int) and s >= 1 << 20 for a in allocated for s in a), "allocated before refusing"
