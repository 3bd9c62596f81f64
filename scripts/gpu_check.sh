#!/usr/bin/env bash
# On a CUDA machine: GPU tests (bfloat16 parity, pack vs serial, memory model ±20 %), the benchmark,
# --devices and the Ray engine;
# JSON into the folder given as $1. Every step has a timeout; together at most 8 minutes.
#   bash scripts/gpu_check.sh gpu-out
set -euo pipefail
out=${1:?usage: gpu_check.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print(torch.cuda.get_device_name())" | tee "$out/device.txt"
timeout 180 "$PY" -m pytest -q -m cuda tests --junitxml="$out/gpu-tests.xml" 2>&1 | tail -5 | tee "$out/gpu-tests.txt"
timeout 185 "$PY" -m gemma4enc bench --device cuda --dtype bfloat16 --size e2b --items 256 --repeats 3 \
    --workload photos --workload video --workload mixed --json "$out/bench-e2b.json" | tee "$out/bench-e2b.txt"
# the engines on the GPU: --devices all, and --engine ray with one actor per GPU (tiny checkpoint, generated media)
timeout 40 "$PY" -m gemma4enc demo "$out/demo" > "$out/demo.json" 2> "$out/demo.txt" || true
timeout 30 "$PY" -m gemma4enc encode "$out/demo/media" -o "$out/devices" --model "$out/demo/tiny-gemma4" \
    --devices all --json -q > "$out/devices.json" || true
timeout 45 "$PY" -m gemma4enc encode "$out/demo/media" -o "$out/ray" --model "$out/demo/tiny-gemma4" \
    --engine ray --device cuda --json -q > "$out/ray.json" 2> "$out/ray.txt" || true
rm -rf "$out/demo" "$out/devices" "$out/ray"
