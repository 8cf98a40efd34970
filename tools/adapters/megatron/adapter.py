"""`MegatronAdapter`: Megatron-Core's DynamicInferenceEngine behind hybridqual's adapter protocol (docs/api.md).

Per trace: the model is built from our HF folder (tools/adapters/megatron/runtime.py, exact mapping or a refusal by field),
a DynamicInferenceContext is sized from the trace's engine config (max_requests -> max_requests, max_tokens_per_step
-> max_tokens, chunked prefill on, async_sched_mode from the mode), and requests enter through
`engine.add_request` at their arrival step (steps = `step_modern()` calls). Greedy = SamplingParams(top_k=1),
which Megatron samples with torch.argmax. Stop tokens: one id -> `termination_id`; several -> `stop_words` (one
token each, kept in the output with `detokenize_stop_sequence`); none -> termination_id -1. The tokens reported are
Megatron's generated tokens as it returns them (never cut or repaired here). Attention runs on the flash-attn
stand-in (tools/adapters/megatron/flash_attn_standin.py): every report says so (version()).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from hybridqual.adapters import Capabilities, RunResult, StepAdapter, installed_version
from hybridqual.adapters.megatron import budget
from hybridqual.scenarios.step_rule import StepRule

# Megatron's piece rule: its token budget is rounded to multiples of 64 (TOKEN_ROUNDER in 0.19.2's dynamic context)
# and a one-token remainder is shortened, so the engine-aware corpus puts prompts = 1 mod 64 (docs/megatron.md)
PIECE_ROUNDING = 64
_NOTES = (
    ("seeded", "Megatron samples temperature/top-k/top-p with torch's generator per step, not the trace's keyed "
               "(request seed, position) sampler, so seeded outputs have no common truth"),
    ("schedule_log", "Megatron's scheduler is its own (token budget only: no prefill_chunk, pieces padded to "
                     "64 tokens); it is not our DESIGN §4 schedule, so there is no oracle log to compare (what it "
                     "did per step is the \"Megatron's schedule facts\" line, checked for consistency)"),
    ("prefix_cache_reporting", "Megatron's prefix cache is its own (KV blocks with refcounts + Mamba states at "
                               "block boundaries, LRU), not DESIGN §12's checkpoint policy, so there are no "
                               "comparable hit/store/evict events (megatron runs without it; megatron-prefix and "
                               "-prefix-mtp with it, judged on tokens and logits)"),
    ("speculation_reporting", "megatron / -rounded / -prefix run speculative traces without speculation (judged on "
                              "tokens); megatron-mtp (and -prefix-mtp, -preempt-mtp, -pause-mtp) speculates with "
                              "Megatron's own MTP drafts, whose accepted counts the oracle recomputes in the "
                              "'Megatron's schedule facts' line, not from a DESIGN §4 log"),
)


class MegatronAdapter(StepAdapter):
    """Megatron-Core dynamic inference engine (legacy and async scheduling), fp32 on CPU, bf16 on CUDA.

    The trace's max_tokens_per_step is Megatron's max_tokens as is (`max_tokens_multiple` = 1): a budget that is not
    a multiple of 64 crashes hybrid prefill steps in 0.19.2 (docs/findings.md, F1). `MegatronRoundedAdapter` rounds
    the budget up to a multiple of 64, the workaround, so the rest of the corpus can be qualified.
    """
    dtype: torch.dtype | None = None
    max_tokens_multiple = 1
    prefix_caching = False
    mtp_seed = 0
    cuda_graphs = False
    kv_block: int | None = None         # KV block size (None: the trace's prefix block, else 16)
    paused_blocks: int | None = None    # not None: KV buffer cut to engine.kv_tokens, this many blocks for paused

    @classmethod
    def capabilities(cls, device: str) -> Capabilities:
        dtype = cls.dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
        return Capabilities(("greedy",), ("legacy", "async"), logits=True, compute_dtype=dtype, notes=_NOTES,
                            piece_granularities=(PIECE_ROUNDING,), step_rule=cls.step_rule())

    @classmethod
    def step_rule(cls) -> StepRule:
        """Megatron's piece rule (0.19.2 dynamic_engine.py schedule_chunked_prefill): the waiting queue in FIFO
        order, a prompt taken whole if it fits the budget left (decode rows count one token each), else cut at the
        budget left, one token shorter where the cut would leave one token (not admitted this step where that cut is
        one token: no split prompt ends with a 1-token piece), and nothing admitted behind a partly
        prefilled prompt; no prefill_chunk, no chunk alignment; the budget is max_tokens (rounded up to
        `max_tokens_multiple`). KV blocks are the trace's prefix block (else 16), so hits land on the trace's."""
        return StepRule(f"megatron-core (max_tokens a multiple of {cls.max_tokens_multiple})",
                        budget_multiple=cls.max_tokens_multiple, uses_prefill_chunk=False, chunk_aligned=False,
                        no_one_token_remainder=True, one_partial_prefill=True)

    @classmethod
    def version(cls) -> str:
        ver = installed_version("megatron-core")
        rounded = (f"; max_tokens rounded up to a multiple of {cls.max_tokens_multiple} (finding F1 workaround)"
                   if cls.max_tokens_multiple > 1 else "")
        return (f"megatron-core {ver} DynamicInferenceEngine; attention on the hybridqual flash-attn stand-in "
                f"(tools/adapters/megatron/flash_attn_standin.py, not flash-attn){rounded}")

    def __init__(self, model_path, trace, mode, device="cpu", dtype=None):
        super().__init__(model_path, trace, mode, device)
        from hybridqual.adapters.megatron import cpu_shim, runtime
        from hybridqual.adapters.megatron.install import available
        why = available()
        if why:
            raise RuntimeError(f"Megatron adapter: {why}")
        self._dtype = dtype or self.capabilities(device).compute_dtype
        self._cpu = torch.device(device).type == "cpu"
        self._shim = cpu_shim.active if self._cpu else _nullcontext
        with self._shim():
            self.model, self.cfg = runtime.build_model(self.model_path, device, self._dtype,
                                                       mtp_seed=self.mtp_seed if self.speculative_k(trace) else None,
                                                       cuda_graphs=self.cuda_graphs)
            if not self.cfg.attention_layer_ids:
                from hybridqual.adapters.megatron.mapping import UnsupportedConfig
                raise UnsupportedConfig(
                    f"layers: {self.cfg.pattern} has no attention layer; Megatron's DynamicInferenceContext "
                    "raises NotImplementedError('Using `DynamicInferenceContext` with no attention is not "
                    "supported') (megatron/core/inference/contexts/dynamic_context.py:401, 0.19.2)")
            self.engine = _make_engine(self.model, self.cfg, trace, mode, self.max_tokens_multiple,
                                       self.prefix_caching, self.speculative_k(trace), self.cuda_graphs,
                                       self.kv_block, self.paused_blocks)
        self._ids: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._reqs: dict[str, object] = {}
        self._seen: dict[str, int] = {}
        self._final: dict[str, list[int]] = {}
        self.schedule_facts: list[dict] = []
        self._rows: dict[str, list[torch.Tensor]] = {}
        self._batches: list[dict] = []
        self._drafts: dict[str, list[int]] = {}
        self._hook_sampling()

    def _hook_sampling(self) -> None:
        """Record each forward's batch (schedule facts) and keep the logits rows requests' tokens are sampled
        from: at Megatron's sampling call, row i of the
        last-token logits belongs to active request i (context slots paused..total). Per request the rows come in
        order; a row whose prefill piece ends before the prompt does (kv offset + query length < prompt length)
        samples nothing, and rows past the last token (async's extra step after a finish) are dropped in
        run_trace, which also checks that the rows' argmax gives the request's tokens (else the mapping is wrong)."""
        ctl = self.engine.controller
        forward, orig = ctl._dynamic_step_forward_logits, ctl._dynamic_step_sample_logits

        def forward_and_record(*a, **k):
            self._record_batch()
            return forward(*a, **k)

        def sample_and_record():
            self._record_logits(ctl._all_logits_cuda.squeeze(0))
            return orig()
        ctl._dynamic_step_forward_logits = forward_and_record
        ctl._dynamic_step_sample_logits = sample_and_record
        if self.engine.num_speculative_tokens:
            self._hook_mtp(ctl)

    def _active_rows(self):
        """(row index i among the active requests, context slot j, request name) of the context's batch now."""
        ctx = self.engine.controller.inference_wrapped_model.inference_context
        for i, j in enumerate(range(ctx.paused_request_count, ctx.total_request_count)):
            name = self._names.get(int(ctx.request_ids[j]))
            if name is not None:
                yield i, j, name

    def _record_batch(self) -> None:
        """At the forward pass: the batch it computes (schedule facts). Recorded here, not at sampling: in async
        mode the context's offsets have already moved on to the next step when the sampler runs."""
        ctx = self.engine.controller.inference_wrapped_model.inference_context
        batch = []
        for _, j, name in self._active_rows():
            batch.append({"request": name, "slot": j, "pos": int(ctx.request_kv_length_offsets[j]),
                          "tokens": int(ctx.request_query_lengths[j]),
                          "mamba_slot": int(ctx.mamba_metadata.request_to_mamba_state_idx[j])
                          if getattr(ctx, "mamba_metadata", None) is not None else -1})
        self._batches.append({"rows": batch, "padded_tokens": int(ctx.padded_active_token_count)})
        self._forward_rows = {r["request"]: r for r in batch}

    def _record_logits(self, logits) -> None:
        """At sampling: row i of the last-token logits belongs to active request i; a row whose forward piece ends
        before the prompt does samples nothing and is skipped."""
        ctx = self.engine.controller.inference_wrapped_model.inference_context
        for i, j, name in self._active_rows():
            row = getattr(self, "_forward_rows", {}).get(name)
            start, count = ((row["pos"], row["tokens"]) if row is not None else
                            (int(ctx.request_kv_length_offsets[j]), int(ctx.request_query_lengths[j])))
            if start + count >= self._prompt_len(name):
                self._rows.setdefault(name, []).append(logits[i].detach().float().cpu().clone())

    def _hook_mtp(self, ctl) -> None:
        """Under MTP: record each verify row's drafts (Megatron's own, sampled from its MTP head at the previous
        step) and accepted count, so tools/qualify/spec_checks.py can recompute acceptance from them."""
        verify, drafts = ctl._dynamic_step_sample_logits_and_verify_tokens, ctl._compute_serial_mtp_and_sample

        def verify_and_record(*a, **k):
            out = verify(*a, **k)
            accepted = ctl._accepted_token_counts_per_request
            for i, _, name in self._active_rows():
                row = getattr(self, "_forward_rows", {}).get(name)
                if row is not None and row["pos"] >= self._prompt_len(name):
                    row["proposals"] = list(self._drafts.get(name, []))
                    row["accepted"] = int(accepted[i])
            return out

        def drafts_and_record(*a, **k):
            out = drafts(*a, **k)
            for i, _, name in self._active_rows():
                self._drafts[name] = [int(t) for t in ctl._sampled_mtp_tokens_cuda[:, i].tolist()]
            return out
        ctl._dynamic_step_sample_logits_and_verify_tokens = verify_and_record
        ctl._compute_serial_mtp_and_sample = drafts_and_record

    @classmethod
    def speculative_k(cls, trace) -> int:
        """Megatron's num_speculative_tokens for this trace (0: no speculation)."""
        return 0

    def _prompt_len(self, name: str) -> int:
        """The prompt Megatron is prefilling for the request now: after an eviction its record's new request has
        prompt + the tokens generated before (`DynamicInferenceRequestRecord.checkpoint`, inference_request.py:657)."""
        rid = self._ids[name]
        if rid in self.engine.requests:
            return len(self.engine.get_request(rid).prompt_tokens)
        return len(self._reqs[name].prompt)

    def add_request(self, request) -> None:
        from megatron.core.inference.sampling_params import SamplingParams
        rid = len(self._ids)
        self._ids[request.id], self._names[rid], self._reqs[request.id] = rid, request.id, request
        self._seen[request.id] = 0
        if request.sampling.kind != "greedy":
            raise ValueError(f"request {request.id}: the Megatron adapter runs greedy sampling only")
        stops = list(request.stop_token_ids)
        sp = SamplingParams(temperature=1.0, top_k=1, num_tokens_to_generate=request.max_new_tokens,
                            termination_id=stops[0] if len(stops) == 1 else -1,
                            stop_words=[str(s) for s in stops] if len(stops) > 1 else None,
                            detokenize_stop_sequence=True)
        with self._shim():
            self.engine.add_request(rid, list(request.prompt), sp)

    def _tokens(self, rid_name: str) -> list[int]:
        """The request's generated tokens so far: from its final record once finished (the engine drops finished
        requests), else from the live request."""
        if rid_name in self._final:
            return self._final[rid_name]
        rid = self._ids[rid_name]
        if rid not in self.engine.requests:
            return []
        record = self.engine.requests[rid].record          # several requests after an eviction: merged in order
        return [t for r in record.requests for t in _ints(r.generated_tokens)]

    def step(self) -> dict[str, list[int]]:
        if not self.engine.has_unfinished_requests():
            return {}
        before = _counters(self.engine)
        with self._shim():
            r = self.engine.step_modern()
        for f in r.get("finished_request_records", []):
            self._final[self._names[int(f.request_id)]] = _ints(f.merge().generated_tokens)
        self.schedule_facts.append(self._step_facts(r, before))
        self._batches = []
        out = {}
        for name in self._ids:
            toks = self._tokens(name)
            if len(toks) > self._seen[name]:
                out[name] = toks[self._seen[name]:]
                self._seen[name] = len(toks)
        return out

    def _step_facts(self, r: dict, before: dict[str, int]) -> dict:
        """This step's facts (tools/adapters/megatron/schedule_facts.py): the batches sampled during it (async: the
        overlapped one too), who finished, who is still active, the CUDA-graph batch size (None: eager), queue
        counts, and the prefix-cache / MTP counter deltas when those features are on."""
        after, eng, ctx = _counters(self.engine), self.engine, self.engine.context
        delta = {k: after[k] - before[k] for k in after}
        fact = {"batches": self._batches,
                "finished": [self._names[int(f.request_id)] for f in r.get("finished_request_records", [])],
                "active": [self._names[int(i)] for i in r.get("active_request_ids", []) if int(i) in self._names],
                "cuda_graph": r.get("cuda_graph_request_count"), "waiting": len(eng.waiting_request_ids),
                "paused": int(ctx.paused_request_count), "evicted": delta["evicted"]}
        if ctx.enable_prefix_caching:
            fact["prefix_cache"] = {k: delta[k] for k in ("hits", "blocks_matched", "computed_tokens",
                                                           "skipped_tokens")}
        if eng.num_speculative_tokens:
            fact["mtp"] = {"proposed": delta["proposed"], "accepted": delta["accepted"]}
        return fact

    @classmethod
    def facts_check(cls, ctx):
        """qualify's extra line: Megatron's per-step facts are a correct schedule's (schedule_facts.check)."""
        from hybridqual.adapters.megatron.schedule_facts import check
        return check(ctx.label, ctx.mode, ctx.trace, ctx.run, cls, ctx.oracle_model)

    def done(self) -> bool:
        return not self.engine.has_unfinished_requests()

    def run_trace(self) -> RunResult:
        res = super().run_trace()
        tokens = {name: self._tokens(name) for name in self._ids}
        reasons = {}
        for name, toks in tokens.items():
            req = self._reqs[name]
            reasons[name] = "stop" if toks and toks[-1] in set(req.stop_token_ids) else "length"
        for name in res.tokens:
            if res.tokens[name] != tokens.get(name, []):
                raise RuntimeError(f"request {name}: tokens streamed per step {res.tokens[name]} differ from the "
                                   f"engine's final record {tokens.get(name)}")
        logits = {}
        for name, toks in tokens.items():
            rows = self._rows.get(name, [])[:len(toks)]
            if toks and len(rows) == len(toks):
                stacked = torch.stack(rows)
                if stacked.argmax(-1).tolist() != toks:    # greedy: each token is its row's argmax
                    raise RuntimeError(f"request {name}: the argmax of the logits rows recorded at sampling is "
                                       f"{stacked.argmax(-1).tolist()}, its tokens are {toks} (the adapter's row "
                                       "mapping or Megatron's greedy sampling is wrong)")
                logits[name] = stacked
        return RunResult(tokens, reasons, logits=logits, schedule_facts=self.schedule_facts)


class MegatronRoundedAdapter(MegatronAdapter):
    """MegatronAdapter with max_tokens rounded up to a multiple of 64 (Megatron's TOKEN_ROUNDER): the workaround of
    finding F1, so traces with small token budgets still run (the tokens' truth does not depend on the budget)."""
    max_tokens_multiple = 64


class MegatronPrefixAdapter(MegatronRoundedAdapter):
    """MegatronRoundedAdapter with Megatron's hybrid prefix caching on (`enable_prefix_caching`, Mamba states cached
    at KV block boundaries within `prefix_caching_mamba_gb`; KV blocks of the trace's prefix_cache block_size). The
    truth is unchanged: each request's tokens alone, cache or no cache (DESIGN §12)."""
    prefix_caching = True


class MegatronMTPAdapter(MegatronRoundedAdapter):
    """MegatronRoundedAdapter with Megatron's MTP speculative decoding: `num_speculative_tokens` = the trace's
    engine.speculative.k (else `default_k`), one repeated MTP layer with random seeded weights (our checkpoints have
    none). Drafts are Megatron's own MTP drafts, not the trace's proposer; the truth is the non-speculative output,
    and the schedule-facts line recomputes every verify row's accepted count from its logged drafts."""
    default_k = 2

    @classmethod
    def speculative_k(cls, trace) -> int:
        spec = getattr(trace.engine, "speculative", None)
        return spec.k if spec is not None else cls.default_k

    @classmethod
    def capabilities(cls, device: str) -> Capabilities:
        caps = super().capabilities(device)
        return Capabilities(caps.sampling_kinds, caps.modes, logits=False, compute_dtype=caps.compute_dtype,
                            piece_granularities=caps.piece_granularities, step_rule=caps.step_rule,
                            notes=caps.notes + (("logits", "under MTP Megatron samples k+1 rows per verify row; the "
                                                 "adapter keeps no logits there (tokens and acceptance are judged)"),))

    @classmethod
    def version(cls) -> str:
        return super().version() + "; MTP speculative decoding (one repeated MTP layer, random seeded weights)"


GRAPHS_ON_CPU = ("megatron-graphs captures CUDA graphs for decode steps (Megatron's cuda_graph_impl='local', "
                 "inference_cuda_graph_scope layer; dynamic_engine.py:412 create_cuda_graphs); on CPU there is no "
                 "CUDA device to capture on: run it with --device cuda")


class MegatronGraphsAdapter(MegatronRoundedAdapter):
    """MegatronRoundedAdapter with Megatron's own CUDA graphs for decode-only steps (`cuda_graph_impl="local"`, no
    Transformer Engine needed; prefill and mixed steps stay eager). CUDA only: on CPU every mode is a SKIP with
    that reason, and building it raises the same. The schedule facts record the graph batch size Megatron used
    per step (`cuda_graph`), so the report shows that graphs really ran."""
    cuda_graphs = True

    @classmethod
    def capabilities(cls, device: str) -> Capabilities:
        caps = super().capabilities(device)
        if torch.device(device).type == "cuda":
            return caps
        return Capabilities(caps.sampling_kinds, (), logits=True, compute_dtype=caps.compute_dtype,
                            piece_granularities=caps.piece_granularities, step_rule=caps.step_rule,
                            notes=caps.notes + (("legacy", GRAPHS_ON_CPU), ("async", GRAPHS_ON_CPU)))

    @classmethod
    def version(cls) -> str:
        return super().version() + "; CUDA graphs for decode steps (cuda_graph_impl=local)"

    def __init__(self, model_path, trace, mode, device="cpu", dtype=None):
        if torch.device(device).type != "cuda":
            from hybridqual.adapters.megatron.mapping import UnsupportedConfig
            raise UnsupportedConfig(f"device: {GRAPHS_ON_CPU}")
        super().__init__(model_path, trace, mode, device, dtype)


def _counters(engine) -> dict[str, int]:
    """Megatron's cumulative engine counters the step facts take deltas of (dynamic_engine.py's accumulators)."""
    g = lambda name: int(getattr(engine, name, 0) or 0)      # noqa: E731
    return {"evicted": g("evicted_request_count"), "hits": g("_prefix_cache_hits"),
            "blocks_matched": g("_prefix_cache_blocks_matched"), "computed_tokens": g("_prefill_tokens_computed"),
            "skipped_tokens": g("_prefill_tokens_skipped"),
            "proposed": int(torch.as_tensor(getattr(engine, "_spec_tokens_proposed_per_pos", [])).sum()),
            "accepted": int(torch.as_tensor(getattr(engine, "_spec_tokens_accepted_per_pos", [])).sum())}


def _ints(toks) -> list[int]:
    return [int(t) for t in (toks.tolist() if torch.is_tensor(toks) else toks)]


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Tokenizer:
    """Megatron's controller needs a tokenizer: token ids are given, so text is the ids in decimal."""
    eod = -1
    bos = None

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids, **_) -> str:
        return " ".join(str(int(i)) for i in ids)

    def offsets(self, ids, text):
        return []


