#!/usr/bin/env bash
# Install Megatron-Core's dynamic inference engine next to hybridqual, for `hybridqual.adapters.megatron:MegatronAdapter`.
#
#   bash scripts/install-megatron.sh                # CPU machine: venv .venv-megatron/ (Python 3.12), idempotent
#   bash scripts/install-megatron.sh --fetch-wheels # also fill .whl/ with what the GPU image lacks (no internet there)
#
# What it installs (docs/megatron.md): torch==2.13.0 (the registry's build; its CUDA libraries come along and are
# not used on CPU), megatron-core==$MEGATRON_VERSION (needs Python >= 3.12), einops, the Triton-only pieces of
# mamba_ssm and causal_conv1d built into wheels from their sdists by tools/adapters/megatron/vendor.py (no CUDA build),
# pytest + hypothesis, and this checkout editable. flash-attn is not installable here: the adapter supplies a
# stand-in (tools/adapters/megatron/flash_attn_standin.py) for the attention kernel only, and every report says so.
# The GPU image (Python 3.12, torch 2.11, triton 3.6) takes .whl/*.whl with
#   pip install --no-index --no-deps --target /tmp/site .whl/*.whl      (tools/bench/gpu_run.d/megatron.sh does it)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${HQ_MEGATRON_VENV:-$ROOT/.venv-megatron}
MEGATRON_VERSION=${MEGATRON_VERSION:-0.19.2}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
MAMBA_VERSION=${MAMBA_VERSION:-2.3.2.post1}
CONV_VERSION=${CONV_VERSION:-1.7.0}
FETCH=0
for a in "$@"; do
  case "$a" in
    --fetch-wheels) FETCH=1 ;;
    -h|--help) sed -n 2,14p "$0"; exit 0 ;;
    *) echo "install-megatron.sh: unknown argument $a" >&2; exit 2 ;;
  esac
done
t0=$SECONDS

find_python312() {
  local c
  for c in "${PYTHON312:-}" python3.12 "$(command -v pyenv >/dev/null 2>&1 && pyenv root)"/versions/3.12*/bin/python \
           "$HOME"/.pyenv/versions/3.12*/bin/python /usr/bin/python3.12; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; assert sys.version_info[:2] >= (3, 12)' \
      2>/dev/null && { command -v "$c"; return 0; }
  done
  return 1
}

SD="$ROOT/.whl-src"            # sdists + built Triton-only wheels (ignored, reused)
mkdir -p "$SD"
vendor_wheels() {               # the two Triton-only wheels, built once from the sdists
  if ! ls "$SD"/mamba_ssm-"$MAMBA_VERSION"-py3-none-any.whl "$SD"/causal_conv1d-"$CONV_VERSION"-py3-none-any.whl \
       >/dev/null 2>&1; then
    [ -f "$SD/mamba_ssm-$MAMBA_VERSION.tar.gz" ] && [ -f "$SD/causal_conv1d-$CONV_VERSION.tar.gz" ] || \
      MAMBA_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE "$1" -m pip download -q --no-deps \
        --no-binary :all: --no-build-isolation -d "$SD" "mamba-ssm==$MAMBA_VERSION" "causal-conv1d==$CONV_VERSION"
    # before hybridqual is installed in the venv: tools/ imported as hybridqual through the link folder
    mkdir -p "$ROOT/.hq-import"; [ -e "$ROOT/.hq-import/hybridqual" ] || ln -s ../tools "$ROOT/.hq-import/hybridqual"
    (cd "$SD" && PYTHONPATH="$ROOT/.hq-import:$ROOT" "$1" -m hybridqual.adapters.megatron.vendor "$SD" "$SD" >/dev/null)
  fi
}

PY312=$(find_python312) || { echo "install-megatron.sh: megatron-core >= 0.17 needs Python >= 3.12; none found on PATH" \
  "or under pyenv (set PYTHON312=/path/to/python3.12)" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || "$PY312" -m venv "$VENV"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)
have() { "$PY" - "$@" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if all(version(n) == v for n, v in (a.split("==") for a in sys.argv[1:])) else 1)
EOF
}
have "torch==$TORCH_VERSION" || "${PIP[@]}" "torch==$TORCH_VERSION"
have "megatron-core==$MEGATRON_VERSION" || "${PIP[@]}" "megatron-core==$MEGATRON_VERSION"
"$PY" -c 'import einops, pytest, hypothesis, safetensors' 2>/dev/null || "${PIP[@]}" einops pytest hypothesis safetensors
vendor_wheels "$PY"
have "mamba-ssm==$MAMBA_VERSION" "causal-conv1d==$CONV_VERSION" || \
  "${PIP[@]}" --no-deps --force-reinstall "$SD/mamba_ssm-$MAMBA_VERSION-py3-none-any.whl" \
    "$SD/causal_conv1d-$CONV_VERSION-py3-none-any.whl"
"$PY" -c 'import hybridqual' 2>/dev/null || "${PIP[@]}" --no-deps -e "$ROOT"
TRITON_INTERPRET=1 "$PY" -c 'import hybridqual.adapters.megatron as m; m.check_install()'
echo "install-megatron.sh: $VENV ready in $((SECONDS - t0)) s (python $("$PY" -c 'import platform; print(platform.python_version())'))"

if [ "$FETCH" = 1 ]; then      # what the GPU image lacks, for `pip install --no-index --no-deps --target /tmp/site`
  mkdir -p "$ROOT/.whl"
  ls "$ROOT"/.whl/megatron_core-"$MEGATRON_VERSION"-cp312-*.whl >/dev/null 2>&1 || \
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      -d "$ROOT/.whl" "megatron-core==$MEGATRON_VERSION"
  cp -f "$SD/mamba_ssm-$MAMBA_VERSION-py3-none-any.whl" "$SD/causal_conv1d-$CONV_VERSION-py3-none-any.whl" "$ROOT/.whl/"
  ls -la "$ROOT/.whl"
fi
