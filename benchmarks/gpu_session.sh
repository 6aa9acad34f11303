#!/usr/bin/env bash
# One-shot GPU verification on the H200 GPU machine (issues 7, 8 and 17), run from the checkout root
# through the device tool with carry [".gpu"], timeout_s 540; every result lands in $OUT as it comes,
# so a timeout keeps what was measured. Prepare .gpu/ on the CPU machine first (about 50 MiB):
#   mkdir -p .gpu && cp ../shared/device-wheels/*.whl ../shared/gpu/arch_model.py .gpu/ \
#     && cp -r ../shared/gpu/minilm-assets .gpu/      # .gpu/ is in .gitignore
#   python benchmarks/gpu_prepare.py            # real MiniLM weights in fp16 + CPU fp32 reference embeddings
# Dry-run on a CPU (tiny sizes, device=cpu, ~3 min):  SURGE_GPU_TRY=1 OUT=/tmp/gpu-try bash benchmarks/gpu_session.sh
# Order: dask-surge first, then the engine alone, then SentenceTransformer.encode at batch size 1024
# (gpu_encode.py), then the cosine against real weights (gpu_cosine.py), then the gpu-marked tests.
set -uo pipefail
OUT=${OUT:-/tmp/surge-gpu-out}
mkdir -p "$OUT"
TRY=${SURGE_GPU_TRY:-}
if [ -z "$TRY" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  DEVICE=cuda
else
  DEVICE=cpu
fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
{ date -u; nproc; python3 -c "import os; print('affinity', sorted(os.sched_getaffinity(0)))"; } > "$OUT/facts.txt" 2>&1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
# NVML utilisation trace for the whole session (every 250 ms), stopped at the end
TRACE_PID=""
if command -v nvidia-smi > /dev/null 2>&1 && [ -z "$TRY" ]; then
  nvidia-smi --query-gpu=timestamp,utilization.gpu,utilization.memory,memory.used --format=csv -lms 250 \
    > "$OUT/nvml_trace.csv" 2>&1 &
  TRACE_PID=$!
fi
stage() { echo "$(date -u +%T) $*" >> "$OUT/stages.txt"; }
python3 .gpu/arch_model.py --arch minilm-l6 --out /tmp/minilm --assets .gpu/minilm-assets > "$OUT/arch.log" 2>&1
python3 .gpu/arch_model.py --arch bert-base --out /tmp/bert --assets .gpu/minilm-assets >> "$OUT/arch.log" 2>&1
if [ -n "$TRY" ]; then
  stage "gpu_encode minilm (try)"
  timeout 240 python3 benchmarks/gpu_encode.py --device cpu --rows 1500 --st-rows 400 --st-batch-size 32 \
    --models minilm-l6=/tmp/minilm --out "$OUT/gpu_encode_minilm.json" > "$OUT/gpu_encode_minilm.log" 2>&1
else
  # MiniLM: 2M texts through dask-surge (~35 s at the 60k texts/s target), engine and ST on 200k
  stage "gpu_encode minilm"
  timeout 240 python3 benchmarks/gpu_encode.py --rows 2000000 --st-rows 200000 --models minilm-l6=/tmp/minilm \
    --out "$OUT/gpu_encode_minilm.json" > "$OUT/gpu_encode_minilm.log" 2>&1
  stage "gpu_encode bert-base"
  timeout 150 python3 benchmarks/gpu_encode.py --rows 600000 --st-rows 50000 --models bert-base=/tmp/bert \
    --out "$OUT/gpu_encode_bert.json" > "$OUT/gpu_encode_bert.log" 2>&1
fi
if [ -d .gpu/minilm-real-fp16 ]; then
  stage "cosine vs real MiniLM"
  timeout 60 python3 benchmarks/gpu_cosine.py --model .gpu/minilm-real-fp16 --ref .gpu/minilm-ref.json \
    --device "$DEVICE" --out "$OUT/gpu_cosine.json" > "$OUT/gpu_cosine.log" 2>&1
fi
if python3 -c "import pytest, hypothesis" > /dev/null 2>&1 && [ -z "$TRY" ]; then
  stage "pytest -m gpu"
  timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_traps.py tests/test_engine.py \
    > "$OUT/pytest_gpu.log" 2>&1
fi
stage done
[ -n "$TRACE_PID" ] && kill "$TRACE_PID" 2> /dev/null
tail -c 4000 "$OUT"/*.log
ls -la "$OUT"
