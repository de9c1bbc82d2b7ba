#!/usr/bin/env bash
# The main job on the embedded default: set up (which fetches the real model, SmolLM2-135M-Instruct
# as a Q4_1 GGUF, into the cache), build, serve it with `shardserve local` as 3 tensor-parallel
# ranks (3 processes, CPU backend) behind an API key made for the run, ask it a question through
# the chat API and a completion with logprobs through curl, show that a request without the key
# is refused, show a few metric lines, and stop everything with SIGINT (as Ctrl-C would).
set -euo pipefail
cd "$(dirname "$0")/.."
SHARDSERVE_SKIP_REFERENCE=1 bash scripts/setup.sh
bash scripts/build.sh
CACHE="${SHARDSERVE_CACHE:-$HOME/.cache/shardserve}"
MODEL=/tmp/shardserve-demo/smollm2  # the path examples/smollm2-tp3.yaml names
mkdir -p "$MODEL"
ln -sfn "$CACHE/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf" "$MODEL/"

LOG=/tmp/shardserve-demo/local.log
KEYS=/tmp/shardserve-demo/api-keys
(umask 077 && echo "sk-demo-$(openssl rand -hex 16)" >"$KEYS")
AUTH="Authorization: Bearer $(head -1 "$KEYS")"
source scripts/local_lib.sh
start_local "$LOG" examples/smollm2-tp3.yaml --api-key-file "$KEYS"
grep -v "metrics on" "$LOG"
API=http://127.0.0.1:8000/v1

echo "--- POST /v1/chat/completions (greedy):"
curl -sS "$API/chat/completions" -H "$AUTH" -H 'Content-Type: application/json' -d '{"model":
  "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}],
  "max_tokens": 32, "temperature": 0}'
echo
echo "--- the same without the API key:"
curl -sS "$API/chat/completions" -H 'Content-Type: application/json' -d '{"model": "smollm2",
  "messages": [{"role": "user", "content": "Hello"}]}'
echo
echo "--- POST /v1/completions, streamed (server-sent events), with the top-2 logprobs:"
curl -sSN "$API/completions" -H "$AUTH" -H 'Content-Type: application/json' -d '{"model":
  "smollm2", "prompt": "The three primary colors are", "max_tokens": 6, "temperature": 0,
  "logprobs": 2, "stream": true}'
echo "--- a few metric lines (leader :8000/metrics; every rank has its own page, :9400-9402):"
curl -sS -H "$AUTH" http://127.0.0.1:8000/metrics | grep -E '^shardserve_(requests_total|generated_tokens_total|time_to_first_token_seconds_count|rank_up|rank_kv_cache_usage_ratio)\{' | awk 'NR <= 8'
echo "--- stopping (SIGINT)"
kill -INT $LOCAL
wait $LOCAL
tail -1 "$LOG"
