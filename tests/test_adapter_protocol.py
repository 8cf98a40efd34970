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
