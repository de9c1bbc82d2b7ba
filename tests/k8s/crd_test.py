#!/usr/bin/env python3
"""The ShardedModel CRD against a real kube-apiserver (tests/k8s/testenv): it installs, the
examples apply cleanly with the defaults filled in, `kubectl explain` describes fields, the
printer columns and the scale and status subresources work, and each of many bad manifests is
refused with a message that names the field."""
import glob
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "cli"))
sys.path.insert(0, os.path.dirname(__file__))
from checks import Checks  # noqa: E402
from cluster import ROOT, Cluster  # noqa: E402

check = Checks()


def manifest(name="m", **spec_overrides):
    spec = {"model": {"name": "llama", "uri": "pvc://models/llama"},
            "parallelism": {"tensor": 2, "pipeline": 2},
            "worker": {"image": "ghcr.io/shardserve/worker:1"}}
    for path, value in spec_overrides.items():
        node = spec
        keys = path.split("__")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        if value is None:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
    return {"apiVersion": "shardserve.io/v1alpha1", "kind": "ShardedModel",
            "metadata": {"name": name}, "spec": spec}


BAD = [
    ("tensor 0", manifest(parallelism__tensor=0), "spec.parallelism.tensor"),
    ("pipeline negative", manifest(parallelism__pipeline=-1), "spec.parallelism.pipeline"),
    ("tensor not a number", manifest(parallelism__tensor="two"), "spec.parallelism.tensor"),
    ("tensor over 64", manifest(parallelism__tensor=128), "spec.parallelism.tensor"),
    ("GPU memory not a quantity", manifest(worker__gpuMemory="80GB"), "spec.worker.gpuMemory"),
    ("no model", manifest(model=None), "spec.model"),
    ("no model uri", manifest(model__uri=None), "spec.model.uri"),
    ("unknown uri scheme", manifest(model__uri="gs://bucket/llama"), "spec.model.uri"),
    ("hf uri without a repository", manifest(model__uri="hf://llama"), "spec.model.uri"),
    ("a Secret name that is none", manifest(model__secret="x" * 300), "spec.model.secret"),
    ("relative file uri", manifest(model__uri="file://models"), "spec.model.uri"),
    ("no worker image", manifest(worker__image=None), "spec.worker.image"),
    ("bad gpu resource", manifest(worker__gpuResource="GPU please"), "spec.worker.gpuResource"),
    ("bad toleration operator",
     manifest(worker__tolerations=[{"key": "gpu", "operator": "Maybe"}]),
     "spec.worker.tolerations[0].operator"),
    ("replicas negative", manifest(replicas=-1), "spec.replicas"),
    ("unknown failure policy", manifest(failurePolicy="Sometimes"), "spec.failurePolicy"),
    ("rollout with no room", manifest(rollout={"maxUnavailable": 0, "maxSurge": 0}),
     "spec.rollout"),
    ("port out of range", manifest(serving__port=70000), "spec.serving.port"),
    ("port of the rendezvous", manifest(serving__port=29500), "spec.serving.port"),
    ("port of a rank's metrics", manifest(serving__port=9401), "spec.serving.port"),
    ("micro-batches beyond the batch",
     manifest(parallelism__microBatches=64, serving__maxBatchSize=16),
     "spec.parallelism.microBatches"),
    ("batch size 0", manifest(serving__maxBatchSize=0), "spec.serving.maxBatchSize"),
    ("API key Secret not a name", manifest(serving__apiKeySecret="Keys_1"),
     "spec.serving.apiKeySecret"),
    ("name too long for pod names", manifest(name="m" * 46), "metadata.name"),
    ("misspelt field (strict validation)", manifest(paralelism={"tensor": 2}),
     "spec.paralelism"),
]

