#!/usr/bin/env bash
# shardserve beside llama.cpp on the same GGUF files, on this machine's CPU: llama.cpp built from
# the source the PyPI llama-cpp-python source package carries (a benchmark peer, never a
# dependency of the product; built once into the cache), `llama-bench -t 1,2 -p 64 -n 64`
# against `shardserve bench` decode (batch 1) and prefill of 64 tokens at 1 and 2 threads, with
# the read-bandwidth roofline shardserve's bench measures in the same run.
# Files: a TinyLlama-1.1B-shaped model written by `gen-model --format gguf` as BF16, its Q8_0 and
# Q4_K_M made by llama-quantize, and the real SmolLM2-135M-Instruct (Q4_1). Then the decode
# kernels alone per weight type (`shardserve bench kernels`).
# Usage: [ROUNDS=N] bench/llama_cpp.sh [FILES...]   (default: 3 rounds, all of the above)
set -euo pipefail
cd "$(dirname "$0")/.."
SHARDSERVE_SKIP_REFERENCE=1 bash scripts/setup.sh
bash scripts/build.sh
CACHE="${SHARDSERVE_CACHE:-$HOME/.cache/shardserve}"
LCP_VERSION=0.3.36
# The peer is built for the instruction set our kernels run at: natively (AVX-512 where the CPU
# has it) by default, and for x86-64-v3 (AVX2 + FMA + F16C, no AVX-512) when
# SHARDSERVE_CPU_KERNELS=avx2 forces our AVX2 path, so that the forced run stands for a machine
# without AVX-512 on both sides (PEER_NATIVE=1 keeps the native peer there instead); with AVX-VNNI
# on both sides where the CPU has it (our avx2 level takes it: cpu_features.h's UsesVnni), as on
# Alder Lake and later, whose native llama.cpp uses it.
if [ "${SHARDSERVE_CPU_KERNELS:-}" = avx2 ] && [ "${PEER_NATIVE:-0}" != 1 ]; then
  AVX_VNNI=OFF
  PEER="$CACHE/llama.cpp-$LCP_VERSION-avx2"
  if grep -qw avx_vnni /proc/cpuinfo; then
    AVX_VNNI=ON
    PEER="$PEER-avxvnni"
  fi
  PEER_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
    -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
    -DGGML_AVX512_BF16=OFF "-DGGML_AVX_VNNI=$AVX_VNNI" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
    -DGGML_AMX_BF16=OFF)
else
  PEER="$CACHE/llama.cpp-$LCP_VERSION"
  PEER_FLAGS=(-DGGML_NATIVE=ON)
fi
if [ ! -x "$PEER/llama-bench" ] || [ ! -x "$PEER/llama-quantize" ]; then
  echo "building llama.cpp (llama-cpp-python $LCP_VERSION source, ${PEER_FLAGS[*]}) into $PEER, once"
  tmp=$(mktemp -d)
  "$CACHE/refvenv/bin/pip" download -q --no-deps --no-binary :all: \
    "llama-cpp-python==$LCP_VERSION" -d "$tmp"
  tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  src="$tmp/llama_cpp_python-$LCP_VERSION/vendor/llama.cpp"
  # The peer's own compiler warnings (thousands with GCC 12's AVX-512 headers) go to a log that
  # is shown only if its build fails.
  if ! { cmake -S "$src" -B "$tmp/build" -DCMAKE_BUILD_TYPE=Release "${PEER_FLAGS[@]}" \
      -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_BUILD_SERVER=OFF &&
    cmake --build "$tmp/build" -j"$(nproc)" --target llama-bench llama-quantize; } \
    >"$tmp/build.log" 2>&1; then
    tail -30 "$tmp/build.log" >&2
    echo "building llama.cpp failed (above)" >&2
    exit 1
  fi
  mkdir -p "$PEER"
  cp "$tmp/build/bin/llama-bench" "$tmp/build/bin/llama-quantize" "$PEER/"
  rm -rf "$tmp"
fi
echo "peer: $PEER"

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

