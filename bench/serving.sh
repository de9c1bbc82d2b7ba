#!/usr/bin/env bash
# Serving benchmark: a TinyLlama-1.1B-shaped BF16 model served by `shardserve local` with TP=2
# (2 rank processes), loaded by `shardserve bench load` at concurrency 1, 4 and 16 (streamed
# greedy completions of random prompts, by default 64 prompt and 64 output tokens): output tokens/s,
# time to first token and inter-token latency p50/p99, and the share of the inter-token time spent
# outside the leader rank's forward passes.
# Usage: bench/serving.sh [LEVELS] [MAX_TOKENS] [PROMPT_TOKENS]
set -euo pipefail
cd "$(dirname "$0")/.."
LEVELS="${1:-1,4,16}"
MAX_TOKENS="${2:-64}"
PROMPT_TOKENS="${3:-64}"
SHARDSERVE_SKIP_REFERENCE=1 bash scripts/setup.sh
bash scripts/build.sh
dir="$PWD/build/bench-models/tinyllama-bf16"
if [ ! -f "$dir/config.json" ]; then
  build/bin/shardserve gen-model --arch llama --out "$dir" --layers 22 --hidden 2048 \
    --intermediate 5632 --heads 32 --kv-heads 4 --vocab 32000 --dtype bf16 --seed 1
fi
tmp=$(mktemp -d)
source scripts/local_lib.sh
write_manifest "$tmp/model.yaml" tinyllama "$dir" 2 1 "port: 18400, maxBatchSize: 16, maxSequenceLength: 2048"
LOCAL_CLEANUP='rm -rf "$tmp"'
start_local "$tmp/log" "$tmp/model.yaml" --metrics-port-base 18500
echo "TinyLlama-1.1B shape, BF16, TP=2 (one rank per core), maxBatchSize 16"
build/bin/shardserve bench load --url 127.0.0.1:18400 --model tinyllama --concurrency "$LEVELS" \
  --max-tokens "$MAX_TOKENS" --prompt-tokens "$PROMPT_TOKENS" --vocab 32000 --rank-metrics 127.0.0.1:18500
