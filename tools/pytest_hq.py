"""pytest plugin: point the differential suite (or your own tests) at *your* checkpoint and traces.

Installed with hybridqual (entry point `pytest11: hybridqual`), so a plain `pytest` loads it:

    pytest --hq-model PATH [--hq-model PATH2]                      # the scenario corpus instantiated per model
    pytest --hq-model PATH --hq-scenario chunked_prefill [--hq-scenario ...]   # only these scenarios
    pytest --hq-model PATH --hq-trace T1.json [--hq-trace T2.json]  # these trace files

Tests that take the `hq_case` fixture are parametrised over (model, trace file) pairs: with `--hq-model` and no
`--hq-trace`, every scenario of hybridqual.scenarios instantiated for each model (its concrete trace written to a
temporary folder of the test run as <scenario>.json; a scenario that cannot run on the model is a skipped case with the
reason); with `--hq-trace`, those files (plus any `--hq-scenario`); with neither, the shipped models and traces
(pairs whose token ids fit the model's vocab). `hq_qualify(AdapterClass)` runs qualify's checks (tokens vs the
truth, schedule log, logits, async == legacy, task accuracy) for the current pair and returns them; a model whose
fp64 weights do not fit in memory is judged by the streamed oracle (hybridqual.qualify.truth).

The qualification matrix (models x engines x configurations), one pytest item per instance and engine:

    pytest --pyargs hybridqual.qualification_matrix --hq-model PATH --hq-engine fastpath --hq-engine llamacpp@all -n 16

`--hq-engine NAME[@CONFIGURATION|@all]` (repeatable; default fastpath) parametrises `hq_engine`; `hq_verdict` runs
qualify's checks for (hq_case, hq_engine). Under pytest-xdist each worker process keeps the truths it loaded (one
fp64 model per model folder, the run's `_hq_oracles`) and gives its engines cores // workers threads
(EngineOptions.threads; torch's threads too).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from hybridqual import paths


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("hybridqual")
    g.addoption("--hq-model", action="append", type=Path, default=[],
                help="HF-format model folder to qualify (repeatable; default: the shipped models)")
    g.addoption("--hq-trace", action="append", type=Path, default=[],
                help="hybridqual.trace/1 JSON file (repeatable; default: the shipped traces, or with --hq-model "
                     "the scenario corpus)")
    g.addoption("--hq-engine", action="append", default=[], metavar="NAME[@CONFIGURATION|@all]",
                help="engine of the qualification matrix (hq_engine; repeatable; default fastpath): a qualify "
                     "--engine name or module:Class, @CONFIGURATION one of its declared configurations, @all its "
                     "default and every declared one")
    g.addoption("--hq-scenario", action="append", default=[],
                help="scenario of hybridqual.scenarios to instantiate for each --hq-model (repeatable; default with "
                     "--hq-model and no --hq-trace: every scenario)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long-running; not in hybridqual's default CPU tier")


def pytest_unconfigure(config: pytest.Config) -> None:
    tmp = getattr(config, "_hq_scenario_dir", None)
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)


def default_models() -> list[Path]:
    """The shipped models: the trained tiny model first, then the zoo."""
    models = sorted(p for p in paths.MODELS.glob("*") if (p / "config.json").exists())
    return sorted(models, key=lambda p: (not p.name.startswith("tiny"), p.name))


def _read_json(path: Path, what: str) -> dict:
    """A JSON object from a user-given file, or a usage error naming the option and the path."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise pytest.UsageError(f"{what} {path}: cannot read it as JSON ({type(e).__name__}: {e})") from e
    if not isinstance(obj, dict):
        raise pytest.UsageError(f"{what} {path}: expected a JSON object")
    return obj


def hq_pairs(config: pytest.Config) -> list[tuple[Path, Path]]:
    """(model, trace) pairs to qualify, with trace token ids inside the model's vocab."""
    models = config.getoption("--hq-model") or default_models()
    traces = config.getoption("--hq-trace") or sorted(paths.TRACES.glob("*.json"))
    pairs = []
    for m in models:
        vocab = _read_json(Path(m) / "config.json", "--hq-model").get("vocab_size", 0)
        for t in traces:
            reqs = _read_json(t, "--hq-trace").get("requests", [])
            ids = [x for r in reqs if isinstance(r, dict) for x in (*r.get("prompt", []), *r.get("stop_token_ids", []))]
            if all(isinstance(x, int) and 0 <= x < vocab for x in ids):
                pairs.append((Path(m), Path(t)))
    return pairs


