"""The product as a user gets it: build the wheel, install it into a fresh venv outside the checkout, then qualify the
shipped model through the `hybridqual` console script and through a plain `pytest` run that uses the plugin.

Marked `wheel` (outside the default tier, ~2 min on 2 cores); ./scripts/test.sh runs it as its own CI step:
    python -m pytest -p no:xdist -m wheel tests/test_packaging_wheel.py
The venv takes torch/triton/numpy/safetensors from the system site-packages (a fresh torch install alone takes
minutes); the checkout's editable install lives there too, so every test proves what it ran came from the venv.
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.wheel

CHECKOUT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "oracle", "fastpath", "tools", "goldens")
WHEEL_NAMES = {"tools": "hybridqual", "oracle": "oracle", "fastpath": "fastpath"}


def sh(cmd, cwd, env=None, timeout=600):
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return p


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(source copy, wheel): the wheel is built from a copy, so the checkout gets no build/ folder."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for name in SOURCES:
        s = CHECKOUT / name
        if s.is_dir():
            shutil.copytree(s, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".*"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(s, src / name)
    p = sh([sys.executable, "-m", "pip", "wheel", src, "--no-deps", "--no-build-isolation", "-q", "-w", tmp / "dist"],
           cwd=tmp)
    assert p.returncode == 0, p.stdout + p.stderr
    (whl,) = (tmp / "dist").glob("hybridqual-*.whl")
    return src, whl


@pytest.fixture(scope="module")
def venv(built, tmp_path_factory):
    """A fresh venv outside the checkout, the wheel (and pytest, for its console script) installed into it."""
    tmp = tmp_path_factory.mktemp("venv")
    v = tmp / "venv"
    p = sh([sys.executable, "-m", "venv", "--system-site-packages", v], cwd=tmp)
    assert p.returncode == 0, p.stderr
    py = v / "bin" / "python"
    # torch and triton come from the interpreter running this test: inside a virtualenv --system-site-packages
    # alone would give the base interpreter's packages, not this one's. A .pth line only appends the folders to
    # sys.path (their own .pth files, such as an editable install's finder, are not run), after the venv's own.
    site_dirs = [d for d in sys.path if d.endswith(("site-packages", "dist-packages")) and Path(d).is_dir()]
    (venv_site,) = (v / "lib").glob("python*/site-packages")
    (venv_site / "_hq_interpreter_site.pth").write_text("".join(f"{d}\n" for d in site_dirs))
    import pytest as system_pytest
    p = sh([py, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", built[1],
            f"pytest=={system_pytest.__version__}"], cwd=tmp)
    assert p.returncode == 0, p.stdout + p.stderr
    return v


@pytest.fixture(scope="module")
def work(venv, tmp_path_factory):
    """(cwd, env) for a user's process: outside the checkout, the venv first on PATH, nothing of ours on PYTHONPATH,
    TRITON_INTERPRET unset (the package turns the interpreter on by itself without CUDA)."""
    cwd = tmp_path_factory.mktemp("user")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET", "PYTHONHOME")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv), OMP_NUM_THREADS="1")
    return cwd, env


def installed_paths(venv, work) -> dict:
    code = textwrap.dedent("""
        import importlib, importlib.metadata as md, importlib.util, json, os, pkgutil, sys
        from pathlib import Path
        import hybridqual, oracle, fastpath, hybridqual.adapters, hybridqual.pytest_hq
        from hybridqual import paths
        broken, checkout_paths = {}, []
        for m in pkgutil.walk_packages(hybridqual.__path__, "hybridqual."):   # every harness module imports, and
            if m.name.endswith(".__main__"):                                     # none points at a checkout's goldens/
                continue                                                         # (a __main__ runs its tool)
            try:
                mod = importlib.import_module(m.name)
            except Exception as e:
                broken[m.name] = f"{type(e).__name__}: {e}"
                continue
            if not m.name.startswith("hybridqual.mutants"):                      # (mutants: checkout only, by design)
                checkout_paths += [f"{m.name}.{k}" for k, v in vars(mod).items()
                                   if isinstance(v, Path) and v.is_absolute() and "goldens" in v.parts]
        print(json.dumps({"hybridqual": hybridqual.__file__, "oracle": oracle.__file__, "fastpath": fastpath.__file__,
                          "plugin": hybridqual.pytest_hq.__file__, "goldens": str(paths.GOLDENS),
                          "tools_importable": importlib.util.find_spec("tools") is not None,
                          "adapter": hybridqual.adapters.Adapter.__module__, "version": hybridqual.__version__,
                          "interpret": os.environ.get("TRITON_INTERPRET"), "site": [p for p in sys.path if "site-packages" in p],
                          "requires": md.requires("hybridqual"), "broken": broken, "checkout_paths": checkout_paths}))
    """)
    p = sh([venv / "bin" / "python", "-c", code], cwd=work[0], env=work[1])
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_wheel_holds_one_harness_namespace_every_source_file_and_the_goldens(built):
    src, whl = built
    names = set(zipfile.ZipFile(whl).namelist())
    tops = {n.split("/")[0] for n in names}
    assert tops == {"hybridqual", "oracle", "fastpath", whl.name.split("-py3")[0] + ".dist-info"}, tops  # no tools/
    for folder, pkg in WHEEL_NAMES.items():
        for f in (src / folder).rglob("*.py"):
            assert f"{pkg}/{f.relative_to(src / folder).as_posix()}" in names, f"{f} missing from the wheel"
    for f in (src / "goldens").rglob("*"):
        if f.is_file():
            assert f"hybridqual/data/{f.relative_to(src / 'goldens').as_posix()}" in names, f"{f} missing"
    dist = whl.name.split("-py3")[0] + ".dist-info"
    eps = zipfile.ZipFile(whl).read(f"{dist}/entry_points.txt").decode()
    assert "hybridqual = hybridqual.cli:main" in eps and "hybridqual = hybridqual.pytest_hq" in eps
    meta = zipfile.ZipFile(whl).read(f"{dist}/METADATA").decode()
    assert all(f"Provides-Extra: {x}" in meta for x in ("hf", "test", "bench"))


def test_installed_modules_and_goldens_come_from_the_venv_not_the_checkout(venv, work):
    got = installed_paths(venv, work)
    for key in ("hybridqual", "oracle", "fastpath", "plugin", "goldens"):
        assert Path(got[key]).resolve().is_relative_to(venv.resolve()), (key, got[key])
    assert not got["tools_importable"], "no top-level `tools` may be importable from the installed product"
    assert got["broken"] == {} and got["checkout_paths"] == []
    assert got["adapter"] == "hybridqual.adapters.base" and got["version"] == "0.1.0"
    assert got["interpret"] == "1"                     # no CUDA here: the package turned the interpreter on itself
    assert {r.split(";")[0].split(">")[0].split("=")[0].strip() for r in got["requires"]} >= {"torch", "triton", "safetensors"}


def test_console_script_qualifies_the_shipped_model(venv, work):
    traces = Path(installed_paths(venv, work)["goldens"]) / "traces"
    exe = shutil.which("hybridqual", path=work[1]["PATH"])
    assert exe and Path(exe).parent == venv / "bin"
    # legacy only (the interpreter is slow); async == legacy runs in the plugin test below on a shorter trace
    p = sh([exe, "qualify", "--trace", traces / "seed_compaction.json", "--mode", "legacy", "--out", "out"],
           cwd=work[0], env=work[1])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((work[0] / "out" / "report.json").read_text())
    assert report["failed"] == 0 and report["passed"] > 0, report
    assert report["instances"][0]["truth"].startswith("golden"), report["instances"]   # the installed golden
    assert f"{venv.resolve()}/lib/" in json.dumps(report) and "tiny-sort" in json.dumps(report)   # the installed model


def test_console_script_qualifies_a_shipped_draft_model_trace_outside_the_checkout(venv, work):
    """spec_draft (in the main job's default run) names its draft model `goldens/models/zoo-mamba2`: installed, that
    is the package data, found from a working directory that is not a checkout."""
    data = Path(installed_paths(venv, work)["goldens"])
    p = sh(["hybridqual", "qualify", "--model", data / "models" / "zoo-bamba", "--trace",
            data / "traces" / "spec_draft.json", "--mode", "legacy", "--out", "out-spec"], cwd=work[0], env=work[1])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((work[0] / "out-spec" / "report.json").read_text())
    assert report["failed"] == 0 and report["passed"] > 0, report


def test_installed_goldens_are_what_the_oracle_produces(venv, work):
    p = sh(["hybridqual", "goldens", "regen", "--check", "--model", "zoo-mamba2", "--trace", "async_drain"],
           cwd=work[0], env=work[1])
    assert p.returncode == 0 and "1 goldens, 0 differ" in p.stdout, p.stdout + p.stderr


def test_mutants_from_the_wheel_say_they_need_a_checkout(venv, work):
    p = sh(["hybridqual", "mutants", "--list"], cwd=work[0], env=work[1])
    assert p.returncode == 2 and "needs a source checkout" in p.stderr, p.stdout + p.stderr


# A user's own short trace (no shipped golden: the oracle computes the truth on the spot), for the tiny model's vocab.
USER_TRACE = {"schema": "hybridqual.trace/1",
              "engine": {"max_requests": 2, "max_tokens_per_step": 16, "mode": "legacy", "prefill_chunk": 8},
              "requests": [{"id": "a", "arrival_step": 0, "prompt": [1, 9, 5, 7, 3], "max_new_tokens": 3,
                            "stop_token_ids": [2], "sampling": {"kind": "greedy"}},
                           {"id": "b", "arrival_step": 1, "prompt": [1, 6, 4, 3], "max_new_tokens": 2,
                            "stop_token_ids": [], "sampling": {"kind": "greedy"}}]}


def test_plain_pytest_with_the_plugin_qualifies_an_engine(venv, work):
    cwd, env = work
    data = Path(installed_paths(venv, work)["goldens"])
    (cwd / "my_trace.json").write_text(json.dumps(USER_TRACE))
    (cwd / "test_my_engine.py").write_text(textwrap.dedent(f"""
        from pathlib import Path
        from hybridqual.adapters import FastpathAdapter

        def test_the_plugin_is_the_installed_one(pytestconfig):
            plugin = pytestconfig.pluginmanager.get_plugin("hybridqual")
            assert Path(plugin.__file__).resolve().is_relative_to(Path({str(venv.resolve())!r}))

        def test_my_engine_qualifies(hq_case, hq_qualify):
            checks = hq_qualify(FastpathAdapter, modes=("legacy", "async"))
            assert any(c.passed for c in checks) and all(c.ok for c in checks), [c for c in checks if not c.ok]
    """))
    exe = shutil.which("pytest", path=env["PATH"])
    assert Path(exe).parent == venv / "bin"
    p = sh([exe, "-q", "-p", "no:cacheprovider", "--hq-model", data / "models" / "tiny-sort",
            "--hq-trace", "my_trace.json", "test_my_engine.py"], cwd=cwd, env=env)
    assert p.returncode == 0 and "2 passed" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
