"""qualify --jobs N: the plan's instances run in N worker processes, the report written in plan order.

The parent walks the plan's steps (hybridqual.qualify.steps.plan_steps) in order, as the serial run does; each instance is
handed to the next free worker (`python -m hybridqual.qualify.worker BUDGET ARGV...`: BUDGET the run's
adapters.base.ThreadBudget as JSON, its threads the worker's torch and OpenMP threads and its engine's budget),
which rebuilds it (same model folder, same scenario or trace file: instantiation is deterministic), runs it
(hybridqual.qualify.runner.run_instance) and sends back, a JSON line each, its progress lines, its instance record, its checks
and "done". The parent applies an instance's messages only when every earlier step has been applied (those of the
instance at the head live, as they arrive; later ones buffered), so report.json, junit.xml and the printed lines
are in the serial run's order whatever finished first, and --fail-fast stops at the first FAIL in that order
(later instances' results are dropped, the workers stopped). Only JSON strings cross between the processes.

A worker is where a hostile adapter cannot take the run with it: a worker that dies (sys.exit outside a check,
os._exit, a signal, an OOM kill) or whose instance runs past --timeout (the parent kills its process group) makes
that instance a FAIL line naming the exit code, signal or timeout and the end of the worker's stderr; a fresh
worker takes the instances left.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from hybridqual.adapters.base import ThreadBudget
from hybridqual.qualify.report import Check, Progress
from hybridqual.qualify.steps import RunInstance, apply_step

HOME = Path(__file__).parent.parent    # the package folder as imported (a link is not resolved)


def worker_env(threads: int) -> dict[str, str]:
    """The workers' environment: THREADS OpenMP threads, and an import path that finds what this process imports
    (this very package first, then this process's own path entries outside the interpreter's install, so an
    engine given as module:Class resolves in a worker as it does here)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    first = [str(HOME.parent)] if HOME.name == "hybridqual" else []   # imported from a folder on the path
    prefixes = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    own = [p for p in sys.path if p and os.path.isdir(p) and not os.path.abspath(p).startswith(prefixes)]
    old = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    path = list(dict.fromkeys(first + old + own))
    if path:
        env["PYTHONPATH"] = os.pathsep.join(path)
    return env


def start_worker(args, budget: ThreadBudget) -> subprocess.Popen:
    """One worker (`python -m hybridqual.qualify.worker BUDGET ARGV...`) in a session of its own (a timeout ends
    its whole process group; a ^C of the terminal reaches only the parent, which stops it)."""
    w = subprocess.Popen([sys.executable, "-m", "hybridqual.qualify.worker", json.dumps(budget.to_json()),
                          *args.argv],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                         env=worker_env(budget.threads), start_new_session=True)
    w.stderr_tail = deque(maxlen=8)     # stderr passed through, its tail kept for the FAIL line a dead worker gives
    w.stderr_reader = threading.Thread(target=_relay_stderr, args=(w,), daemon=True)
    w.stderr_reader.start()
    w.timed_out = None
    return w


def worker_budget(args, cores: int) -> ThreadBudget:
    """The run's thread budget (args.thread_budget, set by qualify's main), else cores // --jobs threads."""
    return getattr(args, "thread_budget", None) or ThreadBudget.for_cores(cores, args.jobs)


def start_workers(args, n: int, cores: int) -> list[subprocess.Popen]:
    """n workers, each with the run's thread budget (cores // --jobs torch threads unless --engine-threads)."""
    budget = worker_budget(args, cores)
    return [start_worker(args, budget) for _ in range(n)]


def _relay_stderr(w: subprocess.Popen) -> None:
    for line in w.stderr:
        w.stderr_tail.append(line.rstrip("\n"))
        sys.stderr.write(line)


def _kill(w: subprocess.Popen) -> None:
    """End worker w and whatever it started (its own process group, made for it by start_worker)."""
    try:
        os.killpg(w.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, AttributeError):
        w.kill()


def stop_workers(workers) -> None:
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
            _kill(w)
            w.wait()


def _reader(i: int, w: subprocess.Popen, inbox: queue.Queue) -> None:
    for line in w.stdout:
        inbox.put((i, line))
    inbox.put((i, None))


def death_text(w: subprocess.Popen, code: int) -> str:
    """Why a worker ended before finishing its instance: the timeout that killed it, its exit code or signal, and
    the end of its stderr."""
    tail = " | ".join(w.stderr_tail) or "no stderr"
    if w.timed_out is not None:
        how = (f"the instance ran past --timeout {w.timed_out:g} s: its worker {w.pid} (and its process group) was "
               "killed")
    elif code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        how = f"worker {w.pid} was killed by {name} before finishing it"
    else:
        how = f"worker {w.pid} exited (code {code}) before finishing it"
    return f"{how}; its stderr ended: {tail}"


WORKER_START_S = 120.0   # a worker's start-up (imports) before it begins its first instance, beyond --timeout

