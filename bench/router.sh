#!/usr/bin/env bash
# A model's replicas behind a plain Service (each request to one of them at random, as
# kube-proxy spreads connections) and behind shardserve-router (issue 35 part 4), on CPU:
# SmolLM2-135M-Instruct (Q4_1) served by `shardserve local`, one rank and one thread a replica.
# `shardserve bench load --turns` runs conversations: every turn resends a 1,000-token shared
# system prompt and the conversation's history with OWN new tokens, and streams a 16-token greedy
# answer. Printed for 1 replica, then 2 and 4 replicas each way: output tokens/s, time to first
# token p50/p99 and the prefix cache's hit rate (cached over prompt tokens, from the answers'
# usage), overall and past the shared prompt; for the router, its decisions by reason and its
# time per request before sending it on.
# Usage: bench/router.sh [CLIENTS] [CONVERSATIONS_PER_CLIENT] [TURNS] [REPLICA_COUNTS] [OWN]
set -euo pipefail
cd "$(dirname "$0")/.."
CLIENTS="${1:-4}"
CONVERSATIONS="${2:-3}"
TURNS="${3:-4}"
COUNTS="${4:-2 4}"
OWN="${5:-128}"
SHARDSERVE_SKIP_REFERENCE=1 bash scripts/setup.sh
bash scripts/build.sh
dir="${SHARDSERVE_CACHE:-$HOME/.cache/shardserve}/models/smollm2-135m-instruct"
run() {  # REPLICAS MODE (single | service | router)
  (
    local replicas=$1 mode=$2 tmp urls args=()
    tmp=$(mktemp -d)
    source scripts/local_lib.sh
    write_manifest "$tmp/model.yaml" smollm2 "$dir" 1 1 \
      "port: 18600, maxBatchSize: 16, maxSequenceLength: 2048" "$replicas"
    LOCAL_CLEANUP='rm -rf "$tmp"'
    [ "$mode" = service ] && args=(--no-router)
    start_local "$tmp/log" "$tmp/model.yaml" --metrics-port-base 18700 --threads 1 "${args[@]}"
    urls=127.0.0.1:18600
    if [ "$mode" = service ]; then
      urls=$(seq -s, 18600 $((18600 + replicas - 1)) | sed 's/\([0-9]*\)/127.0.0.1:\1/g')
    fi
    echo "=== $replicas replica(s), $mode ($CLIENTS clients x $CONVERSATIONS conversations x $TURNS turns)"
    build/bin/shardserve bench load --url "$urls" --model smollm2 --concurrency "$CLIENTS" \
      --requests-per-client "$CONVERSATIONS" --turns "$TURNS" --max-tokens 16 \
      --prompt-tokens "$OWN" --shared-prefix-tokens 1000 --vocab 49152
    if [ "$mode" = router ]; then
      curl -s http://127.0.0.1:18600/metrics |
        awk '/^shardserve_router_decisions_total/ {sub(/.*reason="/, ""); sub(/"}/, ""); printf "router decisions: %s %s\n", $1, $2}
             /^shardserve_router_(prompt|expected_cached)_tokens_total/ {sub(/\{.*\}/, ""); print}
             /^shardserve_router_overhead_seconds_(sum|count)/ {sub(/\{.*\}/, ""); print}'
    fi
  )
}
run 1 single
for r in $COUNTS; do
  run "$r" service
  run "$r" router
done
