#!/usr/bin/env bash
# Builds the Kubernetes test environment once (DESIGN.md §7): kube-apiserver,
# kube-controller-manager, kube-scheduler, kubelet, kube-proxy (k8s.io/kubernetes), kwok
# (sigs.k8s.io/kwok), CoreDNS (its own module, pinned below) and the testenv launcher with
# embedded etcd (tests/k8s/testenv), from the Go module proxy, into $SHARDSERVE_CACHE/testenv/bin.
# For the cluster's monitoring and autoscaling, also Prometheus (Debian's is built without
# Kubernetes service discovery) with promtool, and KEDA's operator and metrics adapter (keda,
# keda-adapter; its manifests into ../keda), each pinned below.
# Rebuilds only when the module, the launcher or this script changes; prints the binary
# directory. Safe to start twice at once (a CI run beside a developer's e2e run): a lock on the
# binary directory lets one build while the other waits, then finds it built.
# Every binary is built with the same flags (-trimpath, no symbol tables: nothing here is
# debugged), so the packages that the modules share at one version compile once in the shared
# Go build cache, and the links skip DWARF.
set -euo pipefail
SELF=$(realpath "$0")
cd "$(dirname "$0")/../tests/k8s/testenv"
CACHE="${SHARDSERVE_CACHE:-$HOME/.cache/shardserve}"
BIN="$CACHE/testenv/bin"
COREDNS=github.com/coredns/coredns@v1.14.7
PROMETHEUS=github.com/prometheus/prometheus@v0.316.0  # Prometheus 3.16.0
KEDA=github.com/kedacore/keda/v2@v2.21.0
stamp="$BIN/.stamp-$( (cat go.mod go.sum cmd/testenv/*.go "$SELF" "$(dirname "$SELF")/testenv-trim.py") |
  md5sum | cut -c1-12)"
moddir() { (cd /tmp && go mod download -json "$1") | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p'; }
mkdir -p "$BIN"
exec 9>"$BIN/.lock"
flock 9
if [ ! -f "$stamp" ]; then
  echo "testenv: building kube-apiserver, kube-controller-manager, kube-scheduler, kubelet," \
    "kube-proxy, kwok, CoreDNS, testenv, Prometheus, KEDA (first time: about 30 minutes)" >&2
  rm -f "$BIN"/.stamp-*
  # The release they are, as Kubernetes' own builds stamp it (clients such as Helm check it).
  K8S=$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ {print $2; exit}' go.mod)
  minor=$(echo "$K8S" | cut -d. -f2)
  V=k8s.io/component-base/version
  go build -trimpath -ldflags "-s -w -X $V.gitVersion=$K8S -X $V.gitMajor=1 -X $V.gitMinor=$minor \
    -X $V.gitTreeState=clean" -o "$BIN/" k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy \
    sigs.k8s.io/kwok/cmd/kwok ./cmd/testenv
  # CoreDNS with the plugins of the test cluster's Corefile only (tests/k8s/testenv/cmd/testenv/
  # nodes.go), and KEDA with the scalers of examples/keda-scaledobject.yaml only: each is built
  # in a copy of its module, cut by scripts/testenv-trim.py (the others bring their own SDKs,
  # about half of each build).
  build_copy() {  # build_copy MODULE@VERSION DIR: a writable copy of the module's source in DIR
    rm -rf "$2" && cp -r "$(moddir "$1")" "$2" && chmod -R u+w "$2"
  }
  src="$CACHE/testenv/coredns-src"
  build_copy "$COREDNS" "$src"
  python3 "$(dirname "$SELF")/testenv-trim.py" coredns "$src" bind,errors,kubernetes
  (cd "$src" && GOFLAGS=-mod=mod go build -trimpath -ldflags "-s -w" -o "$BIN/coredns" .)
  rm -rf "$src"
  # Only Kubernetes service discovery (the others pull modules the proxy does not serve).
  GOBIN="$BIN" GOFLAGS=-mod=mod go install -trimpath -tags remove_all_sd,enable_kubernetes_sd \
    -ldflags "-s -w -X github.com/prometheus/common/version.Version=3.16.0" \
    "${PROMETHEUS%@*}/cmd/prometheus@${PROMETHEUS#*@}" \
    "${PROMETHEUS%@*}/cmd/promtool@${PROMETHEUS#*@}"
  # (KEDA's go.mod also has a replace directive, which `go install pkg@version` refuses.)
  src="$CACHE/testenv/keda-src"
  build_copy "$KEDA" "$src"
  (cd "$src" && GOFLAGS=-mod=mod python3 "$(dirname "$SELF")/testenv-trim.py" keda . \
    cpu,memory,prometheus)
  for cmd in operator:keda adapter:keda-adapter; do
    (cd "$src" && GOFLAGS=-mod=mod go build -trimpath -o "$BIN/${cmd#*:}" \
      -ldflags "-s -w -X github.com/kedacore/keda/v2/version.Version=${KEDA#*@}" "./cmd/${cmd%:*}")
  done
  rm -rf "$CACHE/testenv/keda" && cp -r "$src/config" "$CACHE/testenv/keda" && rm -rf "$src"
  touch "$stamp"
fi
echo "$BIN"
