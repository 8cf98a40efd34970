"""qualify --jobs N: the plan's instances run in N worker processes, the report written in plan order.

The parent walks the plan's steps (hybridqual.qualify.runner.plan_steps) in order, as the serial run does; each instance is
handed to the next free worker (`python -m hybridqual.qualify.jobs THREADS ARGV...`, THREADS torch threads each),
which rebuilds it (same model folder, same scenario or trace file: instantiation is deterministic), runs it
(hybridqual.qualify.runner.run_instance) and sends back, a JSON line each, its progress lines, its instance record, its checks
and "done". The parent applies an instance's messages only when every earlier step has been applied (those of the
instance at the head live, as they arrive; later ones buffered), so report.json, junit.xml and the printed lines
are in the serial run's order whatever finished first, and --fail-fast stops at the first FAIL in that order
(later instances' results are dropped, the workers stopped). Only JSON strings cross between the processes.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import traceback
from collections import deque
from dataclasses import asdict
from pathlib import Path

from hybridqual.qualify.report import FAIL, Check, Progress

HOME = Path(__file__).parent.parent    # the package folder as imported (a link is not resolved)


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


def start_workers(args, n: int) -> list[subprocess.Popen]:
    """n workers, each with cpu_cores() // --jobs torch threads (at least 1)."""
    from hybridqual.qualify.runner import cpu_cores
    threads = max(1, cpu_cores() // max(1, args.jobs))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if HOME.name == "hybridqual":        # imported from a folder on the path: the workers import this very package
        path = os.environ.get("PYTHONPATH")
        env["PYTHONPATH"] = str(HOME.parent) + (os.pathsep + path if path else "")
    workers = [subprocess.Popen([sys.executable, "-m", "hybridqual.qualify.jobs", str(threads), *args.argv],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                bufsize=1, env=env)
               for _ in range(n)]
    for w in workers:                   # stderr passed through, its tail kept for the error a dead worker gives
        w.stderr_tail = deque(maxlen=8)
        w.stderr_reader = threading.Thread(target=_relay_stderr, args=(w,), daemon=True)
        w.stderr_reader.start()
    return workers


def _relay_stderr(w: subprocess.Popen) -> None:
    for line in w.stderr:
        w.stderr_tail.append(line.rstrip("\n"))
        sys.stderr.write(line)


def stop_workers(workers: list[subprocess.Popen]) -> None:
    """End the workers we started (each by its own pid) and reap them."""
    for w in workers:
        try:
            w.stdin.close()
        except OSError:
            pass
        if w.poll() is None:
            w.terminate()
    for w in workers:
        try:
            w.wait(timeout=20)
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()


def _reader(i: int, w: subprocess.Popen, inbox: queue.Queue) -> None:
    for line in w.stdout:
        inbox.put((i, line))
    inbox.put((i, None))


def run_parallel(args, steps, report, progress: Progress, on_check, counters: dict) -> int | None:
    """The plan's steps with instances on args.jobs workers, applied in order; None when done, else an exit code."""
    from hybridqual.qualify.runner import apply_step, count
    steps = list(steps)          # the truths' loading and instantiation: cheap next to running the instances
    tasks = [k for k, s in enumerate(steps) if s[0] == "instance"]
    if not tasks:
        for s in steps:
            code = apply_step(s, report, progress, on_check)
            if code is not None:
                return code
        return None
    workers = start_workers(args, min(args.jobs, len(tasks)))
    inbox: queue.Queue = queue.Queue()
    for i, w in enumerate(workers):
        threading.Thread(target=_reader, args=(i, w, inbox), daemon=True).start()
    todo, busy, buffers = deque(tasks), {}, {k: deque() for k in tasks}
    tau = report.header["tau"]

    def assign(i: int) -> None:
        w = workers[i]
        if todo:
            k = todo.popleft()
            busy[i] = k
            try:
                w.stdin.write(json.dumps({"task": k, "t0": progress.t0, "tau": tau, **steps[k][6]}) + "\n")
                w.stdin.flush()
            except OSError:                  # it died: its end-of-output marks task k an error
                pass
        else:
            try:
                w.stdin.close()              # no more work: the worker exits at end of input
            except OSError:
                pass

    def receive() -> None:
        i, line = inbox.get()
        if line is None:                     # a worker ended: its unfinished task is an error
            k = busy.pop(i, None)
            if k is not None:
                code = workers[i].wait()
                workers[i].stderr_reader.join(timeout=5)
                tail = " | ".join(workers[i].stderr_tail) or "no stderr"
                buffers[k].append({"kind": "error", "text": f"worker {workers[i].pid} exited (code {code}) before "
                                                            f"finishing it; its stderr ended: {tail}"})
            return
        msg = json.loads(line)
        buffers[msg["task"]].append(msg)
        if msg["kind"] in ("done", "error"):
            busy.pop(i, None)
            assign(i)

    try:
        for i in range(len(workers)):
            assign(i)
        for k, step in enumerate(steps):
            if step[0] != "instance":
                code = apply_step(step, report, progress, on_check)
                if code is not None:
                    return code
                continue
            while True:
                while not buffers[k]:
                    receive()
                msg = buffers[k].popleft()
                if msg["kind"] == "say":
                    progress.say(msg["line"])
                elif msg["kind"] == "instance":
                    report.instance(msg["info"])
                elif msg["kind"] == "check":
                    on_check(Check(**msg["check"]))
                elif msg["kind"] == "error":
                    raise RuntimeError(f"qualify worker, {step[1].name} instance {step[2]} ({step[4].scenario}): "
                                       f"{msg['text']}")
                elif msg["kind"] == "done":
                    count(counters, msg["ran"], msg["family"])
                    break
    finally:
        stop_workers(workers)
    return None


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
    adapter_cls = qualify.configured_adapter(args)
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
                    qualify.instances_for(model_dir, om.config, [task["scenario"]], model_dir.name)[0])
            ran, family = qualify.run_instance(args, adapter_cls, task["tau"], model_dir, task["i"], task["n"], inst,
                                               om, Relay(args.quiet, emit, task["t0"]),
                                               lambda info: emit("instance", info=info), on_check)
            emit("done", ran=ran, family=family)
        except _Stop:
            emit("done", ran=True, family="stopped")
        except Exception:  # noqa: BLE001  (the parent reports it where the serial run would have crashed)
            emit("error", text=traceback.format_exc())
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