# Pairs of the shipped corpus that run in the CPU tier; every other shipped pair is marked `slow` (the fast path
# runs its kernels through the Triton interpreter on CPU, about a second per step). User-given pairs always run.
FAST_PAIRS = {("tiny-sort", "seed_compaction")}   # zoo models: tests/test_engine_*.py cover them


def scenario_names(config: pytest.Config) -> list[str] | None:
    """The scenarios to instantiate: --hq-scenario names, all of them with --hq-model and no --hq-trace, else
    none (None). An unknown name is a usage error listing the known ones."""
    from hybridqual.scenarios.plan import SCENARIOS
    names = list(config.getoption("--hq-scenario") or [])
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise pytest.UsageError(f"--hq-scenario {unknown[0]}: not a scenario (known: {', '.join(SCENARIOS)})")
    if names:
        return names
    if config.getoption("--hq-model") and not config.getoption("--hq-trace"):
        return list(SCENARIOS)
    return None


def scenario_cases(config: pytest.Config, names: list[str]) -> list:
    """pytest params (model, trace file) for every scenario instantiated for every model (--hq-model, default the
    shipped ones); each concrete trace is written once per test run as <tmp>/<model>/<scenario>.json (the stem is
    the scenario, so shipped goldens are found by name and sha256); a skipped scenario is a skipped case."""
    import oracle
    from oracle.config import ConfigError
    from oracle.trace import dump_trace
    from hybridqual.scenarios.plan import ScenarioError, instantiate
    if getattr(config, "_hq_scenario_dir", None) is None:
        config._hq_scenario_dir = Path(tempfile.mkdtemp(prefix="hq-scenarios-"))
    params = []
    for m in config.getoption("--hq-model") or default_models():
        m = Path(m)
        _read_json(m / "config.json", "--hq-model")
        try:
            cfg = oracle.from_hf_config(m)
            insts = instantiate(m, cfg, names)
        except (ConfigError, ScenarioError) as e:
            raise pytest.UsageError(f"--hq-model {m}: {e}") from e
        for inst in insts:
            cid = f"{m.name}-{inst.scenario}"
            if inst.trace is None:
                params.append(pytest.param((m, None), id=cid, marks=pytest.mark.skip(
                    reason=f"scenario {inst.scenario} does not run on {m.name}: {inst.skip_reason}")))
                continue
            path = config._hq_scenario_dir / m.name / f"{inst.scenario}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(dump_trace(inst.trace), encoding="utf-8")
            params.append(pytest.param((m, path), id=cid))
    return params


def engine_specs(config: pytest.Config) -> list[tuple[str, str | None]]:
    """(engine, configuration or None = its defaults) per --hq-engine (default fastpath), @all expanded to the
    default and every declared configuration; a usage error naming the option for an unknown engine or
    configuration."""
    from hybridqual import adapters
    out = []
    for spec in config.getoption("--hq-engine") or ["fastpath"]:
        name, _, conf = spec.partition("@")
        try:
            declared = [c.name for c in adapters.resolve(name).configurations()]
        except (ValueError, ImportError, AttributeError) as e:
            raise pytest.UsageError(f"--hq-engine {spec}: {e}") from e
        if conf and conf != "all" and conf not in declared:
            raise pytest.UsageError(f"--hq-engine {spec}: {name} declares no configuration {conf!r} (it declares "
                                    f"{', '.join(declared) or 'none'})")
        out += [(name, None)] + [(name, c) for c in declared] if conf == "all" else [(name, conf or None)]
    return list(dict.fromkeys(out))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "hq_engine" in metafunc.fixturenames:
        metafunc.parametrize("hq_engine", engine_specs(metafunc.config),
                             ids=[n + (f"@{c}" if c else "") for n, c in engine_specs(metafunc.config)])
    if "hq_case" in metafunc.fixturenames:
        config = metafunc.config
        user = bool(config.getoption("--hq-model") or config.getoption("--hq-trace"))
        names = scenario_names(config)
        params = [pytest.param((m, t), id=f"{m.name}-{t.stem}",
                               marks=() if user or (m.name, t.stem) in FAST_PAIRS else (pytest.mark.slow,))
                  for m, t in (hq_pairs(config) if names is None or config.getoption("--hq-trace") else [])]
        if names is not None:
            params += scenario_cases(config, names)
        metafunc.parametrize("hq_case", params)


