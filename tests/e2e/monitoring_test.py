#!/usr/bin/env python3
"""Monitoring and autoscaling on real nodes (DESIGN.md §6, §7), as a platform team runs them: the
chart installed with Helm with its PodMonitor, ServiceMonitor and PrometheusRule (on
prometheus-operator's CRDs), a real Prometheus built with Kubernetes service discovery, and KEDA.

  - Prometheus scrapes the operator and every rank through `kubernetes_sd_configs` against the
    test apiserver, with the scrape jobs and relabelling scripts/prometheus-config.py derives from
    the release's rendered monitors (`helm get manifest`), and the alerts of its PrometheusRule;
    the operator's page with Prometheus' own ServiceAccount token (the chart's metrics-reader);
  - under a load, every panel query of every dashboard returns series with the labels its legend
    names;
  - kill -9 of a rank: ShardserveShardDown fires for that pod, and resolves once the replica is
    recreated; a model the nodes cannot hold: ShardservePlacementFailing fires for it. The rules'
    `for:` durations are shortened to 2 s (a test cannot wait 2 to 10 minutes); their expressions
    are the chart's;
  - KEDA (operator and metrics adapter behind the APIService v1beta1.external.metrics.k8s.io) with
    the ScaledObject of examples/keda-scaledobject.yaml: the HorizontalPodAutoscaler of
    kube-controller-manager scales the ShardedModel 1 -> 2 through its scale subresource when a
    load queues requests, the new replica serves, and back to 1 after the stabilisation window
    once the load stops, with no request failing on the way down;
  - latency targets (spec.serving.slo): the leaders' and routers' distance from them in
    Prometheus; KEDA with examples/keda-slo-scaledobject.yaml scales the idle model to zero (its
    routers stay), and a request sent then is held by a router, wakes the model (the routers'
    queue depth activates the ScaledObject) and is answered.

Figures: load start -> second replica answering, load stop -> back to 1, failures on the way down,
kill -> alert firing -> resolved, idle -> zero replicas, first request at zero -> answered.

usage: monitoring_test.py path/to/shardserve path/to/shardserve-operator"""
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "cli"))
sys.path.insert(0, os.path.join(HERE, "..", "k8s"))
from checks import Checks, wait_until  # noqa: E402
from cluster import PROMOP_CRDS, ROOT, Cluster  # noqa: E402
from deployment import gen_model  # noqa: E402
from monitoring import Keda, check_dashboards, prometheus_for_release  # noqa: E402
from realnodes import (ClientLoop, Models, figure, helm_install, manifest,  # noqa: E402
                       operator_pods, rank_pid, readable_models)

SHARDSERVE, OPERATOR = sys.argv[1], sys.argv[2]
NS, RELEASE, NAME = "shardserve", "ss", "tiny"
ranks_job, operator_job = f"{NS}/{RELEASE}-shardserve-ranks", f"{RELEASE}-shardserve-operator"
KEY = "sk-e2e-" + secrets.token_hex(16)
check = Checks()

tmp = tempfile.mkdtemp(prefix="shardserve-monitoring-")
models, model_dir = readable_models(SHARDSERVE, tmp, gen_model)
c = Cluster(real_nodes=3)
m = Models(c, KEY)
prom = keda = None
loops = []


def load(**kw):
    loop = ClientLoop(m, NAME, **kw)
    loops.append(loop)
    return loop


def targets(job):
    """{(pod, endpoint): health} of the active targets whose job label is `job`."""
    active = prom.api("targets", state="active")["data"]["activeTargets"]
    return {(t["labels"].get("pod"), t["labels"].get("endpoint")): t["health"] for t in active
            if t["labels"]["job"] == job}


def rank_targets():
    """targets(ranks_job) of the ranks (the routers serve their metrics on metrics-0 too)."""
    return {k: v for k, v in targets(ranks_job).items() if "-router-" not in (k[0] or "")}


def spec_replicas():
    return c.get("smodel", NAME)["spec"]["replicas"]


