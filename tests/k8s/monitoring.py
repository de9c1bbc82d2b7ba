"""Monitoring and autoscaling beside a test cluster, as a platform team runs them: a real Prometheus
(the dashboards' and alerts' data) and KEDA's operator and metrics adapter (the external metrics
API the HorizontalPodAutoscaler reads), processes on the host like the control plane, from
scripts/testenv-build.sh. Also the checks every dashboard panel must pass against a Prometheus."""
import base64
import ctypes
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from urllib.parse import urlparse

import yaml

from cluster import HELM, ROOT, wait

DASHBOARDS = os.path.join(ROOT, "dashboards")
TOKEN_IN_POD = "/var/run/secrets/kubernetes.io/serviceaccount/token"


def _die_with_parent():
    """In the child before exec: SIGTERM when the test process ends, however it ends."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _popen(argv, log, env=None, detach=False):
    """A background process logging to `log`: ends with this process unless `detach`."""
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=detach,
                            preexec_fn=None if detach else _die_with_parent)


def free_port(host="127.0.0.1"):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Prometheus:
    """A Prometheus on 127.0.0.1 with `config` (a dict) or the prometheus.yml in `config_dir`;
    with `detach` it outlives this process."""

    def __init__(self, binary="prometheus", config=None, config_dir=None, port=None,
                 detach=False):
        self.dir = tempfile.mkdtemp(prefix="shardserve-prometheus-")
        self.port = port or free_port()
        path = os.path.join(config_dir or self.dir, "prometheus.yml")
        if config is not None:
            with open(path, "w") as f:
                yaml.safe_dump(config, f)
        self.log = open(os.path.join(self.dir, "prometheus.log"), "w")
        self.proc = _popen([binary, f"--config.file={path}", f"--storage.tsdb.path={self.dir}/data",
                            f"--web.listen-address=127.0.0.1:{self.port}"], self.log,
                           detach=detach)
        self.url = f"http://127.0.0.1:{self.port}"
        if not wait(self.ready, 60):
            raise RuntimeError("Prometheus did not start:\n" + self.output()[-3000:])

    def ready(self):
        try:
            return urllib.request.urlopen(self.url + "/-/ready", timeout=2).status == 200
        except OSError:
            return False

    def api(self, path, **params):
        url = f"{self.url}/api/v1/{path}?" + urllib.parse.urlencode(params)
        try:
            return json.loads(urllib.request.urlopen(url, timeout=30).read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read())

    def query(self, expr):
        return self.api("query", query=expr)

    def scalar(self, expr):
        """The first sample of `expr`, 0 when it has none."""
        result = self.query(expr).get("data", {}).get("result", [])
        return float(result[0]["value"][1]) if result else 0.0

    def alerts(self, name, state):
        """The labels of alert `name`'s instances in `state` (pending, firing)."""
        return [a["labels"] for a in self.api("alerts").get("data", {}).get("alerts", [])
                if a["labels"].get("alertname") == name and a["state"] == state]

    def output(self):
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _label_values(prom, query):
    """What Grafana's label_values(metric{sel}, label) offers."""
    m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query.strip())
    return prom.api(f"label/{m.group(2)}/values", **{"match[]": m.group(1)}).get("data", [])


def _substitute(expr, values):
    for name, value in values.items():
        expr = expr.replace(f"${name}", re.escape(value)).replace(f"${{{name}}}", re.escape(value))
    return expr.replace("$__rate_interval", "1m").replace("$__interval", "1m")


def check_dashboards(prom, check, preferred):
    """Every dashboard of dashboards/: each template variable has values (the first of
    `preferred` among them is taken), and each panel query, variables substituted, returns
    series that carry every label its legend names. One check a dashboard, naming each variable
    and query that fails (not a line a panel: 54 of them pushed the e2e test's later checks out
    of the head of its output that a CI summary shows). Returns how many queries were checked."""
    files = sorted(glob.glob(os.path.join(DASHBOARDS, "*.json")))
    check(len(files) == 3, f"three dashboards: {[os.path.basename(f) for f in files]}")
    checked = 0
    for path in files:
        with open(path) as f:
            dash = json.load(f)
        name = os.path.basename(path)
        values, problems, queries = {}, [], 0
        for v in dash["templating"]["list"]:
            if v["type"] != "query":
                continue
            options = _label_values(prom, _substitute(v["query"]["query"], values))
            if not options:
                problems.append(f"variable ${v['name']} has no values")
            values[v["name"]] = ([o for o in options if o in preferred] or options or [""])[0]
        for p in dash["panels"]:
            for t in p.get("targets", []):  # a row has none
                expr = _substitute(t["expr"], values)
                r = prom.query(expr)
                series = r.get("data", {}).get("result", []) if r.get("status") == "success" else []
                wanted = re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", ""))
                unlabelled = [s["metric"] for s in series
                              if not all(s["metric"].get(w) for w in wanted)]
                queries += 1
                if not series:
                    problems.append(f"{p['title']} [{t.get('legendFormat', '')}]: no series for "
                                    f"{expr} ({r.get('error', '')})")
                elif unlabelled:
                    problems.append(f"{p['title']} [{t.get('legendFormat', '')}]: series "
                                    f"without {wanted}: {unlabelled[:2]}")
        checked += queries
        check(not problems, f"{name}: variables {values}, {queries} panel queries return series "
                            f"with their legends' labels" +
              "".join(f"\n  - {x}" for x in problems))
    return checked


