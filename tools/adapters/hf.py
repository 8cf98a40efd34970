"""HF transformers as an engine: `generate`, greedy, one request at a time or all together."""
from __future__ import annotations

import torch

from hybridqual.adapters.base import DEFAULT_OPTIONS, Capabilities, EngineOptions, RunResult, TraceAdapter


def _cut(gen: list[int], req) -> tuple[list[int], str]:
    """A request's output from a longer generation: up to and including its first stop token, at most
    max_new_tokens; with its finish reason."""
    stops = set(req.stop_token_ids)
    gen = gen[:req.max_new_tokens]
    cut = next((i + 1 for i, t in enumerate(gen) if t in stops), None)
    return (gen[:cut], "stop") if cut is not None else (gen, "length")


class HFAdapter(TraceAdapter):
    """HF transformers `generate`, greedy, one request at a time (no scheduling, no schedule log).

    The prompt goes in with an explicit all-ones attention_mask, so no token id is ever taken for padding (without
    one, generate infers the mask from pad_token_id and would mask every prompt token equal to it).
    """
    CAPABILITIES = Capabilities(("greedy",), ("legacy",), compute_dtype=torch.float32,
                                notes=(("seeded", "HF generate cannot reproduce the trace's keyed seeded sampler"),
                                       ("async", "HF generate has no async scheduling mode (async == legacy would "
                                                 "compare a run with itself)"),
                                       ("schedule_log", "HF generate keeps no schedule log"),
                                       ("logits", "the HF adapter does not return logits")))

    def __init__(self, model_path, trace, mode, device="cpu", options: EngineOptions = DEFAULT_OPTIONS):
        super().__init__(model_path, trace, mode, device, options)
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).to(device)
        self.pad = self.model.config.vocab_size - 1    # any id: the attention mask, not the id, marks padding

    @classmethod
    def version(cls, options: EngineOptions = DEFAULT_OPTIONS) -> str:
        import transformers
        return f"transformers {transformers.__version__} generate ({cls.__name__})"

    def _generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy generate for prompts of any lengths (left-padded into one batch): new tokens per prompt."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + list(p) for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=0,
                                      do_sample=False, eos_token_id=None, pad_token_id=self.pad)
        return [row[width:].tolist() for row in out]

    def _check_sampling(self) -> None:
        for req in self.trace.requests:
            if req.sampling.kind != "greedy":
                raise ValueError(f"request {req.id}: the HF adapters run greedy sampling only")

    def run_trace(self) -> RunResult:
        self._check_sampling()
        tokens, reasons = {}, {}
        for req in self.trace.requests:
            [gen] = self._generate([list(req.prompt)], req.max_new_tokens)
            tokens[req.id], reasons[req.id] = _cut(gen, req)
        return RunResult(tokens, reasons)


class HFBatchedAdapter(HFAdapter):
    """HF transformers `generate` with every request of the trace in one left-padded batch (the padding path).

    Generates max(max_new_tokens) tokens for all and cuts each request at its own stop token / length (one
    eos_token_id list for the batch would stop a request on another request's stop token).
    """

    def run_trace(self) -> RunResult:
        self._check_sampling()
        reqs = list(self.trace.requests)
        gens = self._generate([list(r.prompt) for r in reqs], max(r.max_new_tokens for r in reqs))
        tokens, reasons = {}, {}
        for req, gen in zip(reqs, gens):
            tokens[req.id], reasons[req.id] = _cut(gen, req)
        return RunResult(tokens, reasons)
