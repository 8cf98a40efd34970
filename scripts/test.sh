#!/usr/bin/env bash
# The README's test command: install, then run the CPU tier (kernels in the Triton interpreter, fp32), check the
# shipped goldens against the oracle, and test the installed product (wheel → fresh venv outside the checkout →
# `hybridqual qualify` and a plain `pytest` with the plugin; tests/test_packaging_wheel.py).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install.sh
export TRITON_INTERPRET=1
set +e
python3 -m pytest -n 2 -q "$@"
rc=$?
set -e
if [ $rc -eq 0 ]; then
  # Every shipped golden must still be exactly what the oracle produces (DESIGN §6).
  python3 -m tools.goldens regen --check || rc=$?
fi
if [ $rc -eq 0 ]; then
  python3 -m pytest -p no:xdist -q -m wheel tests/test_packaging_wheel.py || rc=$?
fi
# pytest exits 5 when it collected no tests: that is a failure for us (a suite that runs nothing proves nothing).
exit $rc
