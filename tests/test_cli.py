"""The `hybridqual` console script: every tool and bench is found in the package (no hand-kept list), each `main` is
called one way, `main(argv) -> int`, and a bad argument of any entry point is an exit 2 whose one line names the flag,
before any work. Runs the entry points in-process through `hybridqual.cli.main`; CPU, seconds."""
from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import torch

import oracle
from hybridqual import cli

ROOT = Path(__file__).resolve().parents[1]
TRACE = str(ROOT / "goldens" / "traces" / "async_drain.json")
MODEL = str(ROOT / "goldens" / "models" / "zoo-mamba2")
NOWHERE = "/nonexistent-hq-folder/out.json"


def _modules_with_main(folder: Path, package: str) -> set[str]:
    """Every module file of `folder` whose import defines a callable `main` (found by importing, not as cli does)."""
    found = set()
    for path in sorted(folder.glob("*.py")):
        if path.stem.startswith("_"):
            continue
        if callable(getattr(importlib.import_module(f"{package}.{path.stem}"), "main", None)):
            found.add(path.stem)
    return found


def test_every_bench_module_is_reachable_from_the_cli(capsys):
    with_main = _modules_with_main(ROOT / "tools" / "bench", "hybridqual.bench")
    assert with_main and set(cli.benches()) == with_main
    for name in sorted(with_main):
        assert cli.main(["bench", name, "--help"]) == 0, name
        assert capsys.readouterr().out.strip(), f"bench {name} --help printed nothing"


def test_every_tool_is_reachable_from_the_cli_and_its_help_exits_0(capsys):
    tools = cli.tools()
    top = _modules_with_main(ROOT / "tools", "hybridqual") - {"cli"}
    packages = {p.parent.name for p in (ROOT / "tools").glob("*/__main__.py")}
    assert set(tools) == top | packages | set(cli.NESTED)
    for name in tools:
        assert cli.main([name, "--help"]) == 0, name
        assert capsys.readouterr().out.strip(), f"{name} --help printed nothing"


def test_every_entry_point_main_takes_argv_and_returns_an_int():
    for command in [*cli.tools().values(), *cli.benches().values()]:
        main = importlib.import_module(f"hybridqual.{command.module}").main
        params = list(inspect.signature(main).parameters.values())
        assert [(p.name, p.default) for p in params] == [("argv", None)], command
        assert inspect.signature(main).return_annotation in (int, "int"), command


def test_usage_lists_every_tool_and_bench(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in [*cli.tools(), *cli.benches()]:
        assert f"\n  {name} " in out, name
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"\n  {name} " in out for name in cli.benches())


