"""What the end-to-end tests on real nodes share: a tiny model readable by the containers' user,
ShardedModel manifests, the model's status and pods, requests through its Service, a client loop
that counts failures, a rank's process on the host, and the chart installed with Helm."""
import http.client
import json
import os
import subprocess
import threading
import time

from checks import cpu_kernels
from cluster import HELM, ROOT

IMAGE = "localhost/shardserve/worker:dev"
# The CPU kernel level of every pod (manifest's worker env) and of the shardserve local
# references (this process's environment): set by readable_models to the widest F32 level where
# auto's would round BF16 weights' activations (avx512bf16: AMD with AVX512-BF16). The flows
# compare differently sharded replicas' answers (a disaggregated decode replica at TP 1 with its
# TP 2 prefill role, against TP 2 x PP 2 colocated) to 1e-4, which F32 arithmetic keeps and the
# rounding (~1e-2 in logprobs) does not.
KERNELS_ENV = {}


def figure(what, seconds):
    print(f"figure: {what}: {seconds:.1f} s", flush=True)


def readable_models(shardserve, tmp, gen_model):
    """tmp/models/tiny, generated, every directory and file readable by the pods' user."""
    os.chmod(tmp, 0o755)
    models = os.path.join(tmp, "models")
    os.makedirs(models)
    model_dir = os.path.join(models, "tiny")
    gen_model(shardserve, model_dir)
    if cpu_kernels(shardserve, model_dir) == "avx512bf16":
        KERNELS_ENV["SHARDSERVE_CPU_KERNELS"] = os.environ["SHARDSERVE_CPU_KERNELS"] = "avx512"
    for root, dirs, files in os.walk(models):
        os.chmod(root, 0o755)
        for n in files:
            os.chmod(os.path.join(root, n), 0o644)
    return models, model_dir


def manifest(name, uri, tp=2, pp=2, replicas=1, image=IMAGE, env=None, key_secret=True,
             max_batch=8, startup=None, serving=None):
    worker = {"image": image,
              "resources": {"requests": {"cpu": "100m", "memory": "256Mi"},
                            "limits": {"memory": "2Gi"}}}
    env = {**KERNELS_ENV, **(env or {})}
    if env:
        worker["env"] = [{"name": k, "value": v} for k, v in env.items()]
    serving = {"port": 8000, "maxBatchSize": max_batch, "maxSequenceLength": 1024,
               **(serving or {})}
    if key_secret:
        serving["apiKeySecret"] = "tiny-api-keys"
    return {"apiVersion": "shardserve.io/v1alpha1", "kind": "ShardedModel",
            "metadata": {"name": name},
            "spec": {"replicas": replicas, "model": {"name": name, "uri": uri},
                     "parallelism": {"tensor": tp, "pipeline": pp}, "worker": worker,
                     "serving": serving, **({"startup": startup} if startup else {})}}


class Models:
    """kubectl views of the ShardedModels of a Cluster, and requests to them with API key `key`."""

    def __init__(self, cluster, key):
        self.c, self.key = cluster, key

    def apply(self, obj):
        self.c.kubectl("apply", "-f", "-", input=json.dumps(obj), check=True)

    def status(self, name):
        return self.c.get("smodel", name).get("status", {})

    def replica(self, name, index):
        for r in self.status(name).get("replicaStatuses", []):
            if r.get("index") == index:
                return r
        return {}

    def ready(self, name, n):
        obj = self.c.get("smodel", name)
        s = obj.get("status", {})
        return (s.get("readyReplicas") == n and s.get("replicas") == n and
                s.get("phase") == "Ready" and
                s.get("observedGeneration") == obj["metadata"]["generation"] and
                s.get("updatedReplicas") == n)

    def pods(self, name, selector=""):
        sel = f"shardserve.io/model={name}" + (f",{selector}" if selector else "")
        return self.c.get("pods", "-l", sel)["items"]

    def service_ip(self, name):
        return self.c.get("svc", name)["spec"]["clusterIP"]

    def post(self, host, body, path="/v1/completions", timeout=60, key=None):
        """(status, parsed body or text); raises OSError when the connection fails."""
        conn = http.client.HTTPConnection(host, 8000, timeout=timeout)
        try:
            conn.request("POST", path, body=json.dumps(body),
                         headers={"Content-Type": "application/json",
                                  "Authorization": f"Bearer {key or self.key}"})
            r = conn.getresponse()
            data = r.read()
            try:
                return r.status, json.loads(data)
            except ValueError:
                return r.status, data.decode(errors="replace")
        finally:
            conn.close()

    def answers(self, name, prompt="hello world", host=None):
        try:
            return self.post(host or self.service_ip(name),
                             {"model": name, "prompt": prompt, "max_tokens": 12})[0] == 200
        except OSError:
            return False


