#!/usr/bin/env bash
# On a GPU machine without network (CUDA 13 toolkit, cmake, ninja, g++, Python with PyTorch and
# its NCCL wheel): builds shardserve with that toolkit against the prefix of scripts/gpu-prefix.sh,
# then runs the GPU checks — cuda_tests, the CUDA generation and `shardserve local` tests against
# the CPU backend — and, unless told not to, bench/cuda.sh with its PyTorch peer. Writes build.log,
# one log per check and summary.txt into OUT; prints the summary. Exit status: 0 when every check
# passed (a skip is not a failure).
# Usage: scripts/gpu-check.sh OUT [--prefix DIR] [--no-bench] [--bench-models "tinyllama ..."]
#                             [--profile] [--build-only] [--targets "cuda_tests shardserve ..."]
#                             [--prebuilt DIR] [--checks "cuda_tests cuda_generate ..."]
# --prebuilt DIR runs the binaries scripts/gpu-bundle.sh packed on the build machine
# (DIR/bundle.tar.xz) instead of building them here, and builds only if they do not start (from
# DIR/prefix.tar.xz where --prefix's folder is missing). --checks runs only the checks it names
# (cuda_tests, cuda_attention_split, cuda_attention_split-batched, cuda_attention_heads,
# cuda_quant_float, cuda_fp8_staged, cuda_generate, cuda_local; the bench is --no-bench's).
# --profile also runs ncu over two decode steps of each bench model (batch 1 and 32 after a
# 128-token prompt; TinyLlama also batch 16 after 2,048; the Q4_K GGUF at batch 1; PROFILE_ROWS
# chooses others) and writes the per-kernel tables (scripts/ncu_table.py) to OUT/profile.txt;
# PROFILE_DETAIL ("MODEL:BATCH:PROMPT:KERNEL_REGEX ...") adds ncu's sections (occupancy, warp
# stalls, memory) for one launch of each named kernel, in OUT/profile-detail.txt.
# NVCC, NCCL_DIR (include/, lib/), BUILD_DIR (build-gpu), BUILD_TYPE (Release) and BENCH_MODELS
# (where the benchmark's models are generated, /tmp/shardserve-bench-models) override what is found.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: scripts/gpu-check.sh OUT [--prefix DIR] [--no-bench] [--bench-models LIST] [--build-only [--targets LIST]]}"
shift
PREFIX=.gpu/prefix
BENCH=1
BENCH_SET="tinyllama llama3-8b"
BUILD_ONLY=0
PROFILE=0
PREBUILT=""
CHECKS=""
# The checks' binaries only (the unit tests are CI's): a third of the build.
TARGETS="cuda_tests shardserve shardserve-worker"
while (($#)); do
  case "$1" in
    --prefix) PREFIX="$2"; shift 2 ;;
    --no-bench) BENCH=0; shift ;;
    --profile) PROFILE=1; shift ;;
    --bench-models) BENCH_SET="$2"; shift 2 ;;
    --build-only) BUILD_ONLY=1; shift ;;
    --targets) TARGETS="$2"; shift 2 ;;
    --prebuilt) PREBUILT="$2"; shift 2 ;;
    --checks) CHECKS="$2"; shift 2 ;;
    *) echo "gpu-check: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
fail=0

# --- The machine ------------------------------------------------------------------------------
{
  head -1 /etc/os-release
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null ||
    echo "no GPU (nvidia-smi)"
  echo "$(nproc) CPUs; $(g++ --version | head -1); $(cmake --version | head -1)"
} | tee -a "$SUMMARY"

# --- The toolkit: nvcc and cuBLAS from the system or the Python wheels, NCCL from its wheel -----
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
[ -x "$NVCC" ] || { note "FAIL no nvcc on PATH or in /usr/local/cuda"; exit 1; }
CUDA_ROOT=$(dirname "$(dirname "$(realpath "$NVCC")")")
WHEELS=$(python3 -c 'import nvidia, os; print(nvidia.__path__[0])' 2>/dev/null || true)
NCCL_H=""
for d in ${NCCL_DIR:+"$NCCL_DIR/include"} "$WHEELS/nccl/include" "$CUDA_ROOT/include" /usr/include; do
  [ -f "$d/nccl.h" ] && { NCCL_H="$d"; break; }
