#!/usr/bin/env bash
# The CPU kernels on 64-bit ARM: cross-builds the portable kernels (backend/cpu/kernels_portable.cc,
# quant_portable.cc) and their tests (kernel_tests: the kernel tests and the CPU backend's op
# conformance suite) with Debian's aarch64 cross compiler, and runs them under qemu-user.
#   bash scripts/arm64-kernels.sh [BUILD_DIR] [gtest args...]   (default build/arm64)
# Needs what scripts/setup.sh installs: g++-aarch64-linux-gnu, qemu-user and the arm64 sysroot of
# Abseil and GoogleTest under $SHARDSERVE_CACHE/arm64-sysroot.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${SHARDSERVE_CACHE:-$HOME/.cache/shardserve}"
SYSROOT="$CACHE/arm64-sysroot"
BUILD="${1:-build/arm64}"
shift || true
for tool in aarch64-linux-gnu-g++ qemu-aarch64; do
  command -v "$tool" >/dev/null || { echo "arm64-kernels.sh: $tool is missing (scripts/setup.sh)" >&2; exit 1; }
done
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSHARDSERVE_KERNELS_ONLY=ON \
  -DSHARDSERVE_ARM64_SYSROOT="$SYSROOT" \
  -DCMAKE_TOOLCHAIN_FILE="$PWD/cmake/aarch64-linux-gnu.cmake" >/dev/null
ninja -C "$BUILD" kernel_tests >/dev/null
readelf -h "$BUILD/bin/kernel_tests" | grep -q "Machine: *AArch64" ||
  { echo "arm64-kernels.sh: $BUILD/bin/kernel_tests is not an aarch64 binary" >&2; exit 1; }
# The guest's dynamic loader and C++ libraries from the cross toolchain, Abseil from the sysroot.
exec qemu-aarch64 -L /usr/aarch64-linux-gnu \
  -E LD_LIBRARY_PATH="$SYSROOT/usr/lib/aarch64-linux-gnu" "$BUILD/bin/kernel_tests" "$@"
