"""A user's own engine, wrapped in well under 50 lines, qualifies through the adapter protocol."""
import pytest
import torch

import oracle
from hybridqual import adapters
from hybridqual.goldens import regen as goldens
from hybridqual.qualify.compare import TAU
from hybridqual.qualify.runner import check_trace


class NaiveEngine(adapters.Adapter):
    """A toy 'user engine': every live request advances one token per step, fp32, no batching."""

    def __init__(self, model_path, trace, mode, device="cpu"):
        super().__init__(model_path, trace, mode, device)
        self.model = oracle.load(model_path, dtype=torch.float32)
        self.live = {}                      # request id -> (request, state, last logits, tokens so far)

    def add_request(self, request):
        logits, state = self.model.prefill(list(request.prompt))
        self.live[request.id] = (request, state, logits[-1], [])

    def step(self):
        emitted = {}
        for rid, (req, state, last, out) in list(self.live.items()):
            tok = int(torch.argmax(last))
            out.append(tok)
            emitted[rid] = [tok]
            if tok in req.stop_token_ids or len(out) == req.max_new_tokens:
                del self.live[rid]
            else:
                last, state = self.model.decode(tok, state)
                self.live[rid] = (req, state, last, out)
        return emitted

    def done(self):
        return not self.live


def test_user_adapter_qualifies_against_goldens():
    model = goldens.MODELS / "tiny-sort"
    checks = check_trace(NaiveEngine, model, goldens.TRACES / "task_burst.json", ["legacy"],
                         oracle.load(model), "cpu", TAU[torch.float32])
    assert [c.name for c in checks if not c.ok] == [], checks
    assert any("task accuracy" in c.name and c.passed for c in checks)
    assert [c.status for c in checks if "schedule log" in c.name] == ["SKIP"]   # it keeps none: not a pass


def test_resolve_names_bad_engine_specs():

    for spec, words in [("nosuch", "expected one of"), ("os.path:nothing", "cannot load"),
                        ("hybridqual.goldens:regen", "not a subclass")]:
        with pytest.raises(ValueError, match=words):
            adapters.resolve(spec)


@pytest.mark.parametrize("engine", ["oracle", "hf"])
def test_builtin_reference_adapters_qualify_on_the_trained_model(engine):
    if engine == "hf":
        pytest.importorskip("transformers")
    model = goldens.MODELS / "tiny-sort"
    checks = check_trace(adapters.resolve(engine), model, goldens.TRACES / "seed_compaction.json", ["legacy"],
                         oracle.load(model), "cpu", TAU[torch.float32])
    assert checks and [c.name for c in checks if not c.ok] == [], checks
    assert any("schedule log" in c.name and c.passed for c in checks) == (engine == "oracle")
    assert any("schedule log" in c.name and c.skipped for c in checks) == (engine == "hf")


ZEROS = {"schema": "hybridqual.trace/1", "engine": {"max_requests": 2, "max_tokens_per_step": 16, "prefill_chunk": 16},
         "requests": [{"id": "a", "arrival_step": 0, "prompt": [0, 0, 5, 9, 0], "max_new_tokens": 5},
                      {"id": "b", "arrival_step": 0, "prompt": [0, 7], "max_new_tokens": 4, "stop_token_ids": [2]}]}


@pytest.mark.parametrize("engine", ["hf", "hf-batched"])
def test_hf_adapters_keep_prompt_token_zero_and_skip_what_they_cannot_do(engine):
    """Prompts full of token 0 (the config's pad id) and of different lengths (left padding in hf-batched) follow
    the oracle; async, the schedule log and logits are SKIPs with reasons, never a run compared with itself."""
    pytest.importorskip("transformers")
    from oracle.trace import parse_trace
    from hybridqual.qualify.checks import check_instance
    from hybridqual.scenarios.plan import Instance
    model = goldens.MODELS / "zoo-bamba"
    tr = parse_trace(ZEROS)
    checks = {c.name.split(" (")[0]: c for c in check_instance(adapters.resolve(engine), model,
              Instance("zeros", "test", tr, None, tr.to_json()), ["legacy", "async"], oracle.load(model), "cpu")}
    assert checks["legacy: tokens match the truth"].passed, checks["legacy: tokens match the truth"].detail
    assert "exact" in checks["legacy: tokens match the truth"].detail
    for name in ("async: engine runs the trace", "async == legacy, bitwise", "legacy: schedule log matches the "
                 "oracle's", "legacy: logits match the oracle's"):
        assert checks[name].skipped and checks[name].detail.startswith("skipped: "), (name, checks[name].detail)
    assert "compare a run with itself" in checks["async == legacy, bitwise"].detail


class WholeTraceEcho(adapters.TraceAdapter):
    """The whole-trace protocol alone: run_trace, no add_request/step/done (each request repeats its first
    prompt token max_new_tokens times)."""

    def run_trace(self):
        return adapters.RunResult({r.id: [r.prompt[0]] * r.max_new_tokens for r in self.trace.requests})