def test_a_new_module_with_a_main_is_found_without_editing_the_cli(tmp_path, monkeypatch):
    """Adding a bench file, a tool module or a tool package is enough: the registry is derived from the files."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "__init__.py").write_text("")
    (tmp_path / "bench" / "fresh.py").write_text('"""A new bench."""\n\ndef main(argv=None) -> int:\n    return 0\n')
    (tmp_path / "bench" / "helper.py").write_text('"""No main: not a bench."""\n')
    (tmp_path / "newtool.py").write_text('"""A new tool."""\n\ndef main(argv=None) -> int:\n    return 0\n')
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "__main__.py").write_text("import sys\nfrom hybridqual.pkg.core import main\n")
    (tmp_path / "pkg" / "core.py").write_text('"""A packaged tool."""\n\ndef main(argv=None) -> int:\n    return 0\n')
    (tmp_path / "rel").mkdir()
    (tmp_path / "rel" / "__init__.py").write_text("")
    (tmp_path / "rel" / "__main__.py").write_text("from .run import main\nmain()\n")
    (tmp_path / "rel" / "run.py").write_text('"""Imported relatively."""\n\ndef main(argv=None) -> int:\n    return 0\n')
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "__init__.py").write_text('"""A package without __main__: not a tool."""\n')
    monkeypatch.setattr(cli, "PACKAGE_DIR", tmp_path)
    assert list(cli.benches()) == ["fresh"] and cli.benches()["fresh"].summary == "A new bench."
    tools = cli.tools()
    assert tools["newtool"].module == "newtool" and tools["pkg"].module == "pkg.core"
    assert tools["pkg"].summary == "A packaged tool." and tools["rel"].module == "rel.run" and "lib" not in tools


BAD = [  # (argv, the flag its error must name)
    (["bench", "nope"], "NAME"),
    (["qualify", "--tau", "-1"], "--tau"),
    (["replay", "/nonexistent-hq-trace.json"], "TRACE"),
    (["replay", TRACE, "--model", "/nonexistent-hq-folder"], "--model"),
    (["replay", TRACE, "--tau", "-1"], "--tau"),
    (["replay", TRACE, "--device", "xpu"], "--device"),
    (["replay", TRACE, "--engine", "no-such-engine"], "--engine"),
    (["goldens", "regen", "--model", "no-such-model"], "--model"),
    (["goldens", "regen", "--trace", "no-such-trace"], "--trace"),
    (["goldens", "regen", "--oracle-device", "xpu"], "--oracle-device"),
    (["goldens", "zoo", "--seed", "-1"], "--seed"),
    (["mutants", "--only", "no-such-mutant"], "--only"),
    (["mutants", "--jobs", "0"], "--jobs"),
    (["mutants", "--budget-s", "-5"], "--budget-s"),
    (["mutants", "--models", "no-such-model"], "--models"),
    (["scenarios", "list", "--model", "/nonexistent-hq-folder"], "--model"),
    (["scenarios", "write", "no-such-scenario"], "NAME"),
    (["convert", "/nonexistent-hq-folder"], "FOLDER"),
    (["convert", MODEL, "--out", NOWHERE], "--out"),
    (["bench", "ablation", "--pos", "-1"], "--pos"),
    (["bench", "ablation", "--variants", "no-such-variant"], "--variants"),
    (["bench", "account", "--ctx", "0"], "--ctx"),
    (["bench", "account", "--out", NOWHERE], "--out"),
    (["bench", "attention", "--head-dim", "7"], "--head-dim"),
    (["bench", "attention", "--only", "no-such-variant"], "--only"),
    (["bench", "chain", "--no-such-flag"], "--no-such-flag"),
    (["bench", "engine", "--spec-k", "0"], "--spec-k"),
    (["bench", "engine", "--spec-rows", "no-such-row"], "--spec-rows"),
    (["bench", "engine", "--summary", NOWHERE], "--summary"),
    (["bench", "engine", "--tiny"], "--tiny"),
    (["bench", "gemm", "--sections", "gemv,no-such-section"], "--sections"),
    (["bench", "invariant", "--requests", "-1"], "--requests"),
    (["bench", "invariant", "--budget-s", "0"], "--budget-s"),
    (["bench", "kernels", "--only", "no-such-group"], "--only"),
    (["bench", "kernels", "--out", NOWHERE], "--out"),
    (["bench", "peak", "label-without-command"], "LABEL -- COMMAND"),
    (["bench", "qualify", "--model", MODEL, "--probe-mib", "0"], "--probe-mib"),
    (["bench", "qualify", "--model", MODEL, "--summary", NOWHERE], "--summary"),
    (["bench", "sass", "--out", NOWHERE], "--out"),
    (["bench", "spec", "--smoke", "--spec-k", "x"], "--spec-k"),
    (["bench", "spec", "--smoke", "--spec-rows", "no-such-row"], "--spec-rows"),
    (["bench", "table", "/nonexistent-hq-folder/k.json"], "/nonexistent-hq-folder/k.json"),
    (["bench", "tp", "--out", NOWHERE], "--out"),
]


@pytest.mark.parametrize("argv,flag", BAD, ids=[" ".join(a[:3]) for a, _ in BAD])
def test_bad_argument_of_each_entry_point_is_an_exit_2_naming_the_flag(argv, flag, capsys, monkeypatch, tmp_path):
    if argv[0] == "bench" and argv[1] != "nope" and argv[1] not in cli.benches():
        pytest.skip(f"bench {argv[1]} is no longer a module of hybridqual.bench")
    monkeypatch.chdir(tmp_path)          # a check that wrongly passed must not write into the checkout
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and flag in lines[-1], lines
    assert len(lines) == 1 or lines[0].startswith("usage:"), lines     # our checks: one line; argparse's: usage + 1


def test_every_bench_with_options_has_a_bad_argument_case():
    """The table above cannot fall behind the benches: each bench has at least one refused argument in it."""
    covered = {argv[1] for argv, _ in BAD if argv[0] == "bench"}
    assert set(cli.benches()) <= covered, sorted(set(cli.benches()) - covered)


@pytest.mark.parametrize("dtype", ["float64", torch.int32, None])
def test_oracle_load_names_a_bad_dtype(dtype):
    with pytest.raises(ValueError, match=r"^dtype: .* one of torch\.float64, torch\.float32, torch\.bfloat16"):
        oracle.load(MODEL, dtype=dtype)


@pytest.mark.parametrize("device,accepted", [("xpu", "cpu or cuda"), ("no-such-device", "cpu or cuda")])
def test_oracle_load_names_a_bad_device(device, accepted):
    with pytest.raises(ValueError, match=rf"^device: '{device}' .*{accepted}"):
        oracle.load(MODEL, device=device)


def test_save_checkpoint_names_a_bad_dtype(tmp_path):
    config, tensors = oracle.load_checkpoint(MODEL)
    with pytest.raises(ValueError, match=r"^dtype: torch\.int8 is not a floating dtype"):
        oracle.save_checkpoint(tmp_path / "m", config, tensors, dtype=torch.int8)
    assert not (tmp_path / "m").exists()
