#!/usr/bin/env bash
# On a CUDA machine, in one run of under 14 minutes (every step has a timeout):
#   the CUDA tests (bfloat16 parity with transformers, pack vs serial, memory model ±20 %),
#   the benchmark (photos, video, mixed on an E2B-sized tower), again with --compile, the
#   end-to-end benchmark, and `encode --devices all` / `--engine ray --device cuda` on the
#   demo's tiny checkpoint; the 12B unified model's CUDA and torchvision tests and its benchmark.
#   Worst case 855 s (the e2e step's first run makes its media).
#   bash scripts/gpu_check.sh OUTDIR
# OUTDIR gets log.txt (every step's output and exit status) and seven JSON/XML files.
# A machine whose Python lacks some of our dependencies: run `bash scripts/gpu_wheels.sh` on a
# machine with a package index first; the wheels it leaves in .whl/ are installed here into a
# temporary folder, ahead of the machine's own packages.
set -uo pipefail
out=$(realpath -m "${1:?usage: gpu_check.sh OUTDIR}")
mkdir -p "$out"
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
log="$out/log.txt"
if compgen -G ".whl/*.whl" >/dev/null; then
    site=$(mktemp -d)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl >>"$log" 2>&1 \
        && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: output into log.txt, the exit status after it
    local name=$1 limit=$2
    shift 2
    echo "=== $name: $*" >>"$log"
    local start=$SECONDS
    timeout "$limit" "$@" >>"$log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$log"
    return $rc
}

step device 30 "$PY" -c "import torch, transformers; assert torch.cuda.is_available(), 'no CUDA'; \
print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'transformers', transformers.__version__)" || exit 1
step tests 120 "$PY" -m pytest -q -m cuda tests -p no:cacheprovider --junitxml="$out/gpu-tests.xml"
step bench 120 "$PY" -m gemma4enc bench --device cuda --dtype bfloat16 --size e2b --items 256 --repeats 3 \
    --workload photos --workload video --workload mixed --json "$out/bench-e2b.json"
step compile 90 "$PY" -m gemma4enc bench --device cuda --dtype bfloat16 --size e2b --items 128 --repeats 3 \
    --workload photos --workload video --compile --json "$out/bench-compile.json"
# our pixels and tokens against transformers' torchvision processors (they load beside a CUDA torch): the figures
step torchvision 90 "$PY" -m pytest -q -s -rs tests/test_torchvision.py -p no:cacheprovider
grep -E "^(Gemma4(Image|Video)Processor|tokens, torchvision)" "$log" | tail -n 30 >"$out/torchvision.txt"
step unified 60 "$PY" -m pytest -q -rs tests/test_unified.py -k "cuda or torchvision" -p no:cacheprovider \
    --junitxml="$out/unified-tests.xml"  # the 12B unified model on CUDA, and against its torchvision processor
step bench-12b 60 "$PY" -m gemma4enc bench --device cuda --dtype bfloat16 --size 12b --items 256 --repeats 3 \
    --workload photos --workload video --json "$out/bench-12b.json"
# real-size media: made once (about 3 min of CPU here, one file after another), then decode per kind and the overlap
step e2e 300 "$PY" -m gemma4enc bench --e2e --device cuda --repeats 3 --json "$out/e2e.json"
demo=$(mktemp -d)
step demo 30 "$PY" -m gemma4enc demo "$demo/demo"
step devices 20 "$PY" -m gemma4enc encode "$demo/demo/media" -o "$demo/devices" --model "$demo/demo/tiny-gemma4" \
    --devices all --json -q
if "$PY" -c "import ray" 2>/dev/null; then
    step ray 25 "$PY" -m gemma4enc encode "$demo/demo/media" -o "$demo/ray" --model "$demo/demo/tiny-gemma4" \
        --engine ray --device cuda --json -q
else
    echo "=== ray: skipped, ray is not installed" | tee -a "$log"
fi
rm -rf "$demo"
