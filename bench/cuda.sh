#!/usr/bin/env bash
# CUDA decode benchmark (needs a GPU): generated TinyLlama-1.1B- and Llama-3-8B-shaped models in
# BF16, decode at batch 1 and 32 — tokens/s, inter-token latency and effective HBM bandwidth
# against the device's copy bandwidth measured in the same run.
# Usage: bench/cuda.sh [MODELS] (default "tinyllama llama3-8b")
set -euo pipefail
cd "$(dirname "$0")/.."
MODELS="${1:-tinyllama llama3-8b}"
SHARDSERVE_SKIP_REFERENCE=1 bash scripts/setup.sh
SHARDSERVE_CUDA=ON bash scripts/build.sh
for m in $MODELS; do
  dir="build/bench-models/$m-bf16"
  case "$m" in
    tinyllama) shape=(--layers 22 --hidden 2048 --intermediate 5632 --heads 32 --kv-heads 4
                      --vocab 32000) ;;
    llama3-8b) shape=(--layers 32 --hidden 4096 --intermediate 14336 --heads 32 --kv-heads 8
                      --vocab 128256) ;;
    *) echo "unknown model shape '$m' (tinyllama, llama3-8b)" >&2; exit 2 ;;
  esac
  [ -f "$dir/config.json" ] ||
    build/bin/shardserve gen-model --arch llama --out "$dir" "${shape[@]}" --dtype bf16 --seed 1
  echo "=== $m, bf16"
  build/bin/shardserve bench cuda --model "$dir" --batch 1,32 --steps 64
done
