#!/usr/bin/env bash
# CUDA decode benchmark (needs a GPU): generated TinyLlama-1.1B- and Llama-3-8B-shaped models in
# BF16, decode at batch 1 and 32 after a 128-token prompt, then (TinyLlama) at batch 1 and 16
# after each long prompt of BENCH_CONTEXTS (default "2048 8192"), with each row's prefill — tokens/s, inter-token latency and bytes moved
# per step against the device's copy bandwidth measured in the same run — then the peer, PyTorch +
# transformers on the same model directory and the same shapes (bench/cuda_peer.py), and
# shardserve / peer for tokens/s. BENCH_PEER=0 leaves the peer out.
# Usage: bench/cuda.sh [MODELS] (default "tinyllama llama3-8b")
# SHARDSERVE_BIN=DIR uses the binaries in DIR (scripts/gpu-check.sh's build) instead of setting up
# and building here; BENCH_MODELS=DIR holds the generated models (default build/bench-models);
# PEER_PYTHON is the Python with torch + transformers (default: the reference venv, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
MODELS="${1:-tinyllama llama3-8b}"
CACHE="${SHARDSERVE_CACHE:-$HOME/.cache/shardserve}"
if [ -z "${SHARDSERVE_BIN:-}" ]; then
  SHARDSERVE_SKIP_REFERENCE=1 bash scripts/setup.sh
  SHARDSERVE_CUDA=ON bash scripts/build.sh
  SHARDSERVE_BIN=build/bin
fi
PEER_PYTHON="${PEER_PYTHON:-$CACHE/refvenv/bin/python3}"
[ -x "$PEER_PYTHON" ] || PEER_PYTHON=python3
for m in $MODELS; do
  dir="${BENCH_MODELS:-build/bench-models}/$m-bf16"
  case "$m" in
    tinyllama) shape=(--layers 22 --hidden 2048 --intermediate 5632 --heads 32 --kv-heads 4
                      --vocab 32000 --max-position 16384) ;;
    llama3-8b) shape=(--layers 32 --hidden 4096 --intermediate 14336 --heads 32 --kv-heads 8
                      --vocab 128256 --max-position 16384) ;;
    *) echo "unknown model shape '$m' (tinyllama, llama3-8b)" >&2; exit 2 ;;
  esac
  [ -f "$dir/config.json" ] ||
    "$SHARDSERVE_BIN/shardserve" gen-model --arch llama --out "$dir" "${shape[@]}" --dtype bf16 \
      --seed 1
  # One row set: "PROMPT BATCHES" (128-token prompts at batch 1 and 32, then the long ones).
  rows=("128 1,32")
  if [ "$m" = tinyllama ]; then  # the long rows on the small shape: they fit one lease
    for ctx in ${BENCH_CONTEXTS-2048 8192}; do rows+=("$ctx 1,16"); done
  fi
  for row in "${rows[@]}"; do
    read -r prompt batches <<<"$row"
    echo "=== $m, bf16, $prompt-token prompt"
    ours=$("$SHARDSERVE_BIN/shardserve" bench cuda --model "$dir" --batch "$batches" --steps 64 \
      --prompt-tokens "$prompt")
    echo "$ours"
    [ "${BENCH_PEER:-1}" = 0 ] && continue
    peer=$("$PEER_PYTHON" bench/cuda_peer.py "$dir" --batch "$batches" --steps 64 \
      --prompt-tokens "$prompt") || true
    echo "$peer"
    for b in ${batches//,/ }; do
      s=$(sed -nE "s/^decode batch +$b: +([0-9.]+) tokens\/s.*/\1/p" <<<"$ours")
      for mode in eager compiled-static; do
        p=$(sed -nE "s/^peer $mode batch $b: ([0-9.]+) tokens\/s.*/\1/p" <<<"$peer")
        if [ -n "$s" ] && [ -n "$p" ]; then
          awk -v s="$s" -v p="$p" -v b="$b" -v m="$mode" -v c="$prompt" \
            'BEGIN { printf "shardserve / peer %s at batch %d, %d-token prompt: %.2f\n", m, b, c, s / p }'
        fi
      done
    done
  done
done