def prometheus_for_release(cluster, release, ns, out, rule_for_max=None, interval="1s",
                           port=None, detach=False):
    """A Prometheus (built by scripts/testenv-build.sh) with the scrape jobs and rules that
    scripts/prometheus-config.py derives from the release's rendered monitors (`helm get
    manifest`), discovering as the ServiceAccount monitoring/prometheus (made here: get, list,
    watch of pods, services and endpoints; the release binds it the operator's metrics-reader
    when installed with metrics.serviceMonitor.prometheusServiceAccount). Files go to `out`."""
    os.makedirs(out, exist_ok=True)
    k = cluster.kubectl
    k("create", "namespace", "monitoring")
    k("create", "serviceaccount", "prometheus", "-n", "monitoring")
    k("create", "clusterrole", "prometheus-discovery", "--verb=get,list,watch",
      "--resource=pods,services,endpoints,endpointslices.discovery.k8s.io")
    k("create", "clusterrolebinding", "prometheus-discovery", "--clusterrole=prometheus-discovery",
      "--serviceaccount=monitoring:prometheus")
    token = os.path.join(out, "token")
    with open(token, "w") as f:
        f.write(service_account_token(cluster, "monitoring", "prometheus"))
    os.chmod(token, 0o600)
    manifests = subprocess.run([HELM, "--kubeconfig", cluster.kubeconfig, "get", "manifest",
                                release, "-n", ns], capture_output=True, text=True,
                               check=True).stdout
    args = ["--out", out, "--api-server", cluster.server, "--ca-file", cluster_ca(cluster),
            "--token-file", token, "--token-file-in-pod", f"{TOKEN_IN_POD}={token}",
            "--scrape-interval", interval, "--evaluation-interval", interval]
    if rule_for_max:
        args += ["--rule-for-max", rule_for_max]
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "prometheus-config.py"),
                        *args], input=manifests, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"prometheus-config.py: {r.stderr}")
    return Prometheus(os.path.join(cluster.bin, "prometheus"), config_dir=out, port=port,
                      detach=detach)


def _kubeconfig(path, server, ca, token):
    with open(path, "w") as f:
        yaml.safe_dump({"apiVersion": "v1", "kind": "Config",
                        "clusters": [{"name": "c", "cluster": {"server": server,
                                                               "certificate-authority": ca}}],
                        "users": [{"name": "u", "user": {"token": token}}],
                        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                        "current-context": "c"}, f)
    os.chmod(path, 0o600)


def cluster_ca(cluster):
    with open(cluster.kubeconfig) as f:
        return yaml.safe_load(f)["clusters"][0]["cluster"]["certificate-authority"]


def service_account_token(cluster, ns, name, hours=6):
    return cluster.kubectl("create", "token", name, "-n", ns, f"--duration={hours}h",
                           check=True)[1].strip()


