"""A private Kubernetes control plane for one test (the testenv of tests/k8s/testenv: etcd,
kube-apiserver, kube-controller-manager, kube-scheduler, kwok), plus kubectl and fake-node helpers.
Standard library only; the binaries come from scripts/testenv-build.sh."""
import http.client
import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.parse

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE = os.environ.get("SHARDSERVE_CACHE", os.path.expanduser("~/.cache/shardserve"))
HELM = os.path.join(CACHE, "helm", "helm")  # scripts/setup.sh installs it
# PodMonitor, ServiceMonitor, PrometheusRule (scripts/setup.sh fetches them)
PROMOP_CRDS = os.path.join(CACHE, "prometheus-operator-crds-v0.85.0")


def wait(cond, timeout=60, every=0.1):
    """Polls `cond` until it is true (returns True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every)
    return bool(cond())


class Cluster:
    """`real_nodes` > 0 adds that many real nodes (kubelet + containerd each, the images of
    scripts/images/build.sh imported; see tests/k8s/testenv/cmd/testenv/nodes.go)."""

    def __init__(self, real_nodes=0):
        self.bin = subprocess.run(["bash", os.path.join(ROOT, "scripts", "testenv-build.sh")],
                                  check=True, capture_output=True, text=True).stdout.strip()
        self.dir = tempfile.mkdtemp(prefix="shardserve-testenv-")
        self.log = open(os.path.join(self.dir, "testenv.log"), "w")
        args = []
        if real_nodes:
            images = subprocess.run(["bash", os.path.join(ROOT, "scripts", "images", "build.sh")],
                                    check=True, capture_output=True, text=True).stdout.strip()
            args = ["--real-nodes", str(real_nodes), "--images", images,
                    "--crds", os.path.join(ROOT, "crds")]
        self.proc = subprocess.Popen([os.path.join(self.bin, "testenv"), "up", "--dir", self.dir,
                                      "--bin", self.bin, *args],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180 + 60 * real_nodes
        while not os.path.exists(os.path.join(self.dir, "ready")):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                with open(os.path.join(self.dir, "testenv.log")) as f:
                    why = f.read()[-5000:]
                self.stop()  # removes the directory, the log with it
                raise RuntimeError("testenv did not start:\n" + why)
            time.sleep(0.1)
        self.kubeconfig = os.path.join(self.dir, "kubeconfig")
        self.server = open(os.path.join(self.dir, "ready")).read().strip()

    @classmethod
    def attach(cls, directory):
        """The cluster already running in `directory` (scripts/dev-cluster.sh up), not stopped
        by this object."""
        c = cls.__new__(cls)
        c.dir, c.proc, c.log = directory, None, None
        c.bin = subprocess.run(["bash", os.path.join(ROOT, "scripts", "testenv-build.sh")],
                               check=True, capture_output=True, text=True).stdout.strip()
        c.kubeconfig = os.path.join(directory, "kubeconfig")
        c.server = open(os.path.join(directory, "ready")).read().strip()
        return c

    def kubectl(self, *args, input=None, check=False):
        """(returncode, stdout, stderr) of kubectl against this cluster."""
        r = subprocess.run(["kubectl", "--kubeconfig", self.kubeconfig, *args], input=input,
                           capture_output=True, text=True, timeout=120)
        if check and r.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {r.stderr}")
        return r.returncode, r.stdout, r.stderr

    def get(self, *args):
        return json.loads(self.kubectl("get", "-o", "json", *args, check=True)[1])

    def api(self, method, path, body=None, content_type="application/json", timeout=60,
            raw=False):
        """(status, decoded JSON, or the text when `raw`) of one request to the apiserver as the kubeconfig's user, over
        a connection of this thread kept open: pollers use it where a kubectl process per look
        would cost the machine's cores more than the cluster under test does."""
        conns = self.__dict__.setdefault("_conns", threading.local())
        if getattr(conns, "conn", None) is None:
            pki = {}
            with open(self.kubeconfig) as f:
                for line in f:
                    key, _, value = line.strip().partition(": ")
                    if key in ("certificate-authority", "client-certificate", "client-key"):
                        pki[key] = value
            ctx = ssl.create_default_context(cafile=pki["certificate-authority"])
            ctx.load_cert_chain(pki["client-certificate"], pki["client-key"])
            url = urllib.parse.urlparse(self.server)
            conns.conn = http.client.HTTPSConnection(url.hostname, url.port, context=ctx,
                                                     timeout=timeout)
        data = json.dumps(body).encode() if body is not None else None
        try:
            conns.conn.request(method, path, body=data, headers={"Content-Type": content_type})
            resp = conns.conn.getresponse()
            text = resp.read()
            return resp.status, text.decode() if raw else json.loads(text or b"null")
        except (OSError, http.client.HTTPException, ValueError):
            conns.conn.close()  # the next call connects again (the apiserver may be restarting)
            conns.conn = None
            raise

    def install_crds(self):
        self.kubectl("apply", "-f", os.path.join(ROOT, "crds"), check=True)
        self.kubectl("wait", "--for", "condition=established", "--timeout=60s",
                     "crd/shardedmodels.shardserve.io", check=True)

    def add_gpu_node(self, name, gpus=8, zone="zone-a", labels=None, taints=None):
        """A kwok-managed node with `gpus` nvidia.com/gpu, a zone label and the kwok taint."""
        node = {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake"},
                         "labels": dict({"kubernetes.io/hostname": name,
                                         "topology.kubernetes.io/zone": zone, "type": "kwok"},
                                        **(labels or {}))},
            "spec": {"taints": [{"key": "kwok.x-k8s.io/node", "value": "fake",
                                 "effect": "NoSchedule"}] + list(taints or [])},
            "status": {"allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110",
                                       "nvidia.com/gpu": str(gpus)},
                       "capacity": {"cpu": "64", "memory": "512Gi", "pods": "110",
                                    "nvidia.com/gpu": str(gpus)}},
        }
        self.kubectl("apply", "-f", "-", input=json.dumps(node), check=True)

    def print_logs(self):
        """testenv's log, and the errors of each component (for a failed test)."""
        with open(os.path.join(self.dir, "testenv.log")) as f:
            print("--- testenv.log\n" + f.read()[-3000:])
        names = ["kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok",
                 "kube-proxy", "coredns"]
        names += [os.path.basename(p)[:-4] for p in os.listdir(self.dir)
                  if p.startswith(("kubelet-", "containerd-")) and p.endswith(".log")]
        for name in names:
            path = os.path.join(self.dir, name + ".log")
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    errors = [ln for ln in f if ln[:1] in ("E", "F")]
                print(f"--- {name}.log errors\n" + "".join(errors[-15:]))

    def restart_apiserver(self):
        """Restarts kube-apiserver over an etcd compacted past every version handed out."""
        ready = os.path.join(self.dir, "ready")
        self.proc.send_signal(signal.SIGUSR1)
        if not wait(lambda: not os.path.exists(ready), 30) or not wait(
                lambda: os.path.exists(ready), 180):
            raise RuntimeError("kube-apiserver did not come back")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(150)  # real nodes: their pods drained, the machine cleared
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class Operator:
    """build/bin/shardserve-operator against a Cluster, logging to a file; `args` are flags. The
    test models live under hostpath:///models unless `host_paths` says otherwise."""

    def __init__(self, cluster, binary, *args, name="operator", host_paths="/models"):
        self.log_path = os.path.join(cluster.dir, f"{name}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([binary, "--kubeconfig", cluster.kubeconfig,
                                      f"--allowed-host-paths={host_paths}", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def output(self):
        with open(self.log_path) as f:
            return f.read()

    def kill(self, sig=signal.SIGKILL):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(60)
        self.log.close()


class InspectStandIn:
    """kwok runs no containers. What `shardserve-worker inspect` does in a real pod (the e2e tier
    runs it), this does for every inspect pod of the cluster: it ends it Succeeded with the
    footprint of Llama-3-8B's config (examples/plan/llama-3-8b, as `shardserve plan --footprint`
    in `bin_dir` computes it) as its termination message or, for a model uri with "broken" in
    it, Failed with a reader's error."""

    # Llama-3-8B's sizes: 32 layers; the LM head weighs about 2.4 layers, so PP=2 gives the first
    # stage one layer more (0-16, 17-31).
    SHAPE = {"layers": 32, "hidden": 4096, "intermediate": 14336, "qDim": 4096, "kvDim": 1024,
             "vocab": 128256, "expertsPerToken": 0}
    CONFIG = os.path.join(ROOT, "examples", "plan", "llama-3-8b")

    def __init__(self, cluster, bin_dir):
        self.report = subprocess.run(
            [os.path.join(bin_dir, "shardserve"), "plan", "--model", self.CONFIG, "--footprint"],
            check=True, capture_output=True, text=True).stdout.strip()
        assert json.loads(self.report)["shape"] == self.SHAPE, self.report
        self.c, self.done, self.stop = cluster, set(), threading.Event()
        self.uris = []  # the uri of each inspect pod completed, in order
        threading.Thread(target=self.run, daemon=True).start()

    def run(self):
        while not self.stop.wait(0.2):
            try:
                self.complete()
            except (OSError, http.client.HTTPException, ValueError, KeyError):
                pass  # the apiserver may be restarting: try again

    def complete(self):
        code, pods = self.c.api("GET", "/api/v1/pods?labelSelector=shardserve.io%2Frole%3Dinspect")
        if code != 200:
            return
        for p in pods["items"]:
            meta = p["metadata"]
            if meta["uid"] in self.done or p["status"].get("phase") in ("Succeeded", "Failed"):
                continue
            broken = "broken" in meta["annotations"]["shardserve.io/model-uri"]
            term = ({"exitCode": 1, "reason": "Error", "message": "config.json: not valid JSON"}
                    if broken else
                    {"exitCode": 0, "reason": "Completed", "message": self.report})
            status = {"phase": "Failed" if broken else "Succeeded", "containerStatuses": [
                {"name": "inspect", "ready": False, "restartCount": 0,
                 "image": p["spec"]["containers"][0]["image"], "imageID": "",
                 "state": {"terminated": term}}]}
            code, _ = self.c.api(
                "PATCH", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                {"status": status}, content_type="application/merge-patch+json")
            if code == 200:
                self.done.add(meta["uid"])
                self.uris.append(meta["annotations"]["shardserve.io/model-uri"])
