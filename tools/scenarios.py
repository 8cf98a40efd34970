"""The trace corpus as scenarios in a model's units (DESIGN §15, issue 16.1 / 20.2-3).

    from tools import scenarios
    for inst in scenarios.instantiate(model_dir, oracle.from_hf_config(model_dir / "config.json")):
        inst.trace or print(inst.scenario, "skipped:", inst.skip_reason)

A scenario is a builder over a model's `Units` (chunk_size C, vocab_size V, bos/eos/pad): engine limits and the
prompt lengths that decide chunking are multiples/offsets of C, token ids are literal ids of a 64-id alphabet,
kept when they fit V and folded onto the model's ordinary ids when they do not (tools/scenario_units.py). Every
scenario instantiates for a model or is a skip with its reason; an instantiated trace always passes
`oracle.trace.check_against_model`. On the shipped models (C = 8) a scenario with a shipped trace in
goldens/traces/<name>.json instantiates to exactly that trace (same canonical JSON, so the golden's trace_sha256
matches). Families: the shipped corpus (one scenario each, tools/scenario_corpus.py) and request_order,
prefill_boundaries, special_ids (tools/scenario_edges.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .scenario_corpus import CORPUS
from .scenario_edges import EDGES
from .scenario_units import ScenarioError, Skip, Units, build_with_tokens

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "goldens" / "traces"
MODELS = ROOT / "goldens" / "models"

# name -> (family, builder(units, tokens) -> trace JSON object), in report order.
SCENARIOS: dict[str, tuple[str, Callable]] = {**CORPUS, **EDGES}
FAMILIES: tuple[str, ...] = tuple(dict.fromkeys(f for f, _ in SCENARIOS.values()))


@dataclass(frozen=True)
class Instance:
    """One scenario instantiated for one model: its concrete trace, or why it was skipped."""
    scenario: str                   # e.g. "chunked_prefill"
    family: str                     # the scenario family it covers
    trace: "object | None"          # oracle.trace.Trace for this model (None when skipped)
    skip_reason: str | None
    concrete: dict | None           # the concrete trace's JSON (Trace.to_json()), recorded in reports


def _names(names: list[str] | None) -> list[str]:
    if names is None:
        return list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ScenarioError(f"scenario {unknown[0]!r} is not one of {sorted(SCENARIOS)}")
    return list(dict.fromkeys(names))


def instantiate_one(name: str, units: Units, where: str = "the model") -> Instance:
    """Instantiate one scenario for `units`; a ScenarioError if the builder made a trace the model rejects."""
    from oracle.trace import TraceError, check_against_model, parse_trace
    family, builder = SCENARIOS[name]
    try:
        obj, folded = build_with_tokens(builder, units)
    except Skip as s:
        return Instance(name, family, None, str(s), None)
    try:
        tr = parse_trace(obj, vocab_size=units.vocab)
        check_against_model(tr, units.vocab, units.chunk)
    except TraceError as e:
        raise ScenarioError(f"scenario {name!r} for {where} (chunk_size {units.chunk}, vocab_size {units.vocab}) "
                            f"built an invalid trace: {e}") from e
    return Instance(name, family, tr, None, tr.to_json())


def instantiate(model_dir: Path, config, names: list[str] | None = None) -> list[Instance]:
    """Every scenario (or those named, in that order) for the model at `model_dir` whose oracle config is `config`."""
    units = Units.from_config(config)
    return [instantiate_one(n, units, str(model_dir)) for n in _names(names)]


def shipped_trace_path(name: str) -> Path | None:
    """goldens/traces/<name>.json when the scenario has a shipped concrete trace."""
    p = TRACES / f"{name}.json"
    return p if p.exists() else None


# The qualify main job's default: every family at least once, spread over the shipped models so each model's
# architecture runs something, short instances only (the fast path runs in the Triton interpreter on CPU, ~1 s a
# step). Measured wall time: docs/qualification.md ("The main job's default plan").
DEFAULT_PLAN: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("tiny-sort", ("seed_compaction", "task_burst", "request_order")),
    ("zoo-granitemoehybrid", ("seeded_sampling", "piece_chunk")),
    ("zoo-bamba", ("stop_tokens", "piece_budget")),
    ("zoo-mamba2", ("async_drain", "slot_exhaustion", "special_ids")),
    ("zoo-nemotron_h", ("chunked_prefill", "task_staggered")),
)


def default_plan() -> list[tuple[Path, list[str] | None]]:
    """The qualify main job's default run: (model folder, scenario names) covering every family at least once."""
    return [(MODELS / m, list(names)) for m, names in DEFAULT_PLAN]


def plan_coverage(plan: list[tuple[Path, list[str] | None]] | None = None) -> dict[str, list[str]]:
    """family -> the 'model:scenario' entries of a plan that cover it (what the main job says it covered)."""
    out: dict[str, list[str]] = {f: [] for f in FAMILIES}
    for model, names in plan if plan is not None else default_plan():
        for n in _names(names):
            out[SCENARIOS[n][0]].append(f"{Path(model).name}:{n}")
    return out
