#!/usr/bin/env bash
# shardserve beside llama.cpp on the same GGUF files, on this machine's CPU: llama.cpp built from
# the source the PyPI llama-cpp-python source package carries (a benchmark peer, never a
# dependency of the product; built once into the cache), `llama-bench -t 1,2 -p 64 -n 64`
# against `shardserve bench` decode (batch 1) and prefill of 64 tokens at 1 and 2 threads, with
# the read-bandwidth roofline shardserve's bench measures in the same run.
# Files: a TinyLlama-1.1B-shaped model written by `gen-model --format gguf` as BF16, its Q8_0 and
# Q4_K_M made by llama-quantize, and the real SmolLM2-135M-Instruct (Q4_1). Then the decode
# kernels alone per weight type (`shardserve bench kernels`).
# Usage: bench/llama_cpp.sh [FILES...]   (default: all of the above)
set -euo pipefail
cd "$(dirname "$0")/.."
SHARDSERVE_SKIP_REFERENCE=1 bash scripts/setup.sh
bash scripts/build.sh
CACHE="${SHARDSERVE_CACHE:-$HOME/.cache/shardserve}"
LCP_VERSION=0.3.36
PEER="$CACHE/llama.cpp-$LCP_VERSION"
if [ ! -x "$PEER/llama-bench" ] || [ ! -x "$PEER/llama-quantize" ]; then
  echo "building llama.cpp (llama-cpp-python $LCP_VERSION source) into $PEER, once"
  tmp=$(mktemp -d)
  "$CACHE/refvenv/bin/pip" download -q --no-deps --no-binary :all: \
    "llama-cpp-python==$LCP_VERSION" -d "$tmp"
  tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  src="$tmp/llama_cpp_python-$LCP_VERSION/vendor/llama.cpp"
  cmake -S "$src" -B "$tmp/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF >/dev/null
  cmake --build "$tmp/build" -j"$(nproc)" --target llama-bench llama-quantize >/dev/null
  mkdir -p "$PEER"
  cp "$tmp/build/bin/llama-bench" "$tmp/build/bin/llama-quantize" "$PEER/"
  rm -rf "$tmp"
fi

M=build/bench-models
mkdir -p "$M"
if [ ! -f "$M/tinyllama-bf16.gguf" ]; then
  build/bin/shardserve gen-model --arch llama --out "$M/tinyllama-bf16.gguf" --format gguf \
    --gguf-type bf16 --layers 22 --hidden 2048 --intermediate 5632 --heads 32 --kv-heads 4 \
    --vocab 32000 --dtype bf16 --seed 1
fi
for q in Q8_0 Q4_K_M; do
  lower=$(echo "$q" | tr 'A-Z' 'a-z')
  [ -f "$M/tinyllama-$lower.gguf" ] ||
    "$PEER/llama-quantize" "$M/tinyllama-bf16.gguf" "$M/tinyllama-$lower.gguf" "$q" >/dev/null 2>&1
done
FILES=("$@")
if [ ${#FILES[@]} -eq 0 ]; then
  FILES=("$M/tinyllama-bf16.gguf" "$M/tinyllama-q8_0.gguf" "$M/tinyllama-q4_k_m.gguf"
    "$CACHE/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
fi

for f in "${FILES[@]}"; do
  echo "=== $(basename "$f") ($(du -m "$f" | cut -f1) MB)"
  "$PEER/llama-bench" -m "$f" -t 1,2 -p 64 -n 64 -r 3 -o json 2>/dev/null | python3 -c '
import json, sys
for r in json.load(sys.stdin):
    kind = "prefill 64" if r["n_prompt"] else "decode    "
    threads, rate = r["n_threads"], r["avg_ts"]
    print(f"llama.cpp  {kind} {threads} thread(s): {rate:8.2f} tokens/s")'
  for t in 1 2; do
    build/bin/shardserve bench --model "$f" --threads "$t" --decode-tokens 64 \
      --prefill-tokens 64 | python3 -c '
import re, sys
t = sys.argv[1]
for line in sys.stdin:
    m = re.match(r"decode  batch 1 \(median step\): ([\d.]+) tokens/s.*= (\d+)% of read", line)
    if m:
        print(f"shardserve decode     {t} thread(s): {float(m[1]):8.2f} tokens/s"
              f"  ({m[2]}% of the read roofline)")
    m = re.match(r"prefill 64 tokens: ([\d.]+) tokens/s", line)
    if m:
        print(f"shardserve prefill 64 {t} thread(s): {float(m[1]):8.2f} tokens/s")' "$t"
  done
done

echo "=== the decode kernels alone (one thread)"
build/bin/shardserve bench kernels --threads 1
