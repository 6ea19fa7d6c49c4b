#!/usr/bin/env bash
# The engine's measurements on a lent GPU (issue 49; docs/engine.md "The engine against its
# device"), in two calls of under ten minutes each on an H200:
#
#   bash bench/gpu/gpu_session.sh rows       # every row of bench/gpu/engine_device.py, the defaults
#   bash bench/gpu/gpu_session.sh checks     # one setting at a time, and the correctness checks
#
# From the root of a checkout, with SmolLM2's tokenizer files in .gpu/tok (a folder git
# ignores, carried to the GPU machine; a GPU machine may have no network):
#   mkdir -p .gpu/tok && echo /.gpu/ >> .git/info/exclude
#   cp ~/.cache/medha/models/smollm2-135m-instruct/{*.json,*.jinja} .gpu/tok/
# Results go to $OUT (default runs/gpu-out, which git ignores; docs/data/gpu_session_dry holds a
# dry run's). `bash bench/gpu/gpu_session.sh dry` runs both parts on this CPU at toy sizes, with
# Triton's interpreter, to check the script before the GPU does.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/gpu-out}
TOK=${TOK:-.gpu/tok}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
part=${1:-rows}
quick=()
if [ "$part" = dry ]; then
    export TRITON_INTERPRET=1 MEDHA_DECODE_KERNEL=triton
    quick=(--quick --device cpu --self-profile-s 0)
fi

rows() {
    python bench/gpu/engine_device.py --out "$OUT/rows" --tok "$TOK" "${quick[@]}" 2>&1 | tee "$OUT/rows.log"
}

checks() {
    # async scheduling off, then graphs off too: what each is worth on the decode rows
    python bench/gpu/engine_device.py --out "$OUT/sync" --tok "$TOK" --rows decode1,decode64 \
        --engine-arg async_scheduling=false "${quick[@]}" 2>&1 | tee "$OUT/sync.log"
    python bench/gpu/engine_device.py --out "$OUT/eager" --tok "$TOK" --rows decode1 \
        --engine-arg async_scheduling=false --engine-arg cuda_graphs=false "${quick[@]}" \
        2>&1 | tee "$OUT/eager.log"
    # cuDNN's kernel for a chunk's prefix against flash's (the rows' default)
    MEDHA_PREFIX_KERNEL=cudnn python bench/gpu/engine_device.py --out "$OUT/cudnn" --tok "$TOK" \
        --rows chunking "${quick[@]}" 2>&1 | tee "$OUT/cudnn.log"
    if [ "$part" = dry ]; then
        return
    fi
    # token for token against transformers on CUDA (fp32 and bf16, two schedulers), a small
    # random Llama built with the tokenizer; then swap preemption's copies and tokens
    python bench/gpu/engine_gpu_parts.py --out "$OUT" --tok "$TOK" --small 2>&1 | tee "$OUT/small.log"
    python bench/gpu/engine_cuda_check.py --model /tmp/small-llama 2>&1 | tee "$OUT/cuda_check.log"
    python bench/gpu/kv_swap_cuda.py --model /tmp/small-llama --dtype float32 2>&1 | tee "$OUT/kv_swap.log"
}

case "$part" in
    rows) rows ;;
    checks) checks ;;
    dry) rows && checks ;;
    *) echo "usage: $0 rows|checks|dry" >&2; exit 2 ;;
esac
