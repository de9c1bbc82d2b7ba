#!/usr/bin/env bash
# The main job on the embedded default: set up, build, generate a small Llama-style model, serve
# it with `shardserve local` as 2 pipeline stages x 2 tensor-parallel ranks (4 processes, CPU
# backend) behind an API key made for the run, send a completion and a streamed chat request with
# curl, show that a request without the key is refused, show a few metric lines, and stop
# everything with SIGINT (as Ctrl-C would).
set -euo pipefail
cd "$(dirname "$0")/.."
SHARDSERVE_SKIP_REFERENCE=1 bash scripts/setup.sh
bash scripts/build.sh
MODEL=/tmp/shardserve-demo/tiny-llama  # the path examples/tiny-tp2-pp2.yaml names
build/bin/shardserve gen-model --arch llama --out "$MODEL" --layers 4 --hidden 256 \
  --intermediate 512 --heads 8 --kv-heads 2 --vocab 512 --dtype bf16 --seed 1
echo "(random weights: the words are noise; tokens, logprobs and the serving path are real)"

LOG=/tmp/shardserve-demo/local.log
KEYS=/tmp/shardserve-demo/api-keys
(umask 077 && echo "sk-demo-$(openssl rand -hex 16)" >"$KEYS")
AUTH="Authorization: Bearer $(head -1 "$KEYS")"
source scripts/local_lib.sh
start_local "$LOG" examples/tiny-tp2-pp2.yaml --api-key-file "$KEYS"
grep -v "metrics on" "$LOG"
API=http://127.0.0.1:8000/v1

echo "--- POST /v1/completions (greedy, 16 tokens, top-2 logprobs):"
curl -sS "$API/completions" -H "$AUTH" -H 'Content-Type: application/json' -d '{"model":
  "tiny-llama", "prompt": "The model is too large for one machine,", "max_tokens": 16,
  "temperature": 0, "logprobs": 2}'
echo
echo "--- the same without the API key:"
curl -sS "$API/completions" -H 'Content-Type: application/json' -d '{"model": "tiny-llama",
  "prompt": "Hello"}'
echo
echo "--- POST /v1/chat/completions, streamed (server-sent events):"
curl -sSN "$API/chat/completions" -H "$AUTH" -H 'Content-Type: application/json' -d '{"model": "tiny-llama",
  "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0,
  "stream": true}'
echo "--- a few metric lines (leader :8000/metrics; every rank has its own page, :9400-9403):"
curl -sS -H "$AUTH" http://127.0.0.1:8000/metrics | grep -E '^shardserve_(requests_total|generated_tokens_total|time_to_first_token_seconds_count|rank_up|rank_kv_cache_usage_ratio)\{' | head -8
echo "--- stopping (SIGINT)"
kill -INT $LOCAL
wait $LOCAL
tail -1 "$LOG"
