#!/usr/bin/env python3
"""The Helm chart (helm/shardserve): helm lint, helm template over a matrix of values (what each
renders), values.schema.json refusing bad values, the Dockerfiles agreeing with the chart, and
the rendered chart applied to the real test apiserver (with the prometheus-operator CRDs), where
the operator then runs under the chart's ServiceAccount token: it places a model, applies the
worker defaults and the NetworkPolicy, and what the RBAC does not grant is refused.

usage: chart_test.py path/to/shardserve-operator"""
import json
import os
import re
import subprocess
import sys

import yaml

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "cli"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "k8s"))
from checks import Checks  # noqa: E402
from cluster import ROOT, Cluster, wait  # noqa: E402

BIN = sys.argv[1]
CACHE = os.environ.get("SHARDSERVE_CACHE", os.path.expanduser("~/.cache/shardserve"))
HELM = os.path.join(CACHE, "helm", "helm")
PROMOP_CRDS = os.path.join(CACHE, "prometheus-operator-crds-v0.85.0")
CHART = os.path.join(ROOT, "helm", "shardserve")
NS = "shardserve-system"
check = Checks()


def helm(*args):
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)


def render(*sets, crds=False):
    """The objects `helm template` renders with these --set values."""
    args = ["template", "shardserve", CHART, "--namespace", NS]
    if crds:
        args.append("--include-crds")
    for s in sets:
        args += ["--set", s]
    r = helm(*args)
    if r.returncode != 0:
        raise RuntimeError(r.stderr)
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def find(objs, kind, name=None):
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def args_of(objs):
    return find(objs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]


# --- lint, matrix --------------------------------------------------------------------------------
r = helm("lint", CHART, "--strict")
check(r.returncode == 0, f"helm lint --strict: {r.stdout.strip().splitlines()[-1] if r.stdout else r.stderr}")

default = render()
kinds = sorted({o["kind"] for o in default})
check(kinds == ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "Deployment", "Role",
                "RoleBinding", "Service", "ServiceAccount"], f"default render: {kinds}")
dep = find(default, "Deployment")[0]
pod = dep["spec"]["template"]["spec"]
c = pod["containers"][0]
check(dep["spec"]["replicas"] == 2 and "--leader-elect" in c["args"] and
      f"--leader-election-namespace={NS}" in c["args"], "two operators with leader election")
check(pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["seccompProfile"]["type"]
      == "RuntimeDefault" and c["securityContext"]["readOnlyRootFilesystem"] and
      c["securityContext"]["capabilities"]["drop"] == ["ALL"] and
      c["securityContext"]["allowPrivilegeEscalation"] is False,
      "operator pod: non-root, seccomp RuntimeDefault, read-only root, no capabilities")
check(c["readinessProbe"]["httpGet"]["path"] == "/readyz" and
      c["livenessProbe"]["httpGet"]["path"] == "/healthz", "probes on /readyz and /healthz")
check("--network-policies" in c["args"] and not any(a.startswith("--namespace=") for a in c["args"]),
      "NetworkPolicies on, every namespace watched")
models_role = find(default, "ClusterRole", "shardserve-models")[0]
verbs = {(g, res): r["verbs"] for r in models_role["rules"] for g in r["apiGroups"]
         for res in r["resources"]}
check(verbs[("", "pods")] == ["create", "delete"] and verbs[("", "events")] == ["create"] and
      verbs[("shardserve.io", "shardedmodels/status")] == ["patch"] and
      not any("*" in v for v in verbs.values()) and ("", "secrets") not in verbs,
      "RBAC: only the verbs the operator uses, no wildcards, no secrets")
dashboards = [o for o in find(default, "ConfigMap") if "grafana_dashboard" in o["metadata"]["labels"]]
names = sorted(k for o in dashboards for k in o["data"])
check(names == ["shardserve-fleet.json", "shardserve-model.json", "shardserve-shard-health.json"],
      f"the three dashboards as ConfigMaps for the Grafana sidecar: {names}")
check(all(json.loads(o["data"][k])["uid"].startswith("shardserve-") for o in dashboards
          for k in o["data"]), "each ConfigMap holds its dashboard JSON as is")
wd = json.loads(find(default, "ConfigMap", "shardserve-worker-defaults")[0]["data"]
                ["worker-defaults.json"])
