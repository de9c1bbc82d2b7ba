#!/usr/bin/env python3
"""Models from S3 and the Hugging Face Hub (issue 51). S3: against a real S3-compatible server: moto's (PyPI, in the reference
environment; the Go module proxy lists no version of MinIO's server), holding a generated
model uploaded with boto3 (SHA-256 checksums on all files but one, whose ETag's MD5 checks it).

`shardserve local` with spec.model.uri s3://BUCKET/PREFIX fetches the files spec.model.files
chooses into the model cache and serves them with the answers of the same model read from its
directory; a second start fetches nothing; a fetch cut short resumes without fetching again what
it had; `shardserve plan` fetches config.json alone. Through a proxy of this test that flips one
byte of the weights' bodies (a corrupted transfer), the fetch is refused naming the file, and
nothing counts as present. A missing bucket, bad credentials and a pattern matching nothing are
named.

The Hub: against a test server of ours that answers the Hub's documented endpoints
(hub_server.py): hf://ORG/NAME resolved to its commit, fetched with a token, each file checked
(LFS files by SHA-256, the others by git blob id), served with the same answers; a missing
token, an unknown revision and a corrupted file are named.
Usage: model_source_test.py SHARDSERVE_BINARY"""
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks, free_ports  # noqa: E402
from deployment import Deployment, gen_model  # noqa: E402
from source_helpers import greedy, local_fails, manifests_under  # noqa: E402
from fault_proxy import FaultProxy  # noqa: E402
from hub_server import HubServer  # noqa: E402

import boto3  # noqa: E402

BIN = sys.argv[1]
check = Checks()
tmp = tempfile.mkdtemp(prefix="shardserve-s3-")
S3_PORT = free_ports(2)
PROXY_PORT = S3_PORT + 1

moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                         str(S3_PORT)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_port(port, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.2)
    return False


proxy = FaultProxy("127.0.0.1", S3_PORT, port=PROXY_PORT, corrupt=".safetensors")


def env_for(endpoint_port, cache, **extra):
    e = dict(os.environ, AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test",
             AWS_REGION="us-east-1", AWS_ENDPOINT_URL=f"http://127.0.0.1:{endpoint_port}",
             SHARDSERVE_MODEL_CACHE=cache)
    e.update(extra)
    return e


