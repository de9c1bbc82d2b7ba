"""What the model-source tests share: a manifest of the tiny model at a uri, `shardserve local`
on one it must refuse, a greedy answer, and the models present in a cache."""
import os
import subprocess
import time


def write_manifest(tmp, uri, files=None, adapters=None):
    path = os.path.join(tmp, f"m{time.monotonic_ns()}.yaml")
    files_yaml = "".join(f"      - \"{p}\"\n" for p in files or [])
    adapters_yaml = "".join(f"    - {{name: {n}, uri: \"{u}\"}}\n"
                            for n, u in (adapters or {}).items())
    with open(path, "w") as f:
        f.write(f"""apiVersion: shardserve.io/v1alpha1
kind: ShardedModel
metadata:
  name: tiny
spec:
  model:
    name: tiny
    uri: {uri}
{"    files:" + chr(10) + files_yaml if files else ""}  worker:
    image: shardserve/worker:test
{"  adapters:" + chr(10) + adapters_yaml if adapters else ""}""")
    return path


def local_fails(binary, tmp, uri, env, files=None, adapters=None):
    """shardserve local on a model it must refuse (or its adapters: {name: uri}): its exit code
    and output."""
    r = subprocess.run([binary, "local", "-f", write_manifest(tmp, uri, files, adapters)], env=env,
                       capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout + r.stderr


def greedy(d):
    status, _, body = d.post("/v1/completions", {"model": "tiny", "prompt": "the quick brown",
                                                 "max_tokens": 8, "temperature": 0})
    return status, body["choices"][0]["text"] if status == 200 else body


def manifests_under(cache):
    """The models present under a cache (each directory with a manifest)."""
    return [os.path.join(r, f) for r, _, fs in os.walk(cache) for f in fs
            if f == ".manifest.json"]
