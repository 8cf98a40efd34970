#!/usr/bin/env bash
# The fused SSD prefill on the lent GPU, in one call: its gpu tests and the staged path's, then the bench
# (tools/bench/ssd_fused.py: staged / fused / mamba_ssm / byte floor, table printed last).
#   run(command='bash scripts/gpu-ssd-fused.sh', carry=[".peer"])   (.peer: mamba_ssm's Triton files, see
#   tools/bench/ssd_fused.py; without it the bench has no peer column)
# Env: SSD_TESTS=0 skips the tests; SSD_TEST_PATHS replaces the test files; SSD_BENCH=variants runs the variant
# sweep (tools/bench/ssd_variants.py: multi-head scans, register caps, chunk-state tiles) instead of
# tools/bench/ssd_fused.py; SSD_BENCH_ARGS are passed to the bench; logs and JSON go to $OUT (or out/).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"
mkdir -p "$OUT"
export PYTHONPATH=".:.peer${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /'
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader || true
rc=0
if [ "${SSD_TESTS:-1}" != 0 ]; then
  timeout "${SSD_TESTS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider --noconftest -m gpu \
    ${SSD_TEST_PATHS:-tests/test_kernel_ssd.py tests/test_kernel_ssd_fused.py tests/test_kernel_ssd_scan_mh.py} 2>&1 | tee "$OUT/ssd_gpu_tests.log" | tail -15
  rc=${PIPESTATUS[0]}
  echo "gpu tests rc=$rc"
fi
bench="${SSD_BENCH:-fused}"
timeout "${SSD_BENCH_TIMEOUT:-330}" python3 "tools/bench/ssd_$bench.py" --out "$OUT/ssd_$bench.json" ${SSD_BENCH_ARGS:-} \
  2>&1 | tee "$OUT/ssd_${bench}_bench.log" | grep -v '^{'
brc=${PIPESTATUS[0]}
echo "tests rc=$rc bench rc=$brc"
exit $(( rc != 0 ? rc : brc ))
