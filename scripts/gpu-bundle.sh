#!/usr/bin/env bash
# Packs the GPU checks' binaries as this machine built them (cuda_tests, shardserve,
# shardserve-worker; CUDA code for sm_90, cmake/cuda.cmake) with the shared libraries they need
# beside glibc, libstdc++ and CUDA's own, so that a lent GPU machine runs them without spending
# its minutes on a build: scripts/gpu-check.sh --prebuilt DIR unpacks them into build-gpu/
# (bin/, lib/) and builds from the prefix only if they do not start there. The binaries are
# stripped and find lib/ through DT_RPATH ($ORIGIN/../lib, which also serves the libraries they
# load); cuBLAS, the CUDA runtime and NCCL come from the GPU machine's own wheels
# (LD_LIBRARY_PATH, set by gpu-check.sh). Also packs .gpu/prefix (scripts/gpu-prefix.sh) beside
# it as prefix.tar.xz, for that fallback (--no-prefix: not).
# Usage: scripts/gpu-bundle.sh [--build DIR (default build)] [--out DIR (default .gpu)]
#                              [--no-prefix]
# (patchelf: scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build
OUT=.gpu
PREFIX=1
while (($#)); do
  case "$1" in
    --build) BUILD="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --no-prefix) PREFIX=0; shift ;;
    *) echo "gpu-bundle: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
log() { echo "gpu-bundle: $*" >&2; }
command -v patchelf >/dev/null || { log "no patchelf: run scripts/setup.sh"; exit 1; }
BINS=(cuda_tests shardserve shardserve-worker)
ninja -C "$BUILD" "${BINS[@]}" >/dev/null
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/bin" "$tmp/lib" "$OUT"
for b in "${BINS[@]}"; do
  cp "$BUILD/bin/$b" "$tmp/bin/"
  strip "$tmp/bin/$b"
  patchelf --force-rpath --set-rpath '$ORIGIN/../lib' "$tmp/bin/$b"
done
# Every library the loader resolves for them outside glibc (its libresolv too), libstdc++/libgcc
# and CUDA (cuBLAS, cudart, NCCL: the GPU machine's wheels match its driver), under its soname.
for b in "${BINS[@]}"; do ldd "$BUILD/bin/$b"; done |
  awk '$3 ~ /^\// { print $1, $3 }' | sort -u |
  grep -vE '^(libc|libm|libdl|libpthread|librt|libmvec|libresolv|libnsl|libutil|libanl)\.so' |
  grep -vE '^(libstdc\+\+|libgcc_s|libcublas|libcublasLt|libcudart|libnccl)\.so' |
  while read -r name path; do cp -L "$path" "$tmp/lib/$name"; done
tar -C "$tmp" -cf - bin lib | xz -T0 -3 >"$OUT/bundle.tar.xz"
log "$(du -h "$OUT/bundle.tar.xz" | cut -f1) in $OUT/bundle.tar.xz" \
  "($(ls "$tmp/lib" | wc -l) libraries)"
((PREFIX)) || exit 0
[ -f .gpu/prefix/.gathered ] || bash scripts/gpu-prefix.sh
tar -C .gpu -cf - prefix | xz -T0 -3 >"$OUT/prefix.tar.xz"
log "$(du -h "$OUT/prefix.tar.xz" | cut -f1) in $OUT/prefix.tar.xz"
