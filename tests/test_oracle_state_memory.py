"""The oracle refuses, before its first step, a trace whose per-request states cannot fit in the memory free where
it runs (oracle.scheduler.check_state_memory): a FAIL naming the request's max_new_tokens, never an OOM or a hang.
The byte count it uses is the size of the states the oracle really keeps."""
import pytest
import torch

from oracle import zoo
from oracle import streamed
from oracle.scheduler import Scheduler, run_trace, state_bytes
from oracle.trace import TraceError, parse_trace


def trace(max_new: dict[str, int], max_requests: int = 2, prefix_cache: dict | None = None):
    engine = {"max_requests": max_requests, "max_tokens_per_step": 16, "prefill_chunk": 16,
              **({"prefix_cache": prefix_cache} if prefix_cache else {})}
    return parse_trace({"schema": "hybridqual.trace/1", "engine": engine,
                        "requests": [{"id": rid, "arrival_step": 0, "prompt": [1, 2, 3, 4, 5], "max_new_tokens": n}
                                     for rid, n in max_new.items()]})


@pytest.mark.parametrize("arch", ["bamba", "mamba2", "nemotron_h"])
def test_state_bytes_is_the_size_of_the_states_the_oracle_keeps(arch):
    model = zoo.build(arch, seed=1)
    logits, state = model.prefill([1, 2, 3, 4, 5, 6, 7])
    _, state = model.decode(9, state)
    kept = sum(t.numel() * t.element_size() for d in (state.conv, state.ssm, state.k, state.v) for t in d.values())
    assert kept == state_bytes(model.config, 8, 8)


def test_a_trace_whose_states_cannot_fit_is_refused_before_any_step_naming_the_request(monkeypatch):
    model = zoo.build("bamba", seed=1)
    per = state_bytes(model.config, 10 ** 6, 8)
    monkeypatch.setattr(streamed, "available_memory_bytes", lambda: 2 * per)
    ok = trace({"a": 10 ** 6 - 5, "b": 10 ** 6 - 5, "c": 10 ** 6 - 5})      # two live at a time: 2 x per fits
    Scheduler(model, ok, "legacy")
    bad = trace({"a": 3, "b": 10 ** 6 - 5, "c": 10 ** 6})
    with pytest.raises(TraceError, match=r"requests\[2\]\.max_new_tokens \(request 'c'\): 1000000: .* GiB free") as e:
        Scheduler(model, bad, "legacy")
    assert e.value.request_id == "c"
    with pytest.raises(TraceError, match=r"engine\.prefix_cache\.capacity: 1000000 checkpoints"):
        run_trace(model, trace({"a": 10 ** 6 - 5}, prefix_cache={"block_size": 4, "capacity": 10 ** 6}))


def test_a_trace_that_fits_runs_and_unknown_free_memory_refuses_nothing(monkeypatch):
    model = zoo.build("bamba", seed=1)
    assert run_trace(model, trace({"a": 3, "b": 2})).tokens["a"]
    monkeypatch.setattr(streamed, "available_memory_bytes", lambda: None)
    Scheduler(model, trace({"a": 10 ** 6 - 5}), "legacy")
