#!/usr/bin/env bash
# Gathers what a GPU machine without network needs, beside its own CUDA toolkit, cmake, ninja and
# g++, to build shardserve (scripts/gpu-check.sh builds there): the Debian packages of our C++
# dependencies, headers and libraries, unpacked into a prefix, and our Rust crate's static library
# (the Jinja engine). Boost's headers are cut to the ones
# our sources reach (from the compiler's own dependency lists); documentation is dropped. Runs on a
# build machine with Debian's apt and scripts/setup.sh done; idempotent.
# Usage: scripts/gpu-prefix.sh [PREFIX]   (default .gpu/prefix, git-ignored)
#        scripts/gpu-prefix.sh --list     (the Debian packages it gathers, one a line)
set -euo pipefail
cd "$(dirname "$0")/.."
PREFIX="${1:-.gpu/prefix}"
CACHE="${SHARDSERVE_CACHE:-$HOME/.cache/shardserve}"
DEBS="$CACHE/gpu-debs"
log() { echo "gpu-prefix: $*" >&2; }

# Headers, CMake configs and pkg-config files (-dev), the shared libraries they name, and the
# -dev packages their CMake configs look for (cpprestsdk's Boost components, prometheus-cpp's
# civetweb and CURL). pkgconf for a machine without pkg-config.
PKGS=(libabsl-dev libabsl20220623 nlohmann-json3-dev libgtest-dev libgmock-dev libcli11-dev
  libssl-dev libssl3 zlib1g-dev zlib1g libbrotli-dev libbrotli1
  prometheus-cpp-dev libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 libprometheus-cpp-push1.0
  libcivetweb-dev libcivetweb1 civetweb libcurl4-openssl-dev libcurl4 libpugixml-dev libpugixml1v5
  libcpprest-dev libcpprest2.10 libwebsocketpp-dev libyaml-cpp-dev libyaml-cpp0.7
  libpcre2-dev libpcre2-8-0 libutf8proc-dev libutf8proc2 libcpp-httplib-dev libcpp-httplib0.11
  libboost1.74-dev libboost-system1.74-dev libboost-system1.74.0
  libboost-random1.74-dev libboost-random1.74.0 libboost-thread1.74-dev libboost-thread1.74.0
  libboost-filesystem1.74-dev libboost-filesystem1.74.0 libboost-chrono1.74-dev
  libboost-chrono1.74.0 libboost-atomic1.74-dev libboost-atomic1.74.0
  libboost-date-time1.74-dev libboost-date-time1.74.0 libboost-regex1.74-dev
  libboost-regex1.74.0 pkgconf pkgconf-bin libpkgconf3)

if [ "$PREFIX" = --list ]; then
  printf '%s\n' "${PKGS[@]}"
  exit 0
fi

# The packages at the versions this machine built and tested with (its own installed ones).
mkdir -p "$DEBS"
want=()
for p in "${PKGS[@]}"; do
  v=$(dpkg-query -W -f='${Version}' "$p" 2>/dev/null) ||
    { log "package $p is not installed here: run scripts/setup.sh (or apt-get install $p)"; exit 1; }
  ls "$DEBS/${p}_"*.deb >/dev/null 2>&1 || want+=("$p=$v")