c = Cluster()
try:
    c.install_crds()
    check(True, "the CRD installs and is established")
    for path in sorted(glob.glob(os.path.join(ROOT, "examples", "*.yaml"))):
        if not re.search(r"^kind: ShardedModel$", open(path).read(), re.M):
            continue  # e.g. the node list for `shardserve plan`, KEDA's ScaledObject
        rc, out, err = c.kubectl("apply", "--validate=strict", "-f", path)
        check(rc == 0, f"{os.path.basename(path)} applies cleanly {err.strip()}")
    m = c.get("smodel", "tiny-llama")
    spec = m["spec"]
    check(spec["failurePolicy"] == "RecreateReplica" and spec["rollout"] == {
        "maxUnavailable": 1, "maxSurge": 0} and spec["worker"]["gpuResource"] == "nvidia.com/gpu"
        and spec["placement"]["topologyKey"] == "topology.kubernetes.io/zone",
        "defaults are filled in by the apiserver")

    rc, out, _ = c.kubectl("explain", "smodel.spec.parallelism.tensor")
    check(rc == 0 and "Tensor-parallel ranks per stage" in out, "kubectl explain describes a field")
    rc, out, _ = c.kubectl("explain", "shardedmodel.spec.rollout")
    check(rc == 0 and "maxSurge" in out and "maxUnavailable" in out,
          "kubectl explain lists a field's children")

    rc, out, _ = c.kubectl("get", "smodel")
    header = out.splitlines()[0].split()
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    check(header == ["NAME", "READY", "TP", "PP", "GPUS", "STATUS", "AGE"],
          f"printer columns: {' '.join(header)}")
    row = rows.get("tiny-llama", [])
    check(row[1:3] == ["2", "2"], f"TP and PP columns show the parallelism ({' '.join(row)})")
    row = rows.get("deepseek-v3", [])
    check(row[1:3] == ["auto", "auto"], f"or auto, as the spec says it ({' '.join(row)})")

    # The status subresource: the operator's writes go there, and the main resource ignores
    # status; the scale subresource drives spec.replicas and reads status.selector.
    status = {"status": {"replicas": 1, "readyReplicas": 1, "ready": "1/1", "gpus": 4,
                         "phase": "Ready", "selector": "shardserve.io/model=tiny-llama",
                         "observedGeneration": 1}}
    rc, _, err = c.kubectl("patch", "smodel", "tiny-llama", "--subresource=status", "--type=merge",
                           "-p", json.dumps(status))
    check(rc == 0, f"status is written through the status subresource {err.strip()}")
    c.kubectl("patch", "smodel", "tiny-llama", "--type=merge", "-p",
              json.dumps({"status": {"phase": "Degraded"}}))
    check(c.get("smodel", "tiny-llama")["status"]["phase"] == "Ready",
          "a write to the main resource does not change status")
    rc, out, _ = c.kubectl("get", "smodel", "tiny-llama", "--no-headers")
    check(out.split()[1:6] == ["1/1", "2", "2", "4", "Ready"],
          f"READY, GPUS and STATUS come from status ({out.strip()})")
    rc, _, err = c.kubectl("scale", "smodel/tiny-llama", "--replicas=3")
    check(rc == 0 and c.get("smodel", "tiny-llama")["spec"]["replicas"] == 3,
          f"kubectl scale sets spec.replicas {err.strip()}")
    scale = json.loads(c.kubectl("get", "--raw", "/apis/shardserve.io/v1alpha1/namespaces/default/"
                                 "shardedmodels/tiny-llama/scale", check=True)[1])
    check(scale["spec"]["replicas"] == 3 and
          scale["status"]["selector"] == "shardserve.io/model=tiny-llama",
          "the scale subresource reports replicas and the selector (for an HPA)")

    # An HPA drives the model through the scale subresource: with no metrics it still holds
    # the replicas within [minReplicas, maxReplicas].
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": "tiny-llama"},
           "spec": {"scaleTargetRef": {"apiVersion": "shardserve.io/v1alpha1",
                                       "kind": "ShardedModel", "name": "tiny-llama"},
                    "minReplicas": 4, "maxReplicas": 6,
                    "metrics": [{"type": "Resource", "resource": {
                        "name": "cpu", "target": {"type": "Utilization",
                                                  "averageUtilization": 80}}}]}}
    c.kubectl("apply", "-f", "-", input=json.dumps(hpa), check=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and \
            c.get("smodel", "tiny-llama")["spec"]["replicas"] != 4:
        time.sleep(0.5)
    check(c.get("smodel", "tiny-llama")["spec"]["replicas"] == 4,
          "an HPA scales the model to its minReplicas through the scale subresource")

    for what, doc, field in BAD:
        rc, out, err = c.kubectl("apply", "--validate=strict", "-f", "-", input=json.dumps(doc))
        message = (err or out).strip().replace("\n", " ")
        check(rc != 0 and field in message, f"refused: {what}, naming {field}: {message[:200]}")
    check(len(BAD) >= 12, f"{len(BAD)} bad manifests tried")
finally:
    c.stop()
check.finish()
