"""Models from where they live, on real nodes (issue 51): the same tiny model in a real S3 server
(moto's, from PyPI), the CNCF distribution registry (an OCI artifact, built by
scripts/servers-build.sh) and a Hub-compatible test server of ours (tests/cli/hub_server.py),
each listening on the host's address the pods reach (10.244.0.1). Each node keeps its own model
cache (workerDefaults.modelCache.hostPath with "{node}": the test's nodes share one disk).

  - s3:// with its credentials in a Secret: served by a TP=2 x PP=2 replica on two nodes with the
    answers of shardserve local; each node downloaded the model once (the pods' metrics); a second
    replica's pods on nodes that have it download nothing, a restarted replica nothing;
  - hf:// with a token Secret: the revision pinned to the Hub's commit in status, the answers;
  - oci:// through a slow proxy with an image pull Secret: `kubectl get smodel` says Downloading,
    status.downloads gives each node's bytes, total, rate and ETA, events Downloading and
    Downloaded; then the answers;
  - a byte flipped on the server: the replica fails naming the file, nothing of it counts as
    present in the node's cache and no rank starts; the Hub without the token: Invalid, naming
    HTTP 401.
Figures: apply -> Ready for a first start downloading, a restart from the node cache and a second
replica on warm nodes, with the bytes each moved."""
import http.client
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "cli"))
from checks import free_ports, wait_until  # noqa: E402
from fault_proxy import FaultProxy  # noqa: E402
from hub_server import HubServer  # noqa: E402
from registry_server import RegistryServer, SlowProxy, docker_config, wait_port  # noqa: E402
from realnodes import figure, manifest  # noqa: E402

HOST = "10.244.0.1"  # the host, as the pods reach it (tests/k8s/testenv: the apiserver's address)


def node_cache_defaults(path, tmp):
    """The operator's --worker-defaults file: a model cache per node under `path`."""
    f = os.path.join(tmp, "worker-defaults.json")
    with open(f, "w") as out:
        json.dump({"modelCache": {"hostPath": os.path.join(path, "{node}")}}, out)
    return f


def rank_metric(c, pod, name):
    """A metric of a stage's first rank (its page on the pod's address, port 9400)."""
    ip = c.get("pod", pod)["status"]["podIP"]
    conn = http.client.HTTPConnection(ip, 9400, timeout=10)
    conn.request("GET", "/metrics")
    page = conn.getresponse().read().decode()
    conn.close()
    m = re.search(rf'^{name}\{{[^}}]*node="([^"]+)"[^}}]*\}} (\S+)', page, re.M)
    return (m.group(1), float(m.group(2))) if m else (None, None)


