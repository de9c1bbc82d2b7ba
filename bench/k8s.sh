#!/usr/bin/env bash
# Kubernetes client benchmark against a private real control plane (tests/k8s/testenv): creates
# PODS pods, then an informer lists and watches them (time, memory per cached pod, requests) and
# handles a stream of updates (events/s). Usage: bench/k8s.sh [PODS] [UPDATES]
set -euo pipefail
cd "$(dirname "$0")/.."
PODS="${1:-10000}"
UPDATES="${2:-5000}"
SHARDSERVE_SKIP_REFERENCE=1 bash scripts/setup.sh
bash scripts/build.sh
export SHARDSERVE_DEV_CLUSTER=$(mktemp -d)
trap 'bash scripts/dev-cluster.sh down >/dev/null; rm -rf "$SHARDSERVE_DEV_CLUSTER"' EXIT
bash scripts/dev-cluster.sh up >/dev/null
build/bin/shardserve bench informer --kubeconfig "$SHARDSERVE_DEV_CLUSTER/kubeconfig" \
  --pods "$PODS" --updates "$UPDATES"
