"""A `shardserve local` deployment for the process-level serving tests: generates a small model,
writes a ShardedModel manifest, starts `shardserve local` on free ports, waits until it serves,
and stops it (SIGINT, like Ctrl-C). Standard library only."""
import http.client
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading

from checks import free_ports


def gen_model(binary, out, *extra):
    subprocess.run([binary, "gen-model", "--out", out, "--layers", "4", "--hidden", "128",
                    "--heads", "4", "--kv-heads", "2", "--intermediate", "256", "--vocab", "512",
                    "--max-position", "4096", *extra], check=True, capture_output=True)


MANIFEST = """apiVersion: shardserve.io/v1alpha1
kind: ShardedModel
metadata:
  name: {name}
spec:
  replicas: {replicas}
  model:
    name: {name}
    uri: {uri}
{files}  parallelism:
    tensor: {tp}
    pipeline: {pp}
  worker:
    image: shardserve/worker:test
    env:
{env}
  serving:
    port: {port}
    maxBatchSize: {max_batch}
    maxSequenceLength: {max_seq}
{serving}{spec}"""


class Deployment:
    def __init__(self, binary, model, name="tiny", tp=2, pp=2, max_batch=8, max_seq=1024,
                 env=None, args=(), api_key=None, serving=None, replicas=1, base_port=None,
                 uri=None, files=None, proc_env=None, spec=""):
        """`uri` (default file://MODEL) and `files` (spec.model.files) say where the model lives;
        `proc_env` is the environment of `shardserve local` (default this process's); `spec`:
        more of the manifest's spec, as YAML lines indented by two."""
        self.binary = binary
        self.name = name
        self.tmp = tempfile.mkdtemp(prefix="shardserve-deploy-")
        # The API (the router's with several replicas), each replica's API behind the router, then
        # every rank's metrics.
        routed = replicas > 1 and "--no-router" not in args
        base = base_port or free_ports(2 + replicas + replicas * tp * pp)
        self.port = base
        self.replica_ports = [base + (1 if routed else 0) + r for r in range(replicas)]
        metrics_base = self.replica_ports[-1] + 1
        self.metrics_ports = [metrics_base + r for r in range(replicas * tp * pp)]
        env = dict(env or {})
        env_yaml = "\n".join(f"      - name: {k}\n        value: \"{v}\"" for k, v in env.items())
        self.manifest = os.path.join(self.tmp, "model.yaml")
        with open(self.manifest, "w") as f:
            files_yaml = ("    files:\n" + "".join(f"      - \"{p}\"\n" for p in files)
                          if files else "")
            f.write(MANIFEST.format(name=name, uri=uri or f"file://{model}", files=files_yaml,
                                    tp=tp, pp=pp, port=base,
                                    replicas=replicas,
                                    max_batch=max_batch, max_seq=max_seq,
                                    env=env_yaml or "      []",
                                    serving="".join(f"    {k}: {v}\n"
                                                    for k, v in (serving or {}).items()),
                                    spec=spec))
        self.log_lines = []
        self.api_key = api_key  # sent with every request when set
        self.proc = subprocess.Popen(
            [binary, "local", "-f", self.manifest, "--metrics-port-base", str(metrics_base),
             *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=proc_env)
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(120):
            self.stop()
            raise RuntimeError("deployment did not become ready:\n" + "".join(self.log_lines))

    def _read(self):
        for line in self.proc.stdout:
            self.log_lines.append(line)
            if "shardserve local: serving" in line:
                self.ready.set()

    def log(self):
        return "".join(self.log_lines)

    def request(self, method, path, body=None, timeout=120, headers=None, raw=None, port=None):
        """(status, headers, body bytes)."""
        conn = http.client.HTTPConnection("127.0.0.1", port or self.port, timeout=timeout)
        data = raw if raw is not None else (json.dumps(body) if body is not None else None)
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        h.update(headers or {})
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        out = (r.status, dict(r.getheaders()), r.read())
        conn.close()
        return out

    def post(self, path, body, **kw):
        status, headers, data = self.request("POST", path, body, **kw)
        try:
            return status, headers, json.loads(data)
        except ValueError:
            return status, headers, data

    def stream(self, path, body, timeout=120):
        """The parsed SSE events of a streamed request, plus whether [DONE] arrived."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        conn.request("POST", path, body=json.dumps(body), headers=h)
        r = conn.getresponse()
        events, done = [], False
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                done = True
                break
            events.append(json.loads(payload))
        conn.close()
        return r.status, events, done

    def metrics_page(self, port=None, token=None):
        """A /metrics page, read with `token` (a router's) or else the API key."""
        conn = http.client.HTTPConnection("127.0.0.1", port or self.port, timeout=10)
        key = token or self.api_key
        conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
        r = conn.getresponse()
        page = r.read().decode()
        conn.close()
        return page

    def stop(self, sig=signal.SIGINT, timeout=30):
        """Stops the deployment and removes its scratch directory (the manifest); the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)
