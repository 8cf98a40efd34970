"""A qualify --jobs worker (`python -m hybridqual.qualify.worker BUDGET ARGV...`; BUDGET the run's ThreadBudget as
JSON, its threads this process's torch threads and its engine's EngineOptions.threads): instances in as JSON lines
on stdin, their progress lines, instance records, checks and "done" out as JSON lines (hybridqual.qualify.jobs reads
them and applies them in plan order)."""
from __future__ import annotations

import json
import os
import sys
import traceback
from dataclasses import asdict
from pathlib import Path

from hybridqual.qualify.report import FAIL, Check, Progress


class Relay(Progress):
    """A worker's progress lines, sent to the parent instead of printed (times from the run's start)."""

    def __init__(self, quiet: bool, emit, t0: float) -> None:
        super().__init__(quiet)
        self.emit, self.t0 = emit, t0

    def say(self, line: str) -> None:
        if not self.quiet:
            self.emit("say", line=line)


class _Stop(Exception):
    """A worker's --fail-fast: its instance stops at its first FAIL (the parent stops the run there)."""


def worker_main(argv: list[str]) -> int:
    """A worker: tasks (JSON lines) on stdin, messages (JSON lines) on the original stdout; stray prints go to
    stderr so they cannot break the messages."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from hybridqual.adapters.base import ThreadBudget
    budget, qargv = ThreadBudget.from_json(json.loads(argv[0])), argv[1:]
    import torch
    torch.set_num_threads(budget.threads)
    from hybridqual.qualify import runner as qualify
    from hybridqual.qualify.truth import load_truth
    args = qualify.parse_args(qargv)
    args.jobs, args.thread_budget = 1, budget
    problem = qualify.prepare_device(args.device)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    from hybridqual.qualify.configurations import Engines
    from hybridqual.qualify.steps import InstanceSpec, RunInstance, instance_from_file, instances_for
    engine = qualify.configured_engine(args)
    engine_for = Engines(engine)
    truths: dict[str, object] = {}
    for line in sys.stdin:
        task = json.loads(line)

        def emit(kind: str, **kw) -> None:
            proto.write(json.dumps({"task": task["task"], "kind": kind, **kw}, default=str) + "\n")
            proto.flush()

        def on_check(c: Check) -> None:
            emit("check", check=asdict(c))
            if args.fail_fast and c.status == FAIL:
                raise _Stop()
        emit("begin")                     # the instance's --timeout runs from here, not from the worker's start-up
        try:
            spec = InstanceSpec.from_json(task)
            model_dir = Path(spec.model)
            if spec.model not in truths:
                truths[spec.model] = load_truth(model_dir, args.oracle, args.oracle_device)[0]
            om = truths[spec.model]
            inst = (instance_from_file(Path(spec.trace_file), om.config) if spec.trace_file is not None else
                    instances_for(model_dir, om.config, [spec.scenario], model_dir.name,
                                  qualify.engine_granularities(args, engine), qualify.engine_rule(args, engine),
                                  "seeded" not in engine.capabilities(args.device).sampling_kinds)[0])
            ran, family = qualify.run_instance(args, engine_for(spec.configuration), task["tau"],
                                               RunInstance(model_dir, inst, om, spec),
                                               Relay(args.quiet, emit, task["t0"]),
                                               lambda info: emit("instance", info=info), on_check)
            emit("done", ran=ran, family=family)
        except _Stop:
            emit("done", ran=True, family="stopped")
        except Exception:  # noqa: BLE001  (the parent reports it where the serial run would have crashed)
            emit("error", text=traceback.format_exc())
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