def run(c, m, check, shardserve, servers_bin, tmp, model_dir, cache_root, reference, same_answer):
    import boto3  # the reference environment's (scripts/setup.sh)
    names = sorted(os.listdir(model_dir))
    total = sum(os.path.getsize(os.path.join(model_dir, n)) for n in names)
    procs, stops = [], []

    def stage_pods(name):
        return m.pods(name, "shardserve.io/role in (leader,worker)")

    def first_answer(name):
        try:
            code, body = m.post(m.service_ip(name), {"model": name, "prompt": "hello world",
                                                     "max_tokens": 12, "temperature": 0,
                                                     "logprobs": 3})
        except OSError:
            return None
        return body if code == 200 else None

    def serves_same(name):
        got = first_answer(name)
        return got is not None and same_answer(got, reference)

    def delete(name):
        c.kubectl("delete", "smodel", name, "--wait=true", "--timeout=120s")
        check(wait_until(lambda: not m.pods(name), 120), f"{name}: deleted")

    def spec(name, uri, secret, env, replicas=1):
        obj = manifest(name, uri, replicas=replicas, env=env)
        if secret:
            obj["spec"]["model"]["secret"] = secret
        obj["spec"]["model"]["files"] = ["*.safetensors", "*.json"]
        return obj

    def fetched(name):
        """{pod: (node, bytes its fetch step downloaded, found it in the node's cache)}."""
        out = {}
        for p in stage_pods(name):
            n = p["metadata"]["name"]
            node, b = rank_metric(c, n, "shardserve_model_fetch_bytes")
            _, hit = rank_metric(c, n, "shardserve_model_cache_hit")
            out[n] = (node, b, hit)
        return out

    try:
        # --- the servers ---------------------------------------------------------------------
        moto_port = free_ports(1)
        procs.append(subprocess.Popen([sys.executable, "-m", "moto.server", "-H", HOST, "-p",
                                       str(moto_port)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        check(wait_port(HOST, moto_port), "moto's S3 server listens on the pods' side")
        s3 = boto3.client("s3", endpoint_url=f"http://{HOST}:{moto_port}",
                          aws_access_key_id="e2e", aws_secret_access_key="e2e-secret",
                          region_name="us-east-1")
        s3.create_bucket(Bucket="models")
        for prefix in ("tiny", "corrupt"):
            for n in names:
                with open(os.path.join(model_dir, n), "rb") as f:
                    s3.put_object(Bucket="models", Key=f"{prefix}/{n}", Body=f.read(),
                                  ChecksumAlgorithm="SHA256")
        # A LoRA adapter beside the model (issue 54): fetched by a step of each stage pod.
        adapter_dir = os.path.join(tmp, "s3-adapter")
        subprocess.run([shardserve, "gen-adapter", "--model", model_dir, "--out", adapter_dir,
                        "--rank", "8", "--seed", "5"], check=True, capture_output=True)
        for n in os.listdir(adapter_dir):
            with open(os.path.join(adapter_dir, n), "rb") as f:
                s3.put_object(Bucket="models", Key=f"adapters/sql/{n}", Body=f.read(),
                              ChecksumAlgorithm="SHA256")
        # Another listing (the cache is content-addressed: the same files would be present).
        s3.put_object(Bucket="models", Key="corrupt/notes.json", Body=b"{}",
                      ChecksumAlgorithm="SHA256")
        hub = HubServer(model_dir, "tiny-org/tiny-llama", token="hf_e2e", host=HOST)
        stops.append(hub.stop)
        reg_dir = os.path.join(tmp, "registry")
        os.makedirs(reg_dir)
        registry = RegistryServer(servers_bin, reg_dir, host=HOST)
        stops.append(registry.stop)
        digest = registry.push_model("models/tiny", "v1", model_dir, names)
        # 16 KiB a fifth of a second: a download of about 20 s, long enough to watch.
        slow = SlowProxy(registry, host=HOST, piece=16384, pause=0.3)
        stops.append(slow.stop)
        flip = FaultProxy(HOST, moto_port, host=HOST, corrupt=".safetensors")
        stops.append(flip.stop)

        c.kubectl("create", "secret", "generic", "s3-creds", "--from-literal=AWS_ACCESS_KEY_ID=e2e",
                  "--from-literal=AWS_SECRET_ACCESS_KEY=e2e-secret", check=True)
        c.kubectl("create", "secret", "generic", "hub-token", "--from-literal=HF_TOKEN=hf_e2e",
                  check=True)
        docker = os.path.join(tmp, "dockerconfig.json")
        with open(docker, "w") as f:
            f.write(docker_config(slow.address))
        c.kubectl("create", "secret", "docker-registry", "regcred",
                  f"--from-file=.dockerconfigjson={docker}", check=True)
        s3_env = {"AWS_ENDPOINT_URL": f"http://{HOST}:{moto_port}", "AWS_REGION": "us-east-1"}

        # --- s3:// on two nodes: a first start that downloads --------------------------------
        t0 = time.monotonic()
        from_s3 = spec("from-s3", "s3://models/tiny", "s3-creds", s3_env)
        from_s3["spec"]["adapters"] = [{"name": "sql", "uri": "s3://models/adapters/sql"}]
        m.apply(from_s3)
        check(wait_until(lambda: m.ready("from-s3", 1), 300),
              f"from-s3: Ready ({m.status('from-s3').get('replicaStatuses')})")
        first = time.monotonic() - t0
        figure("s3:// apply -> Ready, downloading on 2 nodes", first)
        check(wait_until(lambda: serves_same("from-s3"), 60),
              "from-s3: the answers of shardserve local on the model's directory")
        code, sql = m.post(m.service_ip("from-s3"), {"model": "sql", "prompt": "hello world",
                                                     "max_tokens": 12, "temperature": 0,
                                                     "logprobs": 3})
        steps = [c_["name"] for p in stage_pods("from-s3")
                 for c_ in p["spec"].get("initContainers", [])]
        check(code == 200 and not same_answer(sql, reference) and
              steps.count("fetch-adapter-0") == 2,
              f"from-s3: its adapter from s3:// fetched by a step of each stage pod ({steps}) "
              f"answers as itself, not as the base ({code}: {str(sql)[:200]})")
        source = m.status("from-s3").get("model", {}).get("source", {})
        check(re.fullmatch(r"[0-9a-f]{64}", source.get("revision", "")) is not None and
              source.get("bytes") == total,
              f"from-s3: status.model.source pins the listing ({source})")
        f0 = fetched("from-s3")
        nodes0 = {node for node, _, _ in f0.values()}
        check(len(f0) == 2 and len(nodes0) == 2 and
              all(b == total and hit == 0 for _, b, hit in f0.values()),
              f"from-s3: each of its two nodes downloaded the model once ({f0})")
        print(f"figure: first start: {sum(b for _, b, _ in f0.values()):.0f} bytes moved "
              f"({total} a node)", flush=True)
        for node in nodes0:
            present = [r for r, _, fs in os.walk(os.path.join(cache_root, node))
                       if ".manifest.json" in fs]
            check(len(present) == 1 and present[0].endswith(source.get("dir", "?")),
                  f"node {node}: the model in its cache at status.model.source.dir ({present})")

        # --- a second replica: its pods on warm nodes download nothing -----------------------
        t0 = time.monotonic()
        c.kubectl("scale", "smodel", "from-s3", "--replicas=2", check=True)
        check(wait_until(lambda: m.ready("from-s3", 2), 300), "from-s3: 2 replicas Ready")
        figure("s3:// second replica -> Ready", time.monotonic() - t0)

        def routers_ready():
            pods = m.pods("from-s3", "shardserve.io/role=router")
            return len(pods) == 2 and all(
                any(x["type"] == "Ready" and x["status"] == "True"
                    for x in p.get("status", {}).get("conditions", [])) for p in pods)
        check(wait_until(routers_ready, 180),
              "from-s3: its two routers fetched the tokenizer (no weights) and are Ready")
        f1 = {p: v for p, v in fetched("from-s3").items() if p.startswith("from-s3-1-")}
        warm = {p: v for p, v in f1.items() if v[0] in nodes0}
        cold = {p: v for p, v in f1.items() if v[0] not in nodes0}
        check(warm and all(b == 0 and hit == 1 for _, b, hit in warm.values()),
              f"from-s3: the second replica's pods on nodes that have the model downloaded 0 "
              f"bytes ({f1})")
        check(all(b == total for _, b, _ in cold.values()),
              f"from-s3: ... and one on a new node the model once ({cold})")
        print(f"figure: second replica: {sum(v[1] for v in f1.values()):.0f} bytes moved "
              f"({len(warm)} of {len(f1)} pods on warm nodes)", flush=True)

        # --- a restart from the node cache ----------------------------------------------------
        uids = {p["metadata"]["uid"] for p in stage_pods("from-s3")
                if p["metadata"]["name"].startswith("from-s3-0-")}
        t0 = time.monotonic()
        c.kubectl("delete", "pod", "from-s3-0-1", "--wait=false")
        check(wait_until(lambda: m.replica("from-s3", 0).get("restarts", 0) >= 1 and
                         m.ready("from-s3", 2), 300), "from-s3: replica 0 recreated and Ready")
        figure("s3:// restart of a replica -> Ready from the node cache", time.monotonic() - t0)
        again = {p: v for p, v in fetched("from-s3").items() if p.startswith("from-s3-0-")}
        check(not ({p["metadata"]["uid"] for p in stage_pods("from-s3")} & uids) and
              all(b == 0 and hit == 1 for _, b, hit in again.values()),
              f"from-s3: the restarted replica downloaded nothing ({again})")
        delete("from-s3")

        # --- hf:// -----------------------------------------------------------------------------
        t0 = time.monotonic()
        m.apply(spec("from-hf", "hf://tiny-org/tiny-llama", "hub-token",
                     {"HF_ENDPOINT": f"http://{HOST}:{hub.port}"}))
        check(wait_until(lambda: m.ready("from-hf", 1), 300),
              f"from-hf: Ready ({m.status('from-hf').get('replicaStatuses')})")
        figure("hf:// apply -> Ready, downloading on 2 nodes", time.monotonic() - t0)
        check(wait_until(lambda: serves_same("from-hf"), 60), "from-hf: the same answers")
        check(m.status("from-hf").get("model", {}).get("source", {}).get("revision") == hub.commit,
              "from-hf: the revision pinned to the Hub's commit")
        delete("from-hf")

        # --- oci:// through a slow proxy: Downloading in the open --------------------------------
        t0 = time.monotonic()
        m.apply(spec("from-oci", f"oci://{slow.address}/models/tiny:v1", "regcred",
                     {"SHARDSERVE_OCI_PLAIN_HTTP": slow.address}))
        seen = {}
        trace = []  # what the status said while the model came up, for a failure's message

        def downloading():
            s = m.status("from-oci")
            told = [e for e in s.get("downloads", [])
                    if e.get("bytes", 0) > 100000 and e.get("bytesPerSecond", 0) > 0]
            entry = (round(time.monotonic() - t0, 1), s.get("phase"), s.get("downloads"))
            if not trace or trace[-1][1:] != entry[1:]:
                trace.append(entry)
            if s.get("phase") == "Downloading" and told:
                seen["status"] = told
                seen["table"] = c.kubectl("get", "smodel", "from-oci")[1]
                return True
            return False

        check(wait_until(downloading, 180),
              f"from-oci: phase Downloading with each node's bytes and rate (seen: {trace[-12:]})")
        d = (seen.get("status") or [{}])[0]
        check(d.get("totalBytes") == total and "etaSeconds" in d and d.get("node") and d.get("pods"),
              f"from-oci: ... its total, ETA, node and pods ({d})")
        check(re.search(r"^from-oci\s.*Downloading", seen.get("table", ""), re.M) is not None,
              f"from-oci: kubectl get smodel says Downloading ({seen.get('table', '')!r})")
        print(f"figure: a download in status: {d}", flush=True)
        check(wait_until(lambda: m.ready("from-oci", 1), 300), "from-oci: Ready")
        check(wait_until(lambda: "downloads" not in m.status("from-oci"), 30),
              f"from-oci: status.downloads gone once the nodes have the model "
              f"({m.status('from-oci').get('downloads')})")
        figure("oci:// apply -> Ready through a 53 KB/s proxy", time.monotonic() - t0)
        check(wait_until(lambda: serves_same("from-oci"), 60), "from-oci: the same answers")
        check(m.status("from-oci").get("model", {}).get("source", {}).get("revision") == digest,
              "from-oci: the revision pinned to the manifest's digest")
        events = c.kubectl("get", "events", "--field-selector", "involvedObject.name=from-oci")[1]
        check("Downloading" in events and "Downloaded" in events,
              f"from-oci: events Downloading and Downloaded ({events[-600:]})")
        delete("from-oci")

        # --- refused by name ----------------------------------------------------------------------
        m.apply(spec("corrupt", "s3://models/corrupt", "s3-creds",
                     {"AWS_ENDPOINT_URL": f"http://{HOST}:{flip.port}",
                      "AWS_REGION": "us-east-1"}))

        def refused():
            r = m.replica("corrupt", 0)
            why = r.get("message", "") + r.get("lastFailureMessage", "")
            return "model.safetensors has SHA-256" in why and "corrupt" in why
        check(wait_until(refused, 240),
              f"corrupt: the replica fails naming the corrupted file ({m.replica('corrupt', 0)})")
        present = [r for r, _, fs in os.walk(cache_root) if ".manifest.json" in fs
                   and "corrupt" in r]
        check(present == [], f"corrupt: nothing of it counts as present in a node's cache "
                             f"({present})")
        ran = [p["metadata"]["name"] for p in stage_pods("corrupt")
               if any(s.get("state", {}).get("running") or s.get("state", {}).get("terminated")
                      for s in p.get("status", {}).get("containerStatuses", []))]
        check(ran == [], f"corrupt: no rank started ({ran})")
        delete("corrupt")
        m.apply(spec("no-token", "hf://tiny-org/tiny-llama", None,
                     {"HF_ENDPOINT": f"http://{HOST}:{hub.port}"}))

        def invalid():
            cond = [x for x in m.status("no-token").get("conditions", [])
                    if x["type"] == "Invalid"]
            return cond and cond[0]["status"] == "True" and "HTTP 401" in cond[0]["message"]
        check(wait_until(invalid, 180) and not stage_pods("no-token"),
              f"no-token: Invalid names the Hub's HTTP 401; no stage pod "
              f"({m.status('no-token').get('conditions')})")
        delete("no-token")
    finally:
        for stop in stops:
            stop()
        for p in procs:
            p.terminate()
            p.wait()
