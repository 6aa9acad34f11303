#!/usr/bin/env bash
# One-shot GPU session on the H200 machine (issue 27): conclusive in one try, whatever stops it.
#
# Run from the checkout root through the device tool, with carry [".gpu"] and timeout_s 540:
#   bash benchmarks/gpu_session.sh
# Prepare .gpu/ on the CPU machine first (about 50 MiB; .gpu/ is ignored by git):
#   mkdir -p .gpu && cp ../shared/device-wheels/*.whl ../shared/gpu/arch_model.py .gpu/ \
#     && cp -r ../shared/gpu/minilm-assets .gpu/
#   python benchmarks/gpu_prepare.py   # real MiniLM weights in fp16 + CPU fp32 reference embeddings
# CPU dry run (tiny models and sizes, same stages and files, timeouts scaled by 0.5; part of the tests):
#   SURGE_GPU_TRY=1 OUT=/tmp/gpu-try bash benchmarks/gpu_session.sh
#
# What comes back ($OUT, at most 4 files): results.jsonl (one JSON line per stage result, partial
# results as they come; every stage's final line says which loader loaded its model, `loaded_by`;
# the cosine line's headline is fp16's, bf16's beside it), session.log (everything printed), details.tar.gz (per-SuperBatch records,
# pytest's junit report, the NVML trace, nvidia-smi -q). Each stage runs in a forked child under its
# own timeout (benchmarks/gpu_stages.py); a stage that times out is killed with the workers it started
# and the next one runs. A failed preflight stops the session with one line.
set -uo pipefail
OUT=${OUT:-/tmp/surge-gpu-out}
mkdir -p "$OUT"
RESULTS="$OUT/results.jsonl"
LOG="$OUT/session.log"
WORK=$(mktemp -d /tmp/surge-gpu-work.XXXXXX)
TRY=${SURGE_GPU_TRY:-}
# stage:timeout_s, in order; with SETUP_TIMEOUT the sum must stay under 480 s (the test checks it).
# What matters most runs first, so a session cut short still answers it: end to end through Dask
# (MiniLM, then BERT-base), then the GPU-busy fraction; each with room left in its timeout.
SETUP_TIMEOUT=45
STAGES="preflight:15,data:30,surge_minilm:85,surge_bert:65,busy:30,host:45,engine:45,cosine:20,pytest:50"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTORCH_NVML_BASED_CUDA_CHECK=1

line() {  # one JSON line from the shell itself: line STAGE STATUS [key=number ...]
  local stage=$1 status=$2; shift 2
  local extra=""
  for kv in "$@"; do extra="$extra, \"${kv%%=*}\": ${kv#*=}"; done
  echo "{\"stage\": \"$stage\", \"status\": \"$status\", \"t\": $(date +%s)$extra}" >> "$RESULTS"
}
finish() {
  [ -n "${TRACE_PID:-}" ] && kill "$TRACE_PID" 2> /dev/null
  cp "$LOG" "$WORK/detail/session.log.copy" 2> /dev/null
  tar -czf "$OUT/details.tar.gz" -C "$WORK" detail 2> /dev/null
  echo "== files in \$OUT:" >> "$LOG"; ls -la "$OUT" >> "$LOG"
  tail -c 3000 "$LOG"
  rm -rf "$WORK"
}
trap finish EXIT
mkdir -p "$WORK/detail"
: > "$RESULTS"
{ date -u; echo "nproc $(nproc)"; git rev-parse HEAD 2> /dev/null; git status --short 2> /dev/null | head -20; } > "$LOG" 2>&1
REV=$(git rev-parse --short HEAD 2> /dev/null || echo unknown)
line session start command="\"SURGE_GPU_TRY=$TRY bash benchmarks/gpu_session.sh\"" revision="\"$REV\"" \
  setup_timeout_s="$SETUP_TIMEOUT" stages="\"$STAGES\""

# -- setup: Dask wheels, the random-weight models (one timeout for all of it) ----------------------
T0=$(date +%s)
if [ -z "$TRY" ]; then
  nvidia-smi -q > "$WORK/detail/nvidia-smi-q.txt" 2>&1
  nvidia-smi --query-gpu=timestamp,utilization.gpu,utilization.memory,memory.used,clocks.sm --format=csv -lms 250 \
    > "$WORK/detail/nvml_trace.csv" 2>&1 &
  TRACE_PID=$!
  timeout "$SETUP_TIMEOUT" bash -c '
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/*.whl &&
    python3 .gpu/arch_model.py --arch minilm-l6 --out /tmp/minilm --assets .gpu/minilm-assets &&
    python3 .gpu/arch_model.py --arch bert-base --out /tmp/bert --assets .gpu/minilm-assets' >> "$LOG" 2>&1
  RC=$?
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
  SCALE=1
  ARGS=(--minilm /tmp/minilm --bert /tmp/bert)
else
  timeout $((SETUP_TIMEOUT / 2)) python3 -c "import dask, distributed, torch" >> "$LOG" 2>&1
  RC=$?
  SCALE=0.5
  ARGS=(--try)
fi
if [ "$RC" -ne 0 ]; then
  line setup error rc="$RC" seconds=$(( $(date +%s) - T0 ))
  echo "SETUP FAILED (rc $RC): wheels or models; see session.log" | tee -a "$LOG"
  exit 2
fi
line setup ok seconds=$(( $(date +%s) - T0 ))

# -- the stages ------------------------------------------------------------------------------------
TOTAL=$(python3 -c "print(int(sum(float(x.split(':')[1]) for x in '$STAGES'.split(',')) * $SCALE) + 30)")
timeout "$TOTAL" python3 benchmarks/gpu_stages.py --stages "$STAGES" --scale "$SCALE" --results "$RESULTS" \
  --work "$WORK" "${ARGS[@]}" >> "$LOG" 2>&1
RC=$?
if [ "$RC" -eq 3 ]; then
  echo "PREFLIGHT FAILED: the session stopped; the reason is in results.jsonl (stage preflight)" | tee -a "$LOG"
elif [ "$RC" -ne 0 ]; then
  line session error rc="$RC"
fi
line session done rc="$RC"
exit "$RC"
