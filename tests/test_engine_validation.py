"""Bad input at the engine/trace API boundary is a clear error naming the field, before anything runs or allocates:
hand-built requests are checked exactly as parse_trace checks JSON (fast-path Engine and oracle Scheduler alike),
a config that cannot make progress fails at construction, a bank that cannot fit fails before allocation, and
wrong argument types / devices / undecodable files name the argument. No model forward runs here."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fastpath import Engine, FastModel
from fastpath.engine import memory
from fastpath.engine.bank import StateBank
from fastpath.engine.validate import ArgumentError
from oracle import zoo
from oracle.scheduler import Scheduler
from oracle.trace import EngineConfig, Request, Sampling, Trace, TraceError, check_against_model, load_trace

EC = EngineConfig(2, 16, 8, "legacy")          # tiny zoo models: chunk_size 8, vocab 96


@pytest.fixture(scope="module")
def engine() -> Engine:
    cfg = zoo.tiny_config("bamba")
    return Engine(FastModel(cfg, zoo.random_weights(cfg, seed=0), "cpu", torch.float32), EC, max_len=32)


@pytest.fixture()
def oracle_sched() -> Scheduler:
    from test_scheduler_fake import FakeModel
    return Scheduler(FakeModel(vocab_size=96, chunk_size=8, seed=0), Trace(EC, ()), "legacy")


BAD_REQUESTS = [   # (what, request, field named, request id named)
    ("negative temperature", Request("r", 0, (1, 2), 3, (), Sampling("seeded", -0.5, 1)), "sampling.temperature",
     "r"),
    ("nan temperature", Request("r", 0, (1,), 3, (), Sampling("seeded", math.nan, 1)), "sampling.temperature", "r"),
    ("inf temperature", Request("r", 0, (1,), 3, (), Sampling("seeded", math.inf, 1)), "sampling.temperature", "r"),
    ("bool temperature", Request("r", 0, (1,), 3, (), Sampling("seeded", True, 1)), "sampling.temperature", "r"),
    ("unknown kind", Request("r", 0, (1,), 3, (), Sampling("top_p")), "sampling.kind", "r"),
    ("greedy with seed", Request("r", 0, (1,), 3, (), Sampling("greedy", None, 4)), "sampling.seed", "r"),
    ("seed too large", Request("r", 0, (1,), 3, (), Sampling("seeded", 1.0, 2 ** 63)), "sampling.seed", "r"),
    ("float seed", Request("r", 0, (1,), 3, (), Sampling("seeded", 1.0, 3.0)), "sampling.seed", "r"),
    ("sampling not a Sampling", Request("r", 0, (1,), 3, (), {"kind": "greedy"}), "sampling", "r"),
    ("float token id", Request("r", 0, (1, 2.0), 3), "prompt[1]", "r"),
    ("numpy float token id", Request("r", 0, (np.float64(7.9),), 3), "prompt[0]", "r"),
    ("bool token id", Request("r", 0, (True,), 3), "prompt[0]", "r"),
    ("token id >= vocab", Request("r", 0, (1, 96), 3), "prompt[1]", "r"),
    ("negative token id", Request("r", 0, (-1,), 3), "prompt[0]", "r"),
    ("prompt a string", Request("r", 0, "12", 3), "prompt", "r"),
    ("prompt a tensor", Request("r", 0, torch.tensor([1, 2]), 3), "prompt", "r"),
    ("empty prompt", Request("r", 0, (), 3), "prompt", "r"),
    ("float stop id", Request("r", 0, (1,), 3, (0.5,)), "stop_token_ids[0]", "r"),
    ("zero max_new_tokens", Request("r", 0, (1,), 0), "max_new_tokens", "r"),
    ("float max_new_tokens", Request("r", 0, (1,), 2.5), "max_new_tokens", "r"),
    ("bool arrival", Request("r", True, (1,), 2), "arrival_step", "r"),
    ("float arrival", Request("r", 1.0, (1,), 2), "arrival_step", "r"),
    ("huge arrival", Request("r", 10 ** 18, (1,), 2), "arrival_step", "r"),
    ("int id", Request(7, 0, (1,), 2), "id", None),
    ("empty id", Request("", 0, (1,), 2), "id", None),
]


def _assert_names(err: TraceError, field: str, rid: str | None) -> None:
    assert err.field == field, str(err)
    assert str(err).startswith(field), str(err)
    assert err.request_id == rid, str(err)
    if rid is not None:
        assert f"(request {rid!r})" in str(err)


@pytest.mark.parametrize("what,req,field,rid", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_streaming_add_request_rejects_hand_built_bad_fields_like_run_trace(engine, oracle_sched, what, req, field,
                                                                          rid):
    """Engine.add_request, the oracle's Scheduler.add_request and run_trace's check raise the same TraceError."""
    engine.reset()
    errors = []
    for submit in (engine.add_request, oracle_sched.add_request):
        with pytest.raises(TraceError) as e:
            submit(req)
        errors.append(e.value)
    with pytest.raises(TraceError) as e:
        check_against_model(Trace(EC, (req,)), vocab_size=96, chunk_size=8)
    errors.append(e.value)
    with pytest.raises(TraceError) as e:
        engine.run_trace(Trace(EC, (req,)))
    errors.append(e.value)
    for err in errors:
        _assert_names(err, "requests[0]." + field, rid)
    assert engine.requests == {} and oracle_sched.requests == {}       # nothing half-submitted


def test_numpy_integers_are_accepted_and_normalised(engine, oracle_sched):
    """NumPy integer token ids / counts are ints (not truncated floats): stored as Python ints in tuples."""
    engine.reset()
    req = Request("n", np.int64(0), [np.int32(3), np.int64(4)], np.int64(2), [np.int16(0)],
                  Sampling("seeded", np.float32(0.5), np.uint32(9)))
    for submit, store in ((engine.add_request, engine.requests), (oracle_sched.add_request, oracle_sched.requests)):
        submit(req)
        got = store["n"].req
        assert got == Request("n", 0, (3, 4), 2, (0,), Sampling("seeded", 0.5, 9))
        assert all(type(t) is int for t in got.prompt + got.stop_token_ids) and type(got.sampling.seed) is int


def test_a_request_that_is_not_a_request_names_the_argument(engine):
    engine.reset()
    with pytest.raises(TraceError, match=r"^requests\[0\]: must be an oracle.trace.Request, got dict"):
        engine.add_request({"id": "x", "prompt": [1]})


def test_config_that_cannot_make_progress_fails_at_construction():
    """prefill_chunk below the chunk size (pieces of 0 tokens: a spin) and a budget with no room for a chunk are
    errors of Engine(...) itself, naming the field, before the bank exists."""
    cfg = zoo.tiny_config("mamba2")
    model = FastModel(cfg, zoo.random_weights(cfg, seed=0), "cpu", torch.float32)
    with pytest.raises(TraceError, match=r"^engine_config\.prefill_chunk: must be >= the model's chunk_size 8"):
        Engine(model, EngineConfig(2, 64, 4))
    with pytest.raises(TraceError, match=r"^engine_config\.max_tokens_per_step: .* = 11"):
        Engine(model, EngineConfig(4, 10, 8))
    for bad, field in ((EngineConfig(0, 16, 8), "max_requests"), (EngineConfig(2.0, 16, 8), "max_requests"),
                       (EngineConfig(2, 16, True), "prefill_chunk"), (EngineConfig(2, 16, 8, "turbo"), "mode"),
                       (EngineConfig(70_000, 10 ** 6, 8), "max_requests")):
        with pytest.raises(TraceError, match=rf"^engine_config\.{field}"):
            Engine(model, bad)


@pytest.mark.parametrize("arg,value,name", [
    ("engine_config", "legacy", "engine_config"), ("engine_config", {"max_requests": 2}, "engine_config"),
    ("max_len", "32", "max_len"), ("max_len", 0, "max_len"), ("max_len", 32.0, "max_len"),
    ("graphs", "yes", "graphs"), ("pad_decode", 1, "pad_decode"), ("model", "bamba", "model")])
def test_wrong_argument_types_name_the_argument(arg, value, name):
    cfg = zoo.tiny_config("mamba2")
    kw = dict(model=FastModel(cfg, zoo.random_weights(cfg, seed=0), "cpu", torch.float32), engine_config=EC,
              max_len=32, graphs=False, pad_decode=False)
    kw[arg] = value
    with pytest.raises((TraceError, ArgumentError)) as e:
        Engine(**kw)
    assert str(e.value).startswith(name), str(e.value)


@pytest.mark.parametrize("kw,name", [
    (dict(device="tpu"), "device"), (dict(device="cuda:9"), "device"), (dict(device="cpu:x"), "device"),
    (dict(device=3.5), "device"), (dict(dtype=torch.int32), "dtype"), (dict(dtype="bf16"), "dtype"),
    (dict(path=12), "path"), (dict(path="/nonexistent/model"), "path"),
    (dict(engine_config="legacy"), "engine_config")])
def test_from_pretrained_bad_arguments_name_the_argument(zoo_folder, kw, name):
    args = dict(path=zoo_folder("mamba2"), engine_config=EC, device="cpu")
    args.update(kw)
    with pytest.raises((ArgumentError, TraceError)) as e:
        Engine.from_pretrained(**args)
    assert str(e.value).startswith(name), str(e.value)


def test_bank_prediction_is_exact_and_an_oversized_bank_fails_before_allocating(monkeypatch):
    """memory.bank_bytes equals what StateBank allocates; a bank + activations larger than what the device has
    free is a MemoryError naming the knobs, raised before torch allocates (here: 65535 rows x 2^24 positions of
    KV, ~8 PiB — no machine has it, so reaching the allocator would fail or swap, not raise this)."""
    cfg = zoo.tiny_config("bamba")
    for R, L in ((1, 1), (3, 17), (5, 64)):
        assert memory.bank_bytes(cfg, R, L, torch.float32) == StateBank(cfg, R, L, "cpu").nbytes()
    model = FastModel(cfg, zoo.random_weights(cfg, seed=0), "cpu", torch.float32)
    with pytest.raises(MemoryError, match=r"max_requests=65535, max_len=16777216"):
        Engine(model, EngineConfig(65535, 65542, 8), max_len=2 ** 24)
    need = memory.bank_bytes(cfg, 2, 32, torch.float32)
    monkeypatch.setattr(memory, "available_bytes", lambda device: need)          # the bank alone would fit ...
    with pytest.raises(MemoryError, match="activations"):                       # ... not with the step's tensors
        Engine(model, EC, max_len=32)
    monkeypatch.setattr(memory, "available_bytes", lambda device: 10 * need + 2 ** 20)
    Engine(model, EC, max_len=32)


def test_undecodable_and_odd_trace_files_are_trace_errors(tmp_path):
    p = tmp_path / "t.json"
    cases = {b'{"schema": "\xff\xfe"}': "not UTF-8", b"1" * 5000: "not valid JSON", b"[" * 100_000: "not valid JSON",
             b'{"schema": 1, "schema": 2}': "duplicate key"}
    for data, msg in cases.items():
        p.write_bytes(data)
        with pytest.raises(TraceError, match=f"^file: .*{msg}"):
            load_trace(p)
    with pytest.raises(TraceError, match="^file: path must be"):
        load_trace(3)
    with pytest.raises(TraceError, match="^file: cannot read"):
        load_trace(tmp_path)                                                    # a directory


def test_hand_built_trace_with_bad_engine_or_description_is_rejected(engine):
    with pytest.raises(TraceError, match=r"^engine: must be an oracle.trace.EngineConfig"):
        check_against_model(Trace({"max_requests": 2}, ()), 96, 8)
    with pytest.raises(TraceError, match=r"^description"):
        check_against_model(Trace(EC, (), description=5), 96, 8)
    with pytest.raises(TraceError, match=r"^trace: must be an oracle.trace.Trace"):
        engine.run_trace({"schema": "hybridqual.trace/1"})
    with pytest.raises(TraceError, match=r"^requests\[1\]\.id \(request 'a'\): duplicate"):
        check_against_model(Trace(EC, (Request("a", 0, (1,), 1), Request("a", 0, (2,), 1))), 96, 8)
