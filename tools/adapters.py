"""Engine adapter protocol: how `qualify` and `replay` drive an engine, and adapters for ours and HF's.

To qualify your own engine, subclass `Adapter` and implement four methods (a complete wrapper is ~30 lines):

    class MyEngine(Adapter):
        def __init__(self, model_path, trace, mode, device):   # build your engine from the trace's engine config
            ...
        def add_request(self, request):                       # request: oracle.trace.Request (id, prompt, ...)
            ...
        def step(self) -> dict[str, list[int]]:               # one engine step; returns tokens emitted per request id
            ...
        def done(self) -> bool:                               # nothing waiting, nothing running
            ...

then `python -m tools.qualify --engine mypackage.mymodule:MyEngine`. `Adapter.run_trace` admits each request at
its `arrival_step` (the step counter is the number of `step()` calls made so far) and collects tokens. An adapter
may also override `run_trace` directly and may return a schedule log (DESIGN §4) to have it checked too.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RunResult:
    """What qualify compares: tokens and finish reasons per request, and the schedule log when the engine has one."""
    tokens: dict[str, list[int]]
    finish_reasons: dict[str, str] = field(default_factory=dict)
    schedule_log: object | None = None   # oracle.schedule_log.ScheduleLog (has .to_json()) when the engine logs
    digest: str | None = None


class Adapter:
    """Base class of engine adapters; see the module docstring."""
    max_steps = 100_000

    def __init__(self, model_path: Path, trace, mode: str, device: str = "cpu") -> None:
        self.model_path, self.trace, self.mode, self.device = Path(model_path), trace, mode, device

    def add_request(self, request) -> None:
        raise NotImplementedError

    def step(self) -> dict[str, list[int]]:
        raise NotImplementedError

    def done(self) -> bool:
        raise NotImplementedError

    def run_trace(self) -> RunResult:
        """Drive add_request/step/done through the trace's arrivals."""
        pending = sorted(self.trace.requests, key=lambda r: (r.arrival_step, r.id))
        out: dict[str, list[int]] = {r.id: [] for r in pending}
        k = 0
        while pending or not self.done():
            while pending and pending[0].arrival_step <= k:
                self.add_request(pending.pop(0))
            for rid, toks in self.step().items():
                out[rid].extend(toks)
            k += 1
            if k > self.max_steps:
                raise RuntimeError(f"engine did not finish the trace within {self.max_steps} steps")
        return RunResult(tokens=out)


class OracleAdapter(Adapter):
    """The oracle scheduler itself (fp64 by default): the truth, with its schedule log."""

    def __init__(self, model_path, trace, mode, device="cpu", dtype=None):
        super().__init__(model_path, trace, mode, device)
        import torch
        import oracle
        self.model = oracle.load(self.model_path, dtype=dtype or torch.float64)

    def run_trace(self) -> RunResult:
        import oracle
        r = oracle.run_trace(self.model, self.trace, mode=self.mode)
        return RunResult(r.tokens, r.finish_reasons, r.schedule_log, r.digest)


class FastpathAdapter(Adapter):
    """hybridqual's own fast path (Triton kernels; on CPU through the interpreter, fp32).

    `tp` > 1 (under torchrun) shards the model over ranks; `batch_invariant` selects the batch-invariant mode
    (docs/tp.md). Both are class attributes so `qualify --tp/--batch-invariant` can set them.
    """
    tp = 1
    batch_invariant = False

    def __init__(self, model_path, trace, mode, device="cpu", dtype=None):
        super().__init__(model_path, trace, mode, device)
        if self.tp > 1 or self.batch_invariant:
            from fastpath.tp import engine_from_pretrained
            self.engine = engine_from_pretrained(self.model_path, trace.engine, device=device, dtype=dtype,
                                                 tp=self.tp, batch_invariant=self.batch_invariant)
        else:
            import fastpath
            self.engine = fastpath.Engine.from_pretrained(self.model_path, trace.engine, device=device, dtype=dtype)

    def run_trace(self) -> RunResult:
        r = self.engine.run_trace(self.trace, mode=self.mode)
        return RunResult(r.tokens, r.finish_reasons, r.schedule_log, r.digest)


class HFAdapter(Adapter):
    """HF transformers `generate`, greedy, one request at a time (no scheduling, no schedule log)."""

    def __init__(self, model_path, trace, mode, device="cpu", dtype=None):
        super().__init__(model_path, trace, mode, device)
        import torch
        from transformers import AutoModelForCausalLM
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype or torch.float32).to(device)

    def run_trace(self) -> RunResult:
        torch, tokens, reasons = self.torch, {}, {}
        for req in self.trace.requests:
            if req.sampling.kind != "greedy":
                raise ValueError(f"request {req.id}: the HF adapter runs greedy sampling only")
            ids = torch.tensor([req.prompt], device=self.device)
            out = self.model.generate(ids, max_new_tokens=req.max_new_tokens, do_sample=False,
                                      eos_token_id=list(req.stop_token_ids) or None, pad_token_id=0)
            gen = out[0, len(req.prompt):].tolist()
            stops = set(req.stop_token_ids)
            cut = next((i + 1 for i, t in enumerate(gen) if t in stops), len(gen))
            tokens[req.id] = gen[:cut]
            reasons[req.id] = "stop" if cut <= len(gen) and gen[:cut] and gen[cut - 1] in stops else "length"
        return RunResult(tokens, reasons)


BUILTIN = {"fastpath": FastpathAdapter, "oracle": OracleAdapter, "hf": HFAdapter}


def resolve(spec: str) -> type[Adapter]:
    """'fastpath' | 'oracle' | 'hf' | 'package.module:Class' -> adapter class, with a clear error."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise ValueError(f"--engine {spec!r}: expected one of {sorted(BUILTIN)} or 'module:Class'")
    mod, _, name = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--engine {spec!r}: cannot load it ({e})") from e
    if not (isinstance(cls, type) and issubclass(cls, Adapter)):
        raise ValueError(f"--engine {spec!r}: {name} is not a subclass of tools.adapters.Adapter")
    return cls
