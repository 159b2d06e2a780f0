#!/usr/bin/env bash
# What a few minutes on one GPU should check, in one call (at most 8 minutes on an H100,
# no network): the `gpu`-marked tests, the Triton kernel tests compiled for the GPU, then
# `batchinfer bench` on Llama-3-8B's shape (random weights, TP=1, CUDA graphs) in bfloat16,
# with --quantization fp8, with --kv-cache-dtype fp8 and with --async-scheduling. Each
# section runs under `timeout`, so one that hangs costs its own limit only (90 + 100 +
# 4 x 65 s, and 10 s each to kill). Everything lands in OUT (default
# ./gpu-check-DATE); the report is OUT/gpu-check.json, whose path is printed last.
#
#   scripts/gpu-check.sh [OUT]
#   scripts/gpu-check.sh --dry [OUT]    the bench rows on the tiny shape on a CPU, no tests
#
# Needs only `pip install -e '.[test]'`. PYTHON picks the interpreter (default: python).
set -uo pipefail

dry=()
if [[ ${1:-} == --dry ]]; then
    dry=(--dry)
    shift
fi
out=${1:-gpu-check-$(date +%Y%m%d-%H%M%S)}
python=${PYTHON:-python}
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
mkdir -p "$out"
out=$(cd "$out" && pwd)

# section NAME LIMIT_S COMMAND...: COMMAND's output to OUT/NAME.log, its status to
# OUT/NAME.rc.json. timeout signals the command's whole process group (pytest's and the
# engine's children too), and kills it 10 s after if it is still there.
section() {
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS rc
    timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    printf '{"rc": %d, "seconds": %d, "limit": %d}\n' "$rc" $((SECONDS - start)) "$limit" \
        >"$out/$name.rc.json"
    echo "$name: exit $rc after $((SECONDS - start)) s (limit $limit s)"
}

cd "$root"
export BATCHINFER_CACHE_DIR=${BATCHINFER_CACHE_DIR:-$out/cache}
if [[ ${#dry[@]} -eq 0 ]]; then
    section gpu-tests 90 "$python" -m pytest -q -p no:cacheprovider -m gpu tests
    # the Triton kernels against their references, compiled (the C kernels' tests are left
    # out: building them takes minutes)
    section kernel-tests 100 "$python" -m pytest -q -p no:cacheprovider \
        tests/kernels/test_attention_kernels.py tests/kernels/test_fp8_kv_cache.py \
        tests/kernels/test_fp8_matmul.py -k "not test_c_"
fi
while IFS=$'\t' read -r name flags; do
    # shellcheck disable=SC2086  # the flags are words
    section "bench-$name" 65 "$python" -c 'from batchinfer.cli import main; main()' \
        bench $flags --output-json "$out/bench-$name.json"
done < <("$python" "$here/gpu_check.py" rows ${dry[@]+"${dry[@]}"})
"$python" "$here/gpu_check.py" collect "$out" ${dry[@]+"${dry[@]}"}
echo "$out/gpu-check.json"