done
NCCL_SO=$(ls ${NCCL_DIR:+"$NCCL_DIR"/lib/libnccl.so.*} "$WHEELS"/nccl/lib/libnccl.so.* \
  "$CUDA_ROOT"/lib64/libnccl.so.* \
  /usr/lib/x86_64-linux-gnu/libnccl.so.* 2>/dev/null | head -1)
[ -n "$NCCL_H" ] && [ -n "$NCCL_SO" ] || { note "FAIL NCCL (nccl.h, libnccl.so.*) not found"; exit 1; }
# The wheel has no unversioned libnccl.so to link with: a view of it that has.
BUILD="${BUILD_DIR:-build-gpu}"
NCCL_ROOT=$(realpath -m "$BUILD/nccl-view")  # kept with the build: its configuration names it
mkdir -p "$NCCL_ROOT/lib"
ln -sfn "$NCCL_H" "$NCCL_ROOT/include"
ln -sfn "$NCCL_SO" "$NCCL_ROOT/lib/libnccl.so"
note "toolkit: $("$NVCC" --version | tail -1); NCCL $NCCL_SO"

# --- Prebuilt binaries (scripts/gpu-bundle.sh): this machine's cuBLAS, CUDA runtime and NCCL ---
BIN=""
if [ -n "$PREBUILT" ]; then
  lib_dir() { dirname "$(find "$WHEELS" "$CUDA_ROOT" -name "$1" 2>/dev/null | head -1)"; }
  CUDA_LIBS=$(lib_dir libcublas.so.13)
  prev="${LD_LIBRARY_PATH:-}"
  export LD_LIBRARY_PATH="$CUDA_LIBS:$(lib_dir libcudart.so.13):$(dirname "$NCCL_SO")${prev:+:$prev}"
  mkdir -p "$BUILD"
  # Unpacked once: a second call of this script must not replace binaries that may be running.
  if { [ -x "$BUILD/bin/cuda_tests" ] || tar -C "$BUILD" -xJf "$PREBUILT/bundle.tar.xz"; } &&
    "$BUILD/bin/cuda_tests" --gtest_list_tests >/dev/null 2>"$OUT/build.log" &&
    "$BUILD/bin/shardserve" gen-model --help >/dev/null 2>>"$OUT/build.log"; then
    BIN=$(realpath "$BUILD/bin")
    note "PASS prebuilt binaries start ($PREBUILT/bundle.tar.xz; cuBLAS from $CUDA_LIBS)"
  else
    note "prebuilt binaries do not start here ($(tail -2 "$OUT/build.log" | tr '\n' ' ')): building"
    rm -rf "$BUILD/bin" "$BUILD/lib"
    [ -f "$PREFIX/.gathered" ] || [ ! -f "$PREBUILT/prefix.tar.xz" ] ||
      { mkdir -p "$PREFIX" && tar -C "$(dirname "$PREFIX")" -xJf "$PREBUILT/prefix.tar.xz"; }
  fi
fi

