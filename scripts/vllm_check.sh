#!/usr/bin/env bash
# The proof with vLLM's CPU build (docs/serving.md): vLLM generating from gemma4enc's tokens (through
# the connector and through `export --to vllm`) equals vLLM generating from the pixels, float32 and
# bfloat16, an image and a clip, and vLLM's vision encoder is never run for them; with media kwargs
# no keyed request is answered from a stand-in; and the same through `vllm serve`'s OpenAI API.
#
#   scripts/vllm_check.sh [WORKDIR]      # default: a new temp folder, removed after a pass
#
# PYTHON: gemma4enc's python (default .venv/bin/python); GEMMA4ENC_VLLM_VENV: where vLLM's venv is
# built or reused (default ~/.cache/gemma4enc-vllm; scripts/vllm_venv.sh). STEP_TIMEOUT: seconds one
# vLLM engine run may take (default 900). Exit 0: passed, or skipped with one line where vLLM's CPU
# build cannot be installed here; 1: a check ran and failed (its JSON line says which); 5: the engine
# broke or ran out of time before it could compare (a machine vLLM's CPU build does not run on);
# other: a step of ours broke.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-$REPO/.venv/bin/python}
VENV=${GEMMA4ENC_VLLM_VENV:-$HOME/.cache/gemma4enc-vllm}
STEP_TIMEOUT=${STEP_TIMEOUT:-900}
W=${1:-}
KEEP=1
if [ -z "$W" ]; then W=$(mktemp -d "${TMPDIR:-/tmp}/gemma4enc-vllm-check.XXXXXX"); KEEP=0; fi
mkdir -p "$W"
start=$(date +%s)

scripts/vllm_venv.sh "$VENV"
rc=$?
if [ $rc -eq 3 ]; then
    echo "vllm check: skipped: vLLM's CPU build could not be installed here (see the line above)"
    exit 0
elif [ $rc -ne 0 ]; then
    echo "vllm check: building the vLLM venv failed (exit $rc)"; exit $rc
fi
# gemma4enc where vLLM imports the connector: installed as docs/serving.md says, without its dependencies
if ! "$VENV/bin/python" -m pip install -q --no-deps --force-reinstall "$REPO" >"$W/install.log" 2>&1; then
    echo "vllm check: pip install --no-deps gemma4enc into the vLLM venv failed: $(tail -1 "$W/install.log")"; exit 2
fi

PYTHONPATH=$REPO timeout "$STEP_TIMEOUT" "$PY" scripts/vllm_prepare.py "$W" || { echo "vllm check: preparing failed"; exit 2; }

failed=0
broke=0
for run in "connector float32" "export float32" "connector bfloat16" "connector-kwargs float32"; do
    set -- $run
    log="$W/vllm-$1-$2.log"
    # the shim folder only: gemma4enc comes from the venv's own install; one process, the KV cache in 1 GiB
    (cd "$W" && env HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 \
        PYTHONPATH="$REPO/scripts/vllm_shim" timeout "$STEP_TIMEOUT" \
        "$VENV/bin/python" "$REPO/scripts/vllm_check.py" "$W" --via "$1" --dtype "$2" >"$log" 2>&1)
    rc=$?
    line=$(grep '^{' "$log" | tail -1)
    if [ $rc -eq 0 ]; then
        echo "vllm check: $1 $2: passed: $line"
    elif [ $rc -eq 124 ]; then
        echo "vllm check: $1 $2: did not finish in ${STEP_TIMEOUT} s; log: $log"; broke=1
    elif [ -z "$line" ]; then  # no comparison was made: the engine itself did not run here
        echo "vllm check: $1 $2: the engine broke before comparing (exit $rc): $(grep -E 'Error' "$log" | tail -1 | cut -c1-300); log: $log"
        broke=1
    else
        echo "vllm check: $1 $2: FAILED (exit $rc): ${line:-$(grep -E 'Error' "$log" | tail -1 | cut -c1-300)}; log: $log"
        failed=1
    fi
done
# the server a user runs: `vllm serve`'s OpenAI API on loopback, started and stopped by the step
log="$W/vllm-serve.log"
(cd "$W" && env HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH="$REPO/scripts/vllm_shim" \
    timeout "$STEP_TIMEOUT" "$VENV/bin/python" "$REPO/scripts/vllm_serve_check.py" "$W" >"$log" 2>&1)
rc=$?
line=$(grep '^{' "$log" | tail -1)
if [ $rc -eq 0 ]; then
    echo "vllm check: serve: passed: $line"
elif [ $rc -eq 124 ] || [ $rc -eq 5 ] || [ -z "$line" ]; then
    echo "vllm check: serve: the server did not come up or finish here (exit $rc): ${line:-$(tail -1 "$log" | cut -c1-300)}; log: $log"
    broke=1
else
    echo "vllm check: serve: FAILED (exit $rc): $line; log: $log"; failed=1
fi
verdict=passed; [ $broke -eq 1 ] && verdict="not run to the end"; [ $failed -eq 1 ] && verdict=failed
echo "vllm check: $verdict in $(( $(date +%s) - start )) s"
if [ $failed -eq 0 ] && [ $broke -eq 0 ] && [ $KEEP -eq 0 ]; then rm -rf "$W"; fi
[ $failed -eq 1 ] && exit 1
[ $broke -eq 1 ] && exit 5
exit 0
