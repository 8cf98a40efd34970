"""A qualify --jobs worker (`python -m hybridqual.qualify.worker THREADS ARGV...`): instances in as JSON lines on
stdin, their progress lines, instance records, checks and "done" out as JSON lines (hybridqual.qualify.jobs reads
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
    threads, qargv = int(argv[0]), argv[1:]
    import torch
    torch.set_num_threads(threads)
    from hybridqual.qualify import runner as qualify
    from hybridqual.qualify.truth import load_truth
    args = qualify.parse_args(qargv)
    args.jobs = 1
    problem = qualify.prepare_device(args.device)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    from hybridqual.qualify.configurations import Adapters
    adapter_cls = qualify.configured_adapter(args)
    adapter_for = Adapters(adapter_cls)
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
        try:
            model_dir = Path(task["model"])
            if task["model"] not in truths:
                truths[task["model"]] = load_truth(model_dir, args.oracle, args.oracle_device)[0]
            om = truths[task["model"]]
            inst = (qualify.instance_from_file(Path(task["trace_file"]), om.config) if "trace_file" in task else
                    qualify.instances_for(model_dir, om.config, [task["scenario"]], model_dir.name,
                                          qualify.engine_granularities(args, adapter_cls))[0])
            cfg = task.get("configuration")
            ran, family = qualify.run_instance(args, adapter_for(cfg), task["tau"], model_dir, task["i"], task["n"],
                                               inst, om, Relay(args.quiet, emit, task["t0"]),
                                               lambda info: emit("instance", info=info), on_check, cfg)
            emit("done", ran=ran, family=family)
        except _Stop:
            emit("done", ran=True, family="stopped")
        except Exception:  # noqa: BLE001  (the parent reports it where the serial run would have crashed)
            emit("error", text=traceback.format_exc())
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
