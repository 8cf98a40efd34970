"""A mutated llama.cpp, to prove the llama.cpp path can FAIL: a copy of the install's source and build tree with one
defect, rebuilt incrementally.

    python -m hybridqual.adapters.llamacpp.mutant build [--force]   # .venv-llamacpp-mutant/ (HQ_LLAMACPP_MUTANT)
    python -m hybridqual.adapters.llamacpp.mutant status

The defect (DEFECT): `llama_memory_recurrent::seq_rm` frees a sequence's recurrent cell without resetting its source
(`cells[i].src = -1`, src/llama-memory-recurrent.cpp:233 at 0c1e57098). `find_slot` gives a cell whose source is < 0
the zeroed state (`src0 = rs_z`, :694-696), so the next sequence that takes the freed cell starts from the
previous occupant's final conv and SSM states instead of zeros: the "freed slot not cleared when reused" class
(a reused sequence id or state slot inheriting another request's recurrent state). It applies to every model
with recurrent layers (Mamba2 as llama_memory_recurrent, the hybrids through llama_memory_hybrid::seq_rm). A run
reaches it when a request is admitted after another finished: any trace with more requests than sequences
(slot_exhaustion) or staggered arrivals.

`build` copies the install's unpacked sdist (src/llama_cpp_python-VERSION, with the .git the build-info step reads)
and its cmake build tree with `cp -a` (timestamps kept), rewrites the two tree paths inside the build tree's text
files with their modification times kept, patches the one source file and runs `cmake --build` for libllama and
llama-server under `nice -n 19` with -j2: make rebuilds the touched translation unit and relinks what links
libllama. `LlamaCppMutantAdapter` is LlamaCppAdapter with the worker's llama_cpp loading libllama from the
mutant's build/bin (LLAMA_CPP_LIB_PATH); the GGUF is the unmutated install's conversion.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from hybridqual.adapters.llamacpp import convert as conv
from hybridqual.adapters.base import DEFAULT_OPTIONS, EngineOptions
from hybridqual.adapters.llamacpp.adapter import LlamaCppAdapter

DEFECT = {
    "name": "recurrent-cell-not-cleared-on-reuse",
    "file": "src/llama-memory-recurrent.cpp",
    "function": "llama_memory_recurrent::seq_rm",
    "old": "                cells[i].pos = -1;\n"
           "                cells[i].src = -1;\n"
           "                if (new_head == size) {\n",
    "new": "                cells[i].pos = -1;\n"
           "                // mutant: the freed cell keeps its source, so it is not zeroed when it is reused\n"
           "                if (new_head == size) {\n",
    "what": "seq_rm frees a recurrent cell without resetting cells[i].src: the next sequence in that cell starts "
            "from the previous sequence's final conv/SSM state instead of zeros",
}
TARGETS = ("llama", "llama-server")


def mutant_dir() -> Path:
    """$HQ_LLAMACPP_MUTANT, else .venv-llamacpp-mutant/ in the checkout."""
    env = os.environ.get("HQ_LLAMACPP_MUTANT")
    return Path(env) if env else Path(__file__).resolve().parents[3] / ".venv-llamacpp-mutant"


def lib_dir() -> Path:
    """Where the mutant's libllama.so is (its build tree's bin/)."""
    return mutant_dir() / "build" / "bin"


def available() -> str | None:
    """None when the mutant build is there, else why not (with the command that makes it)."""
    why = conv.available()
    if why:
        return why
    rec = mutant_dir() / "mutant.json"
    if not rec.exists() or not (lib_dir() / "libllama.so").exists():
        return f"{rec} is missing (run python -m hybridqual.adapters.llamacpp.mutant build)"
    return None


def _sdist_dir(venv: Path) -> Path:
    info = json.loads((venv / "llamacpp.json").read_text())
    return venv / "src" / f"llama_cpp_python-{info['llama_cpp_python']}"


def _rewrite_paths(build: Path, subs: list[tuple[bytes, bytes]]) -> int:
    """Replace each (old, new) path in the text files under `build`, keeping each file's times; the count."""
    n = 0
    for p in build.rglob("*"):
        if not p.is_file() or p.is_symlink():
            continue
        data = p.read_bytes()
        if b"\0" in data[:65536] or not any(old in data for old, _ in subs):
            continue
        st = p.stat()
        for old, new in subs:
            data = data.replace(old, new)
        p.write_bytes(data)
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
        n += 1
    return n


