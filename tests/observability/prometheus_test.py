#!/usr/bin/env python3
"""Dashboards and alerts against a real Prometheus (Debian `prometheus`): it scrapes a
`shardserve local` TP=2 x PP=2 deployment under load and the operator (reconciling models on the
kwok test cluster, one of which does not fit). Every template variable of every dashboard must
have values, every panel's PromQL (variables substituted with those values) must return at least
one series, and every alert expression must be accepted by Prometheus. promtool checks the rules
and runs their unit tests.

usage: prometheus_test.py path/to/shardserve path/to/shardserve-operator"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading

import yaml

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "cli"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "k8s"))
from checks import Checks  # noqa: E402
from cluster import Cluster, InspectStandIn, Operator, wait  # noqa: E402
from deployment import Deployment, gen_model  # noqa: E402
from monitoring import DASHBOARDS, Prometheus, check_dashboards  # noqa: E402

SHARDSERVE, OPERATOR = sys.argv[1], sys.argv[2]
check = Checks()


# --- what Prometheus scrapes ---------------------------------------------------------------------
tmp = tempfile.mkdtemp(prefix="shardserve-obs-")
model_dir = os.path.join(tmp, "tiny")
gen_model(SHARDSERVE, model_dir)
# Latency targets: the leaders export how far they are from them (the dashboard's panel).
d = Deployment(SHARDSERVE, model_dir, name="tiny", tp=2, pp=2,
               serving={"slo": "{ttftMilliseconds: 1000, itlMilliseconds: 200}"})
cl = Cluster()
op = prom = None
stop_load = threading.Event()
try:
    cl.install_crds()
    for i in range(2):
        cl.add_gpu_node(f"gpu-{i}", gpus=8)
    InspectStandIn(cl, os.path.dirname(SHARDSERVE))  # kwok runs no container: the inspect pod's report
    op = Operator(cl, OPERATOR, "--listen", "127.0.0.1:0", "--placement-retry", "1")
    assert wait(lambda: "serving /metrics" in op.output(), 30), op.output()
    op_port = int(re.search(r"serving /metrics.* on [\d.]+:(\d+)", op.output()).group(1))
    for name, tp, pp in [("fits", 4, 2), ("too-wide", 8, 3)]:
        cl.kubectl("apply", "-f", "-", check=True, input=json.dumps({
            "apiVersion": "shardserve.io/v1alpha1", "kind": "ShardedModel",
            "metadata": {"name": name},
            "spec": {"model": {"name": name, "uri": "hostpath:///models/x"},
                     "parallelism": {"tensor": tp, "pipeline": pp},
                     "worker": {"image": "w", "tolerations": [{"key": "kwok.x-k8s.io/node",
                                                               "operator": "Exists"}]}}}))

    # The rank targets carry the namespace label Kubernetes service discovery would give them.
    prom = Prometheus(config={
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [os.path.join(DASHBOARDS, "alerts.yaml")],
        "scrape_configs": [
            {"job_name": "shardserve-ranks",
         "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in d.metrics_ports],
                             "labels": {"namespace": "local"}}]},
            {"job_name": "shardserve-operator",
             "static_configs": [{"targets": [f"127.0.0.1:{op_port}"]}]}]})

    def load():
        i = 0
        while not stop_load.is_set():
            i += 1
            if i % 10 == 0:
                d.post("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -1})
            else:
                d.post("/v1/completions", {"model": "tiny", "prompt": f"Hello {i}",
                                           "max_tokens": 16})
    threads = [threading.Thread(target=load, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()

    def targets_up():
        r = prom.query('count(up == 1)')
        return r["data"]["result"] and r["data"]["result"][0]["value"][1] == str(len(d.metrics_ports) + 1)
    check(wait(targets_up, 60), "Prometheus scrapes the 4 ranks and the operator")
    # A minute of data, so the 1m rates and histogram quantiles have two samples and more.
    scalar = prom.scalar
    check(wait(lambda: scalar("sum(increase(shardserve_generated_tokens_total[1m]))") > 0, 90),
          "tokens are being generated")
    # Enough samples that every 1m rate and quantile has data: 15 scrapes of every target.
    check(wait(lambda: scalar("min(count_over_time(up[1m]))") >= 15, 90),
          "15 scrapes of every target in the last minute")

    # --- every dashboard: variables, then every panel ------------------------------------------
    # The deployment's own values: the local model, the operator's fitting model.
    panels_checked = check_dashboards(prom, check, ("local", "tiny", "default", "fits"))
    print(f"{panels_checked} panel queries checked")

    # --- alerts: valid against this Prometheus, and loaded as rules --------------------------
    with open(os.path.join(DASHBOARDS, "alerts.yaml")) as f:
        rules = [r for g in yaml.safe_load(f)["groups"] for r in g["rules"]]
    for rule in rules:
        r = prom.query(rule["expr"])
        check(r.get("status") == "success", f"alert {rule['alert']}: the expression evaluates")
    loaded = prom.api("rules")["data"]["groups"]
    check(sorted(r["name"] for g in loaded for r in g["rules"]) ==
          sorted(r["alert"] for r in rules) and
          all(r["health"] == "ok" for g in loaded for r in g["rules"] if "health" in r),
          "Prometheus loaded every alert rule, all healthy")
    placement = prom.query('sum by (model) (increase(shardserve_placement_failures_total'
                           '{reason="InsufficientGPUs"}[1m])) > 0')["data"]["result"]
    check([s["metric"]["model"] for s in placement] == ["too-wide"],
          "the placement failures of the model that does not fit are counted")
finally:
    stop_load.set()
    if prom:
        if check.failures or sys.exc_info()[0]:
            print(prom.output()[-3000:])
        prom.stop()
    if op:
        op.kill()
    cl.stop()
    d.stop()
    shutil.rmtree(tmp, ignore_errors=True)

for args in (["check", "rules", "alerts.yaml"], ["test", "rules", "alerts.test.yaml"]):
    r = subprocess.run(["promtool", *args], cwd=DASHBOARDS, capture_output=True, text=True)
    check(r.returncode == 0, f"promtool {' '.join(args)}: {(r.stdout + r.stderr).strip()[-200:]}")
check.finish()