# --- Build (the binaries carry the prefix in DT_RPATH, which, unlike RUNPATH, also serves the
# libraries they load: Abseil's libraries need each other) -------------------------------------
# The Rust code (Jinja engine, llguidance) scripts/gpu-prefix.sh built (this machine has no cargo).
if [ -z "$BIN" ]; then
  [ -f "$PREFIX/.gathered" ] || {
    note "FAIL no prefix at $PREFIX: run scripts/gpu-prefix.sh on a build machine and bring it"
    exit 1
  }
  PREFIX=$(realpath "$PREFIX")
  LIBS="$PREFIX/usr/lib/x86_64-linux-gnu"
  RUST_LIB=""
  [ ! -f "$PREFIX/usr/lib/libshardserve_rust.a" ] || RUST_LIB="$PREFIX/usr/lib/libshardserve_rust.a"
  export PKG_CONFIG_LIBDIR="$LIBS/pkgconfig:$PREFIX/usr/share/pkgconfig"
  export PKG_CONFIG_SYSROOT_DIR="$PREFIX"
  t0=$(date +%s)
  if cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" \
      -DSHARDSERVE_CUDA=ON -DCMAKE_PREFIX_PATH="$PREFIX/usr" -DCMAKE_CUDA_COMPILER="$NVCC" \
      -DCUDAToolkit_ROOT="$CUDA_ROOT" -DNCCL_ROOT="$NCCL_ROOT" -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DSHARDSERVE_STYLE_CHECK=OFF -DCMAKE_CXX_FLAGS="-isystem $PREFIX/usr/include/x86_64-linux-gnu" \
      -DCMAKE_BUILD_RPATH="$LIBS;$(dirname "$NCCL_SO")" \
      -DCMAKE_EXE_LINKER_FLAGS=-Wl,--disable-new-dtags \
      ${RUST_LIB:+-DSHARDSERVE_RUST_LIB="$RUST_LIB"} >"$OUT/build.log" 2>&1 &&
    cmake --build "$BUILD" ${TARGETS:+--target $TARGETS} -- -j"$(nproc)" >>"$OUT/build.log" 2>&1; then
    note "PASS build with the machine's toolkit against the prefix ($(($(date +%s) - t0)) s)"
  else
    note "FAIL build: $(grep -m3 -E 'error|Error' "$OUT/build.log" | tr '\n' ' ')"
    tail -40 "$OUT/build.log"
    exit 1
  fi
  BIN=$(realpath "$BUILD/bin")
fi
((BUILD_ONLY)) && exit 0

# --- Checks -----------------------------------------------------------------------------------
check() {  # check NAME COMMAND...: runs it with its log in OUT/NAME.log; 77 is a skip
  local name="$1"; shift
  local t0 rc
  [ -z "$CHECKS" ] || [[ " $CHECKS " == *" $name "* ]] || return 0
  t0=$(date +%s)
  "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  local took=$(($(date +%s) - t0))
  case "$rc" in
    0) note "PASS $name (${took} s)" ;;
    77) note "SKIP $name: $(tail -1 "$OUT/$name.log")" ;;
    *) note "FAIL $name (exit $rc): $(grep -E 'FAIL|Error|error' "$OUT/$name.log" | head -5 |
      tr '\n' ' ')"; fail=1 ;;
  esac
}
check cuda_tests "$BIN/cuda_tests"
[ ! -f "$OUT/cuda_tests.log" ] ||
  grep -E '^\[  (SKIPPED|FAILED) \] [A-Za-z/.0-9]+$' "$OUT/cuda_tests.log" | tee -a "$SUMMARY"
# Attention chooses among three decode kernels by shape: each forced through the attention cases.
for v in split split-batched heads; do
  check "cuda_attention_$v" env SHARDSERVE_CUDA_ATTN_KERNEL=$v "$BIN/cuda_tests" \
    --gtest_filter='*Attention*'
done
# The float quantized GEMV (F32 inputs; the default is dp4a's int8 inputs) through the
# quantized-weights cases.
check cuda_quant_float env SHARDSERVE_CUDA_QUANT_GEMV=float "$BIN/cuda_tests" \
  --gtest_filter='*Quantized*'
# FP8's staged GEMV (the default, direct, reads each block straight) through the same cases
# (F8_128 among them; cuda_generate runs the FP8 models with it too).
check cuda_fp8_staged env SHARDSERVE_CUDA_FP8_GEMV=staged "$BIN/cuda_tests" \
  --gtest_filter='*Quantized*'
