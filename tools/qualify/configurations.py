"""An engine's optional configurations in a qualify run (`TraceAdapter.configurations`, `qualify --configuration`).

The main job runs the default configuration on the whole default plan, then every configuration the adapter
declares on the shipped instances that reach its code (its `reach`): a defect on a path the defaults never take
is still a FAIL line of the main job. With --model/--trace the given instances run in the default configuration,
or in each one that --configuration names. May import the scenarios and the adapter protocol only.
"""
from __future__ import annotations

from pathlib import Path

from hybridqual.scenarios import plan as scenarios

DEFAULT = "default"


def problem(names: list[str] | None, engine) -> str | None:
    """Why --configuration NAMES cannot run with this adapter (an unknown name), or None."""
    known = [DEFAULT] + [c.name for c in engine.configurations()]
    for n in names or []:
        if n not in known:
            return f"--configuration {n}: the engine declares no such configuration (known: {', '.join(known)})"
    return None


def chosen(names: list[str] | None, engine, main_job: bool) -> list[str]:
    """The configurations a run covers, in order: --configuration's, else the main job's default and every
    declared one, else (--model/--trace) the default."""
    if names:
        return list(dict.fromkeys(names))
    return [DEFAULT] + [c.name for c in engine.configurations()] if main_job else [DEFAULT]


def plan(base: list[tuple], names: list[str], engine,
         main_job: bool) -> list[tuple[Path, list[str] | None, list[Path] | None, str | None]]:
    """The run's plan as (model, scenario names, trace files, configuration or None for the default): the main
    job's base plan in the default configuration, then each chosen configuration on its reach; an explicit
    --model/--trace plan once per chosen configuration."""
    out = []
    for name in names:
        if name == DEFAULT:
            out += [(m, n, f, None) for m, n, f in base]
        elif main_job:
            reach = {c.name: c.reach for c in engine.configurations()}[name]
            out += scenarios.configuration_plan([(name, reach)])
        else:
            out += [(m, n, f, name) for m, n, f in base]
    return out


def label(model_dir: Path, scenario: str, configuration: str | None) -> str:
    """An instance's name in the report: model/scenario, then [configuration] when it is not the default."""
    return f"{Path(model_dir).name}/{scenario}" + (f" [{configuration}]" if configuration else "")


class Engines:
    """The engine (an adapters.Engine: class and options) of each configuration of one run, built once each."""

    def __init__(self, engine) -> None:
        self.base, self.built = engine, {}

    def __call__(self, configuration: str | None):
        if configuration is None:
            return self.base
        if configuration not in self.built:
            self.built[configuration] = self.base.configured(configuration)
        return self.built[configuration]
