#!/usr/bin/env bash
# The GPU machine's path without a GPU (scripts/gpu-prefix.sh, scripts/gpu-check.sh): gathers the
# prefix, hides every Debian package it holds from this machine (an overlay on /usr with the
# packages' files whited out, in a mount namespace of this test alone), then builds the binaries
# the GPU checks run against the prefix and the CUDA wheels alone, and runs them: the CLI answers,
# cuda_tests loads its libraries from the prefix (and skips: no GPU). Then those binaries packed
# by scripts/gpu-bundle.sh run through scripts/gpu-check.sh --prebuilt with the packages hidden
# and the prefix gone: the bundle carries every library they need beside glibc, libstdc++ and
# CUDA's. Needs root (mount
# namespaces), as CI has; skips (77) without it or without the CUDA wheels. The build stays in
# .gpu/build-prefix (ignored by git), at the same place in every checkout, so ccache serves its
# objects to the next checkout too. It is a Debug build: what is tested is that it builds, links and
# loads against the prefix, and unoptimised it compiles in two thirds of the time (the GPU machine
# builds Release).
set -euo pipefail
cd "$(dirname "$0")/../.."
CACHE="${SHARDSERVE_CACHE:-$HOME/.cache/shardserve}"
CUDA="$CACHE/cuda13/nvidia"
[ -x "$CUDA/cu13/bin/nvcc" ] || { echo "SKIP: no CUDA wheels in $CUDA (scripts/setup.sh)"; exit 77; }
unshare -m true 2>/dev/null || { echo "SKIP: no mount namespaces here (needs root)"; exit 77; }

bash scripts/gpu-prefix.sh
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Whiteouts (0/0 character devices) for the packages' files under /usr; the libraries the system
# itself runs on (TLS, zlib, curl, PCRE2, pkg-config) stay, as they do on the GPU machine.
mkdir -p "$tmp/upper" "$tmp/work"
keep='^(libssl3|zlib1g|libcurl4|libbrotli1|libpcre2-8-0|pkgconf|pkgconf-bin|libpkgconf3)$'
dpkg -L $(bash scripts/gpu-prefix.sh --list | grep -vE "$keep") | python3 -c '
import os, stat, sys
upper, hidden = sys.argv[1], 0
for line in sys.stdin:
    f = os.path.join(os.path.realpath(os.path.dirname(line.strip())), os.path.basename(line.strip()))
    if not f.startswith("/usr/") or not (os.path.isfile(f) or os.path.islink(f)):
        continue
    w = upper + f[len("/usr"):]
    os.makedirs(os.path.dirname(w), exist_ok=True)
    if not os.path.exists(w):
        os.mknod(w, stat.S_IFCHR | 0o600, os.makedev(0, 0))
        hidden += 1
print(f"hiding {hidden} files of the gathered packages")
' "$tmp/upper"
unshare -m --propagation private bash -euo pipefail -c '
  mount -t overlay overlay -o "lowerdir=/usr,upperdir=$1/upper,workdir=$1/work" /usr
  for h in /usr/include/absl/base/config.h /usr/include/boost/asio.hpp /usr/include/yaml-cpp/yaml.h \
           /usr/lib/x86_64-linux-gnu/libabsl_base.so.20220623 /usr/include/CLI/CLI.hpp; do
    [ ! -e "$h" ] || { echo "FAIL: $h is still visible: the build would not be against the prefix"; exit 1; }
  done
  NVCC="$2/cu13/bin/nvcc" NCCL_DIR="$2/nccl" BUILD_DIR="$3" BUILD_TYPE=Debug \
    bash scripts/gpu-check.sh "$1/out" --build-only --targets "cuda_tests shardserve shardserve-worker ss_jinja" ||
    { tail -30 "$1/out/build.log"; exit 1; }
  # ldd is read whole before the match (grep -q stops reading at its first match, and ldd, still
  # writing, would die of SIGPIPE and fail the pipeline under pipefail). The build resolves the
  # prefix (scripts/gpu-check.sh: realpath), so the comparison does too: a checkout reached through
  # a symbolic link has a $PWD that differs from the path in DT_RPATH.
  libs=$(ldd "$3/bin/shardserve")
  grep -q "libabsl_base.so.20220623 => $(pwd -P)/.gpu/prefix/" <<<"$libs" ||
    { echo "FAIL: shardserve does not load Abseil from $(pwd -P)/.gpu/prefix"; echo "$libs"; exit 1; }
  help=$("$3/bin/shardserve" --help)
  grep -q "^commands:" <<<"$help" ||
    { echo "FAIL: the CLI built against the prefix does not answer --help"; exit 1; }
  "$3/bin/cuda_tests" --gtest_brief=1 | tail -3
' _ "$tmp" "$CUDA" "$(pwd -P)/.gpu/build-prefix"

bash scripts/gpu-bundle.sh --build "$(pwd -P)/.gpu/build-prefix" --out "$tmp/bundle" --no-prefix
unshare -m --propagation private bash -euo pipefail -c '
  mount -t overlay overlay -o "lowerdir=/usr,upperdir=$1/upper,workdir=$1/work" /usr
  mount -t tmpfs tmpfs .gpu/prefix  # the prefix gone: the bundle alone
  NVCC="$2/cu13/bin/nvcc" NCCL_DIR="$2/nccl" BUILD_DIR="$1/run" \
    bash scripts/gpu-check.sh "$1/out-bundle" --prebuilt "$1/bundle" --build-only ||
    { cat "$1/out-bundle/summary.txt"; exit 1; }
  grep -q "^PASS prebuilt binaries start" "$1/out-bundle/summary.txt" ||
    { echo "FAIL: the bundle did not start:"; cat "$1/out-bundle/summary.txt"; exit 1; }
  export LD_LIBRARY_PATH="$2/cu13/lib:$2/nccl/lib"
  libs=$(ldd "$1/run/bin/shardserve-worker")
  ! grep "not found" <<<"$libs" || { echo "FAIL: the bundle lacks a library"; exit 1; }
  grep -q "libabsl_base.so.20220623 => $1/run/bin/../lib/" <<<"$libs" ||
    { echo "FAIL: the worker does not load Abseil from the bundle"; echo "$libs"; exit 1; }
  help=$("$1/run/bin/shardserve" --help)
  grep -q "^commands:" <<<"$help" || { echo "FAIL: the bundled CLI does not answer --help"; exit 1; }
  "$1/run/bin/cuda_tests" --gtest_brief=1 | tail -3
' _ "$tmp" "$CUDA"
echo "PASS: built and ran against the prefix alone, and as a bundle without it"