class ClientLoop:
    """Sends completions of `max_tokens` to model `name` through its Service from `clients`
    threads, each one request after another, until stopped; counts failures (a connection error
    or any status but 200), keeping what each failure said."""

    def __init__(self, models, name, clients=1, max_tokens=8, pause=0.02):
        self.ok, self.failed, self.errors = 0, 0, []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        host = models.service_ip(name)
        body = {"model": name, "prompt": "load", "max_tokens": max_tokens}
        self.threads = [threading.Thread(target=self._run, args=(models, host, body, pause),
                                         daemon=True) for _ in range(clients)]
        for t in self.threads:
            t.start()

    def _run(self, models, host, body, pause):
        while not self.stopping.is_set():
            try:
                code, answer = models.post(host, body)
                err = None if code == 200 else f"{code}: {str(answer)[:200]}"
            except OSError as e:
                err = f"connection: {e}"
            with self.lock:
                if err is None:
                    self.ok += 1
                else:
                    self.failed += 1
                    self.errors.append(err)
            time.sleep(pause)

    def stop(self):
        self.stopping.set()
        for t in self.threads:
            t.join(120)
        return self


class StreamSet:
    """`n` clients streaming completions of model `name` through its Service, each one stream
    after another until stopped: even clients greedy, odd ones sampled with a seed of their
    own, each with a prompt of its own. A client's first stream is its reference (started before
    any fault: wait_references); every later one must equal it. Counts the streams, the errors
    (a status but 200, a connection error, an error event, a stream without [DONE]) and the
    answers that differ, keeping what each said."""

    def __init__(self, models, name, n=16, max_tokens=160):
        self.done, self.errors, self.differ = 0, [], []
        self.refs = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        host = models.service_ip(name)
        self.threads = [threading.Thread(target=self._run, args=(models, host, name, i, max_tokens),
                                         daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, models, host, name, i, max_tokens):
        body = {"model": name, "prompt": f"client {i} asks: " + "tell me more. " * (4 + i % 5),
                "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                "temperature": 0 if i % 2 == 0 else 0.8, **({"seed": 1000 + i} if i % 2 else {})}
        while not self.stopping.is_set():
            err, text = None, ""
            try:
                conn = http.client.HTTPConnection(host, 8000, timeout=120)
                conn.request("POST", "/v1/completions", body=json.dumps(body),
                             headers={"Content-Type": "application/json",
                                      "Authorization": f"Bearer {models.key}"})
                r = conn.getresponse()
                raw = r.read().decode(errors="replace")
                conn.close()
                if r.status != 200:
                    err = f"{r.status}: {raw[:200]}"
                else:
                    for event in raw.split("\n\n"):
                        if not event.startswith("data: {"):
                            continue
                        e = json.loads(event[6:])
                        if "error" in e:
                            err = f"error event: {event[:200]}"
                            break
                        text += "".join(ch.get("text", "") for ch in e.get("choices", []))
                    if err is None and "data: [DONE]" not in raw:
                        err = f"no [DONE]: {raw[-200:]}"
            except (OSError, ValueError) as e:
                err = f"connection: {e}"
            with self.lock:
                if err is not None:
                    self.errors.append(f"client {i}: {err}")
                    continue
                self.done += 1
                if i not in self.refs:
                    self.refs[i] = text
                elif self.refs[i] != text:
                    self.differ.append(f"client {i}: {text[:60]!r} vs {self.refs[i][:60]!r}")

    def wait_references(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.refs) == len(self.threads):
                    return True
            time.sleep(0.2)
        return False

    def stop(self):
        self.stopping.set()
        for t in self.threads:
            t.join(180)
        return self


def container_pid(pod, exe, argv1=None, env=None):
    """The host pid of the process running `exe` (argv[0] ends with it; argv[1] == argv1 when
    given) in `pod`'s container (HOSTNAME is the pod's name), with the environment `env`."""
    want = {b"HOSTNAME": pod.encode(), **{k.encode(): v.encode() for k, v in (env or {}).items()}}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if not argv[0].endswith(exe.encode()) or (
                    argv1 is not None and (len(argv) < 2 or argv[1] != argv1.encode())):
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                penv = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        except OSError:
            continue
        if all(penv.get(k) == v for k, v in want.items()):
            return int(pid)
    return None


def rank_pid(pod, tp_rank):
    """The host pid of `shardserve-worker rank` SHARDSERVE_TP_RANK=tp_rank in pod's container."""
    return container_pid(pod, "shardserve-worker", "rank", {"SHARDSERVE_TP_RANK": str(tp_rank)})


def helm_install(cluster, release, ns, models, *sets):
    """The chart installed in `ns` with the local operator image and workers small enough for
    this machine; `sets` are more --set values. (ok, helm's stderr)."""
    cluster.kubectl("create", "namespace", ns, check=True)
    cluster.kubectl("config", "set-context", "--current", f"--namespace={ns}", check=True)
    args = ["image.repository=localhost/shardserve/operator", "image.tag=dev",
            f"operator.allowedHostPaths={{{models}}}",
            "workerDefaults.resources.requests.cpu=100m",
            "workerDefaults.resources.requests.memory=256Mi",
            "workerDefaults.resources.limits.memory=2Gi", *sets]
    r = subprocess.run([HELM, "--kubeconfig", cluster.kubeconfig, "install", release,
                        os.path.join(ROOT, "helm", "shardserve"), "-n", ns,
                        *[x for s in args for x in ("--set", s)],
                        "--wait", "--timeout=180s"], capture_output=True, text=True, timeout=240)
    return r.returncode == 0, r.stderr[-500:]


def operator_pods(cluster):
    return cluster.get("pods", "-l", "app.kubernetes.io/name=shardserve")["items"]


def lease_holder(cluster, release):
    """The pod holding the operator's Lease ("" while there is none)."""
    code, out, _ = cluster.kubectl("get", "lease", f"{release}-shardserve", "-o",
                                   "jsonpath={.spec.holderIdentity}")
    return out.strip().rsplit("_", 1)[0] if code == 0 else ""


class HeldRegistry:
    """An OCI registry on 127.0.0.1 (plain HTTP, as containerd takes loopback registries) that
    serves the worker image (scripts/images/build.sh's archive) under any name, and holds back the pulls of chosen nodes: a pull as slow as a
    multi-gigabyte image on a busy registry. Each real node's containerd reaches it through a
    hosts.toml of its own that sends the node's name (x-shardserve-node), so the registry knows
    whose pull it is. `hold(wanted, seconds)`: the manifest asked for by a node for which
    `wanted(node)` is true comes `seconds` after the first such request, or at `release()`; the
    pull, and the pod's container, wait meanwhile."""

    def __init__(self, cluster, archive):
        import hashlib
        import http.server
        import tarfile
        with tarfile.open(archive) as t:
            self.blobs = {m.name.split("/")[-1]: t.extractfile(m).read()
                          for m in t.getmembers() if m.name.startswith("blobs/sha256/")}
            index = json.loads(t.extractfile("index.json").read())
        self.manifest_digest = index["manifests"][0]["digest"].split(":")[1]
        assert hashlib.sha256(self.blobs[self.manifest_digest]).hexdigest() == self.manifest_digest
        self.wanted, self.seconds, self.release_at = None, 0, None
        self.held, self.lock = set(), threading.Lock()
        self.released = threading.Event()
        registry = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def answer(self, body):
                ctype = "application/octet-stream"
                if self.path.split("/")[-2] == "manifests":
                    ctype = "application/vnd.oci.image.manifest.v1+json"
                digest = hashlib.sha256(body).hexdigest()
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Docker-Content-Digest", "sha256:" + digest)
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(body)

            def do_GET(self):
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts == ["v2"]:
                    return self.answer(b"{}")
                kind, ref = parts[-2], parts[-1]
                if parts[0] != "v2" or len(parts) < 4 or kind not in ("manifests", "blobs"):
                    return self.send_error(404)
                digest = registry.manifest_digest if kind == "manifests" and not \
                    ref.startswith("sha256:") else ref.split(":")[-1]
                if digest not in registry.blobs:
                    return self.send_error(404)
                if kind == "manifests":  # every node holds the layers already (same digests)
                    registry.wait(self.headers.get("x-shardserve-node", ""))
                self.answer(registry.blobs[digest])

            do_HEAD = do_GET

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        host = f"127.0.0.1:{self.port}"
        for node in os.listdir(os.path.join(cluster.dir, "nodes")):
            d = os.path.join(cluster.dir, "nodes", node, "certs.d", host)
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "hosts.toml"), "w") as f:
                f.write(f'server = "http://{host}"\n[host."http://{host}"]\n'
                        f'  capabilities = ["pull", "resolve"]\n'
                        f'  [host."http://{host}".header]\n'
                        f'    x-shardserve-node = ["{node}"]\n')

    def image(self, name):
        # `latest`: pulled by every pod (imagePullPolicy Always), whatever the node holds.
        return f"127.0.0.1:{self.port}/{name}/worker:latest"

    def hold(self, wanted, seconds):
        with self.lock:
            self.wanted, self.seconds, self.release_at = wanted, seconds, None
            self.held = set()
            self.released.clear()

    def release(self):
        self.released.set()

    def wait(self, node):
        with self.lock:
            wanted = self.wanted
        if wanted is None or not wanted(node):
            return
        with self.lock:
            self.held.add(node)
            if self.release_at is None:
                self.release_at = time.monotonic() + self.seconds
            left = self.release_at - time.monotonic()
        self.released.wait(max(0.0, left))

    def stop(self):
        self.release()
        self.server.shutdown()
