#!/usr/bin/env bash
# For an offline GPU machine whose Python has torch but not all of our dependencies: download
# here, into .whl/, the wheels that scripts/gpu_check.sh then installs there (into a temporary
# folder, ahead of the machine's own packages): the transformers we test with (and a regex new
# enough for it), and PyAV for the demo's videos. The machine's torch is kept.
#   bash scripts/gpu_wheels.sh [PYTHON_VERSION]   (default 3.12: the target machine's Python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
version=${1:-3.12}
transformers=$("$PY" -c "import transformers; print(transformers.__version__)")
rm -rf .whl && mkdir .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "transformers==$transformers" "av>=14" "regex>=2025.10.22"
du -sh .whl/*
