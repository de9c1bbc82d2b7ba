#!/usr/bin/env python3
"""Operator at scale (issue figures): MODELS ShardedModels (TP x PP, REPLICAS each) applied at
once to NODES kwok nodes with 8 GPUs each on the real control plane of tests/k8s/testenv.
kwok runs no container: tests/k8s's InspectStandIn ends each inspect pod with Llama-3-8B's
footprint, as `shardserve-worker inspect` would. Prints the inspect pods the models needed (one
per source: they all read one uri), the time from apply to every pod Running and to every model
reporting Ready, reconcile latency p50/p99 (shardserve_operator_reconcile_seconds: a pass reads,
decides and places) and that of the writes carried out after each pass
(shardserve_operator_reconcile_api_seconds), API requests issued, time lost to the client-side
rate limit, the apiserver's own time for each kind of write the operator makes, the operator's
peak RSS, and cache bytes per pod. The bench polls the apiserver over one connection (no kubectl
process a look: those took more of this machine's two cores than the operator does).

usage: bench/operator_scale.py BUILD/bin/shardserve-operator [--models 200] [--nodes 1000]
       [--tp 8] [--pp 2] [--replicas 2] [--qps 200] [--burst 400] [--concurrency 4]
       [--extra-pods 4000]"""
import argparse
import json
import os
import re
import sys
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "k8s"))
from cluster import Cluster, InspectStandIn, Operator, wait  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("operator")
ap.add_argument("--models", type=int, default=200)
ap.add_argument("--nodes", type=int, default=1000)
ap.add_argument("--tp", type=int, default=8)
ap.add_argument("--pp", type=int, default=2)
ap.add_argument("--replicas", type=int, default=2)
ap.add_argument("--qps", type=float, default=200)
ap.add_argument("--burst", type=int, default=400)
ap.add_argument("--concurrency", type=int, default=4)
ap.add_argument("--extra-pods", type=int, default=4000)
args = ap.parse_args()
pods_total = args.models * args.replicas * args.pp


def quantile(q, buckets):
    """histogram_quantile over cumulative (le, count) buckets, as PromQL computes it."""
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / max(count - prev_count, 1e-9)
        prev_le, prev_count = le, count
    return prev_le


def scrape(port):
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    def histogram(name):
        return [(float(m.group(1)), float(m.group(2))) for m in re.finditer(
            "^" + name + r'_bucket\{le="([^"]+)"\} (\S+)', page, re.M)]
    buckets = (histogram("shardserve_operator_reconcile_seconds"),
               histogram("shardserve_operator_reconcile_api_seconds"))

    def value(pattern):
        m = re.search("^" + re.escape(pattern) + r" (\S+)$", page, re.M)
        return float(m.group(1)) if m else 0.0
    return page, buckets, value


# The apiserver's own time for the operator's kinds of write (apiserver_request_duration_seconds:
# from the request's arrival to its answer), to set beside the operator's wait for them.
OPERATOR_WRITES = {("POST", "pods", ""), ("POST", "secrets", ""), ("POST", "services", ""),
                   ("POST", "poddisruptionbudgets", ""), ("POST", "deployments", ""),
                   ("PATCH", "shardedmodels", "status")}


def apiserver_writes(c):
    """{(verb, resource, subresource): cumulative (le, count) buckets} of OPERATOR_WRITES."""
    code, page = c.api("GET", "/metrics", raw=True)
    out = {}
    if code != 200:
        return out
    for m in re.finditer(r'^apiserver_request_duration_seconds_bucket\{([^}]*)\} (\S+)$', page,
                         re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        key = (labels.get("verb"), labels.get("resource"), labels.get("subresource", ""))
        if key in OPERATOR_WRITES:
            le = float(labels["le"].replace("+Inf", "inf"))
            buckets = out.setdefault(key, {})
            buckets[le] = buckets.get(le, 0.0) + float(m.group(2))
    return {k: sorted(v.items()) for k, v in out.items()}


def rss(pid, field):
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(field + r":\s+(\d+) kB", f.read()).group(1))


def count_running(c):
    code, pods = c.api("GET", "/api/v1/pods?fieldSelector=status.phase%3DRunning")
    return len(pods["items"]) if code == 200 else 0


