"""vLLM's engine built for a trace (needs .venv-vllm's python: scripts/install-vllm.sh): the settings a run may
change (`VllmSettings`), the vLLM EngineArgs they give, and `EnginePool`, which keeps built engines for the life of
the process (building one costs about a minute on a loaded 2-core CPU; `POOL.close()` drops them).

Fixed for every run: float32 weights and activations, eager (no torch.compile), no tokenizer (token ids in and out),
full-vocabulary raw logits as "logprobs" (`logprobs_mode="raw_logits"`, `max_logprobs=-1`), the V1 engine core
in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), threads not bound to cores (VLLM_CPU_OMP_THREADS_BIND=nobind)
and as many as torch has when the engine is built (the adapter sets them to qualify's thread budget,
EngineOptions.threads), a small KV cache (`kv_cache_bytes`).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

INSTALL_HINT = ("run qualify with .venv-vllm/bin/python (made by scripts/install-vllm.sh), e.g. "
                ".venv-vllm/bin/python -m hybridqual.qualify --engine vllm --model goldens/models/zoo-mamba2")


@dataclass(frozen=True)
class VllmSettings:
    """The vLLM flags a configuration sets (EngineOptions.settings of the `vllm` engine)."""
    max_num_batched_tokens: int | None = None   # vLLM's token budget per step; None: the trace's max_tokens_per_step
    enable_prefix_caching: bool = False         # vLLM's prefix cache (Mamba cache mode "align")
    ngram_tokens: int = 0                       # > 0: ngram speculation proposing this many tokens per step
    async_scheduling: bool = False
    kv_cache_bytes: int = 32 << 20              # vLLM's KV cache (attention blocks and Mamba states) in bytes
    mamba_ssm_cache_dtype: str = "float32"      # the SSM state's storage dtype
    block_size: int | None = None               # attention block size; None: vLLM's choice for the model


@dataclass(frozen=True)
class EngineKey:
    """What a built engine depends on: the model folder, the trace's limits and the settings."""
    model: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    settings: VllmSettings


def import_error() -> str | None:
    """Why vLLM cannot be imported here (None: it can)."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return f"vLLM is not importable in this python ({e}); {INSTALL_HINT}"
    return None


def engine_args(key: EngineKey):
    """vllm.EngineArgs for `key`."""
    from vllm import EngineArgs
    s = key.settings
    spec = None
    if s.ngram_tokens:
        spec = {"method": "ngram", "num_speculative_tokens": s.ngram_tokens, "prompt_lookup_min": 1,
                "prompt_lookup_max": 3}
    kw = dict(model=key.model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
              max_num_seqs=key.max_num_seqs, max_num_batched_tokens=key.max_num_batched_tokens,
              max_model_len=key.max_model_len, max_logprobs=-1, logprobs_mode="raw_logits",
              enable_prefix_caching=s.enable_prefix_caching, kv_cache_memory_bytes=s.kv_cache_bytes,
              mamba_ssm_cache_dtype=s.mamba_ssm_cache_dtype, async_scheduling=s.async_scheduling,
              speculative_config=spec, enable_chunked_prefill=True)
    if s.block_size is not None:
        kw["block_size"] = s.block_size
    return EngineArgs(**kw)


def refusals(engine, key: EngineKey) -> list[str]:
    """Settings vLLM accepted and then changed on its own (each names where): a run with them would not be the
    configuration asked for."""
    cfg = engine.vllm_config
    out = []
    if key.settings.async_scheduling and not cfg.scheduler_config.async_scheduling:
        out.append("async_scheduling=True was turned off by vLLM's CPU platform (vllm/platforms/cpu.py:329-331: "
                   "'async scheduling is not required on CPU')")
    got = str(cfg.cache_config.mamba_ssm_cache_dtype)
    if got != key.settings.mamba_ssm_cache_dtype:
        out.append(f"mamba_ssm_cache_dtype={key.settings.mamba_ssm_cache_dtype} was reset to {got} by vLLM's CPU "
                   "platform (vllm/platforms/cpu.py:302-320: on a CPU with AVX512-BF16 every non-GDN Mamba backend "
                   "keeps its SSM state in float32)")
    return out


def build(key: EngineKey):
    """A vLLM LLMEngine for `key`, in this process; torch.set_num_threads is given back after vLLM's CPU worker
    replaced it (vllm/v1/worker/cpu_worker.py: a no-op after its thread binding)."""
    import torch
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    set_threads = torch.set_num_threads
    try:
        from vllm.v1.engine.llm_engine import LLMEngine
        engine = LLMEngine.from_engine_args(engine_args(key))
    finally:
        torch.set_num_threads = set_threads
    bad = refusals(engine, key)
    if bad:
        raise RuntimeError("vLLM refused the configuration: " + "; ".join(bad))
    return engine


class EnginePool:
    """Built engines by EngineKey, kept for the process's life (qualify runs many traces on few engine shapes)."""

    def __init__(self) -> None:
        self._engines: dict[EngineKey, object] = {}

    def get(self, key: EngineKey):
        """The engine for `key`, built on first use; an engine left with unfinished requests is not reused."""
        eng = self._engines.get(key)
        if eng is not None and eng.has_unfinished_requests():
            self.drop(key)
            eng = None
        if eng is None:
            eng = self._engines[key] = build(key)
        return eng

    def drop(self, key: EngineKey) -> None:
        eng = self._engines.pop(key, None)
        if eng is not None:
            _shutdown(eng)

    def close(self) -> None:
        """Shut every engine down."""
        for key in list(self._engines):
            self.drop(key)


def _shutdown(engine) -> None:
    try:
        engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001  (a half-built or crashed engine: nothing more to free)
        pass


POOL = EnginePool()


def key_for(model_path: Path, trace, settings: VllmSettings) -> EngineKey:
    """The engine a trace needs: max_num_seqs = max_requests, the token budget, a model length that holds every
    request (prompt + max_new_tokens + drafts), at least 1024 so most traces share one engine (not with a KV cache
    smaller than the default: there the trace's own length, so the cache can be small enough to preempt)."""
    longest = max(len(r.prompt) + r.max_new_tokens for r in trace.requests) + settings.ngram_tokens + 1
    return EngineKey(str(Path(model_path).resolve()), trace.engine.max_requests,
                     settings.max_num_batched_tokens or trace.engine.max_tokens_per_step,
                     max(1024 if settings.kv_cache_bytes >= VllmSettings.kv_cache_bytes else 0,
                         -(-longest // 64) * 64), settings)


def threads_of(options) -> int:
    """The threads vLLM's CPU backend runs on: the run's budget (options.threads), else torch's now."""
    import torch
    return options.threads.threads if options.threads is not None else torch.get_num_threads()


def describe(settings: VllmSettings) -> str:
    """The settings that differ from the defaults, for the report."""
    base = asdict(VllmSettings())
    return ", ".join(f"{k}={v}" for k, v in asdict(settings).items() if base[k] != v) or "defaults"