check cuda_generate python3 tests/cli/cuda_generate_test.py "$BIN/shardserve"
check cuda_local python3 tests/cli/cuda_local_test.py "$BIN/shardserve"
if ((BENCH)); then
  check bench env SHARDSERVE_BIN="$BIN" BENCH_MODELS="${BENCH_MODELS:-/tmp/shardserve-bench-models}" PEER_PYTHON=python3 \
    bash bench/cuda.sh "$BENCH_SET"
  grep -E '^(===|model:|decode batch|prefill batch|peer |shardserve / peer|\[attention|\[quant|\[fp8|concurrency|[0-9]+ +[0-9.]+ )' "$OUT/bench.log" |
    tee -a "$SUMMARY"
fi
if ((PROFILE)); then
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  : >"$OUT/profile.txt"
  profile() {  # profile MODEL BATCH PROMPT (MODEL: a bench shape in BF16, or a .gguf the bench made)
    local dir="${BENCH_MODELS:-/tmp/shardserve-bench-models}/$1" csv="$OUT/ncu-${1%.gguf}-b$2-p$3.csv"
    [[ "$1" == *.gguf ]] || dir="$dir-bf16"
    [ -e "$dir" ] || { note "SKIP profile $1: no model at $dir (run the bench)"; return; }
    "$NCU" --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
      --print-units base --log-file "$csv" "$BIN/shardserve" bench cuda --model "$dir" \
      --batch "$2" --steps 3 --profile-steps 2 --prompt-tokens "$3" >>"$OUT/profile.log" 2>&1 ||
      { note "FAIL profile $1 b$2 p$3: $(tail -2 "$OUT/profile.log" | tr '\n' ' ')"; fail=1; return; }
    python3 scripts/ncu_table.py "$csv" 2 "$1 batch $2, $3-token prompt" >>"$OUT/profile.txt"
  }
  detail() {  # detail MODEL BATCH PROMPT KERNEL: ncu's sections for one launch of KERNEL (a regex)
    local dir="${BENCH_MODELS:-/tmp/shardserve-bench-models}/$1"
    [[ "$1" == *.gguf ]] || dir="$dir-bf16"
    [ -e "$dir" ] || { note "SKIP detail $1: no model at $dir (run the bench)"; return; }
    {
      echo "=== $4 in $1 batch $2, $3-token prompt"
      "$NCU" --clock-control none --profile-from-start off -k "regex:$4" -c 1 \
        --section SpeedOfLight --section LaunchStats --section Occupancy \
        --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
        "$BIN/shardserve" bench cuda --model "$dir" --batch "$2" --steps 3 --profile-steps 2 \
        --prompt-tokens "$3" 2>&1 | grep -vE '^(decode|prefill|model:|copy)' | sed -n '/==PROF==/,$p'
    } >>"$OUT/profile-detail.txt"
  }
  if [ -z "$NCU" ]; then
    note "SKIP profile: no ncu"
  else
    # PROFILE_ROWS: "MODEL:BATCH:PROMPT ..." (default: batch 1 and 32 of each bench model, TinyLlama
    # also batch 16 after 2,048 tokens, and each model's Q4_K GGUF at batch 1).
    rows="${PROFILE_ROWS:-}"
    if [ -z "$rows" ]; then
      for m in $BENCH_SET; do
        rows+=" $m:1:128 $m:32:128 $m-q4_k.gguf:1:128"
        [ "$m" = tinyllama ] && rows+=" $m:16:2048"
      done
    fi
    for row in $rows; do
      IFS=: read -r m b p <<<"$row"
      profile "$m" "$b" "$p"
    done
    # PROFILE_DETAIL: "MODEL:BATCH:PROMPT:KERNEL ..." (ncu's sections for one launch of each,
    # into OUT/profile-detail.txt).
    for row in ${PROFILE_DETAIL:-}; do
      IFS=: read -r m b p k <<<"$row"
      detail "$m" "$b" "$p" "$k"
    done
    note "profile: $OUT/profile.txt"
    cat "$OUT/profile.txt"
  fi
fi
exit "$fail"
