#!/usr/bin/env bash
# One whole GPU run in one command: environment record, the `gpu` test tier, the kernel benchmarks,
# logs under $OUT, and a short summary table printed last. Installs nothing from the network: the project
# runs from the checkout through PYTHONPATH, `hybridqual` being tools/ through a link in .hq-import/ (mamba_ssm's
# Triton ops come from .peer/ when carried).
#
#   bash tools/bench/gpu_run.sh                                          # on the GPU machine (.peer/ in the root: the peer)
#   STEPS="gpu_tests" bash tools/bench/gpu_run.sh                        # a subset of the steps
#
# Extending it (other parts): add `step_<name>() { ...; }` below and append <name> to DEFAULT_STEPS, or drop
# an executable tools/bench/gpu_run.d/<name>.sh (it runs after the built-in steps). A step's output goes to
# $OUT/<name>.log; if it writes $OUT/<name>.summary, that text is printed in the final summary.
# The device returns at most 8 files from $OUT: keep to a .log (+ optional .summary/.json) per step.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out/gpu_run}
mkdir -p "$OUT"
mkdir -p "$ROOT/.hq-import"; [ -e "$ROOT/.hq-import/hybridqual" ] || ln -s ../tools "$ROOT/.hq-import/hybridqual"
export PYTHONPATH="$ROOT/.hq-import:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
[ -d "$ROOT/.peer" ] && export PYTHONPATH="$PYTHONPATH:$ROOT/.peer"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
unset TRITON_INTERPRET
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
DEFAULT_STEPS="gpu_tests bench_kernels"
DEFAULT_STEPS="$DEFAULT_STEPS bench_engine"; step_bench_engine() { timeout "${BENCH_ENGINE_TIMEOUT:-300}" $PY -m hybridqual.bench.engine ${BENCH_ENGINE_ARGS:-} --out "$OUT/bench_engine.json" --summary "$OUT/bench_engine.summary"; }
# Optional (name it in STEPS): the projection launch-rule sweep in CUDA graphs + batch-invariance cost.
step_bench_gemm() { timeout "${BENCH_GEMM_TIMEOUT:-300}" $PY -m hybridqual.bench.gemm ${BENCH_GEMM_ARGS:-} --out "$OUT/bench_gemm.json"; }
# Optional: one bs1 decode step as a CUDA graph with flag / rule / skip-a-kernel variants (where a step goes).
step_bench_ablation() { timeout "${BENCH_ABLATION_TIMEOUT:-300}" $PY -m hybridqual.bench.ablation ${BENCH_ABLATION_ARGS:-}; }
# Optional: the README's main job as a GPU user runs it (compiled kernels, bf16, CUDA graphs, every configuration).
step_qualify_gpu() {
  timeout "${QUALIFY_GPU_TIMEOUT:-300}" $PY -m hybridqual.qualify --device cuda --graphs --out "$OUT/qualify_gpu" --quiet
  local rc=$?
  grep -E "checks passed|FAIL" "$OUT/qualify_gpu.log" | head -12 > "$OUT/qualify_gpu.summary"
  return $rc
}
# Optional: where a bs1 decode step and a speculative step at 0% acceptance (k = 2) go, by kernel group, beside the
# bytes each group must move (tools/bench/account.py); BENCH_ACCOUNT_ARGS="--flip gemv_rows": the few-row GEMV's A/B.
step_bench_account() { timeout "${BENCH_ACCOUNT_TIMEOUT:-240}" $PY -m hybridqual.bench.account ${BENCH_ACCOUNT_ARGS:-} --out "$OUT/bench_account.json" --summary "$OUT/bench_account.summary"; }
# Optional: the GPU tests of the speculative verify path and the kernels it runs, then its account with the few-row
# GEMV flipped (the checks and the A/B of the verify-step changes in one short call).
step_verify_path() {
  timeout "${VERIFY_TESTS_TIMEOUT:-150}" $PY -m pytest -m gpu -n "${GPU_TESTS_WORKERS:-8}" -q -rfE -p no:cacheprovider \
    tests/test_kernel_gemv_rows.py tests/test_kernel_step_snapshots.py tests/test_kernel_ssm_step.py \
    tests/test_kernel_conv1d.py tests/test_speculative_verify.py tests/test_spec_device.py tests/test_engine_graphs.py \
    tests/test_draft_catch_up.py tests/test_speculative_engine.py > "$OUT/verify_tests.txt" 2>&1
  local rc=$?
  grep -E "passed|failed|error" "$OUT/verify_tests.txt" | tail -1; grep -E "^FAILED|^ERROR" "$OUT/verify_tests.txt" | head
  timeout "${BENCH_ACCOUNT_TIMEOUT:-240}" $PY -m hybridqual.bench.account --verify-k 2 --flip gemv_rows \
    --out "$OUT/verify_account.json" --summary "$OUT/verify_path.summary" || rc=1
  return $rc
}
# Optional: the A/B of changes compiled and tested on CPU (docs/journal/performance.md): their gpu
# tests, then the few-row GEMV per projection and in the verify step (account A/B), the one-row GEMV's XB load and
# the decode attention at 8 warps in bs1 decode. The summary is written as it goes, so a call cut at its limit
# still returns what ran.
step_candidates() {
  local rc=0 t
  t=$(mktemp -d)            # the device returns few files: only candidates.{log,summary} go to $OUT
  timeout "${CAND_TESTS_TIMEOUT:-150}" $PY -m pytest -m gpu -n "${GPU_TESTS_WORKERS:-8}" -q -rfE -p no:cacheprovider \
    tests/test_kernel_gemv.py tests/test_kernel_gemv_rows.py tests/test_speculative_engine.py \
    > "$t/candidates_tests.txt" 2>&1 || rc=1
  { grep -E "passed|failed|error" "$t/candidates_tests.txt" | tail -1; grep -E "^FAILED|^ERROR" "$t/candidates_tests.txt" | head -5; } > "$OUT/candidates.summary"
  timeout 120 $PY -m hybridqual.bench.sass > "$t/candidates_sass.txt" 2>&1 || rc=1     # this image's compiler
  grep -vi warn "$t/candidates_sass.txt" >> "$OUT/candidates.summary"
  timeout 120 $PY -m hybridqual.bench.kernels --only proj --summary "$t/candidates_proj.txt" > /dev/null 2>&1 || rc=1
  grep -E "proj|copy" "$t/candidates_proj.txt" >> "$OUT/candidates.summary"
  timeout 150 $PY -m hybridqual.bench.ablation --variants "code as it is" "attention: 8 warps (no spill at sm_90)" \
    "K>=4096 GEMV: x in the weight layout (XB)" "every GEMV: x in the weight layout (XB)" 2>&1 \
    | grep -E "µs/step|roofline" >> "$OUT/candidates.summary" || rc=1
  timeout 150 $PY -m hybridqual.bench.account --verify-k 2 --flip gemv_rows --summary "$t/candidates_account.txt" \
    > /dev/null 2>&1 || rc=1
  tail -n 12 "$t/candidates_account.txt" >> "$OUT/candidates.summary" 2>/dev/null
  return $rc
}
# Optional: the gpu tests of the GEMVs, the SSD prefill and the speculative engine.
step_recheck() {
  local rc=0
  timeout "${RECHECK_TESTS_TIMEOUT:-200}" $PY -m pytest -m gpu -n "${GPU_TESTS_WORKERS:-8}" -q -rfE -p no:cacheprovider \
    tests/test_kernel_gemv.py tests/test_kernel_gemv_rows.py tests/test_kernel_ssd.py \
    tests/test_speculative_engine.py > "$OUT/recheck_tests.txt" 2>&1 || rc=1
  { grep -E "passed|failed|error" "$OUT/recheck_tests.txt" | tail -1; grep -E "^FAILED|^ERROR" "$OUT/recheck_tests.txt"; } \
    > "$OUT/recheck.summary"
  return $rc
}
# Optional: the fast path's bf16 logit error against the fp64 oracle on the corpus (the basis of τ and c for bf16).
step_measure_tau() {
  timeout "${MEASURE_TAU_TIMEOUT:-240}" $PY -m hybridqual.measure_tau --dtype bfloat16 --device cuda ${MEASURE_TAU_ARGS:-}
  local rc=$?
  tail -n 12 "$OUT/measure_tau.log" > "$OUT/measure_tau.summary"
  return $rc
}
# Optional: prefix-cache TTFT (32k shared prefix, hit vs cold) and speculative bs1 (k sweep), anchor-3b.
step_bench_prefix() { timeout "${BENCH_PREFIX_TIMEOUT:-240}" $PY -m hybridqual.bench.engine --prefix-cache --out "$OUT/bench_prefix.json" --summary "$OUT/bench_prefix.summary"; }
step_bench_spec() { timeout "${BENCH_SPEC_TIMEOUT:-300}" $PY -m hybridqual.bench.engine --spec --spec-k "${SPEC_K:-1,2,4,8}" --spec-rows "${SPEC_ROWS:-ngram,upper_bound,draft,draft_right,draft_backoff,self_draft,last_wrong}" --out "$OUT/bench_spec.json" --summary "$OUT/bench_spec.summary"; }
# Optional: batch-invariant mode at size (anchor-3b, bf16, graphs): speculative == not, prefix cache on == off, bitwise; its cost.
step_bench_invariant() { timeout "${BENCH_INVARIANT_TIMEOUT:-300}" $PY -m hybridqual.bench.invariant ${BENCH_INVARIANT_ARGS:-} --out "$OUT/bench_invariant.json" --summary "$OUT/bench_invariant.summary"; }
# Optional: the fast path on CPU (Triton interpreter of this image's triton) on a GPU machine, with a traceback.
step_interp_cpu() {
  TRITON_INTERPRET=1 timeout "${INTERP_TIMEOUT:-120}" $PY -c "
import traceback, oracle
from fastpath.engine.engine import Engine
t = oracle.load_trace('goldens/traces/seed_compaction.json')
try:
    e = Engine.from_pretrained('goldens/models/tiny-sort', t.engine, device='cpu')
    print(e.run_trace(t, 'legacy').tokens)
except Exception:
    traceback.print_exc(); raise SystemExit(1)
"
}
# Optional: anchor-3b as a real HF folder (bf16, chunk 256), the corpus instantiated for it; the
# truth (fp64 oracle on the GPU, every scenario) and the qualification (fast path bf16 + graphs) as two processes,
# each with its wall time, peak host RSS and peak GPU memory (tools/bench/peak.py).
step_anchor() {
  local dir=${ANCHOR_DIR:-/tmp/anchor-3b} t0=$SECONDS
  [ -e "$dir/config.json" ] || timeout 300 $PY -m hybridqual.anchor write "$dir" || return 1
  echo "anchor write: $((SECONDS - t0)) s"
  # goldens carried in (goldens/outputs/<name>/ from an earlier run's anchor_goldens.tgz) are reused when they hold
  if [ -z "${ANCHOR_REUSE_GOLDENS:-}" ] || [ ! -d "goldens/outputs/$(basename "$dir")" ]; then
    $PY -m hybridqual.bench.peak oracle -- timeout "${ANCHOR_ORACLE_TIMEOUT:-300}" $PY -m hybridqual.goldens regen --model "$dir" --oracle-device cuda
    tar czf "$OUT/anchor_goldens.tgz" -C goldens/outputs "$(basename "$dir")"
  fi
  $PY -m hybridqual.bench.peak qualify -- timeout "${ANCHOR_QUALIFY_TIMEOUT:-300}" $PY -m hybridqual.qualify --model "$dir" --device cuda --graphs \
    --oracle-device cuda --out "$OUT/anchor_qualify" --quiet ${ANCHOR_QUALIFY_ARGS:-}
  local rc=$?
  grep -E "^peak|checks passed" "$OUT/anchor.log" > "$OUT/anchor.summary"
  return $rc
}
# Optional: where a real-size qualification goes (tools/bench/qualify.py): anchor-3b's whole corpus, fast path bf16 +
# graphs, the fp64 oracle on the GPU, the truth computed now; truth and judging split into fp64 weight passes,
# compute, host work and idle beside the bytes floor of the same run (fp64 weights x passes / device copy bandwidth),
# the engine's time, peak host and GPU memory. Cut at its limit, qualify finalises its report and the figures so far
# are written (status "aborted"). Its qualify report stays off $OUT (the device returns few files).
step_bench_qualify() {
  local dir=${ANCHOR_DIR:-/tmp/anchor-3b} t0=$SECONDS
  [ -e "$dir/config.json" ] || timeout 300 $PY -m hybridqual.anchor write "$dir" || return 1
  echo "anchor write: $((SECONDS - t0)) s"
  timeout "${BENCH_QUALIFY_TIMEOUT:-480}" $PY -m hybridqual.bench.qualify --model "$dir" --device cuda --graphs \
    --qualify-out "${TMPDIR:-/tmp}/bench_qualify" --out "$OUT/bench_qualify.json" --summary "$OUT/bench_qualify.summary" \
    ${BENCH_QUALIFY_ARGS:-}
}
# Optional: the fp64 truth of anchor-3b's corpus (goldens regen on the GPU) timed at this tree and, in the same call,
# at a baseline tree carried as .baseline/ (`git archive REV oracle tools fastpath`; its goldens go under .baseline/):
# each run cut at TRUTH_TIMEOUT seconds, its per-golden lines kept, so the two compare golden by golden.
step_truth_at_size() {
  local dir=${ANCHOR_DIR:-/tmp/anchor-3b} t0=$SECONDS s="$OUT/truth_at_size.summary"
  [ -e "$dir/config.json" ] || timeout 300 $PY -m hybridqual.anchor write "$dir" || return 1
  echo "anchor write: $((SECONDS - t0)) s" | tee "$s"
  t0=$SECONDS
  $PY -m hybridqual.bench.peak truth -- timeout "${TRUTH_TIMEOUT:-200}" $PY -m hybridqual.goldens regen --model "$dir" \
    --oracle-device cuda --force > "$OUT/truth_new.txt" 2>&1
  echo "this tree: $((SECONDS - t0)) s, $(grep -c '^  write\|^  ok' "$OUT/truth_new.txt") goldens" | tee -a "$s"
  grep -E "^peak" "$OUT/truth_new.txt" >> "$s"
  if [ -d .baseline ]; then
    t0=$SECONDS
    PYTHONPATH="$ROOT/.baseline/.hq-import:$ROOT/.baseline" timeout "${TRUTH_TIMEOUT:-200}" $PY -m hybridqual.goldens \
      regen --model "$dir" --oracle-device cuda --force > "$OUT/truth_baseline.txt" 2>&1
    echo "baseline: $((SECONDS - t0)) s, $(grep -c '^  write\|^  ok' "$OUT/truth_baseline.txt") goldens" | tee -a "$s"
  fi
}
# The speed figures of docs/performance.md's targets in one run, each beside its peer or roofline of the same run:
# SSD prefill beside mamba_ssm, prefill attention beside SDPA, bs1 decode beside the copy roofline, speculation at
# k = 2 (upper bound, drafts forced right, 0% acceptance with backoff 64), prefix hits, the 131k prefill, batch
# invariance at size.
step_speed() {
  local rc=0 tmp s="$OUT/speed.summary"
  tmp=$(mktemp -d)
  : > "$s"
  timeout 120 $PY -m hybridqual.bench.kernels --only ssd --quick --summary "$tmp/ssd.txt" > /dev/null 2>&1 || rc=1
  cat "$tmp/ssd.txt" >> "$s" 2>/dev/null
  timeout 120 $PY -m hybridqual.bench.attention --only rule 2>&1 | grep -E "^(device|L8192|131k)" >> "$s" || rc=1
  timeout 180 $PY -m hybridqual.bench.engine --bs1-only --summary "$tmp/bs1.txt" > /dev/null 2>&1 || rc=1
  grep -E "^anchor-3b|^bs1 async +graphs=on" "$tmp/bs1.txt" >> "$s" 2>/dev/null
  timeout 240 $PY -m hybridqual.bench.engine --spec --spec-k 2 --spec-rows upper_bound,draft_right,draft_backoff \
    --spec-backoff 64 --summary "$tmp/spec.txt" > /dev/null 2>&1 || rc=1
  cat "$tmp/spec.txt" >> "$s" 2>/dev/null
  step_bench_prefix > /dev/null 2>&1 || rc=1
  grep -E "^prefix cache: 100|^bucketed" "$OUT/bench_prefix.summary" >> "$s" 2>/dev/null
  timeout 120 $PY -m hybridqual.bench.engine --long-only 2>&1 | grep "^long prefill 131072" | tail -n 1 >> "$s" || rc=1
  timeout 240 $PY -m hybridqual.bench.invariant --summary "$tmp/invariant.txt" > /dev/null 2>&1 || rc=1
  cat "$tmp/invariant.txt" >> "$s" 2>/dev/null
  rm -rf "$tmp"
  return $rc
}
STEPS=${STEPS:-$DEFAULT_STEPS}
declare -a SUMMARY=()

