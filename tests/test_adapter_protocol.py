"""A user's own engine, wrapped in well under 50 lines, qualifies through the adapter protocol."""
import pytest
import torch

import oracle
from tools import adapters, goldens
from tools.compare import TAU
from tools.qualify import check_trace


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
    assert any("task accuracy" in c.name for c in checks)


def test_resolve_names_bad_engine_specs():

    for spec, words in [("nosuch", "expected one of"), ("os.path:nothing", "cannot load"),
                        ("tools.goldens:regen", "not a subclass")]:
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
    assert any("schedule log" in c.name for c in checks) == (engine == "oracle")
