"""How `qualify` and `replay` drive an engine: the adapter protocol and the adapters that ship.

Owns the protocol (`base`: Adapter, Capabilities, RunResult), the built-in engines (`oracle`, `fastpath`, `hf`),
the optional ones imported only when named (`megatron/`) and `resolve` (an --engine name or `module:Class` to a
class). May import oracle, fastpath and `hybridqual.qualify.prefix_checks` (the cache facts' type) lazily; nothing
here imports the checks that judge it.

To qualify your own engine, subclass `Adapter` and implement four methods (a complete wrapper is ~30 lines;
the fields a request carries and what a run must return: docs/api.md, "Adapters"):

    class MyEngine(Adapter):
        CAPABILITIES = Capabilities(sampling_kinds=("greedy",), compute_dtype=torch.bfloat16)   # what it can do
        def __init__(self, model_path, trace, mode, device):   # build your engine from the trace's engine config
            ...
        def add_request(self, request):                       # request: oracle.trace.Request (id, prompt, ...)
            ...
        def step(self) -> dict[str, list[int]]:               # one engine step; returns tokens emitted per request id
            ...
        def done(self) -> bool:                               # nothing waiting, nothing running
            ...

then `hybridqual qualify --engine mypackage.mymodule:MyEngine`. `Adapter.run_trace` admits each request at
its `arrival_step` (the step counter is the number of `step()` calls made so far) and collects tokens. An adapter
may also override `run_trace` directly and may return a schedule log (DESIGN §4) and logits rows to have them
checked too. Capabilities say what the adapter can do (DESIGN §14): a check it cannot support is reported as
"SKIP: reason", never run against nothing and never counted as passed.
"""
from __future__ import annotations

import importlib

from hybridqual.adapters.base import Adapter, Capabilities, Configuration, RunResult, installed_version
from hybridqual.adapters.fastpath import FastpathAdapter
from hybridqual.adapters.hf import HFAdapter, HFBatchedAdapter
from hybridqual.adapters.oracle import OracleAdapter

__all__ = ["Adapter", "Capabilities", "Configuration", "RunResult", "installed_version", "OracleAdapter", "FastpathAdapter",
           "HFAdapter", "HFBatchedAdapter", "BUILTIN", "NAMED", "resolve"]


BUILTIN = {"fastpath": FastpathAdapter, "oracle": OracleAdapter, "hf": HFAdapter, "hf-batched": HFBatchedAdapter}


# Short names of adapters that live in optional subpackages (imported only when named).
NAMED = {"megatron": "megatron:MegatronAdapter", "megatron-rounded": "megatron:MegatronRoundedAdapter",
         "megatron-prefix": "megatron:MegatronPrefixAdapter", "megatron-mtp": "megatron:MegatronMTPAdapter",
         "megatron-graphs": "megatron:MegatronGraphsAdapter",
         "llamacpp": "llamacpp.adapter:LlamaCppAdapter", "llamacpp-bf16": "llamacpp.adapter:LlamaCppBF16Adapter",
         "llamacpp-fa": "llamacpp.adapter:LlamaCppFlashAttnAdapter",
         "llamacpp-q8": "llamacpp.adapter:LlamaCppQ8Adapter",
         "llamacpp-mutant": "llamacpp.mutant:LlamaCppMutantAdapter", "openai": "openai:OpenAIServerAdapter"}


def resolve(spec: str) -> type[Adapter]:
    """'fastpath' | 'oracle' | 'hf' | 'hf-batched' | 'megatron[-rounded|-prefix]' | 'package.module:Class' ->
    adapter class, with a clear error."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if spec in NAMED:
        spec = f"{__package__}.{NAMED[spec]}"
    if ":" not in spec:
        raise ValueError(f"--engine {spec!r}: expected one of {sorted(BUILTIN) + sorted(NAMED)} or 'module:Class'")
    mod, _, name = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--engine {spec!r}: cannot load it ({e})") from e
    if not (isinstance(cls, type) and issubclass(cls, Adapter)):
        raise ValueError(f"--engine {spec!r}: {name} is not a subclass of hybridqual.adapters.Adapter")
    if not isinstance(cls.capabilities("cpu"), Capabilities):
        raise ValueError(f"--engine {spec!r}: {name}.capabilities() must return a hybridqual.adapters.Capabilities")
    return cls
