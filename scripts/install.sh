#!/usr/bin/env bash
# Installs hybridqual and its test deps, torch first so that pip never picks torch for us.
#
# torch: when the interpreter already has torch, it is kept (a CUDA build, a vendor's build: yours). Otherwise
# HQ_TORCH is installed (default torch==2.13.0). Whether pip gets a CPU or a CUDA build of it depends on where pip
# looks: on the project's CI machines that version resolves to a CPU build; on an ordinary machine PyPI's default
# Linux wheel is the multi-GB CUDA build, so for a CPU build name a CPU wheel index in HQ_TORCH_INDEX (it is
# passed to pip as --index-url for torch alone), or install the torch you want before running this.
#   HQ_TORCH="torch==2.11.0" HQ_TORCH_INDEX=<a CPU wheel index URL> ./scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if $PY -c "import torch" 2>/dev/null; then
  echo "install.sh: keeping the installed torch $($PY -c 'import torch; print(torch.__version__)')"
else
  TORCH=${HQ_TORCH:-torch==2.13.0}
  echo "install.sh: installing $TORCH${HQ_TORCH_INDEX:+ from $HQ_TORCH_INDEX} (HQ_TORCH / HQ_TORCH_INDEX choose)"
  $PY -m pip install -q ${HQ_TORCH_INDEX:+--index-url "$HQ_TORCH_INDEX"} "$TORCH"
fi
$PY -m pip install -q -e ".[test]"
