#!/usr/bin/env bash
# The KV cache's dtype (spec.serving.kvCacheDtype) on the CPU: a TinyLlama-1.1B-shaped BF16 model
# (22 layers, 4 KV heads of 64) decoding at batch 1 after 4,096 and 16,384 cached positions, the
# cache in F32, BF16, F16 and FP8: its bytes a position and at that context, and decode tokens/s.
# The cached positions are written straight into the cache (their values do not change a step's
# time). Usage: bench/kv_dtype.sh [THREADS] [CONTEXTS] [DTYPES]
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS="${1:-2}"
CONTEXTS="${2:-4096 16384}"
DTYPES="${3:-f32 bf16 f16 fp8}"
SHARDSERVE_SKIP_REFERENCE=1 bash scripts/setup.sh
bash scripts/build.sh
dir="build/bench-models/tinyllama-bf16-16k"
if [ ! -f "$dir/config.json" ]; then
  build/bin/shardserve gen-model --arch llama --out "$dir" --layers 22 --hidden 2048 \
    --intermediate 5632 --heads 32 --kv-heads 4 --vocab 32000 --dtype bf16 --seed 1 \
    --max-position 16640
fi
for context in $CONTEXTS; do
  for dtype in $DTYPES; do
    echo "=== context $context, KV cache $dtype"
    build/bin/shardserve bench --model "$dir" --threads "$THREADS" --decode-tokens 16 \
      --prefill-tokens 0 --context "$context" --kv-cache-dtype "$dtype" | grep -E "^kv cache|^decode.*median"
  done
done
