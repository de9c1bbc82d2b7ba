#!/usr/bin/env bash
# Builds the worker, operator and pause images as OCI archives from the built binaries, without a
# Docker daemon (oci.py), into build/images/; prints that directory. They honour the Dockerfiles'
# contract: user 65532, the same entrypoints and ports, /models as the model mount point, and a
# root filesystem that may be mounted read-only. Rebuilds only what changed. Names:
#   localhost/shardserve/worker:dev    shardserve-worker, shardserve and shardserve-router, with
#                                      their libraries
#   localhost/shardserve/operator:dev  shardserve-operator
#   localhost/shardserve/pause:dev     the pod sandbox (pause.c, static)
# Real registries get their images from worker/Dockerfile and operator/Dockerfile.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=build/bin
OUT=build/images
mkdir -p "$OUT"
here=scripts/images

build() {  # name, inputs..., -- oci.py arguments
  local name=$1; shift
  local inputs=()
  while [ "$1" != -- ]; do inputs+=("$1"); shift; done
  shift
  local stamp
  # The inputs, the builder, and which library files (versioned names) they load.
  stamp="$OUT/.$name-$( (cat "${inputs[@]}" "$here/oci.py"
    for f in "${inputs[@]}"; do
      { ldd "$f" 2>/dev/null || true; } | awk '$3 ~ /^\// {print $3}' | xargs -r readlink -f
    done) | md5sum | cut -c1-12)"
  [ -f "$stamp" ] && [ -f "$OUT/$name.tar" ] && return 0
  rm -f "$OUT/.$name-"*
  python3 "$here/oci.py" --out "$OUT/$name.tar" "$@"
  touch "$stamp"
}

pause="$OUT/pause"
if [ ! -x "$pause" ] || [ "$here/pause.c" -nt "$pause" ]; then
  gcc -static -O2 -o "$pause" "$here/pause.c"
fi
build pause "$pause" -- --name localhost/shardserve/pause:dev \
  --file "$pause:/pause" --entrypoint '["/pause"]' --user 65535:65535
build worker "$BIN/shardserve-worker" "$BIN/shardserve" "$BIN/shardserve-router" -- \
  --name localhost/shardserve/worker:dev \
  --exe "$BIN/shardserve-worker:/usr/local/bin/shardserve-worker" \
  --exe "$BIN/shardserve:/usr/local/bin/shardserve" \
  --exe "$BIN/shardserve-router:/usr/local/bin/shardserve-router" \
  --entrypoint '["shardserve-worker"]' --cmd '["launch"]' --user 65532:65532 --dir /models \
  --port 8000 --port 29500 $(printf -- '--port %s ' $(seq 9400 9407))
build operator "$BIN/shardserve-operator" -- --name localhost/shardserve/operator:dev \
  --exe "$BIN/shardserve-operator:/usr/local/bin/shardserve-operator" \
  --entrypoint '["/usr/local/bin/shardserve-operator"]' --user 65532:65532 --port 8080
echo "$PWD/$OUT"