# ROUNDS rounds (default 3) per file; in each, one llama-bench run (-r 1) and one shardserve
# bench at 1 and at 2 threads, the tool that goes first alternating, so that the slow drifts of a
# shared machine (its memory bandwidth moves 20-30 % between minutes) fall on both tools alike.
# Each figure is the median over the rounds, with its range; "ratio" is the median of the rounds'
# shardserve / llama.cpp ratios, each from two runs minutes apart at most.
ROUNDS="${ROUNDS:-3}"
RESULTS=$(mktemp)
trap 'rm -f "$RESULTS"' EXIT
# llama.cpp 0.3.36 built natively on a CPU with AMX dies (general protection fault) in its
# repacked weights' path for some files (Q8_0 on a Xeon with AMX, 2026-12-02): such a file is run
# again without repacking (--repack 0), and the script says so.
llama() {
  local out
  if ! out=$("$PEER/llama-bench" -m "$1" -t 1,2 -p 64 -n 64 -r 1 -o json 2>/dev/null); then
    echo "llama-bench failed on $(basename "$1") (its repacked weights' path); again with --repack 0"
    out=$("$PEER/llama-bench" -m "$1" -t 1,2 -p 64 -n 64 -r 1 -o json --repack 0 2>/dev/null)
  fi
  python3 -c '
import json, sys
for r in json.load(sys.stdin):
    kind = "prefill" if r["n_prompt"] else "decode"
    print(json.dumps({"file": sys.argv[1], "tool": "llama.cpp", "kind": kind,
                      "threads": r["n_threads"], "rate": r["avg_ts"]}))' "$1" <<<"$out" >>"$RESULTS"
}
ours() {
  for t in 1 2; do
    build/bin/shardserve bench --model "$1" --threads "$t" --decode-tokens 64 \
      --prefill-tokens 64 | python3 -c '
import json, re, sys
f, t = sys.argv[1], int(sys.argv[2])
for line in sys.stdin:
    m = re.match(r"decode  batch 1 \(median step\): ([\d.]+) tokens/s.*= (\d+)% of read", line)
    if m:
        print(json.dumps({"file": f, "tool": "shardserve", "kind": "decode", "threads": t,
                          "rate": float(m[1]), "roofline": int(m[2])}))
    m = re.match(r"prefill 64 tokens: ([\d.]+) tokens/s", line)
    if m:
        print(json.dumps({"file": f, "tool": "shardserve", "kind": "prefill", "threads": t,
                          "rate": float(m[1])}))' "$1" "$t" >>"$RESULTS"
  done
}
for f in "${FILES[@]}"; do
  echo "=== $(basename "$f") ($(du -m "$f" | cut -f1) MB), $ROUNDS rounds"
  for r in $(seq "$ROUNDS"); do
    if [ $((r % 2)) -eq 1 ]; then llama "$f"; ours "$f"; else ours "$f"; llama "$f"; fi
  done
  python3 - "$f" "$RESULTS" <<'PY'
import json, statistics, sys
f = sys.argv[1]
rows = [r for r in map(json.loads, open(sys.argv[2])) if r["file"] == f]
def runs(tool, kind, t):
    return [r for r in rows if (r["tool"], r["kind"], r["threads"]) == (tool, kind, t)]
def spread(v):
    return f"{statistics.median(v):8.2f} ({min(v):.2f}-{max(v):.2f})"
for kind in ("decode", "prefill"):
    for t in (1, 2):
        ours, peer = runs("shardserve", kind, t), runs("llama.cpp", kind, t)
        if not ours or not peer:
            print(f"{kind} {t} thread(s): missing runs (shardserve {len(ours)}, llama.cpp {len(peer)})")
            continue
        a, b = [r["rate"] for r in ours], [r["rate"] for r in peer]
        ratio = statistics.median(x / y for x, y in zip(a, b))
        line = (f"{kind:7s} {t} thread(s), tokens/s: shardserve {spread(a)}  llama.cpp "
                f"{spread(b)}  ratio {ratio:.2f}")
        if kind == "decode":
            roof = [r["roofline"] for r in ours]
            line += f"  roofline {statistics.median(roof):.0f}% ({min(roof)}-{max(roof)}%)"
        print(line)
PY
done

echo "=== the decode kernels alone (one thread)"
build/bin/shardserve bench kernels --threads 1
