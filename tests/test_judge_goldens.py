"""Goldens carry a schema and a hash of their own content (hybridqual.goldens.record): a golden that fails either is
said and the truth recomputed from the oracle, so a broken golden never makes a correct engine FAIL."""
import json
import shutil

import pytest
import torch

import oracle
from hybridqual.adapters import OracleAdapter
from hybridqual.goldens import record
from hybridqual.goldens import regen as goldens
from hybridqual.qualify.checks import check_instance, truth_for
from hybridqual.scenarios.plan import Instance

MODEL = goldens.MODELS / "zoo-bamba"
NAME = "seed_compaction"


def shipped() -> dict:
    return json.loads((goldens.OUTPUTS / MODEL.name / f"{NAME}.json").read_text())


def test_every_shipped_golden_passes_its_schema_and_content_hash():
    for path in sorted(goldens.OUTPUTS.glob("*/*.json")):
        g = json.loads(path.read_text())
        tpath = goldens.TRACES / f"{g['trace']}.json"
        trace = oracle.load_trace(tpath) if tpath.exists() else None
        assert record.check_golden(g, trace) == [], path


def _set(g, path, value):
    *head, last = path
    for k in head:
        g = g[k]
    if value is KeyError:
        del g[last]
    else:
        g[last] = value


RID = "r0"
BROKEN = [   # (what is done to the golden, the problem it must be named by); content hash resealed unless noted
    ("missing field", ("schedule_digest",), KeyError, "schedule_digest: missing"),
    ("missing request field", ("requests", RID, "margins"), KeyError, "must have exactly the fields"),
    ("wrong type", ("requests",), [], "requests: must be a dict"),
    ("wrong token type", ("requests", RID, "tokens"), [1.5], "tokens: must be a list of token ids"),
    ("zeroed schedule digest", ("schedule_digest", "legacy"), "0" * 64, "schedule_digest.legacy: zeroed"),
    ("zeroed model digest", ("model_sha256",), "0" * 64, "model_sha256: zeroed"),
    ("not a digest", ("trace_sha256",), "abc", "trace_sha256: not a sha256"),
    ("old schema", ("schema",), "hybridqual.golden/1", "schema: 'hybridqual.golden/1'"),
    ("unknown field", ("extra",), 1, "'extra': unknown field"),
    ("bad finish reason", ("requests", RID, "finish_reason"), "eos", "finish_reason: must be 'stop' or 'length'"),
    ("nan margin", ("requests", RID, "margins", 0), float("nan"), "margins: must be a list of finite numbers"),
]


@pytest.mark.parametrize("what,path,value,words", BROKEN, ids=[b[0] for b in BROKEN])
def test_a_golden_that_breaks_its_schema_is_named(what, path, value, words):
    g = shipped()
    _set(g, path, value)
    record.seal(g)
    problems = record.check_golden(g)
    assert any(words in p for p in problems), (what, problems)


def test_a_hand_edit_without_resealing_is_a_content_hash_mismatch():
    g = shipped()
    g["requests"][RID]["tokens"][0] = (g["requests"][RID]["tokens"][0] + 1) % 96
    assert record.check_golden(g) == ["content_sha256: does not match the content (edited, truncated or corrupted "
                                      "since it was written)"]
    g2 = shipped()
    g2["schedule_digest"]["async"] = "0" * 64                    # zeroed and not resealed: both said
    assert any("zeroed" in p for p in record.check_golden(g2))


def test_a_resealed_golden_whose_requests_break_the_trace_is_refused_against_that_trace():
    trace = oracle.load_trace(goldens.TRACES / f"{NAME}.json")
    g = shipped()
    g["requests"]["ghost"] = g["requests"].pop(RID)
    assert "requests: not the trace's request ids" in record.check_golden(record.seal(g), trace)[0]
    g = shipped()
    req = trace.request(RID)
    g["requests"][RID]["tokens"] = g["requests"][RID]["tokens"][:1] * (req.max_new_tokens + 1)
    g["requests"][RID]["margins"] = [0.5] * (req.max_new_tokens + 1)
    assert any("more than max_new_tokens" in p or "after the stop" in p
               for p in record.check_golden(record.seal(g), trace, 96))


@pytest.fixture(scope="module")
def omodel():
    return oracle.load(MODEL, dtype=torch.float64)


def corrupt_copy(tmp_path, monkeypatch, edit):
    out = tmp_path / "outputs"
    shutil.copytree(goldens.OUTPUTS / MODEL.name, out / MODEL.name)
    path = out / MODEL.name / f"{NAME}.json"
    g = json.loads(path.read_text())
    edit(g)
    path.write_text(json.dumps(g))
    monkeypatch.setattr(goldens, "OUTPUTS", out)


@pytest.mark.parametrize("what,edit,words", [
    ("missing field", lambda g: g.pop("trace"), "trace: missing"),
    ("zeroed digests, resealed", lambda g: (g["schedule_digest"].update(legacy="0" * 64, **{"async": "0" * 64}),
                                            record.seal(g)), "schedule_digest.legacy: zeroed"),
    ("a token changed", lambda g: g["requests"]["r1"]["tokens"].__setitem__(0, 0), "content_sha256: does not match"),
    ("wrong type, resealed", lambda g: (g["requests"]["r1"].__setitem__("tokens", "1 2 3"), record.seal(g)),
     "tokens: must be a list"),
])
def test_a_broken_golden_is_said_and_the_truth_recomputed_so_a_correct_engine_passes(tmp_path, monkeypatch, omodel,
                                                                                      capsys, what, edit, words):
    good = shipped()
    corrupt_copy(tmp_path, monkeypatch, edit)
    trace = oracle.load_trace(goldens.TRACES / f"{NAME}.json")
    inst = Instance(NAME, "trace file", trace, None, trace.to_json())
    truth = truth_for(MODEL, inst, omodel)
    assert truth.source.startswith("oracle fp64, computed now: shipped golden seed_compaction.json rejected")
    assert words in truth.golden_rejected, truth.golden_rejected
    assert truth.tokens == {r: g["tokens"] for r, g in good["requests"].items()}
    assert truth.schedule_digest == good["schedule_digest"]
    checks = check_instance(OracleAdapter, MODEL, inst, ["legacy", "async"], omodel, "cpu", truth=truth)
    assert checks and all(c.status != "FAIL" for c in checks), [(c.name, c.detail) for c in checks if not c.ok]
