"""llama.cpp in-process (a worker of .venv-llamacpp): continuous batching against the fp64 oracle, and worker death."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

import oracle
from hybridqual.adapters.llamacpp import convert as conv
from oracle.trace import load_trace

pytestmark = [pytest.mark.llamacpp,
              pytest.mark.skipif(conv.available() is not None, reason=str(conv.available()))]
ROOT = Path(__file__).resolve().parents[1]
GRANITE = ROOT / "goldens" / "models" / "zoo-granitemoehybrid"
GRANITE_DENSE = ROOT / "goldens" / "models" / "zoo-granite_dense"    # no experts, hidden 48, rms eps 0.05


def _oracle_rows(model, prompt, toks):
    logits, _ = model.prefill(list(prompt) + toks[:-1])
    return logits[len(prompt) - 1:]


@pytest.mark.parametrize("folder", [GRANITE, GRANITE_DENSE], ids=lambda p: p.name)
def test_continuous_batching_matches_the_oracle_and_reuses_seq_ids(folder):
    from hybridqual.adapters.llamacpp.adapter import LlamaCppAdapter
    trace = load_trace(ROOT / "goldens" / "traces" / "slot_exhaustion.json")
    assert len(trace.requests) > trace.engine.max_requests          # requests must wait for a free sequence
    a = LlamaCppAdapter(folder, trace, "legacy")
    run = a.run_trace()
    model = oracle.load(folder)
    truth = oracle.run_trace(model, trace, mode="legacy")
    assert run.tokens == truth.tokens and run.finish_reasons == truth.finish_reasons
    seqs = list(a.seq_ids.values())
    assert max(seqs) < trace.engine.max_requests and len(set(seqs)) < len(seqs)     # freed ids were reused
    for r in trace.requests:
        rows = _oracle_rows(model, r.prompt, run.tokens[r.id])
        assert run.logits[r.id].shape == rows.shape
        assert (run.logits[r.id].double() - rows).abs().max().item() < 1e-4     # f32 throughout: ~1e-6 measured


def test_partial_rope_bamba_diverges_from_the_oracle():
    """Pins the conversion finding: llama.cpp's converter permutes q/k over the whole head_dim for Bamba's half
    RoPE (convert.known_divergences); when a fixed converter lands, this fails and the finding is closed."""
    from hybridqual.adapters.llamacpp.adapter import LlamaCppAdapter
    folder = ROOT / "goldens" / "models" / "tiny-sort"
    trace = load_trace(ROOT / "goldens" / "traces" / "seed_compaction.json")
    run = LlamaCppAdapter(folder, trace, "legacy").run_trace()
    assert LlamaCppAdapter(folder, trace, "legacy").sidecar["known_divergences"]
    model = oracle.load(folder)
    worst = max((run.logits[r.id].double() - _oracle_rows(model, r.prompt, run.tokens[r.id])).abs().max().item()
                for r in trace.requests)
    assert worst > 0.5


def _malformed(src: Path, dst: Path, key: str, value: int) -> None:
    """A copy of GGUF `src` with integer metadata `key` set to `value` (with the venv's gguf-py)."""
    code = ("import shutil, sys, gguf; shutil.copy(sys.argv[1], sys.argv[2]); r = gguf.GGUFReader(sys.argv[2], 'r+'); "
            "f = r.fields[sys.argv[3]]; f.parts[f.data[0]][...] = int(sys.argv[4])")
    subprocess.run([str(conv.venv_dir() / "bin" / "python"), "-c", code, str(src), str(dst), key, str(value)],
                   check=True)


def test_a_ggml_assert_on_load_is_a_worker_error_not_a_crash(tmp_path, monkeypatch):
    from hybridqual.adapters.llamacpp.adapter import LlamaCppAdapter, WorkerError, cached_gguf
    good, _ = cached_gguf(GRANITE, "f32")
    bad = tmp_path / "bad.gguf"
    _malformed(good, bad, "granitehybrid.expert_used_count", 9)      # more experts used than exist (4)
    monkeypatch.setenv("HQ_LLAMACPP_GGUF", str(bad))
    trace = load_trace(ROOT / "goldens" / "traces" / "seed_compaction.json")
    with pytest.raises(WorkerError, match=r"died during 'load' of .*bad\.gguf \(killed by SIGABRT\)(.|\n)*GGML_ASSERT"):
        LlamaCppAdapter(GRANITE, trace, "legacy").run_trace()


def test_a_worker_that_does_not_answer_is_killed_and_named():
    from hybridqual.adapters.llamacpp.adapter import Worker, WorkerError
    w = Worker(timeout=0.01)
    with pytest.raises(WorkerError, match=r"did not answer 'load' of x\.gguf within 0 s \(killed\)"):
        w.ask({"op": "load", "gguf": "x.gguf", "n_ctx": 64, "n_seq": 1})
    assert w.proc.poll() is not None


def test_an_unreadable_gguf_is_a_refusal_with_the_reason():
    from hybridqual.adapters.llamacpp.adapter import Worker, WorkerError
    w = Worker(timeout=60)
    try:
        with pytest.raises(WorkerError, match="refused 'load' of /nonexistent.gguf: RuntimeError"):
            w.ask({"op": "load", "gguf": "/nonexistent.gguf", "n_ctx": 64, "n_seq": 1})
    finally:
        w.close()


def test_capabilities_declare_the_gguf_dtype():
    from hybridqual.adapters.llamacpp.adapter import LlamaCppAdapter, LlamaCppBF16Adapter, LlamaCppFlashAttnAdapter
    assert LlamaCppAdapter.capabilities("cpu").compute_dtype == torch.float32
    assert LlamaCppBF16Adapter.capabilities("cpu").compute_dtype == torch.bfloat16
    assert LlamaCppFlashAttnAdapter.capabilities("cpu").compute_dtype == torch.float16
    caps = LlamaCppAdapter.capabilities("cpu")
    assert caps.logits and not caps.schedule_log and caps.modes == ("legacy",)
