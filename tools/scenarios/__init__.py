"""The trace corpus as scenarios in a model's own units, and the main job's default plan.

Owns the scenario builders (`corpus`: one per shipped trace; `edges`: boundary families; `units`: a model's
units and token folding), the trained model's task and its traces (`task`, `task_traces`) and the plan
(`plan`: instantiate, shipped traces, `main_job_plan`). May import oracle and `hybridqual.paths` only (no engine,
no checks): a scenario is data.
"""
from hybridqual.scenarios.plan import (DEFAULT_TRACES, FAMILIES, SCENARIOS, Instance, ScenarioError,  # noqa: F401
                                       configuration_plan, default_plan, default_trace_plan, describe, instantiate, instantiate_one,
                                       main_job_plan, plan_coverage, shipped_models, shipped_trace_path,
                                       write_shipped)
