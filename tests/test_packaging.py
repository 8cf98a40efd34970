"""The checkout side of packaging: one import name for the harness, the console script's dispatch, the plugin's
startup with and without an install. The installed wheel itself: tests/test_packaging_wheel.py."""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybridqual import cli, paths

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
def test_the_checkout_is_imported_under_one_name_only():
    import hybridqual
    import hybridqual.adapters
    assert Path(hybridqual.__file__).resolve().parent == ROOT / "tools"
    assert hybridqual.adapters.__name__ == "hybridqual.adapters" and "tools" not in sys.modules


def test_no_file_of_the_project_names_the_source_folder_as_a_module():
    """The harness has one import name, hybridqual: no import, `python -m` or `-p` names the source folder tools/
    as a module anywhere in the project (code, scripts, docs)."""
    pattern = r"(^|[^A-Za-z0-9_.])((from|import) tools( |\.)|-[mp] tools\.|tools\.(qualify|goldens|adapters|mutants|scenarios|bench|replay|compare|megatron)\b)"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    hits = []
    for f in files:
        if not f.endswith((".py", ".sh", ".md", ".toml", ".txt", ".cfg")) and not f.startswith(".ci/"):
            continue
        for i, line in enumerate((ROOT / f).read_text(errors="replace").splitlines(), 1):
            if re.search(pattern, line) and f != "tests/test_packaging.py":
                hits.append(f"{f}:{i}: {line.strip()[:120]}")
    assert not hits, "\n".join(hits)


@installed
def test_a_copy_of_the_tree_on_its_import_path_keeps_its_own_modules(tmp_path):
    from hybridqual.mutants.runner import import_path
    for part in ("tools", "oracle", "fastpath"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    code = "import hybridqual, oracle, hybridqual.adapters as a, json; print(json.dumps([hybridqual.__file__, a.__file__]))"
    env = dict(os.environ, PYTHONPATH=import_path(tmp_path), TRITON_INTERPRET="1")   # as the mutant runner runs copies
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert all(Path(f).is_relative_to(tmp_path) for f in json.loads(p.stdout))


def test_console_script_dispatches_and_refuses_unknown_names(capsys):
    assert cli.main(["--help"]) == 0 and "\n  qualify " in capsys.readouterr().out
    assert cli.main([]) == 2
    assert cli.main(["nonsense"]) == 2 and "unknown subcommand 'nonsense'" in capsys.readouterr().err
    assert cli.main(["bench", "nope"]) == 2 and "engine, gemm" in capsys.readouterr().err
    # the tool's own argparse gets the arguments; its exit comes back as the return code
    assert cli.main(["goldens", "regen", "--no-such-flag"]) == 2 and "--no-such-flag" in capsys.readouterr().err


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
    from hybridqual.pytest_hq import hq_pairs
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


def test_console_script_help_imports_neither_torch_nor_triton():
    """`hybridqual --help` stays fast because the package and the CLI import no engine until a tool runs."""
    code = ("import sys; from hybridqual import cli; rc = cli.main(['--help']); "
            "assert rc == 0 and 'torch' not in sys.modules and 'triton' not in sys.modules, sorted(sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]


def test_shipped_models_and_traces_are_listed_and_taken_by_name(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "tiny-sort" in out and "chunked_prefill" in out
    assert paths.model_arg("tiny-sort") == paths.MODELS / "tiny-sort"
    assert paths.trace_arg("chunked_prefill") == paths.TRACES / "chunked_prefill.json"
    assert paths.model_arg("no-such-model") == Path("no-such-model")       # left for qualify's own error


@pytest.mark.skipif(shutil.which("hybridqual") is None, reason="the console script is not installed")
def test_console_script_imports_an_adapter_module_from_the_current_folder(tmp_path):
    """As with `python -m`, `hybridqual qualify --engine myengine:X` finds myengine.py in the current folder."""
    (tmp_path / "myengine.py").write_text("class NotAnAdapter:\n    pass\n")
    p = subprocess.run([shutil.which("hybridqual"), "qualify", "--engine", "myengine:NotAnAdapter", "--model",
                        "tiny-sort", "--trace", "chunked_prefill"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert "is not a subclass of hybridqual.adapters.Adapter" in p.stderr, p.stderr[-2000:]


def test_every_package_folder_is_listed_in_pyproject():
    """pyproject.toml names its packages one by one (tools/ is installed as hybridqual): a new subpackage missing
    from the list would be left out of the wheel."""
    tomllib = pytest.importorskip("tomllib")          # Python >= 3.11
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for top, name in (("oracle", "oracle"), ("fastpath", "fastpath"), ("tools", "hybridqual")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top).parts
            found.add(".".join([name, *rel]))
    assert found <= listed, f"not in pyproject.toml [tool.setuptools] packages: {sorted(found - listed)}"
