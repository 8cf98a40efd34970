#!/usr/bin/env bash
# Installs hybridqual and its test deps on a fresh CPU machine (torch CPU build first, so pip never pulls CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch" 2>/dev/null; then $PY -m pip install -q torch==2.13.0; fi
$PY -m pip install -q -e ".[test]"
