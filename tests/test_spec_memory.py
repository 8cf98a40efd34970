"""The engine's memory prediction counts speculation's scratch (fastpath/engine/memory.py spec_bytes): the
per-position snapshots or the replay log, the verify buffers, the device-draft buffers and the draft model's bank
and weights equal what the engine allocates; a device with room for the bank but not for speculation's scratch is
an error naming engine_config.speculative.k, before anything is allocated."""
from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastpath import Engine, FastModel  # noqa: E402
from fastpath.engine import memory  # noqa: E402
from fastpath.options import FastOptions  # noqa: E402
from oracle import zoo  # noqa: E402
from oracle.trace import parse_trace  # noqa: E402

MODEL = dict(pattern="M*", hidden_size=16, mamba_n_heads=2, mamba_n_groups=1, n_attn_heads=2, n_kv_heads=1)
ENGINE = {"max_requests": 2, "max_tokens_per_step": 24, "prefill_chunk": 16}
REQ = [{"id": "a", "arrival_step": 0, "prompt": [1, 2, 1, 2, 1], "max_new_tokens": 6}]
NGRAM = {"kind": "ngram", "min_n": 1, "max_n": 2}
DRAFT = {"kind": "draft", "model": "goldens/models/zoo-mamba2"}


def _trace(proposer: dict | None, k: int = 3):
    e = dict(ENGINE)
    if proposer is not None:
        e["speculative"] = {"k": k, "proposer": proposer}
    return parse_trace({"schema": "hybridqual.trace/1", "engine": e, "requests": json.loads(json.dumps(REQ))})


@pytest.fixture(scope="module")
def fast():
    cfg = zoo.tiny_config("bamba", **MODEL)
    return FastModel(cfg, zoo.random_weights(cfg, seed=3), "cpu", torch.float32, FastOptions(backend="torch", spec_device_drafts=True))


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


@pytest.mark.parametrize("proposer,replay,pad", [(NGRAM, False, True), (NGRAM, True, False), (DRAFT, False, True)],
                         ids=["ngram-snapshots-padded", "ngram-replay-exact", "draft-snapshots-padded"])
def test_predicted_speculative_scratch_equals_what_the_engine_allocates(fast, proposer, replay, pad):
    """Every part of spec_bytes against the engine's tensors (verify buffers: after allocating every shape the
    runner can use); predict() adds them up and takes the verify step's activations."""
    model = fast.with_options(spec_replay=replay)
    trace = _trace(proposer)
    eng = Engine(model, trace.engine, max_len=16, pad_decode=pad)
    sp = eng.spec
    parts = memory.spec_bytes(model.config, trace.engine, 16, model.dtype, replay=replay, padded=pad, device_drafts=pad,
                              draft=sp.draft.model.config if sp.draft is not None else None)
    assert parts["rollback"] == sp.runner.scratch_bytes() > 0
    eng.run_trace(trace)
    R, k = eng.R, sp.k
    keys = ([(nb, w) for nb in sp.runner.row_buckets for w in sp.runner.widths] if pad else
            [(nb, w) for nb in range(1, R + 1) for w in range(2, k + 2)])
    for key in keys:
        sp.runner._buffers(key)
    assert set(sp.runner.meta) == set(keys)
    assert parts["verify_buffers"] == _nbytes(sp.out, *sp.runner.meta.values(), *sp.runner.tok.values())
    dd = sp.device_drafts
    assert ("device_drafts" in parts) == (dd is not None)
    if dd is not None:
        assert parts["device_drafts"] == _nbytes(dd.res, dd.hist.hist if dd.hist is not None else dd.buf)
    if sp.draft is not None:
        d = sp.draft
        assert parts["draft_bank"] == d.bank.nbytes() + _nbytes(d.snap.conv, d.snap.ssm)
        assert parts["draft_weights"] == memory.weight_bytes(d.model)
    got = memory.predict(eng)
    assert got["speculative"] == sum(parts.values())
    assert got["activations"] >= memory.verify_activation_bytes(model.config, trace.engine, model.dtype)
    if sp.draft is not None:                       # and the draft's widest catch-up forward (R*W tokens)
        catch_up = memory.activation_bytes(sp.draft.model.config, R * sp.draft.catch_up_max, model.dtype, sequences=R)
        assert got["activations"] >= catch_up and sp.draft.catch_up.widths[-1] == sp.draft.catch_up_max
    plain = memory.predict(Engine(model, _trace(None).engine, max_len=16))
    assert "speculative" not in plain and got["total"] > plain["total"]


def test_a_device_too_small_for_speculations_scratch_is_an_error_naming_k(fast, monkeypatch):
    """Free memory between (bank + activations) and (that + speculation's scratch): speculation is refused naming
    engine_config.speculative.k (the same engine without speculation is built); below the bank, the bank's error."""
    cfg, ec = fast.config, _trace(NGRAM, k=8).engine
    bank = memory.bank_bytes(cfg, ec.max_requests, 16, fast.dtype)
    tokens = min(ec.max_tokens_per_step, ec.max_requests * min(ec.prefill_chunk, 16))
    act = memory.activation_bytes(cfg, tokens, fast.dtype, sequences=min(ec.max_requests, tokens))
    parts = memory.spec_bytes(cfg, ec, 16, fast.dtype, padded=True, device_drafts=True)
    need = bank + max(act, memory.verify_activation_bytes(cfg, ec, fast.dtype)) + sum(parts.values())
    assert need > bank + act
    monkeypatch.setattr(memory, "available_bytes", lambda device: need - 1)
    with pytest.raises(MemoryError, match=r"engine_config\.speculative\.k: speculation with k=8") as e:
        Engine(fast, ec, max_len=16, pad_decode=True)
    assert "rollback" in str(e.value) and "device_drafts" in str(e.value)
    Engine(fast, _trace(None).engine, max_len=16, pad_decode=True)             # fits without speculation
    monkeypatch.setattr(memory, "available_bytes", lambda device: need)
    Engine(fast, ec, max_len=16, pad_decode=True)                              # exactly enough
    monkeypatch.setattr(memory, "available_bytes", lambda device: bank + act - 1)
    with pytest.raises(MemoryError, match="engine_config/max_len"):
        Engine(fast, ec, max_len=16, pad_decode=True)
