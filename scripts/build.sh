#!/usr/bin/env bash
# Configures (once) and builds shardserve into build/ (binaries in build/bin/). Incremental.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${BUILD_DIR:-build}"
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DSHARDSERVE_CUDA="${SHARDSERVE_CUDA:-AUTO}" >"$BUILD_DIR.configure.log" 2>&1 ||
    { cat "$BUILD_DIR.configure.log"; exit 1; }
  grep -E '^-- shardserve:' "$BUILD_DIR.configure.log" || true
  rm -f "$BUILD_DIR.configure.log"
fi
# Quiet progress lines; pipefail keeps the build's own exit status.
cmake --build "$BUILD_DIR" -- -j"${JOBS:-$(nproc)}" | { grep -vE '^\[[0-9]+/[0-9]+\] ' || true; }
