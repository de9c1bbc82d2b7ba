#!/usr/bin/env python3
"""The Helm chart (helm/shardserve): helm lint, helm template over a matrix of values (what each
renders), values.schema.json refusing bad values, the Dockerfiles agreeing with the chart, and
the rendered chart applied to the real test apiserver (with the prometheus-operator CRDs), where
the operator then runs under the chart's ServiceAccount token: it places a model (with its
rendezvous secret and disruption budget), applies the worker defaults and the NetworkPolicy;
what the RBAC does not grant is refused, the admission policy refuses privileged pods and host
paths outside the allowed ones, and /metrics answers only whom RBAC allows.

usage: chart_test.py path/to/shardserve-operator"""
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import yaml

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "cli"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "k8s"))
from checks import Checks  # noqa: E402
from cluster import HELM, PROMOP_CRDS, ROOT, Cluster, InspectStandIn, wait  # noqa: E402

BIN = sys.argv[1]
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
                "RoleBinding", "Service", "ServiceAccount", "ValidatingAdmissionPolicy",
                "ValidatingAdmissionPolicyBinding"], f"default render: {kinds}")
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
check("--network-policies" in c["args"] and f"--namespace={NS}" in c["args"] and
      "--metrics-auth=kubernetes" in c["args"] and
      not any(a.startswith("--allowed-host-paths") for a in c["args"]),
      "by default: NetworkPolicies, the release namespace only, /metrics behind RBAC, no hostPath")
anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
check(anti["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname" and
      anti["podAffinityTerm"]["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] ==
      "operator", "the operator's replicas prefer different nodes")
models_role = find(default, "Role", "shardserve-models")[0]
verbs = {(g, res): r["verbs"] for r in models_role["rules"] for g in r["apiGroups"]
         for res in r["resources"]}
check(verbs[("", "pods")] == ["create", "delete"] and
      verbs[("", "events")] == ["create", "list"] and
      verbs[("shardserve.io", "shardedmodels/status")] == ["patch"] and
      verbs[("", "secrets")] == ["create"] and
      verbs[("policy", "poddisruptionbudgets")] == ["create"] and
      not any("*" in v for v in verbs.values()),
      "RBAC: only the verbs the operator uses, no wildcards; Secrets: create, never read; "
      "events: create, and list (a kubelet's FailedMount)")
check(not find(default, "ClusterRole", "shardserve-models"),
      "namespace scope by default: no cluster-wide writes")
reader = find(default, "ClusterRole", "shardserve-metrics-reader")[0]
check(reader["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}],
      "a metrics-reader ClusterRole for whoever scrapes the operator")
dashboards = [o for o in find(default, "ConfigMap") if "grafana_dashboard" in o["metadata"]["labels"]]
names = sorted(k for o in dashboards for k in o["data"])
check(names == ["shardserve-fleet.json", "shardserve-model.json", "shardserve-shard-health.json"],
      f"the three dashboards as ConfigMaps for the Grafana sidecar: {names}")
check(all(json.loads(o["data"][k])["uid"].startswith("shardserve-") for o in dashboards
          for k in o["data"]), "each ConfigMap holds its dashboard JSON as is")
wd = json.loads(find(default, "ConfigMap", "shardserve-worker-defaults")[0]["data"]
                ["worker-defaults.json"])
check(wd["securityContext"]["runAsUser"] == 65532 and
      {e["name"] for e in wd["env"]} == {"NCCL_DEBUG", "NCCL_SOCKET_IFNAME"} and
      wd["resources"]["requests"]["cpu"] and wd["resources"]["limits"]["memory"],
      "worker defaults (security context, NCCL env, requests and limits) for the operator")

cluster_scope = render("rbac.scope=cluster")
check(not any(a.startswith("--namespace=") for a in args_of(cluster_scope)) and
      find(cluster_scope, "ClusterRole", "shardserve-models") and
      not find(cluster_scope, "Role", "shardserve-models"),
      "rbac.scope=cluster (opt-in): every namespace, a ClusterRole instead of a Role")
cluster_read = find(default, "ClusterRole", "shardserve-cluster-read")[0]["rules"]
check(cluster_read == [{"apiGroups": [""], "resources": ["nodes", "pods"],
                        "verbs": ["list", "watch"]},
                       {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
                        "verbs": ["create"]},
                       {"apiGroups": ["authorization.k8s.io"],
                        "resources": ["subjectaccessreviews"], "verbs": ["create"]}],
      "cluster-wide: reads of nodes and pods (GPU accounting), reviews of /metrics tokens")
policy = find(render("operator.allowedHostPaths={/models}", "operator.allowedImages={ghcr.io/x/}"),
              "ValidatingAdmissionPolicy")[0]
rules = " ".join(v["expression"] for v in policy["spec"]["validations"])
check("'/models'" in rules and "'ghcr.io/x/'" in rules and "privileged" in rules and
      "automountServiceAccountToken" in rules and policy["spec"]["matchConditions"][0]
      ["expression"].endswith(f'"system:serviceaccount:{NS}:shardserve"'),
      "the admission policy holds the allowed host paths and images, for the operator's pods")

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

# --- the monitors as a plain Prometheus configuration (scripts/prometheus-config.py) ------------
TESTENV_BIN = subprocess.run(["bash", os.path.join(ROOT, "scripts", "testenv-build.sh")],
                             check=True, capture_output=True, text=True).stdout.strip()


def prometheus_config(docs):
    """(completed process, prometheus.yml as a dict or None, its path) for rendered objects."""
    out = tempfile.mkdtemp(prefix="shardserve-promcfg-")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "prometheus-config.py"),
                        "--out", out], input=yaml.safe_dump_all(docs), capture_output=True,
                       text=True)
    path = os.path.join(out, "prometheus.yml")
    if not os.path.exists(path):
        return r, None, path
    with open(path) as f:
        return r, yaml.safe_load(f), path


