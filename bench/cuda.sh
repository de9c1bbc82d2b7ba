#!/usr/bin/env bash
# CUDA decode benchmark (needs a GPU): generated TinyLlama-1.1B- and Llama-3-8B-shaped models in
# BF16, decode at batch 1 and 32 after a 128-token prompt, then (the models of BENCH_LONG_MODELS,
# default TinyLlama) at the batches of BENCH_LONG_BATCHES (default 1,16) after each long prompt of
# BENCH_CONTEXTS (default "2048 8192"), once for each KV cache dtype of BENCH_KV (default "auto";
# "f32 bf16 fp8" compares them), with each row's prefill — tokens/s, inter-token latency and bytes
# moved per step against the device's copy bandwidth measured in the same run — then the peer
# (rows with the KV cache in the model's dtype only), PyTorch +
# transformers on the same model directory and the same shapes (bench/cuda_peer.py), and
# shardserve / peer for tokens/s; then speculative decoding at batch 1 (BENCH_SPEC, below) and
# serving (BENCH_SERVE, below). BENCH_PEER=0 leaves the peer out; BENCH_ATTN_AB=1 also runs
# each BF16 row with each decode attention kernel forced (SHARDSERVE_CUDA_ATTN_KERNEL=split,
# split-batched, heads).
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
MODEL_DIR="${BENCH_MODELS:-build/bench-models}"
shape_of() {  # shape_of MODEL: the generator's shape arguments, into `shape`
  case "$1" in
    tinyllama) shape=(--layers 22 --hidden 2048 --intermediate 5632 --heads 32 --kv-heads 4
                      --vocab 32000 --max-position 16384) ;;
    llama3-8b) shape=(--layers 32 --hidden 4096 --intermediate 14336 --heads 32 --kv-heads 8
                      --vocab 128256 --max-position 16384) ;;
    smollm2) shape=(--layers 30 --hidden 576 --intermediate 1536 --heads 9 --kv-heads 3
                    --vocab 49152 --max-position 8192 --tie-embeddings) ;;
    *) echo "unknown model shape '$1' (tinyllama, llama3-8b, smollm2)" >&2; exit 2 ;;
  esac
}
# model_of MODEL TYPE: the generated model of that shape in TYPE (bf16, fp8, or a GGUF type:
# random weights of the same seed), made on first use; its path into `model`.
model_of() {
  shape_of "$1"
  case "$2" in
    bf16) model="$MODEL_DIR/$1-bf16"; set -- "$model" --dtype bf16 ;;
    # FP8 in 128x128 blocks, as the -FP8 checkpoints ship (computed as F8_128).
    fp8) model="$MODEL_DIR/$1-fp8"; set -- "$model" --dtype bf16 --fp8-block 128 ;;
    *) model="$MODEL_DIR/$1-$2.gguf"; set -- "$model" --dtype bf16 --format gguf --gguf-type "$2" ;;
  esac
  [ -e "$model" ] || "$SHARDSERVE_BIN/shardserve" gen-model --arch llama --out "$@" "${shape[@]}" \
    --seed 1 >/dev/null
}
for m in $MODELS; do
  # Row sets: "DTYPE PROMPT BATCHES [KV]": 128-token prompts at batch 1 and 32; the same model's
  # weights as a GGUF of BENCH_QUANT (default Q4_K) and as FP8 (BENCH_FP8=0: none) at batch 1 and
  # 32; then the long prompts of BENCH_CONTEXTS (default "2048 8192") at BENCH_LONG_BATCHES
  # (default 1,16) on the models of BENCH_LONG_MODELS (default the small shape: they fit one
  # lease), once for each KV cache dtype of BENCH_KV (default auto, the model's).
  rows=("bf16 128 1,32")
  for q in ${BENCH_QUANT-q4_k}; do rows+=("$q 128 1,32"); done
  [ "${BENCH_FP8:-1}" = 0 ] || rows+=("fp8 128 1,32")
  if [[ " ${BENCH_LONG_MODELS-tinyllama} " == *" $m "* ]]; then
    for ctx in ${BENCH_CONTEXTS-2048 8192}; do
      for kv in ${BENCH_KV:-auto}; do rows+=("bf16 $ctx ${BENCH_LONG_BATCHES:-1,16} $kv"); done
    done
  fi
  if [ "${BENCH_GEN_ONLY:-0}" = 1 ]; then  # only make the models (beside other work on a lease)
    for row in "${rows[@]}"; do model_of "$m" "${row%% *}"; done
    continue
  fi
  for row in "${rows[@]}"; do
    read -r type prompt batches kv <<<"$row"
    export SHARDSERVE_KV_CACHE_DTYPE="${kv:-auto}"
    echo "=== $m, $type, $prompt-token prompt, KV cache $SHARDSERVE_KV_CACHE_DTYPE"
    model_of "$m" "$type"
    ours=$("$SHARDSERVE_BIN/shardserve" bench cuda --model "$model" --batch "$batches" --steps 64 \
      --prompt-tokens "$prompt")
    echo "$ours"
    if [ "$type" = fp8 ] && [ "${BENCH_FP8_STAGED:-1}" = 1 ]; then
      # FP8's staged GEMV (the default is direct) beside the row, same machine
      # (BENCH_FP8_STAGED=0: not).
      SHARDSERVE_CUDA_FP8_GEMV=staged "$SHARDSERVE_BIN/shardserve" bench cuda --model "$model" \
        --batch "$batches" --steps 64 --prompt-tokens "$prompt" | grep -E '^decode batch' |
        sed 's/^/[fp8 staged] /'
    fi
    if [ "$type" != bf16 ] && [ "$type" != fp8 ]; then
      # The float GEMV (F32 inputs; the default is dp4a) beside the GGUF row, same machine
      # (BENCH_QUANT_FLOAT=0: not).
      [ "${BENCH_QUANT_FLOAT:-1}" = 0 ] ||
        SHARDSERVE_CUDA_QUANT_GEMV=float "$SHARDSERVE_BIN/shardserve" bench cuda \
          --model "$model" --batch "$batches" --steps 64 --prompt-tokens "$prompt" |
          grep -E '^decode batch' | sed 's/^/[quant float] /'
    fi
    [ "$type" = bf16 ] || continue
    if [ "${BENCH_ATTN_AB:-0}" = 1 ]; then  # each attention kernel forced, same machine
      for v in split split-batched heads; do
        SHARDSERVE_CUDA_ATTN_KERNEL=$v "$SHARDSERVE_BIN/shardserve" bench cuda --model "$model" \
          --batch "$batches" --steps 64 --prompt-tokens "$prompt" | grep -E '^decode batch' |
          sed "s/^/[attention $v] /"
      done
    fi
    [ "${BENCH_PEER:-1}" = 0 ] || [ "$SHARDSERVE_KV_CACHE_DTYPE" != auto ] && continue
    peer=$("$PEER_PYTHON" bench/cuda_peer.py "$model" --batch "$batches" --steps 64 \
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

unset SHARDSERVE_KV_CACHE_DTYPE
[ "${BENCH_GEN_ONLY:-0}" = 0 ] || exit 0

# Speculative decoding on the GPU (BENCH_SPEC=0 leaves it out): the BF16 model of each of
# BENCH_SPEC_MODELS (default TinyLlama's shape) decoding greedily at batch 1 through the rank
# runtime (`shardserve generate`, SHARDSERVE_BACKEND=cuda) without speculation, with n-gram prompt
# lookup and with its Q4_K GGUF (the same seed) as the draft model on the same GPU, BENCH_SPEC_K
# (default 4) drafted a step: tokens/s over the whole generation (prefill included), the speedup,
# the drafts kept and whether the tokens are the ones without speculation. The weights are random,
# so the drafts kept say what this model does, not what a trained one would; the speedup at a
# given rate of kept drafts is what the GPU's verify step costs.
if [ "${BENCH_SPEC:-1}" = 1 ]; then
  for m in ${BENCH_SPEC_MODELS-tinyllama}; do
    [[ " $MODELS " == *" $m "* ]] || continue
    model_of "$m" q4_k
    draft="$model"
    model_of "$m" bf16
    echo "=== speculative decoding, $m BF16, batch 1, greedy, ${BENCH_SPEC_TOKENS:-256} tokens"
    # BENCH_SPEC_BACKEND=cpu: a dry run of this part on a machine without a GPU.
    SHARDSERVE_BACKEND="${BENCH_SPEC_BACKEND:-cuda}" python3 - "$SHARDSERVE_BIN/shardserve" \
      "$model" "$draft" "${BENCH_SPEC_TOKENS:-256}" "${BENCH_SPEC_K:-4}" <<'EOF'
import json, subprocess, sys
shardserve, model, draft, tokens, k = sys.argv[1:6]
prompt = ("Copy this list exactly: " + ", ".join(f"item {i} of the list" for i in range(40)) +
          ". Again: ")
base = None
for method, extra in (("none", []), ("ngram", []), ("draft", ["--draft-model", draft])):
    cmd = [shardserve, "generate", "--model", model, "--prompt", prompt, "--max-tokens", tokens,
           "--ignore-eos", "--format", "json", "--speculative", method] + extra
    if method != "none":
        cmd += ["--speculative-tokens", k]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        print(f"speculative {method}: failed: {r.stderr[-400:]}")
        if base is None:
            break  # no speedup means anything without the run it is measured against
        continue
    out = json.loads(r.stdout)
    n = len(out["tokens"])
    rate = n / out["timing"]["seconds"]
    base = base or (rate, out["tokens"])
    spec = out.get("speculation") or {}
    kept = f"{spec['accepted']}/{spec['drafted']}" if spec.get("drafted") else "-"
    same = "same tokens" if out["tokens"] == base[1] else "DIFFERENT TOKENS"
    print(f"speculative {method:5}: {n} tokens, {rate:.1f} tok/s, {rate / base[0]:.2f}x, "
          f"kept {kept}, {same}")
EOF
  done
fi

# Serving on the GPU (BENCH_SERVE=0 leaves it out): `shardserve local` with SHARDSERVE_BACKEND=cuda
# answering `shardserve bench load` at 1, 8, 32 and 64 clients (streamed greedy completions, 64
# prompt and 64 output tokens): the TinyLlama shape in BF16 at PP=1 and at PP=2 on the one GPU
# (the stages' hidden states through the host), and the demo model's shape (SmolLM2-135M) as a
# Q4_1 GGUF, the type the demo serves.
if [ "${BENCH_SERVE:-1}" = 1 ]; then
  export SHARDSERVE_BIN
  source scripts/local_lib.sh
  model_of smollm2 q4_1
  smol="$model"
  serve_row() {  # serve_row NAME URI PP VOCAB
    local tmp port=$((18400 + RANDOM % 500))
    tmp=$(mktemp -d)
    write_manifest "$tmp/model.yaml" "$1" "$2" 1 "$3" \
      "port: $port, maxBatchSize: 64, maxSequenceLength: 2048"
    (
      LOCAL_CLEANUP='rm -rf "$tmp"'
      export SHARDSERVE_BACKEND="${BENCH_SERVE_BACKEND:-cuda}"  # cpu: a dry run of this script
      start_local "$tmp/log" "$tmp/model.yaml" --metrics-port-base $((port + 600))
      echo "=== serving $1, PP=$3, backend $SHARDSERVE_BACKEND"
      "$SHARDSERVE_BIN/shardserve" bench load --url 127.0.0.1:$port --model "$1" \
        --concurrency "${BENCH_SERVE_LEVELS:-1,8,32,64}" --max-tokens 64 --prompt-tokens 64 --vocab "$4" \
        --rank-metrics 127.0.0.1:$((port + 600))
    )
  }
  if [[ " $MODELS " == *" tinyllama "* ]]; then
    serve_row tinyllama "$(realpath "$MODEL_DIR/tinyllama-bf16")" 1 32000
    serve_row tinyllama "$(realpath "$MODEL_DIR/tinyllama-bf16")" 2 32000
  fi
  serve_row smollm2-q4-1 "$(realpath "$smol")" 1 49152
fi
