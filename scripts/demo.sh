#!/usr/bin/env bash
# The main job on the embedded default: set up, build, generate a small Llama-style model, and
# run a generation on it with the CPU runtime: in one process, then sharded as 2 pipeline stages
# x 2 tensor-parallel ranks (4 processes), which must give the same tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARDSERVE_SKIP_REFERENCE=1 bash scripts/setup.sh
bash scripts/build.sh
MODEL="${MODEL_DIR:-build/models/demo-llama}"
build/bin/shardserve gen-model --arch llama --out "$MODEL" --layers 4 --hidden 256 \
  --intermediate 512 --heads 8 --kv-heads 2 --vocab 512 --dtype bf16 --seed 1
echo "(random weights: the words are noise; tokens, logprobs and determinism are real)"
PROMPT="The model is too large for one machine,"
echo "--- greedy, 24 tokens, one process:"
build/bin/shardserve generate --model "$MODEL" --prompt "$PROMPT" --max-tokens 24 --ignore-eos
echo "--- the same, sharded: TP=2 x PP=2 (2 stage launchers x 2 rank processes):"
build/bin/shardserve generate --model "$MODEL" --prompt "$PROMPT" --max-tokens 24 --ignore-eos \
  --tp 2 --pp 2
echo "--- sampled (temperature 0.8, top-p 0.9, seed 42), with top-2 logprobs, as JSON:"
build/bin/shardserve generate --model "$MODEL" --prompt "A good serving system" --max-tokens 6 \
  --temperature 0.8 --top-p 0.9 --seed 42 --logprobs 2 --ignore-eos --format json