try:
    check(wait_port(S3_PORT), "moto's S3 server listens")
    model = os.path.join(tmp, "model")
    gen_model(BIN, model)
    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{S3_PORT}",
                      aws_access_key_id="test", aws_secret_access_key="test",
                      region_name="us-east-1")
    s3.create_bucket(Bucket="models")
    names = sorted(os.listdir(model))
    for name in names:
        with open(os.path.join(model, name), "rb") as f:
            body = f.read()
        extra = {} if name == "tokenizer_config.json" else {"ChecksumAlgorithm": "SHA256"}
        s3.put_object(Bucket="models", Key=f"llama/tiny/{name}", Body=body, **extra)
    s3.put_object(Bucket="models", Key="llama/tiny/README.md", Body=b"# not a model file\n")
    total = sum(os.path.getsize(os.path.join(model, n)) for n in names)

    # The same model from its directory, for the answers.
    ref = Deployment(BIN, model, tp=2, pp=1)
    try:
        want = greedy(ref)
    finally:
        ref.stop()
    check(want[0] == 200, f"the model answers from its directory: {want}")

    cache = os.path.join(tmp, "cache")
    files = ["*.safetensors", "*.json"]
    d = Deployment(BIN, None, tp=2, pp=1, uri="s3://models/llama/tiny", files=files,
                   proc_env=env_for(S3_PORT, cache))
    try:
        check(greedy(d) == want, "served from s3:// with the directory's answers")
        log = d.log()
    finally:
        d.stop()
    check(f"{total / 1e6:.1f} MB fetched now" in log,
          f"the first start fetched the model's {total} bytes: {log[-600:]}")
    fetched = manifests_under(cache)
    check(len(fetched) == 1, f"one model in the cache: {fetched}")
    cached_dir = os.path.dirname(fetched[0]) if fetched else ""
    check(sorted(f for f in os.listdir(cached_dir) if not f.startswith(".")) == names,
          "spec.model.files chose the model's files and not README.md")
    for name in names:
        same = open(os.path.join(model, name), "rb").read() == \
            open(os.path.join(cached_dir, name), "rb").read()
        check(same, f"{name} arrived whole")

    d = Deployment(BIN, None, tp=2, pp=1, uri="s3://models/llama/tiny", files=files,
                   proc_env=env_for(S3_PORT, cache))
    try:
        check(greedy(d) == want, "a second start serves the same answers")
        log = d.log()
    finally:
        d.stop()
    check("in the cache already" in log and "0.0 MB fetched now" in log,
          f"a second start fetches nothing: {log[-400:]}")

    # A LoRA adapter from s3:// (issue 54): fetched into the cache, served with the answers of the
    # same adapter read from its directory.
    adapter = os.path.join(tmp, "adapter")
    subprocess.run([BIN, "gen-adapter", "--model", model, "--out", adapter, "--rank", "8",
                    "--seed", "3"], check=True, capture_output=True)
    for name in os.listdir(adapter):
        with open(os.path.join(adapter, name), "rb") as f:
            s3.put_object(Bucket="models", Key=f"adapters/sql/{name}", Body=f.read(),
                          ChecksumAlgorithm="SHA256")
    sql = {"model": "sql", "prompt": "the quick brown", "max_tokens": 8, "temperature": 0}
    answers = {}
    for where in (f"file://{adapter}", "s3://models/adapters/sql"):
        d = Deployment(BIN, model, tp=2, pp=1, proc_env=env_for(S3_PORT, cache),
                       spec=f"  adapters:\n    - {{name: sql, uri: \"{where}\"}}\n")
        try:
            status, _, body = d.post("/v1/completions", sql)
            answers[where] = (status, body["choices"][0]["text"] if status == 200 else body)
            log = d.log()
        finally:
            d.stop()
    check(answers[f"file://{adapter}"][0] == 200 and
          answers["s3://models/adapters/sql"] == answers[f"file://{adapter}"] and
          answers["s3://models/adapters/sql"] != want,
          f"an adapter from s3:// answers as from its directory, not as the base: {answers}")
    check("s3://models/adapters/sql is " in log and "MB fetched now" in log,
          f"the adapter was fetched into the cache: {log[-400:]}")
    rc, out = local_fails(BIN, tmp, f"file://{model}", env_for(S3_PORT, cache),
                          adapters={"sql": "s3://models/adapters/none"})
    check(rc != 0 and "spec.adapters[0].uri: " in out and "no objects under the prefix" in out,
          f"a missing adapter is named with its field: {out[-300:]}")

    # A fetch cut short (the tokenizer refused by the proxy) resumes: what it had stays.
    resumed = os.path.join(tmp, "resumed")
    proxy.corrupt, proxy.refuse = None, "tokenizer.json"
    rc, out = local_fails(BIN, tmp, "s3://models/llama/tiny", env_for(PROXY_PORT, resumed), files)
    check(rc != 0 and "tokenizer.json: HTTP 503" in out,
          f"a file the server keeps refusing stops the fetch, named: {out[-400:]}")
    check(manifests_under(resumed) == [], "a fetch cut short leaves no model present")
    proxy.refuse = None
    d = Deployment(BIN, None, tp=2, pp=1, uri="s3://models/llama/tiny", files=files,
                   proc_env=env_for(S3_PORT, resumed))
    try:
        check(greedy(d) == want, "the resumed fetch serves the same answers")
        log = d.log()
    finally:
        d.stop()
    kept = sum(os.path.getsize(os.path.join(model, n)) for n in names if n < "tokenizer.json")
    check(f"{(total - kept) / 1e6:.1f} MB fetched now" in log,
          f"the resumed fetch fetched only what it lacked ({total - kept} bytes): {log[-300:]}")

    # A byte corrupted in transit: refused by name, nothing present.
    corrupt = os.path.join(tmp, "corrupt")
    proxy.corrupt = ".safetensors"
    rc, out = local_fails(BIN, tmp, "s3://models/llama/tiny", env_for(PROXY_PORT, corrupt), files)
    check(rc != 0 and "model.safetensors has SHA-256" in out and "corrupt" in out,
          f"a corrupted file is refused by name: {out[-400:]}")
    check(manifests_under(corrupt) == [], "nothing of the corrupt fetch counts as present")
    proxy.corrupt = "tokenizer_config.json"  # the file checked by its ETag's MD5
    rc, out = local_fails(BIN, tmp, "s3://models/llama/tiny", env_for(PROXY_PORT, corrupt), files)
    check(rc != 0 and "tokenizer_config.json has MD5" in out,
          f"a file without a SHA-256 is checked by its ETag: {out[-400:]}")
    proxy.corrupt = None

    # What plan reads: config.json alone.
    planned = os.path.join(tmp, "plan")
    r = subprocess.run([BIN, "plan", "--footprint", "--model", "s3://models/llama/tiny"],
                       env=env_for(S3_PORT, planned), capture_output=True, text=True, timeout=60)
    check(r.returncode == 0 and '"architecture":"LlamaForCausalLM"' in r.stdout,
          f"shardserve plan reads the model's footprint from s3://: {r.stdout[:200]}{r.stderr}")
    got = [os.path.basename(p) for p in manifests_under(planned)]
    plan_dir = os.path.dirname(manifests_under(planned)[0]) if got else ""
    check(got and sorted(f for f in os.listdir(plan_dir) if not f.startswith(".")) ==
          ["config.json"], "the plan fetched config.json alone")

    # Errors named.
    rc, out = local_fails(BIN, tmp, "s3://no-such-bucket/x", env_for(S3_PORT, cache))
    check(rc != 0 and "s3://no-such-bucket/x: listing the bucket: HTTP 404" in out,
          f"a missing bucket is named: {out[-300:]}")
    rc, out = local_fails(BIN, tmp, "s3://models/llama/none", env_for(S3_PORT, cache))
    check(rc != 0 and "no objects under the prefix" in out, f"an empty prefix is named: {out[-300:]}")
    rc, out = local_fails(BIN, tmp, "s3://models/llama/tiny", env_for(S3_PORT, cache), ["*.gguf"])
    check(rc != 0 and "'*.gguf' matches none of the model's" in out,
          f"a pattern matching nothing is named: {out[-300:]}")
    rc, out = local_fails(BIN, tmp, "s3://models/llama/tiny",
                          env_for(S3_PORT, cache, AWS_SECRET_ACCESS_KEY=""))
    check(rc != 0 and "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY go together" in out,
          f"half the credentials are named: {out[-300:]}")
    rc, out = local_fails(BIN, tmp, "s3://models/llama/tiny", env_for(S3_PORT + 7, cache))
    check(rc != 0 and "s3://models/llama/tiny: listing the bucket: http://127.0.0.1:" in out and
          "connect" in out.lower(), f"an unreachable endpoint is named: {out[-300:]}")

    # The Hub.
    hub = HubServer(model, "tiny-org/tiny-llama", token="hf_test")
    try:
        hf_cache = os.path.join(tmp, "hf")
        hf_env = dict(os.environ, HF_ENDPOINT=f"http://127.0.0.1:{hub.port}", HF_TOKEN="hf_test",
                      SHARDSERVE_MODEL_CACHE=hf_cache)
        d = Deployment(BIN, None, tp=2, pp=1, uri="hf://tiny-org/tiny-llama", proc_env=hf_env)
        try:
            check(greedy(d) == want, "served from hf:// with the directory's answers")
        finally:
            d.stop()
        present = manifests_under(hf_cache)
        check(len(present) == 1 and os.path.basename(os.path.dirname(present[0])) == hub.commit,
              f"the revision's commit addresses it in the cache: {present}")
        check(any(p.startswith("/lfs-cdn/") for p in hub.requests),
              "the weights came through the Hub's redirect")
        d = Deployment(BIN, None, tp=2, pp=1, uri=f"hf://tiny-org/tiny-llama@{hub.commit}",
                       proc_env=hf_env)
        try:
            check(greedy(d) == want, "the commit names the same revision")
            log = d.log()
        finally:
            d.stop()
        check("in the cache already" in log, "the same commit is in the cache already")
        r = subprocess.run([BIN, "plan", "--footprint", "--model", "hf://tiny-org/tiny-llama"],
                           env=dict(hf_env, SHARDSERVE_MODEL_CACHE=os.path.join(tmp, "hfplan")),
                           capture_output=True, text=True, timeout=60)
        check(r.returncode == 0 and '"architecture":"LlamaForCausalLM"' in r.stdout,
              f"shardserve plan reads the footprint from hf://: {r.stderr[-300:]}")
        rc, out = local_fails(BIN, tmp, "hf://tiny-org/tiny-llama", dict(hf_env, HF_TOKEN=""))
        check(rc != 0 and "hf://tiny-org/tiny-llama: the Hub refuses (HTTP 401)" in out and
              "needs HF_TOKEN" in out, f"a model that needs a token says so: {out[-300:]}")
        rc, out = local_fails(BIN, tmp, "hf://tiny-org/tiny-llama@nope", hf_env)
        check(rc != 0 and "has no revision 'nope' of tiny-org/tiny-llama" in out,
              f"an unknown revision is named: {out[-300:]}")
        rc, out = local_fails(BIN, tmp, "hf://tiny-org/other", hf_env)
        check(rc != 0 and "hf://tiny-org/other: the Hub has no revision 'main'" in out,
              f"an unknown repository is named: {out[-300:]}")
        for name, how in (("model.safetensors", "has SHA-256"), ("config.json", "has git blob id")):
            hub.corrupt = name
            bad = os.path.join(tmp, f"hf-corrupt-{name}")
            rc, out = local_fails(BIN, tmp, "hf://tiny-org/tiny-llama",
                                  dict(hf_env, SHARDSERVE_MODEL_CACHE=bad))
            check(rc != 0 and f"{name} {how}" in out and "corrupt" in out,
                  f"a corrupted {name} is refused by name: {out[-300:]}")
            check(manifests_under(bad) == [], f"nothing of the corrupt {name} counts as present")
        hub.corrupt = None
        hub.overlong = "tokenizer.json"  # a server that sends more than asked: never written
        bad = os.path.join(tmp, "hf-overlong")
        rc, out = local_fails(BIN, tmp, "hf://tiny-org/tiny-llama", dict(hf_env, SHARDSERVE_MODEL_CACHE=bad))
        check(rc != 0 and "tokenizer.json: the answer is longer than" in out,
              f"an answer longer than the range asked is refused: {out[-300:]}")
        sizes = {n: os.path.getsize(os.path.join(model, n)) for n in names}
        too_big = [os.path.join(r, f) for r, _, fs in os.walk(bad) for f in fs
                   if f.split(".part")[0] in sizes and
                   os.path.getsize(os.path.join(r, f)) > sizes[f.split(".part")[0]]]
        check(too_big == [], f"nothing past the range was written: {too_big}")
        hub.overlong = None
    finally:
        hub.stop()
finally:
    proxy.stop()
    moto.terminate()
    moto.wait()
    shutil.rmtree(tmp, ignore_errors=True)
check.finish()