r, config, path = prometheus_config(mon)
check(r.returncode == 0 and config, f"prometheus-config.py translates the monitors: {r.stderr}")
jobs = {j["job_name"]: j for j in (config or {}).get("scrape_configs", [])}
check(sorted(jobs) == [f"podMonitor/{NS}/shardserve-ranks/{t}" for t in range(4)] +
      [f"serviceMonitor/{NS}/shardserve-operator/0"],
      f"a scrape job per monitor endpoint, named as prometheus-operator names them: {sorted(jobs)}")


def job_label(job):
    """The `job` label the relabelling gives a target of `job` (a constant, or the Service's
    name when taken from __meta_kubernetes_service_name)."""
    rule = [x for x in job["relabel_configs"] if x.get("target_label") == "job"][-1]
    if rule.get("source_labels") == ["__meta_kubernetes_service_name"]:
        return find(mon, "Service")[0]["metadata"]["name"]
    return rule["replacement"]


ranks = jobs.get(f"podMonitor/{NS}/shardserve-ranks/1", {"relabel_configs": []})
operator = jobs.get(f"serviceMonitor/{NS}/shardserve-operator/0", {"relabel_configs": []})
check({"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
       "regex": "metrics-1"} in ranks["relabel_configs"] and
      {"action": "keep", "regex": "true",
       "source_labels": ["__meta_kubernetes_pod_labelpresent_shardserve_io_model"]}
      in ranks["relabel_configs"] and
      {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"}
      in ranks["relabel_configs"] and ranks["kubernetes_sd_configs"][0]["role"] == "pod",
      "the ranks' job keeps pods with the model label on port metrics-<t>, labelled by namespace")
check(operator.get("honor_labels") is True and
      operator.get("authorization", {}).get("credentials_file") ==
      "/var/run/secrets/kubernetes.io/serviceaccount/token" and
      operator["kubernetes_sd_configs"][0]["role"] == "endpoints",
      "the operator's job keeps the models' namespaces and sends Prometheus' token")
# The alerts select the scrape jobs by their `job` label: they must match what the monitors give.
for rule in alerts["groups"][0]["rules"]:
    for regex in re.findall(r'up\{job=~"([^"]+)"\}', rule["expr"]):
        matched = [job_label(j) for j in jobs.values() if re.fullmatch(regex, job_label(j))]
        check(matched, f"alert {rule['alert']}: job=~\"{regex}\" matches the monitors' jobs "
                       f"({sorted(set(matched))})")
r = subprocess.run([os.path.join(TESTENV_BIN, "promtool"), "check", "config", "--syntax-only",
                    path], capture_output=True, text=True)
check(r.returncode == 0, f"promtool (with Kubernetes discovery) accepts it: "
                         f"{(r.stdout + r.stderr).strip()[-300:]}")
odd = [dict(o, spec=dict(o["spec"], sampleLimit=10)) if o["kind"] == "PodMonitor" else o
       for o in mon]
r, _, _ = prometheus_config(odd)
check(r.returncode != 0 and "sampleLimit not translated" in r.stderr,
      f"a monitor field it does not translate is an error: {r.stderr.strip()}")
minimal = render("networkPolicy.enabled=false", "operator.leaderElection.enabled=false",
                 "operator.replicas=1", "dashboards.enabled=false", "operator.metricsAuth=none",
                 "operator.disruptionBudgets=false", "admissionPolicy.enabled=false")
check("--network-policies" not in args_of(minimal) and "--leader-elect" not in args_of(minimal) and
      "--no-disruption-budgets" in args_of(minimal) and
      "--metrics-auth=none" in args_of(minimal) and
      not find(minimal, "ValidatingAdmissionPolicy") and
      not find(minimal, "ClusterRole", "shardserve-metrics-reader") and
      not [o for o in find(minimal, "Role") if "leader" in o["metadata"]["name"]] and
      not [o for o in find(minimal, "ConfigMap") if "dashboard" in o["metadata"]["name"]],
      "features off: no NetworkPolicy flag or RBAC, no lease RBAC, no dashboards, no budgets, "
      "open /metrics, no admission policy")
own_sa = render("serviceAccount.create=false", "serviceAccount.name=platform-sa")
check(not find(own_sa, "ServiceAccount") and
      find(own_sa, "Deployment")[0]["spec"]["template"]["spec"]["serviceAccountName"]
      == "platform-sa", "an existing ServiceAccount")
# An InferencePool per entry: the model's leaders (the Service's selector), its API port, the EPP.
pools = find(render("inferencePools[0].model=llama", "inferencePools[0].port=8100",
                    "inferencePools[0].endpointPicker.name=llama-epp",
                    "inferencePools[1].model=qwen", "inferencePools[1].namespace=team-b",
                    "inferencePools[1].endpointPicker.name=qwen-epp",
                    "inferencePools[1].endpointPicker.failureMode=FailClose"), "InferencePool")
check(len(pools) == 2 and pools[0]["apiVersion"] == "inference.networking.k8s.io/v1" and
      pools[0]["metadata"]["name"] == "llama" and pools[0]["metadata"]["namespace"] == NS and
      pools[0]["spec"]["selector"]["matchLabels"] == {"shardserve.io/model": "llama",
                                                      "shardserve.io/role": "leader"} and
      pools[0]["spec"]["targetPorts"] == [{"number": 8100}] and
      pools[0]["spec"]["endpointPickerRef"] == {"name": "llama-epp", "port": {"number": 9002},
                                                "failureMode": "FailOpen"} and
      pools[1]["metadata"]["namespace"] == "team-b" and
      pools[1]["spec"]["targetPorts"] == [{"number": 8000}] and
      pools[1]["spec"]["endpointPickerRef"]["failureMode"] == "FailClose",
      f"inferencePools: an InferencePool on each model's leaders ({pools})")
check(not find(default, "InferencePool"), "no InferencePool by default")
crds = [o for o in render(crds=True) if o["kind"] == "CustomResourceDefinition"]
with open(os.path.join(ROOT, "crds", "shardedmodel.yaml")) as f:
    check(crds == [yaml.safe_load(f)], "the chart's CRD is crds/shardedmodel.yaml (one source)")

# --- values.schema.json --------------------------------------------------------------------------
BAD = [("operator.replicas=0", "/operator/replicas"),
       ("operator.metricsAuth=maybe", "/operator/metricsAuth"),
       ("operator.allowedHostPaths={models}", "/operator/allowedHostPaths/0"),
       ("rbac.scope=cluster-wide", "/rbac/scope"),
       ("operator.qps=-1", "/operator/qps"),
       ("metrics.podMonitor.interval=fifteen", "/metrics/podMonitor/interval"),
       ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
       ("workerDefaults.env[0].name=1BAD", "/workerDefaults/env/0/name"),
       ("operater.replicas=2", "operater"),
       ("inferencePools[0].model=llama", "/inferencePools/0"),
       ("inferencePools[0].endpointPicker.failureMode=Maybe", "/inferencePools/0")]
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
                        "metrics.prometheusRule.enabled=true", "operator.allowedHostPaths={/models}",
                        crds=True)
    rc, out, err = cl.kubectl("apply", "--validate=strict", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "List", "items": everything}))
    check(rc == 0, f"the rendered chart ({len(everything)} objects) is accepted: {err[-300:]}")
    cl.kubectl("wait", "--for", "condition=established", "--timeout=60s",
               "crd/shardedmodels.shardserve.io", check=True)
    with open(cl.kubeconfig) as f:
        admin = yaml.safe_load(f)
    ca = admin["clusters"][0]["cluster"]["certificate-authority"]

    def token_config(sa, ns):
        """A kubeconfig with a token of ServiceAccount ns/sa (and the token)."""
        rc, token, _ = cl.kubectl("create", "token", sa, "-n", ns)
        path = os.path.join(cl.dir, f"{sa}.kubeconfig")
        with open(path, "w") as f:
            yaml.safe_dump({"apiVersion": "v1", "kind": "Config", "current-context": "sa",
                            "clusters": [{"name": "c", "cluster": {"server": cl.server,
                                                                   "certificate-authority": ca}}],
                            "users": [{"name": "sa", "user": {"token": token.strip()}}],
                            "contexts": [{"name": "sa", "context": {"cluster": "c", "user": "sa",
                                                                    "namespace": ns}}]}, f)
        return path, token.strip()

    sa_config, token = token_config("shardserve", NS)
    check(bool(token), "a token of the chart's ServiceAccount")
    defaults = os.path.join(cl.dir, "worker-defaults.json")
    with open(defaults, "w") as f:
        f.write(find(everything, "ConfigMap", "shardserve-worker-defaults")[0]["data"]
                ["worker-defaults.json"])

    def as_sa(*args, config=sa_config, stdin=None):
        return subprocess.run(["kubectl", "--kubeconfig", config, *args], capture_output=True,
                              text=True, timeout=60, input=stdin)

    for i in range(2):
        cl.add_gpu_node(f"gpu-{i}", gpus=8)
    InspectStandIn(cl, os.path.dirname(BIN))  # kwok runs no container: the inspect pod's report
    # The operator's own flags, as the Deployment renders them, against the SA kubeconfig.
    flags = [a for a in args_of(everything) if not a.startswith("--listen")]
    flags = [f"--worker-defaults={defaults}" if a.startswith("--worker-defaults") else a
             for a in flags]
    log_path = os.path.join(cl.dir, "operator.log")
    op = subprocess.Popen([BIN, "--kubeconfig", sa_config, "--listen", "127.0.0.1:0", *flags],
                          stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    model = {"apiVersion": "shardserve.io/v1alpha1", "kind": "ShardedModel",
             "metadata": {"name": "rbac-check", "namespace": NS},
             "spec": {"replicas": 1, "model": {"name": "llama", "uri": "hostpath:///models/l"},
                      "parallelism": {"tensor": 4, "pipeline": 2},
                      "worker": {"image": "ghcr.io/shardserve/worker:0.1.0",
                                 "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                                 "tolerations": [{"key": "kwok.x-k8s.io/node",
                                                  "operator": "Exists"}]}}}
    cl.kubectl("apply", "-f", "-", input=json.dumps(model), check=True)

    def ready():
        s = cl.get("smodel", "rbac-check", "-n", NS).get("status", {})
        return s.get("readyReplicas") == 1
    ok = wait(ready, 90)
    check(ok, "under the chart's RBAC and admission policy the operator places the model (pods, "
              "services, the rendezvous secret, the disruption budget, status, events, lease)")
    pods = cl.get("pods", "-n", NS, "-l",
                  "shardserve.io/model=rbac-check,shardserve.io/role!=inspect")["items"]
    spec = pods[0]["spec"] if pods else {}
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]} if pods else {}
    check(pods and env.get("NCCL_SOCKET_IFNAME") == "eth0" and env.get("NCCL_DEBUG") == "INFO" and
          spec["containers"][0]["securityContext"]["runAsUser"] == 65532 and
          spec["containers"][0]["resources"]["requests"]["cpu"] == "2",
          "worker pods get the chart's workerDefaults (the model's own env wins)")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    check(spec.get("automountServiceAccountToken") is False and
          volumes["shm"]["emptyDir"].get("sizeLimit") and
          volumes["rendezvous"]["secret"]["secretName"] == "rbac-check-0-rendezvous",
          "worker pods: no ServiceAccount token, a bounded /dev/shm, the replica's secret")
    rc, out, _ = cl.kubectl("get", "secret", "rbac-check-0-rendezvous", "-n", NS, "-o", "json")
    secret = json.loads(out) if rc == 0 else {}
    check(rc == 0 and len(secret["data"]["secret"]) > 40 and
          secret["metadata"]["ownerReferences"][0]["kind"] == "ShardedModel",
          "the operator made the replica's rendezvous secret, owned by the model")
    leader = [p for p in pods if p["metadata"]["labels"]["shardserve.io/stage"] == "0"]
    pdbs = json.loads(cl.kubectl("get", "pdb", "-n", NS, "-o", "json")[1])["items"]
    check(leader and len(pdbs) == 1 and pdbs[0]["spec"]["minAvailable"] == 2 and
          pdbs[0]["metadata"]["ownerReferences"][0]["uid"] == leader[0]["metadata"]["uid"],
          "a disruption budget for the replica's gang, owned by its leader pod")
    np = cl.kubectl("get", "networkpolicy", "rbac-check-workers", "-n", NS, "-o", "json")
    check(np[0] == 0 and json.loads(np[1])["spec"]["podSelector"]["matchLabels"] ==
          {"shardserve.io/model": "rbac-check"}, "the model's NetworkPolicy was written")
    lease = cl.kubectl("get", "lease", "shardserve", "-n", NS, "-o", "json")
    check(lease[0] == 0 and json.loads(lease[1])["spec"]["holderIdentity"],
          "the leader Lease in the release namespace")
    for what, args in [("read secrets", ["get", "secrets", "-n", NS]),
                       ("delete a node", ["delete", "node", "gpu-0", "--wait=false"]),
                       ("patch a ShardedModel's spec", ["patch", "smodel", "rbac-check", "-n",
                                                        NS, "--type=merge", "-p",
                                                        '{"spec":{"replicas":3}}']),
                       ("delete a Deployment", ["delete", "deployment", "x", "-n", NS]),
                       ("read a Deployment", ["get", "deployments", "-n", NS]),
                       ("create pods in another namespace", ["run", "x", "--image=x", "-n",
                                                             "default"])]:
        r = as_sa(*args)
        check(r.returncode != 0 and "forbidden" in r.stderr.lower(),
              f"the ServiceAccount may not {what}: {r.stderr.strip()[:160]}")
    for verb, res in [("list", "secrets"), ("watch", "secrets"), ("create", "pods/exec")]:
        resource, _, sub = res.partition("/")
        r = cl.kubectl("auth", "can-i", verb, resource, "-n", NS, "--as",
                       f"system:serviceaccount:{NS}:shardserve",
                       *([f"--subresource={sub}"] if sub else []))
        check(r[1].strip() == "no", f"the ServiceAccount may not {verb} {res}")

    # The admission policy, whatever the operator would write: pods the ServiceAccount creates.
    good = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "policy-check", "namespace": NS},
            "spec": {"automountServiceAccountToken": False,
                     "containers": [{"name": "c", "image": "ghcr.io/shardserve/worker:0.1.0"}],
                     "volumes": [{"name": "m", "hostPath": {"path": "/models/l"}}]}}

    def with_(mutate):
        pod = json.loads(json.dumps(good))
        mutate(pod["spec"])
        return json.dumps(pod)
    r = as_sa("create", "--dry-run=server", "-f", "-", stdin=json.dumps(good))
    check(r.returncode == 0, f"the policy admits a pod as the operator builds it {r.stderr[:160]}")
    # (The test apiserver runs with --allow-privileged=false and refuses '..' in a hostPath
    # itself; the policy's own refusal is checked where nothing else refuses.)
    for what, mutate, by_policy in [
            ("privileged", lambda s: s["containers"][0].update(
                {"securityContext": {"privileged": True}}), False),
            ("escalating privileges", lambda s: s["containers"][0].update(
                {"securityContext": {"allowPrivilegeEscalation": True}}), True),
            ("with an added capability", lambda s: s["containers"][0].update(
                {"securityContext": {"capabilities": {"add": ["NET_ADMIN"]}}}), True),
            ("on the host network", lambda s: s.update({"hostNetwork": True}), True),
            ("with a ServiceAccount token", lambda s: s.update(
                {"automountServiceAccountToken": True}), True),
            ("mounting /etc", lambda s: s["volumes"].append(
                {"name": "e", "hostPath": {"path": "/etc"}}), True),
            ("mounting /models-other", lambda s: s["volumes"].append(
                {"name": "e", "hostPath": {"path": "/models-other"}}), True),
            ("escaping /models with ..", lambda s: s["volumes"].append(
                {"name": "e", "hostPath": {"path": "/models/../etc"}}), False)]:
        r = as_sa("create", "--dry-run=server", "-f", "-", stdin=with_(mutate))
        check(r.returncode != 0 and (not by_policy or "shardserve-worker-pods" in r.stderr),
              f"a pod {what} is refused: {r.stderr.strip()[-140:]}")

    # /metrics: for whom the apiserver authenticates and RBAC allows.
    port = None
    for _ in range(100):
        m = re.search(r"serving /metrics, /healthz, /readyz on 127\.0\.0\.1:(\d+)",
                      open(log_path).read())
        if m:
            port = int(m.group(1))
            break
        time.sleep(0.1)
    cl.kubectl("create", "serviceaccount", "prometheus", "-n", NS, check=True)
    cl.kubectl("create", "clusterrolebinding", "prometheus-reads-shardserve",
               "--clusterrole=shardserve-metrics-reader",
               f"--serviceaccount={NS}:prometheus", check=True)
    _, prom_token = token_config("prometheus", NS)

    def metrics(token=None):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        conn.request("GET", "/metrics",
                     headers={"Authorization": f"Bearer {token}"} if token else {})
        r = conn.getresponse()
        return r.status, r.read().decode()
    status, page = metrics(prom_token)
    check(status == 200 and "shardserve_operator_reconcile_total" in page,
          f"/metrics answers a ServiceAccount bound to metrics-reader ({status})")
    check(metrics()[0] == 401 and metrics("not-a-token")[0] == 401,
          "/metrics without a token, or with one the apiserver does not know: 401")
    status, page = metrics(token)
    check(status == 403 and "may not get /metrics" in page,
          f"/metrics with a token RBAC does not allow: 403 ({page.strip()[:100]})")

    # A second release, scoped to the whole cluster (opt-in): writes everywhere.
    cl.kubectl("create", "namespace", "team-a", check=True)
    scoped = [o for o in render("rbac.scope=cluster", "dashboards.enabled=false",
                                "admissionPolicy.enabled=false")
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
    check(rc == 0, f"a cluster-scoped release is accepted {err[-200:]}")
    for who, verb, res, ns, allowed in [
            ("team-a", "create", "pods", "team-a", "yes"),
            ("team-a", "create", "pods", "default", "yes"),
            ("team-a", "patch", "shardedmodels.shardserve.io/status", "default", "yes"),
            ("team-a", "update", "shardedmodels.shardserve.io", "team-a", "no"),
            (NS, "patch", "shardedmodels.shardserve.io", "default", "no"),
            (NS, "patch", "shardedmodels.shardserve.io", NS, "yes"),
            ("team-a", "get", "secrets", "team-a", "no"),
            (NS, "create", "pods", "default", "no"),
            (NS, "patch", "shardedmodels.shardserve.io/status", "default", "no"),
            (NS, "patch", "shardedmodels.shardserve.io/status", NS, "yes"),
            (NS, "list", "pods", "default", "yes"),
            (NS, "list", "nodes", "", "yes")]:
        resource, _, sub = res.partition("/")
        r = cl.kubectl("auth", "can-i", verb, resource, "--as",
                       f"system:serviceaccount:{who}:shardserve",
                       *([f"--subresource={sub}"] if sub else []), *(["-n", ns] if ns else []))
        check(r[1].strip() == allowed, f"{who}'s operator: {verb} {res} in "
                                       f"{ns or 'the cluster'}: {r[1].strip()} (want {allowed})")
    cl.kubectl("delete", "smodel", "rbac-check", "-n", NS, check=True)
    check(wait(lambda: not cl.get("pods", "-n", NS, "-l", "shardserve.io/model=rbac-check")
               ["items"]), "its pods go with it")
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