def _make_engine(model, cfg, trace, mode: str, max_tokens_multiple: int = 1, prefix_caching: bool = False,
                 speculative: int = 0, cuda_graphs: bool = False, block: int | None = None, paused_blocks=None):
    """DynamicInferenceContext + GPTInferenceWrapper + TextGenerationController + DynamicInferenceEngine; `block`:
    the KV block size (else the trace's prefix block or 16); `paused_blocks` not None: the KV buffer is cut to the
    trace's engine.kv_tokens (tools/adapters/megatron/budget.py) with that many blocks reserved for paused
    requests, so Megatron pauses and evicts under that budget."""
    from megatron.core.inference.config import (AsyncScheduleMode, InferenceConfig, MambaInferenceStateConfig,
                                                PrefixCachingEvictionPolicy)
    from megatron.core.inference.contexts import DynamicInferenceContext
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController)
    e = trace.engine
    longest = max(len(r.prompt) + r.max_new_tokens for r in trace.requests)
    pc = getattr(e, "prefix_cache", None)
    block = block or (pc.block_size if (prefix_caching and pc is not None)
                      else int(os.environ.get("HQ_MEGATRON_BLOCK", "16")))
    max_tokens = -(-e.max_tokens_per_step // max_tokens_multiple) * max_tokens_multiple
    max_seq = block * ((longest + block) // block + 1)
    ic = InferenceConfig(
        block_size_tokens=block, buffer_size_gb=0.05, max_requests=e.max_requests, max_tokens=max_tokens,
        max_sequence_length=max_seq, mamba_inference_state_config=MambaInferenceStateConfig.from_model(model),
        enable_chunked_prefill=True, materialize_only_last_token_logits=True,
        enable_prefix_caching=prefix_caching, prefix_caching_mamba_gb=0.01 if prefix_caching else None,
        prefix_caching_eviction_policy=PrefixCachingEvictionPolicy.LRU, num_speculative_tokens=speculative,
        **({"num_cuda_graphs": 8, "use_cuda_graphs_for_non_decode_steps": False} if cuda_graphs else {}),
        async_sched_mode=AsyncScheduleMode.ASYNC if mode == "async" else AsyncScheduleMode.LEGACY)
    ctx = DynamicInferenceContext(model.config, ic)
    want = budget.BlockBudget.from_trace(trace, block, paused_blocks) if paused_blocks is not None else None
    if want is not None:
        gb, paused_gb = budget.sizes(ctx, want)
        ctx = DynamicInferenceContext(model.config, dataclasses.replace(ic, buffer_size_gb=gb,
                                                                        paused_buffer_size_gb=paused_gb))
        budget.check(ctx, want)
    wrapper = GPTInferenceWrapper(model, ctx)
    ctl = TextGenerationController(inference_wrapped_model=wrapper, tokenizer=_Tokenizer())
    return DynamicInferenceEngine(controller=ctl, context=ctx)