class Keda:
    """KEDA (its operator and its metrics adapter, built by scripts/testenv-build.sh) on a
    cluster with real nodes: KEDA's own CRDs, ServiceAccount and RBAC from its release's
    manifests, a CA and a certificate for the adapter's API and the operator's gRPC metrics
    service, the adapter behind the APIService v1beta1.external.metrics.k8s.io (a Service whose
    endpoint is the host address the apiserver also listens on). With `detach` the processes
    outlive this one."""

    def __init__(self, cluster, bin_dir, detach=False):
        self.c, self.bin, self.detach = cluster, bin_dir, detach
        config = os.path.join(bin_dir, "..", "keda")
        self.dir = os.path.join(cluster.dir, "keda")
        os.makedirs(self.dir)
        self.host = urlparse(cluster.server).hostname  # the apiserver's, reachable from it
        k = cluster.kubectl
        k("create", "namespace", "keda", check=True)
        k("apply", "--server-side", "-f", os.path.join(config, "crd", "bases"), check=True)
        for part in ("service_account/service_account.yaml", "rbac/role.yaml",
                     "rbac/role_binding.yaml", "metrics-server/role.yaml",
                     "metrics-server/role_binding.yaml"):
            k("apply", "-f", os.path.join(config, part), check=True)
        k("wait", "--for", "condition=established", "--timeout=60s",
          "crd/scaledobjects.keda.sh", check=True)
        self._certificates()
        kubeconfig = os.path.join(self.dir, "kubeconfig")
        _kubeconfig(kubeconfig, cluster.server, cluster_ca(cluster),
                    service_account_token(cluster, "keda", "keda-operator"))
        grpc = f"127.0.0.1:{free_port()}"
        self.adapter_port = free_port(self.host)
        env = dict(os.environ, KUBECONFIG=kubeconfig, WATCH_NAMESPACE="", POD_NAMESPACE="keda",
                   KEDA_CLUSTER_OBJECT_NAMESPACE="keda")
        certs = os.path.join(self.dir, "certs")
        self.procs = []
        try:
            self._run(env, grpc, certs, kubeconfig)
        except BaseException:
            self.stop()
            raise

    def _run(self, env, grpc, certs, kubeconfig):
        self._start(env, "keda", "--leader-elect=false", "--metrics-bind-address=0",
                    "--health-probe-bind-address=0", f"--metrics-service-bind-address={grpc}",
                    f"--cert-dir={certs}", "--enable-cert-rotation=false",
                    "--enable-webhook-patching=false", "--enable-apiservice-patching=false",
                    "--zap-log-level=info")
        self._start(env, "keda-adapter", f"--secure-port={self.adapter_port}",
                    f"--bind-address={self.host}", f"--port={free_port()}",
                    f"--cert-dir={certs}", f"--tls-cert-file={certs}/tls.crt",
                    f"--tls-private-key-file={certs}/tls.key", f"--client-ca-file={certs}/ca.crt",
                    f"--lister-kubeconfig={kubeconfig}",
                    f"--authentication-kubeconfig={kubeconfig}",
                    f"--authorization-kubeconfig={kubeconfig}",
                    f"--metrics-service-address={grpc}", "--zap-log-level=info")
        self._api_service()

    def _certificates(self):
        """A CA, and a serving and client certificate for both of KEDA's endpoints (gRPC between
        adapter and operator is mutual TLS on the same pair)."""
        certs = os.path.join(self.dir, "certs")
        os.makedirs(certs)

        def ssl(*args):
            subprocess.run(["openssl", *args], cwd=certs, check=True, capture_output=True)
        ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
            "/CN=keda-test-ca", "-keyout", "ca.key", "-out", "ca.crt")
        with open(os.path.join(certs, "ext.cnf"), "w") as f:
            f.write("subjectAltName=DNS:keda-metrics-apiserver.keda.svc,"
                    "DNS:keda-operator.keda.svc,DNS:localhost,"
                    f"IP:127.0.0.1,IP:{self.host}\n"
                    "extendedKeyUsage=serverAuth,clientAuth\n")
        ssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=keda-operator.keda.svc",
            "-keyout", "tls.key", "-out", "tls.csr")
        ssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", "ext.cnf", "-out", "tls.crt")

    def _start(self, env, exe, *args):
        log = open(os.path.join(self.dir, exe + ".log"), "w")
        self.procs.append((_popen([os.path.join(self.bin, exe), *args], log, env, self.detach),
                           log))

    def _api_service(self):
        with open(os.path.join(self.dir, "certs", "ca.crt"), "rb") as f:
            ca = base64.b64encode(f.read()).decode()
        port = {"name": "https", "port": 443, "targetPort": self.adapter_port, "protocol": "TCP"}
        objs = [
            {"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": "keda-metrics-apiserver", "namespace": "keda"},
             "spec": {"ports": [port]}},
            {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
             "metadata": {"name": "keda-metrics-apiserver-host", "namespace": "keda",
                          "labels": {"kubernetes.io/service-name": "keda-metrics-apiserver"}},
             "addressType": "IPv4", "endpoints": [{"addresses": [self.host]}],
             "ports": [{"name": "https", "port": self.adapter_port, "protocol": "TCP"}]},
            {"apiVersion": "v1", "kind": "Endpoints",
             "metadata": {"name": "keda-metrics-apiserver", "namespace": "keda"},
             "subsets": [{"addresses": [{"ip": self.host}],
                          "ports": [{"name": "https", "port": self.adapter_port}]}]},
            {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
             "metadata": {"name": "v1beta1.external.metrics.k8s.io"},
             "spec": {"service": {"name": "keda-metrics-apiserver", "namespace": "keda",
                                  "port": 443},
                      "group": "external.metrics.k8s.io", "version": "v1beta1",
                      "caBundle": ca, "groupPriorityMinimum": 100, "versionPriority": 100}}]
        self.c.kubectl("apply", "-f", "-", check=True, input=yaml.safe_dump_all(objs))

    def available(self):
        code, out, _ = self.c.kubectl("get", "apiservice", "v1beta1.external.metrics.k8s.io",
                                      "-o", "jsonpath={.status.conditions[?(@.type=="
                                      "'Available')].status}")
        return code == 0 and out.strip() == "True"

    def output(self):
        text = ""
        for proc, log in self.procs:
            with open(log.name, errors="replace") as f:
                text += f"--- {os.path.basename(log.name)}\n" + f.read()[-3000:]
        return text

    def stop(self):
        for proc, log in self.procs:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
