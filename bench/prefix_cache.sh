#!/usr/bin/env bash
# Prefix caching on one replica: SmolLM2-135M-Instruct (the demo's model, Q4_1) served by
# `shardserve local` (one rank), loaded by `shardserve bench load` with prompts that share a
# 1,000-token start (a long system prompt) and end in 32 tokens of their own, streamed greedy
# answers of 16 tokens; once with spec.serving.prefixCaching true, once false: time to first
# token p50/p99 and output tokens/s at each concurrency, and the leader's hit rate.
# Usage: bench/prefix_cache.sh [LEVELS] [SHARED_TOKENS]
set -euo pipefail
cd "$(dirname "$0")/.."
LEVELS="${1:-1,4}"
SHARED="${2:-1000}"
SHARDSERVE_SKIP_REFERENCE=1 bash scripts/setup.sh
bash scripts/build.sh
dir="${SHARDSERVE_CACHE:-$HOME/.cache/shardserve}/models/smollm2-135m-instruct"
for caching in true false; do
  (
    tmp=$(mktemp -d)
    source scripts/local_lib.sh
    write_manifest "$tmp/model.yaml" smollm2 "$dir" 1 1 \
      "port: 18410, maxBatchSize: 16, maxSequenceLength: 2048, prefixCaching: $caching"
    LOCAL_CLEANUP='rm -rf "$tmp"'
    start_local "$tmp/log" "$tmp/model.yaml" --metrics-port-base 18510
    echo "=== prefixCaching: $caching (SmolLM2-135M Q4_1, one rank, $SHARED shared + 32 own tokens)"
    build/bin/shardserve bench load --url 127.0.0.1:18410 --model smollm2 --concurrency "$LEVELS" \
      --requests-per-client 4 --max-tokens 16 --prompt-tokens 32 --shared-prefix-tokens "$SHARED" \
      --vocab 49152
    page=$(curl -s http://127.0.0.1:18510/metrics)
    q=$(echo "$page" | awk '/^shardserve_prefix_cache_queried_tokens_total/ {print $2}')
    h=$(echo "$page" | awk '/^shardserve_prefix_cache_hit_tokens_total/ {print $2}')
    awk -v q="${q:-0}" -v h="${h:-0}" 'BEGIN { printf "prefix cache: %d of %d prompt tokens hit (%.1f%%)\n", h, q, (q > 0 ? 100 * h / q : 0) }'
  )
done