def build(force: bool = False, jobs: int = 2) -> dict:
    """Make the mutant (copy, patch, incremental rebuild); returns what mutant.json records."""
    why = conv.available()
    if why:
        raise RuntimeError(why)
    venv, out = conv.venv_dir().resolve(), mutant_dir().resolve()
    rec_path = out / "mutant.json"
    if rec_path.exists() and not force:
        rec = json.loads(rec_path.read_text())
        if rec.get("defect") == DEFECT["name"] and \
                rec.get("llama_cpp_commit") == conv.install_info().get("llama_cpp_commit"):
            return rec
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    src, bld = _sdist_dir(venv), venv / "build"
    msrc, mbld = out / "src" / src.name, out / "build"
    t0 = time.monotonic()
    (out / "src").mkdir()
    subprocess.run(["cp", "-a", str(src), str(msrc)], check=True)
    subprocess.run(["cp", "-a", str(bld), str(mbld)], check=True)
    rewritten = _rewrite_paths(mbld, [(str(src).encode(), str(msrc).encode()), (str(bld).encode(), str(mbld).encode())])
    t_copy = time.monotonic() - t0
    target = msrc / "vendor" / "llama.cpp" / DEFECT["file"]
    text = target.read_text()
    if text.count(DEFECT["old"]) != 1:
        raise RuntimeError(f"{target}: the defect's anchor is not there exactly once (another llama.cpp version?)")
    line = text[:text.index(DEFECT["old"])].count("\n") + 2
    target.write_text(text.replace(DEFECT["old"], DEFECT["new"]))
    t1 = time.monotonic()
    r = subprocess.run(["nice", "-n", "19", "cmake", "--build", str(mbld), "--target", *TARGETS, "-j", str(jobs)],
                       capture_output=True, text=True)
    t_build = time.monotonic() - t1
    (out / "cmake-build.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        raise RuntimeError(f"the mutant build failed (exit {r.returncode}):\n" + "\n".join(r.stdout.splitlines()[-20:])
                           + r.stderr[-2000:])
    compiled = re.findall(r"Building \w+ object (\S+)", r.stdout)
    linked = re.findall(r"Linking \w+ (?:shared library|executable|static library|module) (\S+)", r.stdout)
    rec = {"defect": DEFECT["name"], "what": DEFECT["what"], "file": DEFECT["file"], "line": line,
           "function": DEFECT["function"], "llama_cpp_commit": conv.install_info().get("llama_cpp_commit"),
           "lib_dir": str(mbld / "bin"), "server": str(mbld / "bin" / "llama-server"),
           "copy_seconds": round(t_copy, 1), "build_seconds": round(t_build, 1), "jobs": jobs,
           "compiled": compiled, "linked": linked, "build_files_rewritten": rewritten,
           "date": time.strftime("%Y-%m-%d")}
    rec_path.write_text(json.dumps(rec, indent=1))
    return rec


class LlamaCppMutantAdapter(LlamaCppAdapter):
    """LlamaCppAdapter on the mutated libllama of .venv-llamacpp-mutant/ (DEFECT): must FAIL qualify."""

    @classmethod
    def lib_path(cls) -> str | None:
        return str(lib_dir())

    @classmethod
    def version(cls, options: EngineOptions = DEFAULT_OPTIONS) -> str:
        return f"{super().version(options)}; MUTATED ({DEFECT['name']}: {DEFECT['file']})"

    def __init__(self, model_path, trace, mode, device="cpu", options: EngineOptions = DEFAULT_OPTIONS):
        why = available()
        if why:
            raise RuntimeError(f"llama.cpp mutant: {why}")
        super().__init__(model_path, trace, mode, device, options)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridqual.adapters.llamacpp.mutant", description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["build", "status"])
    ap.add_argument("--force", action="store_true", help="copy and rebuild even when the mutant is there")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    a = ap.parse_args(argv)
    if a.what == "status":
        why = available()
        print(why or (mutant_dir() / "mutant.json").read_text())
        return 1 if why else 0
    try:
        rec = build(a.force, a.jobs)
    except RuntimeError as e:
        print(f"mutant: {e}", file=sys.stderr)
        return 1
    print(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
