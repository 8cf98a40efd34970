#!/usr/bin/env bash
# Builds .peer/: mamba_ssm's Triton SSD ops at a pinned commit, the peer the GPU benchmarks time beside ours
# (docs/performance.md). Only the files the benches import, with empty __init__.py files; never committed.
#   bash scripts/peer.sh                    # clones state-spaces/mamba (network)
#   bash scripts/peer.sh /path/to/mamba.git # or reads an existing clone or bare mirror (no network)
# Then carry .peer to the GPU machine (the device's run(carry=[".peer"])).
set -euo pipefail
cd "$(dirname "$0")/.."
REV=e9594ce
SRC=${1:-}
if [ -z "$SRC" ]; then
  SRC=$(mktemp -d)/mamba
  git clone -q --filter=blob:none --no-checkout https://github.com/state-spaces/mamba "$SRC"
fi
git -C "$SRC" cat-file -e "$REV^{commit}" 2>/dev/null || { echo "peer.sh: $SRC lacks commit $REV" >&2; exit 2; }
rm -rf .peer
mkdir -p .peer/mamba_ssm/ops/triton .peer/mamba_ssm/utils
for f in ssd_combined ssd_chunk_scan ssd_chunk_state ssd_state_passing ssd_bmm selective_state_update softplus \
         layernorm_gated k_activations; do
  git -C "$SRC" show "$REV:mamba_ssm/ops/triton/$f.py" > ".peer/mamba_ssm/ops/triton/$f.py"
done
for f in determinism torch; do
  git -C "$SRC" show "$REV:mamba_ssm/utils/$f.py" > ".peer/mamba_ssm/utils/$f.py"
done
touch .peer/mamba_ssm/__init__.py .peer/mamba_ssm/ops/__init__.py .peer/mamba_ssm/ops/triton/__init__.py \
      .peer/mamba_ssm/utils/__init__.py
echo "peer: .peer/mamba_ssm at state-spaces/mamba $REV ($(find .peer -name '*.py' | wc -l) files)"
