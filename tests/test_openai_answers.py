"""The OpenAI adapter's reading of a server's answers (hybridqual.adapters.openai), on the fake server of
tests/test_openai_server.py (the fp64 oracle of tiny-sort, in llama-server's or vLLM's answer form): a server that
pads its vocabulary passes, the model is identified by what /v1/models reports, every field of an answer is
validated whether or not logprobs came, and --timeout ends the process with requests in flight. Default CPU tier."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from hybridqual.adapters import Engine, EngineOptions
from hybridqual.adapters.openai import OpenAIServerAdapter, ServerError
from hybridqual.adapters.openai.adapter import ServerSettings
from hybridqual.adapters.openai.report import logprobs_check
from test_openai_server import ROOT, TINY, TRACES, adapter_for, fake, fresh, run  # noqa: F401 - fixtures


def vllm_like(fake, root: str | None = None) -> None:
    """The fake in vLLM's form: no n_vocab, its root and max_model_len reported, any prompt id accepted."""
    fake.flavour, fake.n_vocab_reported, fake.root, fake.max_model_len = "vllm", None, root, 512


def test_padded_vocab_server_that_accepts_any_id_passes(fresh):
    """vLLM's case: the embedding table padded, prompt ids not range-checked, no n_vocab reported. A correct such
    server passes (no id outside the vocabulary is sent to it), identified by its root (the --model folder), and
    the report says the vocabulary size was not confirmed."""
    vllm_like(fresh, root=str(TINY))
    cls = adapter_for(fresh.url, step_s=0.0)
    trace, res = run(cls)
    for r in trace.requests:
        assert res.tokens[r.id] == fresh.model.generate_greedy(list(r.prompt), r.max_new_tokens), r.id
    c = logprobs_check(cls, "t", "legacy", trace, res, fresh.model)
    assert c.passed, c.detail
    assert "vocabulary size not reported: not confirmed" in res.probe
    assert "is the --model folder" in res.probe and "max_model_len 512" in res.probe


def test_server_root_identifies_the_model(fresh, tmp_path):
    """/v1/models root: another folder with identical files confirms, one whose weights differ is a wrong model,
    a root that is no folder here is said to be unconfirmed."""
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(TINY, copy)
    vllm_like(fresh, root=str(copy))
    assert "identical to --model's (sha256)" in run(adapter_for(fresh.url, step_s=0.0))[1].probe
    other = ROOT / "goldens" / "models" / "zoo-mamba2"
    OpenAIServerAdapter.probes.clear()
    vllm_like(fresh, root=str(other))
    with pytest.raises(ServerError, match=r"wrong model: .* loaded .*zoo-mamba2, whose config.json differs"):
        run(adapter_for(fresh.url, step_s=0.0))
    OpenAIServerAdapter.probes.clear()
    vllm_like(fresh, root="org/some-hub-name")
    assert "is not a folder here: the weights it serves are not confirmed" in \
        run(adapter_for(fresh.url, step_s=0.0))[1].probe


def test_max_model_len_below_the_trace_is_named(fresh):
    vllm_like(fresh, root=str(TINY))
    fresh.max_model_len = 4
    with pytest.raises(ServerError, match="max_model_len 4 .* below this trace's longest request"):
        run(adapter_for(fresh.url, step_s=0.0))


@pytest.mark.parametrize("flavour", ["llama", "vllm"])
@pytest.mark.parametrize("mode, field", [
    ("nan_logprob", r"top_logprobs.*the logprob nan is not finite"),
    ("id_outside_vocab", r"wrong model: request \w+: /v1/completions\.choices\[0\]\.logprobs\.(content\[\d+\]\."
                         r"top_logprobs|top_logprobs\[\d+\]) has token id 21, outside the model's vocabulary of 16"),
    ("cached_over", r"usage.prompt_tokens_details.cached_tokens \d+ outside the prompt"),
])
def test_bad_answer_field_is_named(fresh, flavour, mode, field):
    """A logprob NaN, a logprob id outside the vocabulary, cached tokens beyond the prompt: the run fails naming
    the field, in either answer form."""
    if flavour == "vllm":
        vllm_like(fresh, root=str(TINY))
    fresh.mode = mode
    with pytest.raises(ServerError, match=field):
        run(adapter_for(fresh.url, step_s=0.0))


class Launched(OpenAIServerAdapter):
    """A server only this process talks to (as vllm-server's): its cached tokens are bounded by what it was sent."""
    seen_is_whole = True


def test_cached_tokens_beyond_what_the_server_was_sent_fail(fresh):
    """A server reporting every prompt token cached: within the prompt, so an external server's answer stands (its
    cache may hold other clients' prompts); a server only this process talks to cannot have cached prompts it was
    never sent: FAIL naming the request and the field."""
    vllm_like(fresh, root=str(TINY))
    fresh.mode = "cached_all"
    run(adapter_for(fresh.url, step_s=0.0))
    OpenAIServerAdapter.probes.clear()
    OpenAIServerAdapter.seen.clear()
    launched = Engine(Launched, EngineOptions(base_url=fresh.url, settings=ServerSettings(step_s=0.0)))
    with pytest.raises(ServerError, match=r"request \w+: usage.prompt_tokens_details.cached_tokens \d+, but the "
                                          r"longest prefix of its prompt that this server was ever sent is \d+"):
        run(launched)
    OpenAIServerAdapter.probes.clear()
    OpenAIServerAdapter.seen.clear()
    fresh.mode = "good"
    trace, res = run(launched)
    assert all(f["cached_tokens"] == 0 for f in res.schedule_facts)


def test_counts_checked_without_logprobs(fresh):
    """An answer without logprobs is still validated: cached tokens beyond the prompt fail, named."""
    vllm_like(fresh, root=str(TINY))
    fresh.mode = "no_logprobs"
    trace, res = run(adapter_for(fresh.url, step_s=0.0))
    assert all(res.logprobs[r.id] is None for r in trace.requests)
    from hybridqual.adapters.openai.client import check_answer, parse_completion
    ans = fresh.complete({"prompt": [1, 2, 3], "max_tokens": 2})
    ans["usage"]["prompt_tokens_details"]["cached_tokens"] = 4
    with pytest.raises(ServerError, match=r"r0: usage.prompt_tokens_details.cached_tokens 4 outside the prompt"):
        check_answer(parse_completion(ans), 3, 2, fresh.vocab, "r0")
    ans["usage"]["prompt_tokens_details"]["cached_tokens"] = "3"
    with pytest.raises(ServerError, match=r"usage.prompt_tokens_details.cached_tokens: expected an integer"):
        parse_completion(ans)


def test_timeout_bounds_the_process_with_requests_in_flight(fresh, tmp_path):
    """qualify --timeout 2 while every trace request waits 60 s at the server: the instance FAILs by --timeout and
    the process exits at once, its request threads still waiting (no thread keeps it alive)."""
    fresh.sleep_requests = 60.0
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "hybridqual.qualify", "--engine", "openai", "--base-url", fresh.url,
                        "--model", str(TINY), "--trace", str(TRACES / "seed_compaction.json"), "--mode", "legacy",
                        "--in-process", "--timeout", "2", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == 1 and "FAIL  instance finishes within --timeout" in p.stdout, p.stdout + p.stderr
    assert took < 45, took
