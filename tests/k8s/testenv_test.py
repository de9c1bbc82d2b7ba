#!/usr/bin/env python3
"""The Kubernetes test environment itself, as a person uses it (scripts/dev-cluster.sh up, env,
down) and as the operator will need it: kwok nodes with nvidia.com/gpu become Ready, kube-scheduler
binds pods within the GPUs a node has (and leaves the rest Pending), kwok makes bound pods
Running, the garbage collector deletes children with their owner, and TLS is verified (a client
with another CA is refused)."""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "cli"))
sys.path.insert(0, os.path.dirname(__file__))
from checks import Checks  # noqa: E402
from cluster import ROOT, Cluster, wait  # noqa: E402

check = Checks()


def gpu_pod(name, gpus, owner=None):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
           "spec": {"tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists",
                                     "effect": "NoSchedule"}],
                    "containers": [{"name": "w", "image": "worker",
                                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}}
    if owner:
        pod["metadata"]["ownerReferences"] = [owner]
    return json.dumps(pod)


# --- the person's command ---------------------------------------------------------------------
state = tempfile.mkdtemp(prefix="shardserve-devcluster-")
env = dict(os.environ, SHARDSERVE_DEV_CLUSTER=state)
script = os.path.join(ROOT, "scripts", "dev-cluster.sh")
up = subprocess.run(["bash", script, "up"], env=env, capture_output=True, text=True, timeout=600)
check(up.returncode == 0 and "KUBECONFIG=" in up.stdout, "dev-cluster.sh up starts it")
exports = subprocess.run(["bash", script, "env"], env=env, capture_output=True, text=True).stdout
kubeconfig = exports.split("KUBECONFIG=")[1].split()[0]
r = subprocess.run(["kubectl", "--kubeconfig", kubeconfig, "get", "namespaces", "-o", "name"],
                   capture_output=True, text=True)
check(r.returncode == 0 and "namespace/default" in r.stdout, "kubectl works with its KUBECONFIG")
down = subprocess.run(["bash", script, "down"], env=env, capture_output=True, text=True)
r = subprocess.run(["kubectl", "--kubeconfig", kubeconfig, "get", "ns", "--request-timeout=3s"],
                   capture_output=True, text=True)
check(down.returncode == 0 and r.returncode != 0, "dev-cluster.sh down stops it")

# --- what the operator tests need ------------------------------------------------------------
c = Cluster()
try:
    c.add_gpu_node("gpu-a", gpus=8)
    check(wait(lambda: any(cd["type"] == "Ready" and cd["status"] == "True"
                           for cd in c.get("node", "gpu-a")["status"].get("conditions", []))),
          "a kwok node with 8 nvidia.com/gpu becomes Ready")
    c.kubectl("apply", "-f", "-", input=gpu_pod("p1", 6), check=True)
    check(wait(lambda: c.get("pod", "p1")["status"].get("phase") == "Running"),
          "kube-scheduler binds a 6-GPU pod and kwok makes it Running")
    check(c.get("pod", "p1")["spec"].get("nodeName") == "gpu-a", "it is on the GPU node")
    c.kubectl("apply", "-f", "-", input=gpu_pod("p2", 4), check=True)
    def unschedulable():
        p2 = c.get("pod", "p2")
        reasons = [cd.get("reason") for cd in p2["status"].get("conditions", [])]
        return p2["status"].get("phase") == "Pending" and "Unschedulable" in reasons

    check(wait(unschedulable),
          "a pod needing more GPUs than are left stays Pending (Unschedulable)")
    c.add_gpu_node("gpu-b", gpus=8, zone="zone-b")
    check(wait(lambda: c.get("pod", "p2")["status"].get("phase") == "Running"),
          "a node that appears later takes it")

    cm = json.loads(c.kubectl("create", "configmap", "owner", "-o", "json", check=True)[1])
    owner = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
             "uid": cm["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
    c.kubectl("apply", "-f", "-", input=gpu_pod("child", 1, owner), check=True)
    c.kubectl("delete", "configmap", "owner", check=True)
    check(wait(lambda: c.kubectl("get", "pod", "child")[0] != 0),
          "the garbage collector deletes a pod with its owner")

    # TLS is verified: a kubeconfig naming another CA is refused.
    other = tempfile.mkdtemp()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=other-ca", "-keyout", os.path.join(other, "ca.key"),
                    "-out", os.path.join(other, "ca.crt")], check=True, capture_output=True)
    wrong = open(c.kubeconfig).read().replace(os.path.join(c.dir, "pki", "ca.crt"),
                                              os.path.join(other, "ca.crt"))
    open(os.path.join(other, "kubeconfig"), "w").write(wrong)
    r = subprocess.run(["kubectl", "--kubeconfig", os.path.join(other, "kubeconfig"), "get", "ns"],
                       capture_output=True, text=True)
    check(r.returncode != 0 and "certificate" in r.stderr,
          f"a client trusting another CA is refused ({r.stderr.strip()[:120]})")
finally:
    c.stop()
check.finish()