try:
    c.kubectl("apply", "--server-side", "-f", PROMOP_CRDS, check=True)
    c.kubectl("wait", "--for", "condition=established", "--timeout=60s",
              "crd/podmonitors.monitoring.coreos.com", "crd/servicemonitors.monitoring.coreos.com",
              "crd/prometheusrules.monitoring.coreos.com", check=True)
    ok, err = helm_install(c, RELEASE, NS, models,
                           "metrics.podMonitor.enabled=true", "metrics.podMonitor.interval=1s",
                           "metrics.serviceMonitor.enabled=true",
                           "metrics.serviceMonitor.interval=1s",
                           "metrics.serviceMonitor.prometheusServiceAccount.name=prometheus",
                           "metrics.serviceMonitor.prometheusServiceAccount.namespace=monitoring",
                           "metrics.prometheusRule.enabled=true")
    check(ok, "helm install with the PodMonitor, ServiceMonitor and PrometheusRule" +
          ("" if ok else f": {err}"))
    names = c.kubectl("get", "podmonitor,servicemonitor,prometheusrule", "-o", "name")[1].split()
    check(len(names) == 3, f"the release's monitors are in the cluster: {names}")
    c.kubectl("create", "secret", "generic", "tiny-api-keys", f"--from-literal=key={KEY}",
              check=True)
    # Latency targets: the model keeps its routers at one replica (and at zero); they hold
    # requests up to 5 minutes while no replica is ready.
    m.apply(manifest(NAME, f"hostpath://{model_dir}", max_batch=2,
                     serving={"slo": {"ttftMilliseconds": 2000, "itlMilliseconds": 500},
                              "queue": {"timeoutSeconds": 300}}))
    check(wait_until(lambda: m.ready(NAME, 1), 240) and wait_until(lambda: m.answers(NAME), 60),
          "the TP=2 x PP=2 model is Ready and answers")
    prom = prometheus_for_release(c, RELEASE, NS, os.path.join(tmp, "prometheus"),
                                  rule_for_max="2s")
    with open(os.path.join(tmp, "prometheus", "prometheus.yml")) as f:
        jobs = [j["job_name"] for j in yaml.safe_load(f)["scrape_configs"]]
    check(f"serviceMonitor/{NS}/{RELEASE}-shardserve-operator/0" in jobs and
          f"podMonitor/{NS}/{RELEASE}-shardserve-ranks/0" in jobs,
          f"scrape jobs derived from the release's monitors ({len(jobs)})")

    # --- Prometheus on real pods -------------------------------------------------------------
    want = {(f"{NAME}-0-{s}", f"metrics-{t}") for s in (0, 1) for t in (0, 1)}
    check(wait_until(lambda: len([h for h in rank_targets().values() if h == "up"]) == 4, 90),
          f"the 4 ranks are scraped through service discovery (job {ranks_job}: "
          f"{targets(ranks_job)})")
    check(set(rank_targets()) == want, "their targets carry the pod and endpoint labels")
    check(wait_until(lambda: sorted(v for k, v in targets(ranks_job).items()
                                    if "-router-" in k[0]) == ["up", "up"], 60),
          f"the model's 2 routers are scraped on their metrics port ({targets(ranks_job)})")
    op_pods = {p["metadata"]["name"] for p in operator_pods(c)}
    check(wait_until(lambda: targets(operator_job) == {(p, "http-metrics"): "up"
                                                       for p in op_pods}, 60),
          f"both operator pods are scraped with Prometheus' token (job {operator_job}: "
          f"{targets(operator_job)})")
    t0 = time.monotonic()
    busy = load(clients=4, max_tokens=16)
    load(max_tokens=-1, pause=0.5)  # refused requests, for the error panels
    check(wait_until(lambda: prom.scalar(f'sum(increase(shardserve_generated_tokens_total'
                                         f'{{namespace="{NS}",model="{NAME}"}}[1m]))') > 0, 90),
          "tokens are generated, in the model's namespace")
    check(wait_until(lambda: prom.scalar(f'min(count_over_time(up{{job=~"{ranks_job}|'
                                         f'{operator_job}"}}[1m]))') >= 15, 120),
          "15 scrapes of every target in the last minute")
    print(f"load: {busy.ok / (time.monotonic() - t0):.0f} completions/s", flush=True)
    for i in range(4):  # the routers measure streams (a whole answer has no first token)
        m.post(m.service_ip(NAME), {"model": NAME, "prompt": f"stream {i}", "max_tokens": 8,
                                    "stream": True})
    for name in ("shardserve_slo_ratio", "shardserve_router_slo_ratio"):
        query = f'max({name}{{namespace="{NS}",model="{NAME}",slo="ttft"}})'
        check(wait_until(lambda: prom.scalar(query) > 0, 60),
              f"{name}: how far from the TTFT target, in Prometheus ({prom.scalar(query)})")
    checked = check_dashboards(prom, check, (NS, NAME))
    print(f"{checked} panel queries checked", flush=True)
    for loop in loops:
        loop.stop()
    loops.clear()
    check(busy.ok > 0 and busy.failed == 0, f"the load was served ({busy.ok} ok, "
                                            f"{busy.failed} failed: {busy.errors[:2]})")

    # --- alerts: a rank killed, a model that cannot be placed --------------------------------
    rules = {r["name"]: r for g in prom.api("rules")["data"]["groups"] for r in g["rules"]}
    check("ShardserveShardDown" in rules and "ShardservePlacementFailing" in rules and
          all(r["health"] == "ok" for r in rules.values()),
          f"the PrometheusRule's {len(rules)} alerts are loaded and healthy")
    check(not prom.alerts("ShardserveShardDown", "firing"), "no shard is down before the kill")
    pid = rank_pid(f"{NAME}-0-1", 1)
    check(pid is not None, "rank (stage 1, tp 1) found in its container")
    t0 = time.monotonic()
    if pid:
        os.kill(pid, signal.SIGKILL)
    check(wait_until(lambda: any(a.get("pod") == f"{NAME}-0-1" and a.get("namespace") == NS
                                 for a in prom.alerts("ShardserveShardDown", "firing")), 60),
          f"ShardserveShardDown fires for {NAME}-0-1: "
          f"{prom.alerts('ShardserveShardDown', 'firing')}")
    figure("kill -9 of a rank -> ShardserveShardDown firing", time.monotonic() - t0)
    check(wait_until(lambda: m.ready(NAME, 1) and m.answers(NAME), 240),
          "the replica is recreated, Ready and answering")
    check(wait_until(lambda: not prom.alerts("ShardserveShardDown", "firing") and
                     not prom.alerts("ShardserveShardDown", "pending"), 90),
          "and ShardserveShardDown resolves")
    figure("kill -9 of a rank -> ShardserveShardDown resolved", time.monotonic() - t0)

    # TP=4 x PP=2 needs two nodes with 4 free GPUs; the serving model (TP=2 x PP=2) holds 2 on
    # two of the three (a TP its 4 heads do not divide would be refused as invalid instead).
    m.apply(manifest("too-wide", f"hostpath://{model_dir}", tp=4, pp=2, key_secret=False))
    t0 = time.monotonic()
    check(wait_until(lambda: any(a.get("model") == "too-wide" and a.get("namespace") == NS
                                 for a in prom.alerts("ShardservePlacementFailing", "firing")),
                     150),
          f"ShardservePlacementFailing fires for a model the nodes cannot hold (TP=4 x PP=2): "
          f"{prom.alerts('ShardservePlacementFailing', 'firing')}")
    figure("unplaceable model -> ShardservePlacementFailing firing", time.monotonic() - t0)
    c.kubectl("delete", "smodel", "too-wide", "--wait=true", "--timeout=60s")

    # --- autoscaling on load: KEDA, the HPA, the scale subresource ---------------------------
    keda = Keda(c, c.bin)
    check(wait_until(keda.available, 120), "KEDA's metrics adapter serves external.metrics.k8s.io")
    with open(os.path.join(ROOT, "examples", "keda-scaledobject.yaml")) as f:
        so = yaml.safe_load(f)
    so["metadata"].update(name=NAME, namespace=NS)
    so["spec"]["scaleTargetRef"]["name"] = NAME
    trigger = so["spec"]["triggers"][0]["metadata"]
    trigger["serverAddress"] = prom.url  # the Prometheus of this test, beside KEDA on the host
    trigger["query"] = trigger["query"].replace('model="tiny-llama"', f'model="{NAME}"')
    window = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"][
        "stabilizationWindowSeconds"]
    m.apply(so)

    def hpa():
        code, out, _ = c.kubectl("get", "hpa", f"keda-hpa-{NAME}", "-o", "json")
        return yaml.safe_load(out) if code == 0 else {}

    def metric_read():
        conds = {x["type"]: x for x in hpa().get("status", {}).get("conditions", [])}
        return conds.get("ScalingActive", {}).get("status") == "True"

    check(wait_until(metric_read, 120),
          f"KEDA made the HPA keda-hpa-{NAME}, which reads the queue depth through the external "
          f"metrics API: {hpa().get('status', {}).get('conditions')}")
    check(hpa().get("spec", {}).get("scaleTargetRef", {}).get("kind") == "ShardedModel",
          "the HPA targets the ShardedModel")
    check(wait_until(lambda: hpa().get("status", {}).get("desiredReplicas") == 1, 60) and
          spec_replicas() == 1,
          f"no load: the HPA computes 1 replica ({hpa().get('status', {}).get('desiredReplicas')})")

    t0 = time.monotonic()
    busy = load(clients=8, max_tokens=32)
    check(wait_until(lambda: spec_replicas() == 2, 120),
          "a load that queues requests: the HPA scales the model to 2 replicas")
    figure("load start -> HPA sets 2 replicas", time.monotonic() - t0)
    check(wait_until(lambda: m.ready(NAME, 2), 240), "2/2 Ready")
    check(wait_until(lambda: prom.scalar(
        f'sum(increase(shardserve_requests_total{{namespace="{NS}",model="{NAME}",replica="1",'
        f'code="200"}}[30s]))') > 0, 60), "the new replica serves the load (replica 1's requests)")
    figure("load start -> second replica answering", time.monotonic() - t0)
    check(wait_until(lambda: len(rank_targets()) == 8 and
                     set(rank_targets().values()) == {"up"}, 60),
          f"Prometheus scrapes every rank of both replicas: {sorted(rank_targets())}")
    busy.stop()
    loops.remove(busy)
    check(busy.failed == 0, f"no request failed during the scale-up ({busy.ok} ok, "
                            f"{busy.failed} failed: {busy.errors[:2]})")

    t0 = time.monotonic()
    light = load(clients=1, max_tokens=8, pause=0.2)  # requests in flight on the way down
    check(wait_until(lambda: spec_replicas() == 1, window + 120),
          f"the load stopped: back to 1 replica after the {window} s stabilisation window")
    check(wait_until(lambda: m.ready(NAME, 1) and not m.pods(NAME, "shardserve.io/replica=1"),
                     120), "replica 1's pods are gone")
    figure("load stop -> 1 replica", time.monotonic() - t0)
    light.stop()
    loops.remove(light)
    print(f"figure: requests on the way down: {light.ok} ok, {light.failed} failed", flush=True)
    check(light.failed == 0 and light.ok > 0,
          f"no request failed on the way down ({light.ok} ok, {light.failed} failed: "
          f"{light.errors[:3]})")

    # --- latency targets, and scale to zero --------------------------------------------------
    with open(os.path.join(ROOT, "examples", "keda-slo-scaledobject.yaml")) as f:
        so = yaml.safe_load(f)
    so["metadata"].update(name=NAME, namespace=NS)
    so["spec"]["scaleTargetRef"]["name"] = NAME
    so["spec"]["maxReplicaCount"] = 2
    so["spec"]["cooldownPeriod"] = 15  # a test cannot idle 5 minutes
    for trigger in so["spec"]["triggers"]:
        trigger["metadata"]["serverAddress"] = prom.url
        trigger["metadata"]["query"] = trigger["metadata"]["query"].replace(
            'model="tiny-llama"', f'model="{NAME}"')
    m.apply(so)
    t0 = time.monotonic()
    check(wait_until(lambda: spec_replicas() == 0, 180),
          f"idle (no request in the SLO window, none held): KEDA scales the model to zero "
          f"({spec_replicas()})")
    check(wait_until(lambda: not m.pods(NAME, "shardserve.io/role!=router"), 120),
          "its replica's pods are gone")
    figure("idle -> zero replicas", time.monotonic() - t0)
    routers = m.pods(NAME, "shardserve.io/role=router")
    check(len(routers) == 2 and all(
        any(x["type"] == "Ready" and x["status"] == "True" for x in p["status"]["conditions"])
        for p in routers), "its 2 routers stay, Ready (they hold what comes)")
    t0 = time.monotonic()
    try:
        code, answer = m.post(m.service_ip(NAME), {"model": NAME, "prompt": "wake up",
                                                  "max_tokens": 8}, timeout=330)
    except OSError as e:
        code, answer = 0, str(e)
    figure("first request at zero replicas -> answered", time.monotonic() - t0)
    check(code == 200 and answer["usage"]["completion_tokens"] == 8,
          f"a model scaled to zero answers its first request: a router held it until KEDA woke "
          f"the model and its replica was Ready ({code} {str(answer)[:300]})")
    check(spec_replicas() == 1, f"the model runs 1 replica again ({spec_replicas()})")
finally:
    for loop in loops:
        loop.stop()
    if check.failures:
        c.print_logs()
        for p in operator_pods(c):
            print(f"--- {p['metadata']['name']} log\n" +
                  c.kubectl("logs", p["metadata"]["name"])[1][-3000:])
        if prom:
            print("--- prometheus\n" + prom.output()[-3000:])
        if keda:
            print(keda.output())
    if keda:
        keda.stop()
    if prom:
        prom.stop()
    c.stop()
    shutil.rmtree(tmp, ignore_errors=True)
check.finish()