def models_ready(c):
    code, models = c.api("GET", "/apis/shardserve.io/v1alpha1/shardedmodels")
    items = models["items"] if code == 200 else []
    return sum(1 for m in items if m.get("status", {}).get("readyReplicas") == args.replicas)


c = Cluster()
op = inspect = None
try:
    c.install_crds()
    nodes = []
    for i in range(args.nodes):
        name = f"gpu-{i:04d}"
        nodes.append({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake"},
                         "labels": {"kubernetes.io/hostname": name, "type": "kwok",
                                    "topology.kubernetes.io/zone": f"zone-{i % 10}"}},
            "spec": {"taints": [{"key": "kwok.x-k8s.io/node", "value": "fake",
                                 "effect": "NoSchedule"}]},
            "status": {"allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110",
                                       "nvidia.com/gpu": "8"},
                       "capacity": {"cpu": "64", "memory": "512Gi", "pods": "110",
                                    "nvidia.com/gpu": "8"}}})
    t = time.monotonic()
    c.kubectl("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                      "items": nodes}), check=True)
    # Ready, and without the node.kubernetes.io/not-ready taint the node controller sets first.
    def nodes_ready():
        code, listed = c.api("GET", "/api/v1/nodes")
        items = listed["items"] if code == 200 else []
        return len(items) == args.nodes and all(
            any(cnd["type"] == "Ready" and cnd["status"] == "True"
                for cnd in n["status"].get("conditions", [])) and
            not any(tn["key"].startswith("node.kubernetes.io/")
                    for tn in n["spec"].get("taints", [])) for n in items)
    assert wait(nodes_ready, 300, every=1), "the kwok nodes did not become Ready"
    print(f"{args.nodes} kwok nodes created and Ready in {time.monotonic() - t:.1f} s")

    inspect = InspectStandIn(c, os.path.dirname(args.operator))
    op = Operator(c, args.operator, "--listen", "127.0.0.1:0", "--qps", str(args.qps),
                  "--burst", str(args.burst), "--concurrency", str(args.concurrency))
    assert wait(lambda: "caches synced" in op.output(), 120), op.output()
    port = int(re.search(r"serving /metrics.* on [\d.]+:(\d+)", op.output()).group(1))
    _, _, value = scrape(port)
    requests_before = value("shardserve_operator_api_requests_total")
    rss_before = rss(op.proc.pid, "VmRSS")

    models = [{"apiVersion": "shardserve.io/v1alpha1", "kind": "ShardedModel",
               "metadata": {"name": f"model-{i:03d}"},
               "spec": {"replicas": args.replicas,
                        "model": {"name": f"llama-{i}", "uri": "hostpath:///models/llama"},
                        "parallelism": {"tensor": args.tp, "pipeline": args.pp},
                        "worker": {"image": "shardserve/worker:1",
                                   "tolerations": [{"key": "kwok.x-k8s.io/node",
                                                    "operator": "Exists",
                                                    "effect": "NoSchedule"}]}}}
              for i in range(args.models)]
    writes_before = apiserver_writes(c)
    t0 = time.monotonic()
    c.kubectl("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                      "items": models}), check=True)
    applied = time.monotonic() - t0
    running_at = ready_at = None
    deadline = t0 + 900
    while time.monotonic() < deadline and (running_at is None or ready_at is None):
        if running_at is None and count_running(c) >= pods_total:
            running_at = time.monotonic() - t0
        if ready_at is None and models_ready(c) == args.models:
            ready_at = time.monotonic() - t0
        time.sleep(1)
    page, buckets, value = scrape(port)
    writes_after = apiserver_writes(c)
    hwm, rss_after = rss(op.proc.pid, "VmHWM"), rss(op.proc.pid, "VmRSS")
    pods_cached = value('shardserve_operator_cache_objects{resource="pods"}')
    pods_bytes = value('shardserve_operator_cache_bytes{resource="pods"}')

    gpus = args.models * args.replicas * args.tp * args.pp
    print(f"\n{args.models} ShardedModels (TP={args.tp}, PP={args.pp}, {args.replicas} replicas: "
          f"{pods_total} pods, {gpus} GPUs) on {args.nodes} nodes x 8 GPUs")
    print(f"  kubectl create of the models:       {applied:.1f} s")
    print(f"  inspect pods: {len(inspect.uris)} for {args.models} models of one uri")
    print(f"  apply -> every pod Running:         "
          f"{'%.1f s' % running_at if running_at else 'not within 900 s'}")
    print(f"  apply -> every model Ready (status): "
          f"{'%.1f s' % ready_at if ready_at else 'not within 900 s'}")
    total, api = buckets
    print(f"  reconciles: {total[-1][1]:.0f}; latency p50 {quantile(0.5, total) * 1e3:.1f} ms,"
          f" p99 {quantile(0.99, total) * 1e3:.1f} ms (read, decide, place); their apiserver "
          f"writes, carried out after: p50 {quantile(0.5, api) * 1e3:.1f} ms,"
          f" p99 {quantile(0.99, api) * 1e3:.1f} ms")
    for key, after in sorted(writes_after.items()):
        before = dict(writes_before.get(key, []))
        delta = [(le, n - before.get(le, 0.0)) for le, n in after]
        if delta[-1][1] > 0:
            print(f"    apiserver's own time for {key[0]} {key[1]}{'/' + key[2] if key[2] else ''}"
                  f" ({delta[-1][1]:.0f}, everyone's): p50 {quantile(0.5, delta) * 1e3:.1f} ms,"
                  f" p99 {quantile(0.99, delta) * 1e3:.1f} ms")
    print(f"  API requests issued: {value('shardserve_operator_api_requests_total') - requests_before:.0f}"
          f" (client-side throttling: "
          f"{value('shardserve_operator_client_throttled_seconds_total'):.1f} s in all, "
          f"qps {args.qps:g} burst {args.burst}, {args.concurrency} workers)")
    print(f"  operator peak RSS: {hwm / 1024:.1f} MiB (RSS {rss_before / 1024:.1f} MiB with the "
          f"nodes cached, {rss_after / 1024:.1f} MiB at the end)")
    print(f"  per cached pod: {pods_bytes / max(pods_cached, 1):.0f} bytes of object (CBOR); "
          f"{(rss_after - rss_before) * 1024 / max(pods_cached, 1):.0f} bytes of RSS growth "
          f"(everything the models added, divided by {pods_cached:.0f} pods)")
    errors = value('shardserve_operator_reconcile_total{result="error"}')
    print(f"  reconcile errors: {errors:.0f}")

    # Memory per cached pod: RSS growth while the informer takes EXTRA pods of other workloads
    # (bound to the kwok nodes, each with a realistic spec), divided by their number.
    extra = args.extra_pods
    if extra:
        rss0 = rss(op.proc.pid, "VmRSS")
        cached0 = value('shardserve_operator_cache_objects{resource="pods"}')
        env = [{"name": f"VAR_{k}", "value": "x" * 40} for k in range(15)]
        batch = []
        for i in range(extra):
            batch.append({"apiVersion": "v1", "kind": "Pod",
                          "metadata": {"name": f"other-{i}", "labels": {"app": "other",
                                                                        "tier": "web"}},
                          "spec": {"nodeName": f"gpu-{i % args.nodes:04d}",
                                   "tolerations": [{"operator": "Exists"}],
                                   "containers": [{"name": "app", "image": "nginx:1.27",
                                                   "env": env,
                                                   "ports": [{"containerPort": 8080}],
                                                   "resources": {"requests": {"cpu": "10m"}},
                                                   "readinessProbe": {"httpGet": {
                                                       "path": "/", "port": 8080}}}]}})
            if len(batch) == 500 or i == extra - 1:
                c.kubectl("create", "-f", "-", input=json.dumps(
                    {"apiVersion": "v1", "kind": "List", "items": batch}), check=True)
                batch = []

        def cached():
            return scrape(port)[2]('shardserve_operator_cache_objects{resource="pods"}')
        wait(lambda: cached() >= cached0 + extra, 300, every=2)
        time.sleep(5)  # kwok's status updates of the new pods settle
        rss1 = rss(op.proc.pid, "VmRSS")
        print(f"  memory per cached pod: {(rss1 - rss0) * 1024 / extra:.0f} bytes of operator RSS "
              f"for {extra} more pods of another workload ({cached():.0f} pods cached)")
finally:
    if op:
        op.kill()
    if inspect:
        inspect.stop.set()
    c.stop()