@pytest.fixture(scope="session")
def _hq_oracles() -> dict:
    return {}


def worker_budget():
    """The threads one engine of this pytest process may use: the cores // pytest-xdist's workers (1 without xdist)."""
    from hybridqual.adapters.base import ThreadBudget
    return ThreadBudget.for_cores(len(os.sched_getaffinity(0)), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


@pytest.fixture(scope="session")
def _hq_budget():
    """This worker's thread budget, torch's threads set to it for the whole pytest run (and given back after)."""
    import torch
    budget, before = worker_budget(), torch.get_num_threads()
    torch.set_num_threads(budget.threads)
    yield budget
    torch.set_num_threads(before)


@pytest.fixture
def hq_verdict(hq_case, hq_engine, hq_qualify, _hq_budget):
    """hq_verdict(modes=("legacy", "async"), device="cpu") -> qualify's checks of the matrix item (hq_case's model
    and trace, hq_engine's engine in its configuration), the engine given this worker's thread budget."""
    from hybridqual import adapters
    from hybridqual.adapters.base import EngineOptions
    name, configuration = hq_engine

    def run(modes=("legacy", "async"), device: str = "cpu") -> list:
        engine = adapters.engine(name, EngineOptions(threads=_hq_budget))
        return hq_qualify(engine.configured(configuration) if configuration else engine, modes, device)
    return run


@pytest.fixture
def hq_qualify(hq_case, _hq_oracles, request):
    """hq_qualify(adapter, modes=("legacy", "async"), device="cpu", tau=None) -> list of qualify Checks for the
    current (model, trace); `adapter` an adapter class, or an adapters.Engine (a class with its EngineOptions);
    `tau` None: the engine's compute dtype's; the fp64 oracle loads once per model (in
    memory when it fits, else streamed: hybridqual.qualify.truth.load_truth).

    Skipped checks are not hidden in a passing test: a case whose every check is a SKIP is a skipped test (with the
    reasons), and the terminal summary counts the checks passed, failed and skipped over the run, with each skip's
    reason."""
    from hybridqual.qualify.runner import check_trace
    from hybridqual.qualify.truth import load_truth

    model_dir, trace_path = hq_case

    def run(adapter, modes=("legacy", "async"), device: str = "cpu", tau: float | None = None) -> list:
        if model_dir not in _hq_oracles:
            _hq_oracles[model_dir] = load_truth(model_dir, "auto")[0]
            request.config.stash[LOADS] = request.config.stash.get(LOADS, 0) + 1
        checks = check_trace(adapter, model_dir, trace_path, list(modes), _hq_oracles[model_dir], device, tau)
        request.config.stash.setdefault(CHECKS, []).extend(checks)
        request.node.user_properties.append(("hq_checks", ", ".join(
            f"{n} {s}" for s, n in _counts(checks).items() if n)))
        if checks and all(c.skipped for c in checks):
            pytest.skip("every qualify check was a SKIP: " + "; ".join(sorted({c.detail for c in checks})))
        return checks
    return run


CHECKS = pytest.StashKey[list]()
LOADS = pytest.StashKey[int]()          # truths (fp64 models) this pytest process loaded


def _counts(checks: list) -> dict[str, int]:
    return {status: sum(c.status == status for c in checks) for status in ("PASS", "FAIL", "SKIP")}


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    """The qualify checks behind the hq_qualify tests: how many passed, failed, were skipped, and why skipped."""
    checks = config.stash.get(CHECKS, [])
    if not checks:
        return
    n = _counts(checks)
    terminalreporter.section("hybridqual checks")
    terminalreporter.write_line(f"{n['PASS']} passed, {n['FAIL']} failed, {n['SKIP']} skipped "
                                f"(of {len(checks)} qualify checks in the hq_qualify tests); "
                                f"{config.stash.get(LOADS, 0)} truths loaded")
    reasons: dict[str, int] = {}
    for c in checks:
        if c.skipped:
            key = f"{c.name}: {c.detail}"
            reasons[key] = reasons.get(key, 0) + 1
    for why, k in sorted(reasons.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"  SKIP x{k}  {why[:200]}")