class Pool:
    """The worker processes of one run: each takes the next instance when free; their messages are buffered per
    task until the plan's walk reaches it. A worker that dies, or whose instance runs past args.timeout (it is then
    killed), leaves a "died" message for its task, and a fresh worker takes the tasks left."""

    def __init__(self, args, steps: list, tasks: list[int], tau: float, t0: float, cores: int) -> None:
        self.args, self.steps, self.tau, self.t0 = args, steps, tau, t0
        self.budget = worker_budget(args, cores)
        self.timeout = getattr(args, "timeout", None)
        self.inbox: queue.Queue = queue.Queue()
        self.workers: dict[int, subprocess.Popen] = {}   # worker number -> process (a dead one gets a new number)
        self.serial = iter(range(1 << 30))
        self.todo, self.busy, self.started, self.begun = deque(tasks), {}, {}, set()
        self.buffers = {k: deque() for k in tasks}

    def spawn(self) -> int:
        i = next(self.serial)
        self.workers[i] = start_worker(self.args, self.budget)
        threading.Thread(target=_reader, args=(i, self.workers[i], self.inbox), daemon=True).start()
        return i

    def assign(self, i: int) -> None:
        """Worker i's next task, or the end of its input when none is left."""
        w = self.workers[i]
        if self.todo:
            k = self.todo.popleft()
            self.busy[i], self.started[i] = k, time.monotonic()
            self.begun.discard(i)
            task = {"task": k, "t0": self.t0, "tau": self.tau, **self.steps[k].spec.to_json()}
            try:
                w.stdin.write(json.dumps(task) + "\n")
                w.stdin.flush()
            except OSError:                  # it died: its end-of-output marks task k a FAIL
                pass
        else:
            try:
                w.stdin.close()              # no more work: the worker exits at end of input
            except OSError:
                pass

    def overdue(self) -> None:
        """Kill a worker whose instance ran past --timeout (from its "begin"; before it, the worker's start-up
        gets WORKER_START_S more)."""
        now = time.monotonic()
        for i, k in list(self.busy.items()):
            w = self.workers[i]
            limit = self.timeout + (0 if i in self.begun else WORKER_START_S)
            if w.timed_out is None and now - self.started[i] > limit:
                w.timed_out = self.timeout
                _kill(w)                     # its reader then sees the end of its output

    def receive(self) -> None:
        """One message (or a worker's end) from the inbox into its task's buffer."""
        try:
            i, line = self.inbox.get(timeout=1.0 if self.timeout else None)
        except queue.Empty:
            self.overdue()
            return
        if line is None:                     # a worker ended: its unfinished task is a FAIL, a new worker goes on
            k = self.busy.pop(i, None)
            w = self.workers.pop(i)
            if k is not None:
                code = w.wait()
                w.stderr_reader.join(timeout=5)
                self.buffers[k].append({"kind": "died", "text": death_text(w, code)})
                if self.todo:
                    self.assign(self.spawn())
            return
        try:
            msg = json.loads(line)
        except ValueError:                   # a stray line on the protocol: shown, never trusted
            sys.stderr.write(f"qualify worker {self.workers[i].pid}: not a message: {line[:200]!r}\n")
            return
        if msg["kind"] == "begin":           # the worker started the instance: its --timeout runs from now
            self.started[i] = time.monotonic()
            self.begun.add(i)
            return
        self.buffers[msg["task"]].append(msg)
        if msg["kind"] in ("done", "error"):
            self.busy.pop(i, None)
            self.assign(i)
        if self.timeout:
            self.overdue()

    def next_message(self, k: int) -> dict:
        while not self.buffers[k]:
            self.receive()
        return self.buffers[k].popleft()


def apply_instance(pool: Pool, k: int, step: RunInstance, report, progress: Progress, on_check, counters: dict,
                   count) -> None:
    """Task k's messages, in order, until it is done or could not finish (a FAIL line; the run goes on)."""
    while True:
        msg = pool.next_message(k)
        if msg["kind"] == "say":
            progress.say(msg["line"])
        elif msg["kind"] == "instance":
            report.instance(msg["info"])
        elif msg["kind"] == "check":
            on_check(Check(**msg["check"]))
        elif msg["kind"] in ("error", "died"):
            timed_out = msg["kind"] == "died" and "--timeout" in msg["text"]
            name = "instance finishes within --timeout" if timed_out else "instance runs to its end"
            c = Check.of(step.label, name, False, ("the qualify worker raised: " if msg["kind"] == "error" else "")
                         + msg["text"])
            progress.check(c)
            on_check(c)
            count(counters, True, step.inst.family)
            return
        elif msg["kind"] == "done":
            count(counters, msg["ran"], msg["family"])
            return


def run_parallel(args, steps, report, progress: Progress, on_check, counters: dict, count,
                 cores: int) -> int | None:
    """The plan's steps with instances on args.jobs workers, applied in order; None when done, else an exit code.
    `apply_step` (hybridqual.qualify.steps) and `count` are the serial run's own, so both runs apply steps alike.
    A worker that dies, or whose instance runs past args.timeout (it is then killed), makes that instance a FAIL
    line; a fresh worker takes the remaining instances."""
    steps = list(steps)          # the truths' loading and instantiation: cheap next to running the instances
    tasks = [k for k, s in enumerate(steps) if isinstance(s, RunInstance)]
    if not tasks:
        for s in steps:
            code = apply_step(s, report, progress, on_check)
            if code is not None:
                return code
        return None
    pool = Pool(args, steps, tasks, report.header["tau"], progress.t0, cores)
    try:
        for _ in range(min(args.jobs, len(tasks))):
            pool.assign(pool.spawn())
        for k, step in enumerate(steps):
            if isinstance(step, RunInstance):
                apply_instance(pool, k, step, report, progress, on_check, counters, count)
                continue
            code = apply_step(step, report, progress, on_check)
            if code is not None:
                return code
    finally:
        stop_workers(list(pool.workers.values()))
    return None
