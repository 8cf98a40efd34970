"""`goldens regen` and `goldens zoo` never lose data: all-or-nothing writes, shipped files changed only with --force,
a corrupt golden regenerated instead of blocking the run. Every test works on a temporary copy of goldens/."""
import json
import shutil

import pytest

from hybridqual.goldens import regen as goldens

MODEL = "zoo-mamba2"          # the smallest shipped model
FAST_TRACE = "async_drain"    # its cheapest trace for the oracle (a few seconds)


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """goldens/ copied (one model, every trace, that model's outputs) and the module pointed at the copy."""
    root = tmp_path / "goldens"
    shutil.copytree(goldens.MODELS / MODEL, root / "models" / MODEL)
    shutil.copytree(goldens.TRACES, root / "traces")
    shutil.copytree(goldens.OUTPUTS / MODEL, root / "outputs" / MODEL)
    for name, sub in (("MODELS", "models"), ("TRACES", "traces"), ("OUTPUTS", "outputs")):
        monkeypatch.setattr(goldens, name, root / sub)
    return root


def fake_golden(model, model_dir, trace_path):
    """A stand-in for the oracle (the write protocol is under test, not the oracle): differs from every shipped one."""
    return {"schema": goldens.SCHEMA, "model": model_dir.name, "trace": trace_path.stem,
            "requests": {"r0": {"tokens": [1, 2, 3]}}}


def snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(root):
    return [p.name for p in root.iterdir() if p.name.startswith((".regen-", ".zoo-"))]


def test_regen_refuses_to_overwrite_changed_goldens_without_force(tree, monkeypatch, capsys):
    monkeypatch.setattr(goldens, "golden_for", fake_golden)
    before = snapshot(tree)
    assert goldens.main(["regen", "--model", MODEL]) == 1
    out = capsys.readouterr()
    assert "refusing to overwrite" in out.err and f"{MODEL} × {FAST_TRACE}" in out.err
    assert "CHANGED" in out.out and "request r0" in out.out      # what would change, per golden
    assert snapshot(tree) == before and not leftovers(tree)

    assert goldens.main(["regen", "--model", MODEL, "--force"]) == 0
    written = json.loads((tree / "outputs" / MODEL / f"{FAST_TRACE}.json").read_text())
    assert written == json.loads(goldens.canonical(fake_golden(None, tree / "models" / MODEL,
                                                               tree / "traces" / f"{FAST_TRACE}.json")))
    assert not leftovers(tree)


def test_regen_writes_new_goldens_without_force_but_only_once_all_are_computed(tree, monkeypatch):
    shutil.rmtree(tree / "outputs" / MODEL)                        # every golden is new: no --force needed
    calls = []

    def fails_on_the_third(model, model_dir, trace_path):
        calls.append(trace_path.stem)
        if len(calls) == 3:
            raise RuntimeError("oracle crashed")
        return fake_golden(model, model_dir, trace_path)
    monkeypatch.setattr(goldens, "golden_for", fails_on_the_third)
    with pytest.raises(RuntimeError, match="oracle crashed"):
        goldens.regen(check=False, model_filter=MODEL)
    assert not (tree / "outputs" / MODEL).exists() and not leftovers(tree)   # the first two were not written

    monkeypatch.setattr(goldens, "golden_for", fake_golden)
    assert goldens.regen(check=False, model_filter=MODEL) == 0
    assert len(list((tree / "outputs" / MODEL).glob("*.json"))) == len(list((tree / "traces").glob("*.json")))


def test_a_corrupt_golden_is_reported_and_regenerated_from_the_oracle(tree, capsys):
    path = tree / "outputs" / MODEL / f"{FAST_TRACE}.json"
    shipped = path.read_bytes()
    path.write_bytes(b"\xff\xfe{ not a golden")
    assert goldens.regen(check=True, model_filter=MODEL, trace_filter=FAST_TRACE) == 1   # reported, not a traceback
    assert "CORRUPT" in capsys.readouterr().out
    assert goldens.regen(check=False, model_filter=MODEL, trace_filter=FAST_TRACE) == 0  # no --force needed
    assert "CORRUPT" in capsys.readouterr().out
    assert path.read_bytes() == shipped        # exactly the shipped golden again: the oracle's own output