def test_the_whole_trace_and_the_step_protocols_are_separate():
    from oracle.trace import parse_trace
    tr = parse_trace(ZEROS)
    assert not hasattr(WholeTraceEcho, "add_request") and not hasattr(WholeTraceEcho, "step")
    assert WholeTraceEcho("m", tr, "legacy").run_trace().tokens == {"a": [0] * 5, "b": [0] * 4}

    class Unfinished(adapters.StepAdapter):
        pass
    with pytest.raises(NotImplementedError, match="Unfinished must implement add_request"):
        Unfinished("m", tr, "legacy").run_trace()
    assert adapters.Adapter is adapters.StepAdapter          # the former name keeps old adapters working


def test_an_adapter_written_without_options_gets_none_and_options_it_does_not_read_are_refused_by_name():
    """NaiveEngine (the ~30-line form: __init__(model_path, trace, mode, device), no options) is built with the
    four arguments; options it does not list in OPTIONS are refused before any work, naming the field and the
    flag."""
    engine = adapters.Engine(NaiveEngine)
    assert engine.problem() is None and engine.capabilities("cpu") == NaiveEngine.CAPABILITIES
    bound = adapters.Engine(NaiveEngine, adapters.EngineOptions(graphs=True))
    assert "takes no graphs option" in bound.problem()
    with pytest.raises(ValueError, match="takes no dtype option"):
        adapters.engine("test_adapter_protocol:NaiveEngine", adapters.EngineOptions(dtype=torch.bfloat16))
    from hybridqual.qualify import runner
    with pytest.raises(ValueError, match="apply to the fastpath engine only"):
        runner.configured_engine(runner.parse_args(["--engine", "test_adapter_protocol:NaiveEngine", "--graphs"]))
    with pytest.raises(ValueError, match="apply to a server engine"):
        runner.configured_engine(runner.parse_args(["--engine", "oracle", "--base-url", "http://127.0.0.1:1"]))


def test_options_reach_the_adapter_as_values_and_configurations_are_options():
    fast = adapters.Engine(adapters.FastpathAdapter, adapters.EngineOptions(dtype=torch.bfloat16, graphs=True))
    assert fast.capabilities("cpu").compute_dtype == torch.bfloat16 and "graphs" in fast.version()
    inv = fast.configured("batch_invariant")
    assert inv.options.batch_invariant and inv.options.graphs and inv.options.configuration == "batch_invariant"
    assert inv.capabilities("cpu").batch_invariant and not fast.capabilities("cpu").batch_invariant
    assert fast.options.configuration is None                  # a value: configuring made a new one


def test_every_engine_name_resolves_to_an_adapter_and_qualify_help_lists_it(capsys):
    from hybridqual.qualify import arguments
    for name in adapters.ENGINES:
        assert issubclass(adapters.resolve(name), adapters.TraceAdapter), name
    with pytest.raises(SystemExit):
        arguments.parse_args(["--help"])
    helptext = " ".join(capsys.readouterr().out.split())
    for name in adapters.ENGINES:
        assert name in helptext.replace("- ", "-"), name


def test_an_engine_declaring_plan_models_gets_their_corpora_as_its_default_plan():
    from hybridqual.adapters import resolve
    from hybridqual.adapters.base import Engine, EngineOptions
    from hybridqual.adapters.vllm import VLLM_MODELS
    from hybridqual.qualify.runner import build_plan, parse_args
    for name in ("vllm", "vllm-server"):
        engine = Engine(resolve(name), EngineOptions())
        plan = build_plan(parse_args(["--engine", name]), engine)
        assert {p[0].name for p in plan} == set(VLLM_MODELS)
        assert all(p[1] is None and p[2] is None for p in plan if p[3] is None)     # each model's whole corpus
    main = build_plan(parse_args([]), Engine(resolve("fastpath"), EngineOptions()))
    assert "tiny-sort" in {p[0].name for p in main}                                  # others keep the main job's


def test_vllm_logprob_rows_keep_the_engines_nan_and_name_a_missing_id():
    """A NaN logprob is the engine's output (validation FAILs it by request and row); a missing id is the adapter's."""
    from types import SimpleNamespace
    from hybridqual.adapters.vllm.adapter import _row
    row = _row({0: SimpleNamespace(logprob=-1.0), 1: SimpleNamespace(logprob=float("nan")),
                2: SimpleNamespace(logprob=-2.0)}, "m")
    assert row[0] == -1.0 and bool(torch.isnan(row[1])) and row[2] == -2.0
    with pytest.raises(RuntimeError, match=r"ids \[1\] missing"):
        _row({0: SimpleNamespace(logprob=-1.0), 2: SimpleNamespace(logprob=-2.0)}, "m")