step_gpu_tests() {   # the gpu tier of the whole suite (kernels, engine, ...)
  timeout "${GPU_TESTS_TIMEOUT:-330}" $PY -m pytest -m gpu -n "${GPU_TESTS_WORKERS:-0}" -q -rfE -p no:cacheprovider --continue-on-collection-errors ${GPU_TESTS_PATHS:-tests/}
  local rc=$?
  grep -E "passed|failed|error|no tests ran" "$OUT/gpu_tests.log" | tail -1 > "$OUT/gpu_tests.summary"
  return $rc
}

step_bench_kernels() {   # per-kernel time, TB/s, TFLOP/s, floors, mamba_ssm peer
  timeout "${BENCH_TIMEOUT:-240}" $PY -m hybridqual.bench.kernels ${BENCH_ARGS:-} --out "$OUT/bench_kernels.json" \
    --summary "$OUT/bench_kernels.summary"
}

# Optional: the gpu tier twice in a row (an order dependence or state left by one run shows in the second).
step_gpu_tests_twice() {
  local rc=0 i
  for i in 1 2; do
    timeout "${GPU_TESTS_TIMEOUT:-330}" $PY -m pytest -m gpu -n "${GPU_TESTS_WORKERS:-4}" -q -rfE -p no:cacheprovider \
      ${GPU_TESTS_PATHS:-tests/} > "$OUT/gpu_tests_$i.txt" 2>&1 || rc=1
    echo "run $i: $(grep -E "passed|failed|error|no tests ran" "$OUT/gpu_tests_$i.txt" | tail -1)"
  done | tee "$OUT/gpu_tests_twice.summary"
  grep -h "^FAILED\|^ERROR" "$OUT"/gpu_tests_[12].txt | head -20
  return $rc
}
# Optional: blind verdicts of qualify's main job alone over the CPU zoo, in the Triton interpreter on this machine's
# cores (BLIND_ARGS: e.g. --only NAME ...; verdicts copied to $OUT/blind.json as they come). BLIND_STAGES=qualify-main-gpu
# judges by the main job on this GPU (compiled kernels, CUDA graphs) instead; BLIND_CONTROL=1 also judges the
# unmutated tree.
step_blind_qualify() {
  ( while sleep 15; do cp -f out/mutants/blind.json "$OUT/blind.json" 2>/dev/null; done ) & local copier=$!
  local control=--no-control; [ "${BLIND_CONTROL:-0}" = 1 ] && control=
  TRITON_INTERPRET=1 $PY -m hybridqual.mutants --blind --stages ${BLIND_STAGES:-qualify-main} $control \
    --jobs "${BLIND_JOBS:-7}" --stage-timeout "${BLIND_STAGE_TIMEOUT:-400}" --start-by "${BLIND_START_BY:-300}" \
    ${BLIND_ARGS:-}
  local rc=$?
  kill $copier 2>/dev/null; cp -f out/mutants/blind.json "$OUT/blind.json" 2>/dev/null
  tail -n 4 "$OUT/blind_qualify.log" > "$OUT/blind_qualify.summary"
  return $rc
}

run_step() {
  local name=$1; shift
  local t0=$SECONDS
  echo "=== $name ($(date -u +%H:%M:%S))"
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 5 "$OUT/$name.log"
  SUMMARY+=("$(printf '%-16s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
}

{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1
  $PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
  $PY -c "import transformers; print('transformers', transformers.__version__)" 2>&1 | tail -1
  git -C "$ROOT" log --oneline -1 2>/dev/null || true
} > "$OUT/env.log" 2>&1

for s in $STEPS; do run_step "$s" "step_$s"; done
if [ -d tools/bench/gpu_run.d ]; then
  for f in tools/bench/gpu_run.d/*.sh; do [ -e "$f" ] && run_step "$(basename "$f" .sh)" bash "$f"; done
fi

echo
echo "================ gpu_run summary ================"
head -n 3 "$OUT/env.log"
for line in "${SUMMARY[@]}"; do echo "$line"; done
for f in "$OUT"/*.summary; do [ -e "$f" ] && { echo "--- $(basename "$f" .summary)"; cat "$f"; }; done
