"""The repeatability lines ("the same trace run twice", "a request alone") come out of qualify for the llama.cpp,
llama-server (`openai`) and vllm-server adapters, each over its default-tier stand-in (tests/llamacpp_standin.py,
tests/test_openai_server.py's fake server, tests/fake_vllm_server.py), and a second run that differs FAILs the line.
Default CPU tier: no llama.cpp, no server, no vLLM."""
from __future__ import annotations

from pathlib import Path

import pytest

import oracle
from oracle.trace import load_trace
from hybridqual.adapters.llamacpp import adapter as llama_adapter
from hybridqual.qualify import checks
from hybridqual.scenarios import plan as scenarios
from llamacpp_standin import StandIn
from test_openai_server import adapter_for, fake, fresh  # noqa: F401  (fixtures: the fake llama-server)
from test_vllm_server_launcher import fake_env, qualify_here  # noqa: F401  (fixture: the launched stand-in)

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "goldens" / "traces"
TINY = ROOT / "goldens" / "models" / "tiny-sort"                    # the model the server stand-ins serve
TWICE = "the same trace run twice gives the same tokens"
ALONE = "a request alone gives its tokens in the batch"


class StandInWorker:
    """llama.cpp's worker process replaced by the stand-in in this process: the "load" and "run" ops of worker.py.
    `FLIP_SECOND` changes request a's last token in every second run (an engine that does not repeat itself)."""
    runs, FLIP_SECOND = 0, False

    def __init__(self, timeout: float = 600.0, env: dict | None = None) -> None:
        self.vocab = 0

    def ask(self, msg: dict, timeout: float | None = None) -> dict:
        if msg["op"] == "load":
            self.vocab = oracle.from_hf_config(Path(msg["gguf"]) / "config.json").vocab_size
            return {"meta": {}, "n_vocab": self.vocab}
        got = StandIn(self.vocab).run(msg["requests"], msg["max_requests"], msg["max_tokens_per_step"],
                                      msg["prefill_chunk"], msg["chunk_size"])
        type(self).runs += 1
        if self.FLIP_SECOND and type(self).runs % 2 == 0 and len(got["tokens"]) > 1:
            got["tokens"]["a"][-1] = (got["tokens"]["a"][-1] + 1) % self.vocab
        return got

    def close(self, kill: bool = False) -> None:
        pass


def _lines(engine, model_dir: Path, name: str) -> dict:
    """qualify's lines (name -> Check) for the shipped trace `name` on `model_dir` through `engine`, legacy mode."""
    trace = load_trace(TRACES / f"{name}.json")
    inst = scenarios.Instance(name, "file", trace, None, trace.to_json())
    lines = checks.check_instance(engine, model_dir, inst, ["legacy"], oracle.load(model_dir), "cpu")
    return {c.name: c for c in lines}


@pytest.mark.parametrize("flip", [False, True])
def test_llamacpp_adapter_gets_both_lines_and_a_second_run_that_differs_fails(monkeypatch, flip):
    model_dir = scenarios.MODELS / "zoo-mamba2"
    monkeypatch.setattr(llama_adapter, "Worker", StandInWorker)
    monkeypatch.setenv("HQ_LLAMACPP_GGUF", str(model_dir))          # the stand-in reads the config from here
    StandInWorker.runs, StandInWorker.FLIP_SECOND = 0, flip
    got = _lines(llama_adapter.LlamaCppAdapter, model_dir, "slot_exhaustion")     # a, b, c arrive together
    assert got[ALONE].status == "PASS", got[ALONE].detail
    assert got[TWICE].status == ("FAIL" if flip else "PASS"), got[TWICE].detail
    if flip:
        assert "a position" in got[TWICE].detail or "a:" in got[TWICE].detail
    assert StandInWorker.runs == 3                                   # the trace, its repeat, one request alone


def test_openai_adapter_against_llama_server_form_gets_both_lines(fresh):  # noqa: F811
    got = _lines(adapter_for(fresh.url, served_model="tiny"), TINY, "seed_compaction")
    assert got[TWICE].status == "PASS", got[TWICE].detail
    assert got[ALONE].status == "PASS", got[ALONE].detail


def test_openai_adapter_fails_the_repeat_line_when_the_second_run_differs(fresh):  # noqa: F811
    engine = adapter_for(fresh.url, served_model="tiny")
    trace, model_dir = load_trace(TRACES / "seed_compaction.json"), TINY
    model = oracle.load(model_dir)
    ctx = checks.context(engine, model_dir, trace, model, "cpu", modes=("legacy",))
    ctx.runs["legacy"] = engine(model_dir, trace, "legacy").run_trace()
    first = ctx.runs["legacy"]
    a = first.tokens["r0"]
    first.tokens["r0"] = a[:-1] + [(a[-1] + 1) % model.config.vocab_size]   # the first run as another token
    line = checks.run_check("repeat", ctx.for_mode(None))
    assert line.status == "FAIL" and "r0 position" in line.detail, line.detail


def test_vllm_server_adapter_gets_both_lines(fake_env):  # noqa: F811
    rc, got = qualify_here(fake_env / "q", ["seed_compaction"])
    (only,) = got.values()                                           # one instance
    lines = {name: (status, detail) for status, name, detail in only}
    assert lines[TWICE][0] == "PASS", lines
    assert lines[ALONE][0] == "PASS", lines
    assert rc == 0, lines
