"""How `qualify` and `replay` drive an engine: the adapter protocol and the adapters that ship.

Owns the protocol (`base`: TraceAdapter, StepAdapter, EngineOptions, Engine, Capabilities, RunResult), the
built-in engines (`oracle`, `fastpath`, `hf`), the optional ones imported only when named (`megatron/`,
`llamacpp/`, `openai/`), the engine-name registry `ENGINES` and `resolve` (an --engine name or `module:Class` to a
class). May import oracle, fastpath and `hybridqual.qualify.prefix_checks` (the cache facts' type) lazily; nothing
here imports the checks that judge it.

To qualify your own engine, subclass `StepAdapter` and implement four methods (a complete wrapper is ~30 lines;
the fields a request carries and what a run must return: docs/api.md, "Adapters"):

    class MyEngine(StepAdapter):
        CAPABILITIES = Capabilities(sampling_kinds=("greedy",), compute_dtype=torch.bfloat16)   # what it can do
        def __init__(self, model_path, trace, mode, device):   # build your engine from the trace's engine config
            ...
        def add_request(self, request):                       # request: oracle.trace.Request (id, prompt, ...)
            ...
        def step(self) -> dict[str, list[int]]:               # one engine step; returns tokens emitted per request id
            ...
        def done(self) -> bool:                               # nothing waiting, nothing running
            ...

then `hybridqual qualify --engine mypackage.mymodule:MyEngine`. `StepAdapter.run_trace` admits each request at
its `arrival_step` (the step counter is the number of `step()` calls made so far) and collects tokens. An engine
that runs a whole trace itself subclasses `TraceAdapter` and implements `run_trace` only, and may return a schedule
log (DESIGN §4) and logits rows to have them checked too. Capabilities say what the adapter can do (DESIGN §14): a
check it cannot support is reported as "SKIP: reason", never run against nothing and never counted as passed.
"""
from __future__ import annotations

import importlib

__all__ = ["Adapter", "StepAdapter", "TraceAdapter", "EngineOptions", "DEFAULT_OPTIONS", "Engine", "as_engine",
           "Capabilities", "Configuration", "RunResult", "installed_version", "OracleAdapter", "FastpathAdapter",
           "HFAdapter", "HFBatchedAdapter", "ENGINES", "resolve", "engine"]

# The names this package gives, each imported from its module when first used (importing the package, e.g. for
# the engine names, imports no torch).
_LAZY = {**{n: "base" for n in ("Adapter", "StepAdapter", "TraceAdapter", "EngineOptions", "DEFAULT_OPTIONS",
                                "Engine", "as_engine", "Capabilities", "Configuration", "RunResult",
                                "installed_version")},
         "OracleAdapter": "oracle", "FastpathAdapter": "fastpath", "HFAdapter": "hf", "HFBatchedAdapter": "hf"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Every engine name --engine accepts: name -> "module:Class" inside this package, imported only when named
# (one line adds an engine; `qualify --help` lists these names).
ENGINES: dict[str, str] = {
    "fastpath": "fastpath:FastpathAdapter",
    "oracle": "oracle:OracleAdapter",
    "hf": "hf:HFAdapter",
    "hf-batched": "hf:HFBatchedAdapter",
    "megatron": "megatron:MegatronAdapter",
    "megatron-rounded": "megatron:MegatronRoundedAdapter",
    "megatron-prefix": "megatron:MegatronPrefixAdapter",
    "megatron-mtp": "megatron:MegatronMTPAdapter",
    "megatron-prefix-mtp": "megatron:MegatronPrefixMTPAdapter",
    "megatron-preempt": "megatron:MegatronPreemptAdapter",
    "megatron-pause": "megatron:MegatronPauseAdapter",
    "megatron-preempt-mtp": "megatron:MegatronPreemptMTPAdapter",
    "megatron-pause-mtp": "megatron:MegatronPauseMTPAdapter",
    "megatron-graphs": "megatron:MegatronGraphsAdapter",
    "llamacpp": "llamacpp.adapter:LlamaCppAdapter",
    "llamacpp-bf16": "llamacpp.adapter:LlamaCppBF16Adapter",
    "llamacpp-fa": "llamacpp.adapter:LlamaCppFlashAttnAdapter",
    "llamacpp-q8": "llamacpp.adapter:LlamaCppQ8Adapter",
    "llamacpp-mutant": "llamacpp.mutant:LlamaCppMutantAdapter",
    "openai": "openai:OpenAIServerAdapter",
    "vllm-server": "vllm.server:VLLMServerAdapter",
    "vllm-server-mutant": "vllm.server:VLLMServerMutantAdapter",
    "vllm": "vllm.adapter:VLLMAdapter", "vllm-mutant": "vllm.mutant:VLLMMutantAdapter",
}


def resolve(spec: str) -> "type[TraceAdapter]":
    """An --engine value (a name of ENGINES, or 'package.module:Class') -> adapter class, with a clear error."""
    from hybridqual.adapters.base import Capabilities, TraceAdapter
    if spec in ENGINES:
        spec = f"{__package__}.{ENGINES[spec]}"
    if ":" not in spec:
        raise ValueError(f"--engine {spec!r}: expected one of {sorted(ENGINES)} or 'module:Class'")
    mod, _, name = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--engine {spec!r}: cannot load it ({e})") from e
    if not (isinstance(cls, type) and issubclass(cls, TraceAdapter)):
        raise ValueError(f"--engine {spec!r}: {name} is not a subclass of hybridqual.adapters.Adapter "
                         "(StepAdapter) or TraceAdapter")
    if not isinstance(cls.capabilities("cpu"), Capabilities):
        raise ValueError(f"--engine {spec!r}: {name}.capabilities() must return a hybridqual.adapters.Capabilities")
    return cls


def engine(spec: str, options: "EngineOptions | None" = None) -> "Engine":
    """An --engine value with the run's options (None: the defaults), checked (a ValueError naming what the
    adapter does not take)."""
    from hybridqual.adapters.base import DEFAULT_OPTIONS, Engine
    bound = Engine(resolve(spec), options if options is not None else DEFAULT_OPTIONS)
    problem = bound.problem()
    if problem:
        raise ValueError(f"--engine {spec}: {problem}")
    return bound