check(wd["securityContext"]["runAsUser"] == 65532 and
      {e["name"] for e in wd["env"]} == {"NCCL_DEBUG", "NCCL_SOCKET_IFNAME"},
      "worker defaults (security context, NCCL env) rendered for the operator")

ns_scope = render("rbac.scope=namespace")
check(f"--namespace={NS}" in args_of(ns_scope) and find(ns_scope, "Role", "shardserve-models") and
      not find(ns_scope, "ClusterRole", "shardserve-models"),
      "rbac.scope=namespace: --namespace and a Role instead of a ClusterRole")
cluster_read = find(ns_scope, "ClusterRole", "shardserve-cluster-read")[0]["rules"]
check(cluster_read == [{"apiGroups": [""], "resources": ["nodes", "pods"],
                        "verbs": ["list", "watch"]}],
      "cluster-wide, only reads of nodes and pods (GPU accounting)")

mon = render("metrics.serviceMonitor.enabled=true", "metrics.podMonitor.enabled=true",
             "metrics.prometheusRule.enabled=true", "metrics.podMonitor.maxTensor=4")
pm = find(mon, "PodMonitor")[0]
check([e["port"] for e in pm["spec"]["podMetricsEndpoints"]] ==
      ["metrics-0", "metrics-1", "metrics-2", "metrics-3"], "PodMonitor: a port per tp_rank")
sm = find(mon, "ServiceMonitor")[0]
check(sm["spec"]["endpoints"][0]["honorLabels"] is True, "ServiceMonitor keeps the model namespace")
with open(os.path.join(ROOT, "dashboards", "alerts.yaml")) as f:
    alerts = yaml.safe_load(f)
check(find(mon, "PrometheusRule")[0]["spec"] == alerts,
      "the PrometheusRule is dashboards/alerts.yaml (one source)")
minimal = render("networkPolicy.enabled=false", "operator.leaderElection.enabled=false",
                 "operator.replicas=1", "dashboards.enabled=false")
check("--network-policies" not in args_of(minimal) and "--leader-elect" not in args_of(minimal) and
      not [o for o in find(minimal, "Role") if "leader" in o["metadata"]["name"]] and
      not [o for o in find(minimal, "ConfigMap") if "dashboard" in o["metadata"]["name"]],
      "features off: no NetworkPolicy flag or RBAC, no lease RBAC, no dashboards")
own_sa = render("serviceAccount.create=false", "serviceAccount.name=platform-sa")
check(not find(own_sa, "ServiceAccount") and
      find(own_sa, "Deployment")[0]["spec"]["template"]["spec"]["serviceAccountName"]
      == "platform-sa", "an existing ServiceAccount")
crds = [o for o in render(crds=True) if o["kind"] == "CustomResourceDefinition"]
with open(os.path.join(ROOT, "crds", "shardedmodel.yaml")) as f:
    check(crds == [yaml.safe_load(f)], "the chart's CRD is crds/shardedmodel.yaml (one source)")

# --- values.schema.json --------------------------------------------------------------------------
BAD = [("operator.replicas=0", "/operator/replicas"),
       ("rbac.scope=cluster-wide", "/rbac/scope"),
       ("operator.qps=-1", "/operator/qps"),
       ("metrics.podMonitor.interval=fifteen", "/metrics/podMonitor/interval"),
       ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
       ("workerDefaults.env[0].name=1BAD", "/workerDefaults/env/0/name"),
       ("operater.replicas=2", "operater")]
for s, where in BAD:
    r = helm("template", "x", CHART, "--set", s)
    check(r.returncode != 0 and where in r.stderr,
          f"values.schema.json refuses {s}: {r.stderr.strip().splitlines()[-1] if r.stderr else ''}")

# --- the Dockerfiles match what the chart and the operator expect --------------------------------
with open(os.path.join(ROOT, "operator", "Dockerfile")) as f:
    op_df = f.read()
with open(os.path.join(ROOT, "worker", "Dockerfile")) as f:
    wk_df = f.read()
check(c["command"] == ["/usr/local/bin/shardserve-operator"] and
      "COPY --from=build /build/bin/shardserve-operator /usr/local/bin/shardserve-operator" in op_df
      and re.search(r"^USER 65532", op_df, re.M) and pod["securityContext"]["runAsUser"] == 65532
      and re.search(r"^EXPOSE 8080$", op_df, re.M) and
      c["ports"][0]["containerPort"] == 8080, "operator image: entrypoint, user and port of the chart")
