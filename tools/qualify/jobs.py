"""qualify --jobs N: the plan's instances run in N worker processes, the report written in plan order.

The parent walks the plan's steps (hybridqual.qualify.runner.plan_steps) in order, as the serial run does; each instance is
handed to the next free worker (`python -m hybridqual.qualify.worker THREADS ARGV...`, THREADS torch threads each),
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
from collections import deque
from pathlib import Path

from hybridqual.qualify.report import Check, Progress

HOME = Path(__file__).parent.parent    # the package folder as imported (a link is not resolved)


def start_workers(args, n: int, cores: int) -> list[subprocess.Popen]:
    """n workers, each with cores // --jobs torch threads (at least 1)."""
    threads = max(1, cores // max(1, args.jobs))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if HOME.name == "hybridqual":        # imported from a folder on the path: the workers import this very package
        path = os.environ.get("PYTHONPATH")
        env["PYTHONPATH"] = str(HOME.parent) + (os.pathsep + path if path else "")
    workers = [subprocess.Popen([sys.executable, "-m", "hybridqual.qualify.worker", str(threads), *args.argv],
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


def run_parallel(args, steps, report, progress: Progress, on_check, counters: dict, apply_step, count,
                 cores: int) -> int | None:
    """The plan's steps with instances on args.jobs workers, applied in order; None when done, else an exit code.
    `apply_step` and `count` are the serial run's own (hybridqual.qualify.runner), so both runs apply steps alike."""
    steps = list(steps)          # the truths' loading and instantiation: cheap next to running the instances
    tasks = [k for k, s in enumerate(steps) if s[0] == "instance"]
    if not tasks:
        for s in steps:
            code = apply_step(s, report, progress, on_check)
            if code is not None:
                return code
        return None
    workers = start_workers(args, min(args.jobs, len(tasks)), cores)
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
