#!/usr/bin/env bash
# The README's main job: install, then qualify the fast path on the shipped tiny model (CPU, Triton interpreter, fp32).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install.sh
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
exec python3 -m hybridqual.qualify "$@"
