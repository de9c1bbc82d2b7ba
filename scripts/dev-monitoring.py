#!/usr/bin/env python3
"""Prometheus and KEDA beside the dev cluster with real nodes (README "Monitoring and autoscaling on
the dev cluster"), as tests/e2e/monitoring_test.py runs them: Prometheus on 127.0.0.1:PORT with the
scrape jobs and alerts of a Helm release's PodMonitor, ServiceMonitor and PrometheusRule
(scripts/prometheus-config.py), and KEDA's operator and metrics adapter serving
external.metrics.k8s.io. They keep running in the background until `down` (or
`scripts/dev-cluster.sh down`).

usage: dev-monitoring.py up DIR --release NAME --namespace NS [--port 9090]
       dev-monitoring.py down DIR"""
import argparse
import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "k8s"))
from cluster import Cluster, wait  # noqa: E402
from monitoring import Keda, prometheus_for_release  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["up", "down"])
    ap.add_argument("dir", help="the dev cluster's directory")
    ap.add_argument("--release", default="ss")
    ap.add_argument("--namespace", default="shardserve")
    ap.add_argument("--port", type=int, default=9090)
    a = ap.parse_args()
    pids = os.path.join(a.dir, "monitoring.pids")
    if a.action == "down":
        if os.path.exists(pids):
            for pid in open(pids).read().split():
                try:
                    os.kill(int(pid), signal.SIGTERM)
                except ProcessLookupError:
                    pass
            os.remove(pids)
        print("dev-monitoring: stopped")
        return
    if os.path.exists(pids):
        sys.exit(f"dev-monitoring: already running ({pids}); `down` first")
    c = Cluster.attach(a.dir)
    prom = prometheus_for_release(c, a.release, a.namespace, os.path.join(a.dir, "prometheus"),
                                  interval="5s", port=a.port, detach=True)
    try:
        keda = Keda(c, c.bin, detach=True)
    except BaseException:
        prom.stop()
        raise
    with open(pids, "w") as f:
        f.write(" ".join(str(p.pid) for p in [prom.proc] + [p for p, _ in keda.procs]))
    if not wait(keda.available, 120):
        sys.exit("dev-monitoring: KEDA's metrics adapter is not available:\n" + keda.output())
    print(f"dev-monitoring: Prometheus on {prom.url} (logs {prom.dir}); KEDA serves "
          f"external.metrics.k8s.io (logs {keda.dir})")


if __name__ == "__main__":
    main()
