#!/usr/bin/env bash
# LoRA adapters on a CPU rank (issue 54): decode throughput of a batch of 32 sequences whose
# adapters (rank 16, every attention and MLP projection) are 1, 8 or 32 distinct ones, against the
# same batch on the base alone; the time to read an adapter from PEFT's files, to put it in a slot
# and to swap it. Models: SmolLM2-135M's shape and a TinyLlama-1.1B-shaped one, in BF16
# (generated). Usage: bench/lora.sh [THREADS] [BATCH]
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS="${1:-2}"
BATCH="${2:-32}"
SHARDSERVE_SKIP_REFERENCE=1 bash scripts/setup.sh
bash scripts/build.sh
gen() {  # NAME ARGS...: a generated BF16 model under build/bench-models
  local dir="build/bench-models/$1"
  shift
  [ -f "$dir/config.json" ] ||
    build/bin/shardserve gen-model --arch llama --out "$dir" --dtype bf16 --seed 1 "$@" 2>/dev/null
  echo "$dir"
}
smol=$(gen smollm2-135m-bf16 --layers 30 --hidden 576 --intermediate 1536 --heads 9 \
  --kv-heads 3 --vocab 49152)
tiny=$(gen tinyllama-bf16 --layers 22 --hidden 2048 --intermediate 5632 --heads 32 --kv-heads 4 \
  --vocab 32000)
for dir in "$smol" "$tiny"; do
  echo "=== $(basename "$dir")"
  build/bin/shardserve bench lora --model "$dir" --threads "$THREADS" --batch "$BATCH" \
    --rank 16 --steps 8 --adapters 1,8,32
done
