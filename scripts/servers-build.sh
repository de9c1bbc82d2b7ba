#!/usr/bin/env bash
# Builds the real servers the model-source tests fetch from (DESIGN.md §7), once, from the Go
# module proxy, into $SHARDSERVE_CACHE/servers/bin; prints that directory:
#   registry — the CNCF distribution registry (an OCI registry), pinned below.
# (The S3-compatible server is moto's, from PyPI in the reference environment: the Go module proxy
# lists no version of MinIO's server; the Hub's endpoints are served by tests/cli/hub_server.py:
# olah proxies the Hub and cannot serve repositories made here offline.)
# Rebuilds only when this script changes; safe to start twice at once (a lock on the directory).
set -euo pipefail
SELF=$(realpath "$0")
CACHE="${SHARDSERVE_CACHE:-$HOME/.cache/shardserve}"
BIN="$CACHE/servers/bin"
REGISTRY=github.com/distribution/distribution/v3@v3.1.2
stamp="$BIN/.stamp-$(md5sum <"$SELF" | cut -c1-12)"
mkdir -p "$BIN"
exec 9>"$BIN/.lock"
flock 9
if [ ! -f "$stamp" ]; then
  echo "servers: building the distribution registry (first time: about 3 minutes)" >&2
  rm -f "$BIN"/.stamp-*
  (cd /tmp && GOBIN="$BIN" GOFLAGS=-mod=mod go install -trimpath -ldflags "-s -w" \
    "${REGISTRY%@*}/cmd/registry@${REGISTRY#*@}")
  touch "$stamp"
fi
echo "$BIN"
