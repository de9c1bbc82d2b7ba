#!/usr/bin/env python3
"""Models from an OCI registry, and the fetch step of a worker pod (issue 51).

The registry is the CNCF distribution registry (built from its Go module by
scripts/servers-build.sh), with htpasswd (basic) authentication, holding a generated model pushed
as an OCI artifact, one layer a file titled by org.opencontainers.image.title (as `oras push`
makes it; pushed here through the distribution API).

`shardserve local` with oci://REGISTRY/REPO:TAG serves the same answers as the model's directory;
@sha256:DIGEST names the same revision; credentials come from a Docker config; without them, an
unknown tag, and a byte corrupted in the registry's storage are named. `shardserve fetch` (the
pods' fetch step): two fetches of one model into one cache at once download it once (one
waits, saying so on /startupz, while the other reports bytes, total, rate and ETA); credentials
from a Secret-like directory; a cache limit evicts the least recently used model nobody holds,
and refuses, naming what holds it, when the model is held (a shared flock on .inuse, as ranks
keep it).
Usage: model_fetch_test.py SHARDSERVE_BINARY SERVERS_BIN"""
import fcntl
import hashlib
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks, free_ports  # noqa: E402
from deployment import Deployment, gen_model  # noqa: E402
from source_helpers import greedy, local_fails, manifests_under  # noqa: E402
from registry_server import RegistryServer, SlowProxy, docker_config  # noqa: E402

BIN, SERVERS = sys.argv[1], sys.argv[2]
check = Checks()
tmp = tempfile.mkdtemp(prefix="shardserve-oci-")
PROGRESS_PORT = free_ports(2)
registry = RegistryServer(SERVERS, tmp)
slow = SlowProxy(registry)
REGISTRY = registry.address


def docker_config_dir(where, **kw):
    os.makedirs(where, exist_ok=True)
    with open(os.path.join(where, "config.json"), "w") as f:
        f.write(docker_config(REGISTRY, **kw))
    return where


def env_for(cache, config=None, **extra):
    e = dict(os.environ, SHARDSERVE_MODEL_CACHE=cache, DOCKER_CONFIG=config or "/nonexistent")
    e.update(extra)
    return e