check(re.search(r"^FROM .* AS build", op_df, re.M) and re.search(r"^FROM .*slim", op_df, re.M),
      "operator image: multi-stage, slim runtime")
exposed = re.search(r"^EXPOSE (.*)$", wk_df, re.M).group(1).split()
check(re.search(r"^FROM nvidia/cuda:13[^ ]*-runtime", wk_df, re.M) and "libnccl2" in wk_df and
      "/usr/local/bin/" in wk_df and re.search(r"^USER 65532", wk_df, re.M) and
      wd["securityContext"]["runAsUser"] == 65532 and
      exposed[:3] == ["8000", "29500", "9400"], "worker image: CUDA runtime + NCCL, the pod "
      "command on PATH, user 65532 (workerDefaults), ports 8000/29500/9400+t")

# --- applied to the real apiserver; the operator runs with the chart's ServiceAccount ----------
cl = Cluster()
op = None
try:
    cl.kubectl("apply", "--server-side", "-f", PROMOP_CRDS, check=True)
    cl.kubectl("create", "namespace", NS, check=True)
    everything = render("metrics.serviceMonitor.enabled=true", "metrics.podMonitor.enabled=true",
                        "metrics.prometheusRule.enabled=true", crds=True)
    rc, out, err = cl.kubectl("apply", "--validate=strict", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "List", "items": everything}))
    check(rc == 0, f"the rendered chart ({len(everything)} objects) is accepted: {err[-300:]}")
    cl.kubectl("wait", "--for", "condition=established", "--timeout=60s",
               "crd/shardedmodels.shardserve.io", check=True)
    rc, token, err = cl.kubectl("create", "token", "shardserve", "-n", NS)
    check(rc == 0 and token.strip(), "a token of the chart's ServiceAccount")
    with open(cl.kubeconfig) as f:
        admin = yaml.safe_load(f)
    ca = admin["clusters"][0]["cluster"]["certificate-authority"]
    sa_config = os.path.join(cl.dir, "sa.kubeconfig")
    with open(sa_config, "w") as f:
        yaml.safe_dump({"apiVersion": "v1", "kind": "Config", "current-context": "sa",
                        "clusters": [{"name": "c", "cluster": {"server": cl.server,
                                                               "certificate-authority": ca}}],
                        "users": [{"name": "sa", "user": {"token": token.strip()}}],
                        "contexts": [{"name": "sa", "context": {"cluster": "c", "user": "sa",
                                                                "namespace": NS}}]}, f)
    defaults = os.path.join(cl.dir, "worker-defaults.json")
    with open(defaults, "w") as f:
        f.write(find(everything, "ConfigMap", "shardserve-worker-defaults")[0]["data"]
                ["worker-defaults.json"])

    def as_sa(*args):
        return subprocess.run(["kubectl", "--kubeconfig", sa_config, *args], capture_output=True,
                              text=True, timeout=60)

    for i in range(2):
        cl.add_gpu_node(f"gpu-{i}", gpus=8)
    # The operator's own flags, as the Deployment renders them, against the SA kubeconfig.
    flags = [a for a in args_of(everything) if not a.startswith("--listen")]
    flags = [f"--worker-defaults={defaults}" if a.startswith("--worker-defaults") else a
             for a in flags]
    op = subprocess.Popen([BIN, "--kubeconfig", sa_config, "--listen", "127.0.0.1:0", *flags],
                          stdout=open(os.path.join(cl.dir, "operator.log"), "w"),
                          stderr=subprocess.STDOUT)
    model = {"apiVersion": "shardserve.io/v1alpha1", "kind": "ShardedModel",
             "metadata": {"name": "rbac-check", "namespace": "default"},
             "spec": {"replicas": 1, "model": {"name": "llama", "uri": "hostpath:///models/l"},
                      "parallelism": {"tensor": 4, "pipeline": 2},
                      "worker": {"image": "ghcr.io/shardserve/worker:0.1.0",
                                 "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                                 "tolerations": [{"key": "kwok.x-k8s.io/node",
                                                  "operator": "Exists"}]}}}
    cl.kubectl("apply", "-f", "-", input=json.dumps(model), check=True)

    def ready():
        s = cl.get("smodel", "rbac-check").get("status", {})
        return s.get("readyReplicas") == 1
    ok = wait(ready, 90)
    check(ok, "under the chart's RBAC the operator places the model (pods, services, status, "
              "events, lease)")
    pods = cl.get("pods", "-l", "shardserve.io/model=rbac-check")["items"]
    env = {e["name"]: e.get("value") for e in pods[0]["spec"]["containers"][0]["env"]} if pods else {}
    check(pods and env.get("NCCL_SOCKET_IFNAME") == "eth0" and env.get("NCCL_DEBUG") == "INFO" and
          pods[0]["spec"]["containers"][0]["securityContext"]["runAsUser"] == 65532,
          "worker pods get the chart's workerDefaults (the model's own env wins)")
    np = cl.kubectl("get", "networkpolicy", "rbac-check-workers", "-o", "json")
    check(np[0] == 0 and json.loads(np[1])["spec"]["podSelector"]["matchLabels"] ==
          {"shardserve.io/model": "rbac-check"}, "the model's NetworkPolicy was written")
    lease = cl.kubectl("get", "lease", "shardserve", "-n", NS, "-o", "json")
    check(lease[0] == 0 and json.loads(lease[1])["spec"]["holderIdentity"],
          "the leader Lease in the release namespace")
    for what, args in [("read secrets", ["get", "secrets", "-n", NS]),
                       ("delete a node", ["delete", "node", "gpu-0", "--wait=false"]),
                       ("patch a ShardedModel's spec", ["patch", "smodel", "rbac-check", "-n",
                                                        "default", "--type=merge", "-p",
                                                        '{"spec":{"replicas":3}}']),
                       ("create a Deployment", ["create", "deployment", "x", "--image=x", "-n",
                                                "default"])]:
        r = as_sa(*args)
        check(r.returncode != 0 and "forbidden" in r.stderr.lower(),
              f"the ServiceAccount may not {what}: {r.stderr.strip()[:160]}")

    # A second release, scoped to its namespace: writes there only, reads of nodes and pods.
    cl.kubectl("create", "namespace", "team-a", check=True)
    scoped = [o for o in render("rbac.scope=namespace", "dashboards.enabled=false")
              if o["kind"] != "CustomResourceDefinition"]
    for o in scoped:
        if o["metadata"].get("namespace") == NS:
            o["metadata"]["namespace"] = "team-a"
        for subject in o.get("subjects", []):
            subject["namespace"] = "team-a"
        if o["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            o["metadata"]["name"] += "-team-a"
            if "roleRef" in o:
                o["roleRef"]["name"] += "-team-a"
    rc, _, err = cl.kubectl("apply", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "List", "items": scoped}))
    check(rc == 0, f"a namespace-scoped release is accepted {err[-200:]}")
    who = "system:serviceaccount:team-a:shardserve"
    for verb, res, ns, allowed in [("create", "pods", "team-a", "yes"),
                                   ("create", "pods", "default", "no"),
                                   ("patch", "shardedmodels.shardserve.io/status", "default", "no"),
                                   ("patch", "shardedmodels.shardserve.io/status", "team-a", "yes"),
                                   ("patch", "shardedmodels.shardserve.io", "team-a", "no"),
                                   ("list", "pods", "default", "yes"),
                                   ("list", "nodes", "", "yes"),
                                   ("get", "secrets", "team-a", "no")]:
        resource, _, sub = res.partition("/")
        r = cl.kubectl("auth", "can-i", verb, resource, "--as", who,
                       *([f"--subresource={sub}"] if sub else []), *(["-n", ns] if ns else []))
        check(r[1].strip() == allowed, f"namespace scope: {verb} {res} in {ns or 'the cluster'}: "
                                       f"{r[1].strip()} (want {allowed})")
    cl.kubectl("delete", "smodel", "rbac-check", check=True)
    check(wait(lambda: not cl.get("pods", "-l", "shardserve.io/model=rbac-check")["items"]),
          "its pods go with it")
finally:
    if op is not None:
        op.kill()
        op.wait()
    if check.failures or sys.exc_info()[0]:
        log = os.path.join(cl.dir, "operator.log")
        if os.path.exists(log):
            print("--- operator.log\n" + open(log).read()[-4000:])
        cl.print_logs()
    cl.stop()
check.finish()
