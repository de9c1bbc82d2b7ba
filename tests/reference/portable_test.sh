#!/usr/bin/env bash
# The portable CPU kernels end to end (backend/cpu/kernels_portable.cc, quant_portable.cc: what a
# CPU other than x86-64 builds; arm64.kernels runs their kernel tests on ARM): shardserve built
# with SHARDSERVE_PORTABLE_KERNELS in a build directory of its own (ccache gives it the main
# build's other objects; the main build's Rust library), then against transformers on generated
# models of each attention kind (GQA, MoE, sliding window with sinks, MLA; TP and PP as each case
# runs them) and on the real SmolLM2-135M's Q4_1 GGUF (skipped without it).
#   portable_test.sh MAIN_BUILD_DIR REF_PYTHON
set -euo pipefail
main="$1" python="$2"
src="$(cd "$(dirname "$0")/../.." && pwd)"
build="$main/portable"
cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSHARDSERVE_CUDA=OFF \
  -DSHARDSERVE_PORTABLE_KERNELS=ON \
  -DSHARDSERVE_RUST_LIB="$main/src/rust/release/libshardserve_rust.a" >/dev/null
ninja -C "$build" shardserve shardserve-worker >/dev/null
bin="$build/bin/shardserve"
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
for case in llama_gqa_bf16 mixtral_f32 gpt_oss_bf16 deepseek_v3_plain_bf16; do
  out=$("$python" "$src/tests/reference/check_reference.py" --shardserve "$bin" --case "$case")
  echo "$out"
  grep -q "CPU kernels portable" <<<"$out" ||
    { echo "portable_test.sh: $case did not run the portable kernels" >&2; exit 1; }
done
rc=0
"$python" "$src/tests/reference/check_gguf.py" "$bin" smollm2 || rc=$?
[ "$rc" = 0 ] || [ "$rc" = 77 ] || exit "$rc"