def test_a_corrupt_golden_does_not_block_the_others(tree, monkeypatch, capsys):
    monkeypatch.setattr(goldens, "golden_for", fake_golden)
    for p in (tree / "outputs" / MODEL).glob("*.json"):
        p.write_text(goldens.canonical(fake_golden(None, tree / "models" / MODEL, tree / "traces" / p.name)))
    bad = tree / "outputs" / MODEL / "stop_tokens.json"
    bad.write_text('{"requests": [1, 2]}')                         # valid JSON, not a golden record
    assert goldens.regen(check=False, model_filter=MODEL) == 0
    out = capsys.readouterr().out
    assert "stop_tokens: CORRUPT" in out and out.count(": unchanged") == len(list((tree / "traces").glob("*.json"))) - 1
    assert json.loads(bad.read_text())["trace"] == "stop_tokens"


@pytest.fixture
def zoo_tree(tmp_path, monkeypatch):
    """The shipped zoo models copied, and the module pointed at the copy."""
    models = tmp_path / "goldens" / "models"
    for name in goldens.zoo_models():
        shutil.copytree(goldens.MODELS / name, models / name)
    monkeypatch.setattr(goldens, "MODELS", models)
    return models


def test_zoo_refuses_to_overwrite_changed_models_without_force(zoo_tree, capsys):
    n = len(goldens.zoo_models())
    assert n == 9 and {"zoo-granite_dense", "zoo-bamba_wide", "zoo-corners", "zoo-granite_hd32",
                       "zoo-nemotron_h_hd32"} <= set(goldens.zoo_models())  # per architecture + 5
    assert sorted(goldens.zoo_models()) == sorted(p.name for p in goldens.MODELS.iterdir() if p.name.startswith("zoo-"))
    before = snapshot(zoo_tree)
    assert goldens.main(["zoo", "--seed", "1"]) == 1
    out = capsys.readouterr()
    assert f"refusing to overwrite {n} shipped zoo model(s)" in out.err and out.out.count("CHANGED sha256") == n
    assert snapshot(zoo_tree) == before and not leftovers(zoo_tree.parent)

    assert goldens.main(["zoo", "--seed", "0"]) == 0               # the shipped seed: every shipped model reproduced
    assert f"{n} zoo models, 0 written" in capsys.readouterr().out and snapshot(zoo_tree) == before

    shutil.rmtree(zoo_tree / "zoo-mamba2")                         # a missing model is written without --force
    assert goldens.main(["zoo"]) == 0 and snapshot(zoo_tree) == before


def test_zoo_force_replaces_whole_folders_and_a_failure_replaces_none(zoo_tree, monkeypatch):
    from oracle import zoo
    before = snapshot(zoo_tree)
    (zoo_tree / "zoo-bamba" / "stale.safetensors").write_bytes(b"x")   # an extra file would change the model's hash
    real = zoo.write_shipped

    def fails_on_mamba2(path, name, seed=0):
        if name == "mamba2":
            raise OSError("disk full")
        return real(path, name, seed=seed)
    monkeypatch.setattr(zoo, "write_shipped", fails_on_mamba2)
    with pytest.raises(OSError, match="disk full"):
        goldens.write_zoo(seed=1, force=True)
    assert (zoo_tree / "zoo-bamba" / "stale.safetensors").exists() and not leftovers(zoo_tree.parent)

    monkeypatch.setattr(zoo, "write_shipped", real)
    assert goldens.write_zoo(seed=0, force=True) == 0
    assert snapshot(zoo_tree) == before                            # zoo-bamba rewritten whole: the extra file is gone
