#!/usr/bin/env bash
# Builds the Kubernetes test environment once (DESIGN.md §7): kube-apiserver,
# kube-controller-manager, kube-scheduler, kubelet, kube-proxy (k8s.io/kubernetes), kwok
# (sigs.k8s.io/kwok), CoreDNS (its own module, pinned below) and the testenv launcher with
# embedded etcd (tests/k8s/testenv), from the Go module proxy, into $SHARDSERVE_CACHE/testenv/bin.
# Rebuilds only when the module, the launcher or this script changes; prints the binary
# directory.
set -euo pipefail
SELF=$(realpath "$0")
cd "$(dirname "$0")/../tests/k8s/testenv"
CACHE="${SHARDSERVE_CACHE:-$HOME/.cache/shardserve}"
BIN="$CACHE/testenv/bin"
COREDNS=github.com/coredns/coredns@v1.14.7
stamp="$BIN/.stamp-$( (cat go.mod go.sum cmd/testenv/*.go "$SELF"; echo "$COREDNS") | md5sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "testenv: building kube-apiserver, kube-controller-manager, kube-scheduler, kubelet," \
    "kube-proxy, kwok, CoreDNS, testenv (first time: several minutes)" >&2
  mkdir -p "$BIN"
  rm -f "$BIN"/.stamp-*
  # The release they are, as Kubernetes' own builds stamp it (clients such as Helm check it).
  K8S=$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ {print $2; exit}' go.mod)
  minor=$(echo "$K8S" | cut -d. -f2)
  V=k8s.io/component-base/version
  go build -ldflags "-X $V.gitVersion=$K8S -X $V.gitMajor=1 -X $V.gitMinor=$minor \
    -X $V.gitTreeState=clean" -o "$BIN/" k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy \
    sigs.k8s.io/kwok/cmd/kwok ./cmd/testenv
  GOBIN="$BIN" GOFLAGS=-mod=mod go install "$COREDNS"
  touch "$stamp"
fi
echo "$BIN"