def fetch(uri, cache, *extra, env=None, wait=True):
    argv = [BIN, "fetch", "--uri", uri, "--cache", cache, *extra]
    if not wait:
        return subprocess.Popen(argv, env=env or os.environ, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    r = subprocess.run(argv, env=env or os.environ, capture_output=True, text=True, timeout=120)
    report = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
    return r.returncode, report, r.stderr


def startupz(port):
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/startupz")
        return json.loads(conn.getresponse().read())
    except (OSError, ValueError):
        return None


try:
    model = os.path.join(tmp, "model")
    gen_model(BIN, model)
    names = sorted(os.listdir(model))
    total = sum(os.path.getsize(os.path.join(model, n)) for n in names)
    digest = registry.push_model("models/tiny", "v1", model, names)
    registry.push_model("models/tiny-config", "v1", model, ["config.json"])

    ref = Deployment(BIN, model, tp=2, pp=1)
    try:
        want = greedy(ref)
    finally:
        ref.stop()
    check(want[0] == 200, f"the model answers from its directory: {want}")

    cache = os.path.join(tmp, "cache")
    config = docker_config_dir(os.path.join(tmp, "docker"))
    d = Deployment(BIN, None, tp=2, pp=1, uri=f"oci://{REGISTRY}/models/tiny:v1",
                   proc_env=env_for(cache, config))
    try:
        check(greedy(d) == want, "served from oci:// with the directory's answers")
        log = d.log()
        page = d.metrics_page(port=d.metrics_ports[0])
    finally:
        d.stop()
    fetched_metric = re.search(r"^shardserve_model_fetch_bytes\{[^}]*node=\"[^\"]+\"[^}]*\} (\S+)",
                               page, re.M)
    check(fetched_metric is not None and float(fetched_metric.group(1)) == total,
          f"the first rank's metrics say what the fetch downloaded: {fetched_metric}")
    check(f"{total / 1e6:.1f} MB fetched now" in log, f"the model's bytes fetched: {log[-400:]}")
    present = manifests_under(cache)
    check(len(present) == 1 and os.path.basename(os.path.dirname(present[0])) == digest[7:],
          f"the manifest's digest addresses it in the cache: {present}")
    d = Deployment(BIN, None, tp=2, pp=1, uri=f"oci://{REGISTRY}/models/tiny@{digest}",
                   proc_env=env_for(cache, config))
    try:
        check(greedy(d) == want, "the digest names the same model")
        log = d.log()
        page = d.metrics_page(port=d.metrics_ports[0])
    finally:
        d.stop()
    check(re.search(r"^shardserve_model_cache_hit\{[^}]*\} 1$", page, re.M) is not None and
          re.search(r"^shardserve_model_fetch_bytes\{[^}]*\} 0$", page, re.M) is not None,
          "... and a start from the cache: a hit, 0 bytes")
    check("in the cache already" in log, f"the same digest is in the cache: {log[-300:]}")

    c2 = os.path.join(tmp, "c2")
    rc, out = local_fails(BIN, tmp, f"oci://{REGISTRY}/models/tiny:v1", env_for(c2))
    check(rc != 0 and "the registry refuses (HTTP 401)" in out and "needs credentials" in out,
          f"a registry that wants credentials says so: {out[-300:]}")
    wrong = docker_config_dir(os.path.join(tmp, "wrong"), password="nope")
    rc, out = local_fails(BIN, tmp, f"oci://{REGISTRY}/models/tiny:v1", env_for(c2, wrong))
    check(rc != 0 and "HTTP 401" in out and "lack pull access" in out,
          f"wrong credentials are named: {out[-300:]}")
    rc, out = local_fails(BIN, tmp, f"oci://{REGISTRY}/models/tiny:v9", env_for(c2, config))
    check(rc != 0 and "has no models/tiny at 'v9' (HTTP 404)" in out,
          f"an unknown tag is named: {out[-300:]}")

    # The pods' fetch step: credentials from a mounted Secret (.dockerconfigjson), progress on
    # /startupz, two fetches of a node at once downloading once.
    secret = os.path.join(tmp, "secret")
    os.makedirs(secret)
    node = os.path.join(tmp, "node")
    slow_uri = f"oci://{slow.address}/models/tiny:v1"
    slow_env = dict(os.environ, SHARDSERVE_OCI_PLAIN_HTTP=slow.address)
    with open(os.path.join(secret, ".dockerconfigjson"), "w") as f:
        f.write(docker_config(slow.address))
    first = fetch(slow_uri, node, "--credentials", secret, "--progress-port", str(PROGRESS_PORT),
                  "--report", os.path.join(tmp, "first.json"), env=slow_env, wait=False)
    seen_first = None
    told = set()  # every byte count the downloading fetch said
    deadline = time.monotonic() + 60

    def watch_first():
        s = startupz(PROGRESS_PORT)
        if s and s.get("download", {}).get("rate", 0) > 0:
            told.add(s["download"]["bytes"])
            return s
        return None

    while time.monotonic() < deadline and first.poll() is None and seen_first is None:
        seen_first = watch_first()
        time.sleep(0.05)
    second = fetch(slow_uri, node, "--credentials", secret, "--progress-port",
                   str(PROGRESS_PORT + 1), env=slow_env, wait=False)
    seen_second = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and first.poll() is None:
        watch_first()
        s = startupz(PROGRESS_PORT + 1)
        if s and "waiting for this node's download" in s.get("state", ""):
            seen_second = seen_second or s
        time.sleep(0.05)
    out1, err1 = first.communicate(timeout=120)
    out2, err2 = second.communicate(timeout=120)
    check(first.returncode == 0 and second.returncode == 0,
          f"both fetches succeed: {err1[-300:]} {err2[-300:]}")
    check(seen_first is not None and seen_first["download"]["total"] == total and
          "downloading oci://" in seen_first["state"],
          f"the downloading fetch reports bytes and total on /startupz: {seen_first}")
    check(seen_first is not None and seen_first["download"]["eta"] > 0 and
          "/s, " in seen_first["state"] and " s left" in seen_first["state"],
          f"... and rate and ETA: {seen_first}")
    # Told as the bytes come, not a file (one range of 64 MiB) at a time: a count that no set of
    # whole files adds up to.
    sizes = [os.path.getsize(os.path.join(model, n)) for n in names]
    whole_files = {sum(sz for i, sz in enumerate(sizes) if mask >> i & 1)
                   for mask in range(1 << len(sizes))}
    check(any(b not in whole_files for b in told),
          f"... and its bytes climb within a file ({sorted(told)})")
    check(seen_second is not None and seen_second.get("download", {}).get("total") == total,
          f"the other fetch says it waits for the node's download, with its bytes: {seen_second}")
    r1, r2 = json.loads(out1.splitlines()[-1]), json.loads(out2.splitlines()[-1])
    check(r1["bytes_fetched"] + r2["bytes_fetched"] == total and r2["cache_hit"],
          f"the node downloaded the model once: {r1['bytes_fetched']} + {r2['bytes_fetched']}")
    check(json.load(open(os.path.join(tmp, "first.json")))["revision"] == digest,
          "the report names the revision (the manifest's digest)")
    rc, r3, err = fetch(slow_uri, node, "--credentials", secret, "--revision", digest, env=slow_env)
    check(rc == 0 and r3["bytes_fetched"] == 0 and r3["cache_hit"],
          f"a pinned fetch of a present model moves nothing: {r3} {err[-200:]}")
    rc, _, err = fetch(slow_uri, node, "--credentials", secret, "--revision", "sha256:" + "0" * 64,
                       env=slow_env)
    check(rc != 0 and "HTTP 404" in err, f"a pinned digest the registry lacks is named: {err[-200:]}")

    # What a router fetches: the files that are not weights, reached through a link.
    router = os.path.join(tmp, "router")
    rc, r5, err = fetch(slow_uri, router, "--credentials", secret, "--small", "--link",
                        os.path.join(router, "model"), env=slow_env)
    linked = os.path.join(router, "model")
    check(rc == 0 and os.path.islink(linked) and
          sorted(n for n in os.listdir(linked) if not n.startswith(".")) ==
          [n for n in names if not n.endswith(".safetensors")],
          f"--small --link: the config and tokenizer files, no weights, at the link: {err[-300:]}")

    # The cache's limit: the least recently used model nobody holds is evicted; one held is not.
    small = f"oci://{REGISTRY}/models/tiny-config:v1"
    creds = ["--credentials", os.path.join(tmp, "secret-direct")]
    os.makedirs(creds[1])
    shutil.copy(os.path.join(config, "config.json"), os.path.join(creds[1], ".dockerconfigjson"))
    big_dir = os.path.dirname(manifests_under(node)[0])
    held = open(os.path.join(big_dir, ".inuse"))
    fcntl.flock(held, fcntl.LOCK_SH)
    rc, _, err = fetch(small, node, *creds, "--cache-limit", str(total + 100),
                       "--used-grace-seconds", "0")
    check(rc != 0 and "of it models in use or just used" in err,
          f"a full cache whose models are held refuses, saying so: {err[-300:]}")
    check(os.path.isdir(big_dir), "the held model stays")
    rc, _, err = fetch(small, node, *creds, "--cache-limit", str(total + 100))
    check(rc != 0 and "in use or just used" in err, "a model used just now stays (the grace)")
    fcntl.flock(held, fcntl.LOCK_UN)
    held.close()
    rc, r4, err = fetch(small, node, *creds, "--cache-limit", str(total + 100),
                        "--used-grace-seconds", "0")
    check(rc == 0 and r4["evicted"] and not os.path.exists(big_dir),
          f"the least recently used model nobody holds is evicted: {r4} {err[-300:]}")
    check(rc == 0 and r4["cache_bytes"] <= total + 100, "the cache stays under its limit")

    # A byte corrupted in the registry's storage: refused by name, nothing present.
    path = registry.blob_file(open(os.path.join(model, "model.safetensors"), "rb").read())
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    bad = os.path.join(tmp, "bad")
    rc, _, err = fetch(f"oci://{REGISTRY}/models/tiny:v1", bad, *creds)
    check(rc != 0 and "model.safetensors has SHA-256" in err and "corrupt" in err,
          f"a corrupted layer is refused by name: {err[-300:]}")
    check(manifests_under(bad) == [], "nothing of the corrupt fetch counts as present")
finally:
    slow.stop()
    registry.stop()
    shutil.rmtree(tmp, ignore_errors=True)
check.finish()
