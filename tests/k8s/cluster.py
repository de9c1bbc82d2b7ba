"""A private Kubernetes control plane for one test (the testenv of tests/k8s/testenv: etcd,
kube-apiserver, kube-controller-manager, kube-scheduler, kwok), plus kubectl and fake-node helpers.
Standard library only; the binaries come from scripts/testenv-build.sh."""
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

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
