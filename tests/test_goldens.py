"""The shipped goldens are exactly what the oracle produces now, and the check notices a changed golden."""
import json
import shutil


from hybridqual.goldens import regen as goldens


def test_goldens_regenerate_identically_from_the_oracle(capsys):
    assert goldens.regen(check=True, trace_filter="seed_compaction") == 0, capsys.readouterr().out


def test_golden_check_fails_on_a_hand_edited_token(tmp_path, monkeypatch, capsys):
    out = tmp_path / "outputs"
    shutil.copytree(goldens.OUTPUTS, out)
    monkeypatch.setattr(goldens, "OUTPUTS", out)
    path = out / "zoo-mamba2" / "stop_tokens.json"
    g = json.loads(path.read_text())
    rid = sorted(g["requests"])[0]
    g["requests"][rid]["tokens"][0] += 1
    path.write_text(goldens.canonical(g))
    assert goldens.regen(check=True, model_filter="zoo-mamba2", trace_filter="stop_tokens") == 1
    assert f"request {rid}" in capsys.readouterr().out


def test_golden_records_name_their_model_and_trace_hashes():
    for path in goldens.OUTPUTS.glob("*/*.json"):
        g = json.loads(path.read_text())
        assert g["schema"] == goldens.SCHEMA
        assert g["model_sha256"] == goldens.model_sha256(goldens.MODELS / g["model"]), path
        assert set(g["schedule_digest"]) == {"legacy", "async"}
