#!/usr/bin/env bash
# CPU runtime benchmark on a TinyLlama-1.1B-shaped generated model (hidden 2048, 22 layers,
# intermediate 5632, 32 heads, 4 KV heads, vocab 32000), in BF16 and F32: decode tokens/s at
# batch 1 and its effective bandwidth against the measured read bandwidth, prefill of 512 tokens
# against the measured FMA peak, and resident memory. Usage: bench/runtime.sh [THREADS] [DTYPES]
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS="${1:-2}"
DTYPES="${2:-bf16 f32}"
SHARDSERVE_SKIP_REFERENCE=1 bash scripts/setup.sh
bash scripts/build.sh
for dtype in $DTYPES; do
  dir="build/bench-models/tinyllama-$dtype"
  if [ ! -f "$dir/config.json" ]; then
    build/bin/shardserve gen-model --arch llama --out "$dir" --layers 22 --hidden 2048 \
      --intermediate 5632 --heads 32 --kv-heads 4 --vocab 32000 --dtype "$dtype" --seed 1
  fi
  echo "=== TinyLlama-1.1B shape, $dtype"
  build/bin/shardserve bench --model "$dir" --threads "$THREADS" --decode-tokens 32 \
    --prefill-tokens 512
done