done
if ((${#want[@]})); then
  log "downloading ${#want[@]} Debian packages into $DEBS"
  # A version the mirror no longer serves (a security update since) falls back to its candidate.
  for pv in "${want[@]}"; do
    (cd "$DEBS" && { apt-get download -qq "$pv" || apt-get download -qq "${pv%%=*}"; } \
      >/dev/null 2>&1) || { log "apt-get download ${pv%%=*} failed (apt-get update first?)"; exit 1; }
  done
fi

# Boost headers our sources reach: preprocess every source that includes Boost or cpprestsdk
# (which includes Boost.Asio) with the compile flags of a configured build and keep each header
# the compiler opened.
stamp="$PREFIX/.gathered"
sources=$(grep -rlE '#include <(boost|cpprest|pplx)/' src operator worker tests | sort)
rust=(src/rust/Cargo.toml src/rust/Cargo.lock src/rust/src/lib.rs src/tokenizer/jinja/Cargo.toml src/tokenizer/jinja/src/lib.rs)
sum=$( (printf '%s\n' "${PKGS[@]}"; cat $sources "${rust[@]}") | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$sum" ]; then exit 0; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake -S . -B "$tmp/build" -G Ninja -DSHARDSERVE_CUDA=OFF >"$tmp/configure.log" 2>&1 ||
  { cat "$tmp/configure.log"; exit 1; }
python3 - "$tmp/build/compile_commands.json" $sources >"$tmp/boost-headers" <<'EOF'
import json, os, shlex, subprocess, sys
commands = {os.path.realpath(c["file"]): c for c in json.load(open(sys.argv[1]))}
headers = set()
for source in sys.argv[2:]:
    c = commands.get(os.path.realpath(source))
    if c is None:
        continue
    args = [a for a in shlex.split(c["command"]) if a not in ("-c",)]
    if "-o" in args:
        i = args.index("-o"); del args[i:i + 2]
    out = subprocess.run(args + ["-M"], cwd=c["directory"], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"gpu-prefix: {source}: {out.stderr}")
    for word in out.stdout.replace("\\\n", " ").split():
        if word.startswith("/usr/include/boost/"):
            headers.add(os.path.normpath(word))
print("\n".join(sorted(headers)))
EOF

rm -rf "$PREFIX"
mkdir -p "$PREFIX"
for p in "${PKGS[@]}"; do dpkg -x "$(ls "$DEBS/${p}_"*.deb | tail -1)" "$PREFIX"; done
rm -rf "$PREFIX/usr/share/doc" "$PREFIX/usr/share/man" "$PREFIX/usr/share/lintian" \
  "$PREFIX/usr/share/doc-base" "$PREFIX/usr/share/bash-completion"
rm -rf "$PREFIX/usr/include/boost"
while read -r h; do
  mkdir -p "$PREFIX$(dirname "$h")"
  cp "$h" "$PREFIX$h"
done <"$tmp/boost-headers"
# Static archives: we link the shared libraries, except GoogleTest's (it ships no others).
find "$PREFIX/usr/lib" -name '*.a' ! -name 'libgtest*.a' ! -name 'libgmock*.a' -delete
# Absolute links inside the packages point into the prefix instead.
find "$PREFIX" -type l -lname '/*' | while read -r l; do
  target=$(readlink "$l")
  ln -sfn "$(realpath -m --relative-to="$(dirname "$l")" "$PREFIX$target")" "$l"
done
# The Rust code we link (src/rust: the Jinja engine and llguidance), built here with cargo: the
# GPU machine has neither Rust nor a network. scripts/gpu-check.sh hands it to CMake
# (SHARDSERVE_RUST_LIB), llguidance's header beside it.
cargo build --release --locked --quiet --manifest-path src/rust/Cargo.toml \
  --target-dir "$tmp/rust" || { log "cargo build of src/rust failed"; exit 1; }
cp "$tmp/rust/release/libshardserve_rust.a" "$PREFIX/usr/lib/"
strip --strip-debug "$PREFIX/usr/lib/libshardserve_rust.a"
llg=$(cargo metadata --format-version 1 --locked --manifest-path src/rust/Cargo.toml |
  python3 -c 'import json, sys; print(next(p["manifest_path"] for p in json.load(sys.stdin)["packages"] if p["name"] == "llguidance"))')
cp "$(dirname "$llg")/llguidance.h" "$PREFIX/usr/lib/"
echo "$sum" >"$stamp"
log "$(du -sh "$PREFIX" | cut -f1) in $PREFIX ($(wc -l <"$tmp/boost-headers") Boost headers)"
