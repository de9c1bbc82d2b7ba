#!/usr/bin/env bash
# Builds the Kubernetes test environment once (DESIGN.md §7): kube-apiserver,
# kube-controller-manager, kube-scheduler (k8s.io/kubernetes), kwok (sigs.k8s.io/kwok) and the
# testenv launcher with embedded etcd (tests/k8s/testenv), from the Go module proxy, into
# $SHARDSERVE_CACHE/testenv/bin. Rebuilds only when the module or the launcher changes; prints
# the binary directory.
set -euo pipefail
cd "$(dirname "$0")/../tests/k8s/testenv"
CACHE="${SHARDSERVE_CACHE:-$HOME/.cache/shardserve}"
BIN="$CACHE/testenv/bin"
stamp="$BIN/.stamp-$(cat go.mod go.sum cmd/testenv/*.go | md5sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "testenv: building kube-apiserver, kube-controller-manager, kube-scheduler, kwok, testenv" \
    "(first time: several minutes)" >&2
  mkdir -p "$BIN"
  rm -f "$BIN"/.stamp-*
  go build -o "$BIN/" k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler \
    sigs.k8s.io/kwok/cmd/kwok ./cmd/testenv
  touch "$stamp"
fi
echo "$BIN"
