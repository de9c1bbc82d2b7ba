#!/usr/bin/env bash
# A real Kubernetes control plane on loopback for people and tests: etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler and kwok (fake nodes), built once from the Go module
# proxy, with the ShardedModel CRD installed. Usage:
#   scripts/dev-cluster.sh up [--real-nodes N]
#                                 start it (in the background) and wait until it is ready; with
#                                 --real-nodes, N real nodes too (kubelet + containerd + runc,
#                                 bridge CNI, kube-proxy, CoreDNS; as root) running the images of
#                                 scripts/images/build.sh (localhost/shardserve/*:dev)
#   scripts/dev-cluster.sh env    print `export KUBECONFIG=...` for it (eval "$(... env)")
#   scripts/dev-cluster.sh monitoring [--release R] [--namespace NS] [--port P]
#                                 Prometheus (the monitors and alerts of Helm release R) and
#                                 KEDA beside it (scripts/dev-monitoring.py; real nodes)
#   scripts/dev-cluster.sh down   stop it (and the monitoring)
# State lives in $SHARDSERVE_DEV_CLUSTER (default ~/.cache/shardserve/dev-cluster).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${SHARDSERVE_DEV_CLUSTER:-${SHARDSERVE_CACHE:-$HOME/.cache/shardserve}/dev-cluster}"
case "${1:-}" in
  up)
    if [ -f "$DIR/pid" ] && kill -0 "$(cat "$DIR/pid")" 2>/dev/null; then
      echo "dev-cluster: already running; $(cat "$DIR/env" | head -1)"; exit 0
    fi
    extra=()
    if [ "${2:-}" = --real-nodes ]; then
      [[ "${3:-}" =~ ^[1-9]$ ]] || { echo "dev-cluster: --real-nodes takes 1 to 9" >&2; exit 2; }
      bash scripts/setup.sh
      bash scripts/build.sh
      extra=(--real-nodes "$3" --images "$(bash scripts/images/build.sh)")
    fi
    BIN=$(bash scripts/testenv-build.sh)
    rm -rf "$DIR"; mkdir -p "$DIR"
    setsid "$BIN/testenv" up --dir "$DIR" --bin "$BIN" --crds "$PWD/crds" "${extra[@]}" \
      >"$DIR/testenv.log" 2>&1 &
    echo $! >"$DIR/pid"
    for _ in $(seq 1 900); do
      [ -f "$DIR/ready" ] && { echo "dev-cluster: ready"; cat "$DIR/env"; exit 0; }
      kill -0 "$(cat "$DIR/pid")" 2>/dev/null || { cat "$DIR/testenv.log"; exit 1; }
      sleep 0.2
    done
    echo "dev-cluster: not ready after 180 s; logs in $DIR" >&2; exit 1 ;;
  env)
    cat "$DIR/env" ;;
  monitoring)
    shift
    python3 scripts/dev-monitoring.py up "$DIR" "$@" ;;
  down)
    python3 scripts/dev-monitoring.py down "$DIR" >/dev/null
    if [ -f "$DIR/pid" ]; then
      pid=$(cat "$DIR/pid")
      kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 1 750); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
      rm -f "$DIR/pid"
    fi
    echo "dev-cluster: stopped" ;;
  *)
    echo "usage: scripts/dev-cluster.sh up [--real-nodes N]|env|monitoring|down" >&2; exit 2 ;;
esac
