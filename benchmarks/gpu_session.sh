#!/usr/bin/env bash
# One-shot GPU verification on the H200 GPU machine (issues 7 and 8), run from the checkout root
# through the device tool with carry [".gpu"]; results land in $OUT. Prepare .gpu/ here first:
#   mkdir -p .gpu && cp ../shared/device-wheels/*.whl ../shared/gpu/arch_model.py .gpu/ \
#     && cp -r ../shared/gpu/minilm-assets .gpu/ && echo /.gpu/ >> .git/info/exclude
# Tried on a CPU with: SURGE_GPU_TRY=1 bash benchmarks/gpu_session.sh  (tiny sizes, device=cpu)
set -euo pipefail
OUT=${OUT:-/tmp/surge-gpu-out}
mkdir -p "$OUT"
if [ -z "${SURGE_GPU_TRY:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
python3 .gpu/arch_model.py --arch minilm-l6 --out /tmp/minilm --assets .gpu/minilm-assets
python3 .gpu/arch_model.py --arch bert-base --out /tmp/bert --assets .gpu/minilm-assets
if [ -n "${SURGE_GPU_TRY:-}" ]; then
  python3 benchmarks/gpu_encode.py --device cpu --rows 1500 --st-rows 400 --models minilm-l6=/tmp/minilm \
    --out "$OUT/gpu_encode.json" 2>&1 | tee "$OUT/gpu_encode.log"
else
  # MiniLM: 2M texts through dask-surge (~35 s at the 60k texts/s target), ST on 200k
  timeout 300 python3 benchmarks/gpu_encode.py --rows 2000000 --st-rows 200000 --models minilm-l6=/tmp/minilm \
    --out "$OUT/gpu_encode_minilm.json" 2>&1 | tail -c 20000 > "$OUT/gpu_encode_minilm.log" || true
  timeout 180 python3 benchmarks/gpu_encode.py --rows 600000 --st-rows 50000 --models bert-base=/tmp/bert \
    --out "$OUT/gpu_encode_bert.json" 2>&1 | tail -c 20000 > "$OUT/gpu_encode_bert.log" || true
fi
ls -la "$OUT"
