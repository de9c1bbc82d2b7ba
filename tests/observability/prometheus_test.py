#!/usr/bin/env python3
"""Dashboards and alerts against a real Prometheus (Debian `prometheus`): it scrapes a
`shardserve local` TP=2 x PP=2 deployment under load and the operator (reconciling models on the
kwok test cluster, one of which does not fit). Every template variable of every dashboard must
have values, every panel's PromQL (variables substituted with those values) must return at least
one series, and every alert expression must be accepted by Prometheus. promtool checks the rules
and runs their unit tests.

usage: prometheus_test.py path/to/shardserve path/to/shardserve-operator"""
import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.parse
import urllib.request

import yaml

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "cli"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "k8s"))
from checks import Checks  # noqa: E402
from cluster import ROOT, Cluster, Operator, wait  # noqa: E402
from deployment import Deployment, gen_model  # noqa: E402

SHARDSERVE, OPERATOR = sys.argv[1], sys.argv[2]
DASHBOARDS = os.path.join(ROOT, "dashboards")
check = Checks()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, jobs):
        self.dir = tempfile.mkdtemp(prefix="shardserve-prometheus-")
        self.port = free_port()
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "rule_files": [os.path.join(DASHBOARDS, "alerts.yaml")],
                  "scrape_configs": jobs}
        path = os.path.join(self.dir, "prometheus.yml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        self.log = open(os.path.join(self.dir, "prometheus.log"), "w")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={path}", f"--storage.tsdb.path={self.dir}/data",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        assert wait(lambda: self.ready(), 60), open(self.log.name).read()

    def ready(self):
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready",
                                          timeout=2).status == 200
        except OSError:
            return False

    def api(self, path, **params):
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?" + urllib.parse.urlencode(params)
        try:
            return json.loads(urllib.request.urlopen(url, timeout=30).read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read())

    def query(self, expr):
        return self.api("query", query=expr)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def label_values(prom, query):
    """What Grafana's label_values(metric{sel}, label) offers."""
    m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query.strip())
    series, label = m.group(1), m.group(2)
    r = prom.api(f"label/{label}/values", **{"match[]": series})
    return r.get("data", [])


def substitute(expr, values):
    for name, value in values.items():
        expr = expr.replace(f"${name}", re.escape(value)).replace(f"${{{name}}}", re.escape(value))
    return expr.replace("$__rate_interval", "1m").replace("$__interval", "1m")


# --- what Prometheus scrapes ---------------------------------------------------------------------
tmp = tempfile.mkdtemp(prefix="shardserve-obs-")
model_dir = os.path.join(tmp, "tiny")
gen_model(SHARDSERVE, model_dir)
d = Deployment(SHARDSERVE, model_dir, name="tiny", tp=2, pp=2)
cl = Cluster()
op = prom = None
stop_load = threading.Event()
try:
    cl.install_crds()
    for i in range(2):
        cl.add_gpu_node(f"gpu-{i}", gpus=8)
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
    prom = Prometheus([
        {"job_name": "shardserve-ranks",
         "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in d.metrics_ports],
                             "labels": {"namespace": "local"}}]},
        {"job_name": "shardserve-operator",
         "static_configs": [{"targets": [f"127.0.0.1:{op_port}"]}]}])

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
    def scalar(expr):
        result = prom.query(expr)["data"]["result"]
        return float(result[0]["value"][1]) if result else 0.0
    check(wait(lambda: scalar("sum(increase(shardserve_generated_tokens_total[1m]))") > 0, 90),
          "tokens are being generated")
    # Enough samples that every 1m rate and quantile has data: 15 scrapes of every target.
    check(wait(lambda: scalar("min(count_over_time(up[1m]))") >= 15, 90),
          "15 scrapes of every target in the last minute")

    # --- every dashboard: variables, then every panel ------------------------------------------
    files = sorted(glob.glob(os.path.join(DASHBOARDS, "*.json")))
    check(len(files) == 3, f"three dashboards: {[os.path.basename(f) for f in files]}")
    panels_checked = 0
    for path in files:
        with open(path) as f:
            dash = json.load(f)
        name = os.path.basename(path)
        values = {}
        for v in dash["templating"]["list"]:
            if v["type"] != "query":
                continue
            options = label_values(prom, substitute(v["query"]["query"], values))
            check(options, f"{name}: variable ${v['name']} has values {options[:4]}")
            # The deployment's own values: the local model, the operator's fitting model.
            preferred = [o for o in options if o in ("local", "tiny", "default", "fits")]
            values[v["name"]] = (preferred or options or [""])[0]
        for p in dash["panels"]:
            for t in p["targets"]:
                expr = substitute(t["expr"], values)
                r = prom.query(expr)
                ok = r.get("status") == "success" and len(r["data"]["result"]) > 0
                panels_checked += 1
                check(ok, f"{name} / {p['title']} [{t['legendFormat']}]: "
                          f"{len(r.get('data', {}).get('result', []))} series"
                          + ("" if ok else f" for {expr} ({r.get('error', '')})"))
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
            print(open(prom.log.name).read()[-3000:])
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
