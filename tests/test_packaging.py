"""The checkout side of packaging: one set of harness modules under both names, the console script's dispatch, the
plugin's startup with and without an install. The installed wheel itself: tests/test_packaging_wheel.py."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools import cli, paths

ROOT = Path(__file__).resolve().parent.parent


def _installed_from_this_checkout() -> bool:
    """hybridqual is pip-installed (editable) from this very checkout: only then are both names one module set (a
    copy of the tree beside another checkout's install, e.g. a blind mutant judge's, imports `hybridqual` from there)."""
    spec = importlib.util.find_spec("hybridqual")
    return spec is not None and spec.origin is not None and ROOT in Path(spec.origin).resolve().parents


installed = pytest.mark.skipif(not _installed_from_this_checkout(),
                               reason="hybridqual is not pip-installed from this checkout (PYTHONPATH, or another "
                                      "checkout's install)")


def test_goldens_are_found_in_the_checkout():
    assert paths.checkout_root() == ROOT
    assert paths.GOLDENS == ROOT / "goldens" and (paths.MODELS / "tiny-sort" / "config.json").exists()


@installed
def test_both_names_give_the_same_module_objects_in_a_checkout():
    import hybridqual.adapters
    import tools.adapters
    assert hybridqual.adapters is tools.adapters      # else a hybridqual.adapters.Adapter subclass is not a tools one
    import hybridqual.goldens
    import tools.goldens
    assert hybridqual.goldens is tools.goldens and hybridqual.paths is paths


@installed
@pytest.mark.parametrize("first", ["tools", "hybridqual"])
def test_whichever_name_is_imported_first_the_other_is_an_alias(first):
    second = {"tools": "hybridqual", "hybridqual": "tools"}[first]
    code = (f"import {first}.adapters as a, {second}.adapters as b, {second}.qualify as q, {first}.qualify as r; "
            f"assert a is b and q is r and a.__name__ == '{first}.adapters', (a, b)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]


@installed
def test_a_copy_of_the_tree_on_pythonpath_keeps_its_own_modules(tmp_path):
    shutil.copytree(ROOT / "tools", tmp_path / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import hybridqual, tools, json; "
            "print(json.dumps([hybridqual.__file__, tools.__file__, hybridqual is tools]))")
    env = dict(os.environ, PYTHONPATH=str(tmp_path), TRITON_INTERPRET="1")   # as the mutant runner runs its copies
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    hq, tl, same = json.loads(p.stdout)
    assert Path(tl).is_relative_to(tmp_path) and not Path(hq).is_relative_to(tmp_path) and not same


def test_console_script_dispatches_and_refuses_unknown_names(capsys):
    assert cli.main(["--help"]) == 0 and "hybridqual qualify" in capsys.readouterr().out
    assert cli.main([]) == 2
    assert cli.main(["nonsense"]) == 2 and "unknown subcommand 'nonsense'" in capsys.readouterr().err
    assert cli.main(["bench", "nope"]) == 2 and "engine, kernels" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:                    # the tool's own argparse gets the arguments
        cli.main(["goldens", "regen", "--no-such-flag"])
    assert e.value.code == 2 and "--no-such-flag" in capsys.readouterr().err


def test_console_script_runs_a_tool_with_its_arguments(capsys):
    assert cli.main(["goldens", "regen", "--check", "--model", "zoo-mamba2", "--trace", "async_drain"]) == 0
    assert "1 goldens, 0 differ" in capsys.readouterr().out


def test_mutants_from_an_installed_copy_say_they_need_a_checkout(monkeypatch, capsys):
    monkeypatch.setattr(paths, "checkout_root", lambda: None)
    assert cli.main(["mutants", "--list"]) == 2
    assert "needs a source checkout" in capsys.readouterr().err


class _Config:
    """The pytest.Config method the plugin's pairing uses (getoption), over a dict of options."""

    def __init__(self, **opts):
        self.opts = opts

    def getoption(self, name):
        return self.opts.get(name, [])


def test_plugin_names_an_unreadable_user_file(tmp_path):
    from tools.pytest_hq import hq_pairs
    bad = tmp_path / "t.json"
    bad.write_bytes(b"\xff\xfe not json")
    with pytest.raises(pytest.UsageError, match=f"--hq-trace {bad}: cannot read it as JSON"):
        hq_pairs(_Config(**{"--hq-model": [paths.MODELS / "tiny-sort"], "--hq-trace": [bad]}))
    with pytest.raises(pytest.UsageError, match="--hq-model .*config.json: cannot read"):
        hq_pairs(_Config(**{"--hq-model": [tmp_path]}))


@installed
def test_plain_pytest_and_python_m_pytest_both_start_with_the_plugin():
    """`pytest` loads the plugin through the entry point; `python -m pytest` without entry points (a checkout never
    pip-installed) gets it from tests/conftest.py. Either way it is registered once and its options work."""
    args = ["--co", "-q", "-p", "no:xdist", "--hq-model", "goldens/models/tiny-sort",
            "--hq-trace", "goldens/traces/seed_compaction.json", "tests/test_packaging.py::test_hq_case_fits_its_model"]
    pytest_exe = shutil.which("pytest", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    runs = {"plain pytest": ([pytest_exe, *args], {}),
            "python -m pytest, no entry points": ([sys.executable, "-m", "pytest", *args],
                                                 {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})}
    for name, (cmd, extra) in runs.items():
        env = dict(os.environ, TRITON_INTERPRET="1", **extra)
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, f"{name}: {p.stdout[-2000:]}{p.stderr[-2000:]}"
        assert "[tiny-sort-seed_compaction]" in p.stdout, name


def test_hq_case_fits_its_model(hq_case):
    """The plugin pairs a trace with a model only when every prompt and stop token is in the model's vocab."""
    model_dir, trace_path = hq_case
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    reqs = json.loads(trace_path.read_text())["requests"]
    assert all(0 <= t < vocab for r in reqs for t in (*r["prompt"], *r.get("stop_token_ids", [])))
