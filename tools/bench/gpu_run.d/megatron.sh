#!/usr/bin/env bash
# Qualify Megatron-Core's dynamic inference engine on the GPU (docs/megatron.md). Off unless .whl/ holds the
# megatron wheels (`bash scripts/install-megatron.sh --fetch-wheels` on a machine with network, then copy .whl/ along):
#   bash tools/bench/gpu_run.sh                                          # picked up after the built-in steps
#   STEPS= bash tools/bench/gpu_run.sh                                  # this step only
# Installs the three wheels into /tmp/site (no network), then: qualify --engine megatron-rounded --device cuda over
# every scenario of each model Megatron can run (zoo-bamba, tiny-sort), megatron-prefix on the three prefix traces,
# megatron-graphs and megatron-mtp on two scenarios each, the gpu-marked Megatron test (CUDA graphs), and the
# faithful adapter on finding F1's trace.
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-out/gpu_run}
mkdir -p "$OUT"
shopt -s nullglob
wheels=(.whl/megatron_core-*.whl .whl/mamba_ssm-*.whl .whl/causal_conv1d-*.whl)
if [ "${#wheels[@]}" -lt 3 ]; then
  echo "megatron: .whl/ has no megatron_core / mamba_ssm / causal_conv1d wheels; skipped (scripts/install-megatron.sh --fetch-wheels)"
  exit 0
fi
PY=${PYTHON:-python3}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}" || exit 1
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
$PY -c 'import hybridqual.adapters.megatron as m; m.check_install()' || exit 1
rc=0
: > "$OUT/megatron.summary"
for model in ${MEGATRON_MODELS:-zoo-bamba tiny-sort}; do
  t0=$SECONDS
  timeout "${MEGATRON_QUALIFY_TIMEOUT:-240}" $PY -m hybridqual.qualify --engine megatron-rounded --device cuda \
    --model "goldens/models/$model" --out "$OUT/megatron-$model" --quiet ${MEGATRON_QUALIFY_ARGS:-} || rc=1
  echo "megatron-rounded $model cuda: qualify took $((SECONDS - t0)) s" >> "$OUT/megatron.summary"
done
timeout 180 $PY -m hybridqual.qualify --engine megatron-prefix --device cuda --model goldens/models/zoo-bamba \
  --trace goldens/traces/prefix_shared_system.json goldens/traces/prefix_multi_turn.json \
  goldens/traces/prefix_eviction.json --out "$OUT/megatron-prefix" --quiet || rc=1
# Megatron's CUDA graphs (decode steps) and MTP speculation: two scenarios each; the graphs pytest (marker gpu)
timeout 240 $PY -m hybridqual.qualify --engine megatron-graphs --device cuda --model goldens/models/zoo-bamba \
  --scenario seed_compaction stop_tokens --out "$OUT/megatron-graphs" --quiet || rc=1
timeout 240 $PY -m hybridqual.qualify --engine megatron-mtp --device cuda --model goldens/models/zoo-bamba \
  --scenario seed_compaction chunked_prefill --out "$OUT/megatron-mtp" --quiet || rc=1
timeout 300 $PY -m pytest -p no:xdist -q -m "megatron and gpu" tests/test_megatron_engine.py \
  > "$OUT/megatron-gpu-pytest.log" 2>&1 || rc=1
tail -3 "$OUT/megatron-gpu-pytest.log" | sed 's/^/megatron gpu pytest: /' >> "$OUT/megatron.summary"
timeout 120 $PY -m hybridqual.qualify --engine megatron --device cuda --model goldens/models/zoo-bamba --mode legacy \
  --trace goldens/traces/megatron_token_budget.json --out "$OUT/megatron-f1" --quiet
echo "F1 (faithful budget 16, expect 'engine runs the trace' FAIL on 0.19.2): exit $?" >> "$OUT/megatron.summary"
$PY - "$OUT" <<'PY' >> "$OUT/megatron.summary"
import json, sys, pathlib
for rep in sorted(pathlib.Path(sys.argv[1]).glob("megatron-*/report.json")):
    r = json.loads(rep.read_text())
    fails = [f"{c['trace']}: {c['name']}: {c['detail'][:160]}" for c in r["checks"] if c["status"] == "FAIL"]
    print(f"{rep.parent.name}: {r['passed']} pass {r['failed']} fail {r['skipped']} skip in {r['seconds']:.0f} s")
    for f in fails[:8]:
        print("   FAIL", f)
PY
exit $rc
