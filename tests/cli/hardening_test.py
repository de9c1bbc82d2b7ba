#!/usr/bin/env python3
"""What an outside tester did to `shardserve local`, each as a check (issue: hardening): API keys
(missing, wrong, rotated; open probes), prompts that once held a core for minutes or grew the
leader's memory, 1,000 slow connections against the API and a rank's metrics port, bodies that
are not JSON or whose length is ambiguous, max_tokens near 2^63, a kill -9 that orphaned the
ranks, SIGTERM to ranks waiting at the rendezvous, a broken tokenizer.json that took 46 s to fail,
and what listens where. Real processes and sockets; loops and waits are bounded."""
import http.client
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from checks import Checks, free_ports, wait_until, workers_running  # noqa: E402
from deployment import Deployment, gen_model  # noqa: E402

BIN = sys.argv[1]
WORKER = os.path.join(os.path.dirname(BIN), "shardserve-worker")
check = Checks()
tmp = tempfile.mkdtemp(prefix="shardserve-hardening-")
MODEL = os.path.join(tmp, "model")
gen_model(BIN, MODEL)
KEY, KEY2 = "sk-test-0123456789abcdef", "sk-rotated-fedcba9876543210"
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)


def raw(port, data, wait=5.0):
    """What the server answers to bytes sent as they are (until it closes or `wait` passes)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=wait)
    s.sendall(data)
    out = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    except OSError:
        pass
    s.close()
    return out


def probe(port, path):
    try:
        return raw(port, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode(),
                   5).startswith(b"HTTP/1.1 ")
    except OSError:
        return False


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def pid_of_rank(rank):
    out = subprocess.run(["pgrep", "-f", f"{WORKER} rank --rank {rank}"], capture_output=True,
                         text=True).stdout.split()
    return int(out[0]) if out else None


def listening_addresses(pid):
    """host:port of every TCP socket the process listens on (from /proc/net/tcp)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    addr, port = cols[1].split(":")
                    if len(addr) == 8:
                        ip = ".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0))
                    else:
                        ip = "v6:" + addr
                    found.append(f"{ip}:{int(port, 16)}")
    return found


# --- API keys ------------------------------------------------------------------------------
keys_file = os.path.join(tmp, "keys")
with open(keys_file, "w") as f:
    f.write(f"# the API keys of the test\n{KEY}\n")
d = Deployment(BIN, MODEL, env={"SHARDSERVE_HTTP_HEADER_TIMEOUT_MS": "4000"},
               args=("--api-key-file", keys_file), api_key=KEY)
try:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    for what, headers in [("no key", {"Authorization": ""}),
                          ("a wrong key", {"Authorization": "Bearer sk-wrong-0123456789abcdef"}),
                          ("not Bearer", {"Authorization": f"Basic {KEY}"})]:
        status, h, data = d.post("/v1/completions", body, headers=headers)
        check(status == 401 and data["error"]["code"] == "invalid_api_key" and
              h.get("WWW-Authenticate") == "Bearer",
              f"{what}: 401 with an OpenAI error body ({status}: {data['error']['message']})")
    status, _, data = d.post("/v1/completions", body)
    check(status == 200 and data["choices"][0]["text"], "the key is accepted")
    check(d.request("GET", "/v1/models", headers={"Authorization": ""})[0] == 401 and
          d.request("GET", "/metrics", headers={"Authorization": ""})[0] == 401 and
          d.request("POST", "/tokenize", {"prompt": "x"}, headers={"Authorization": ""})[0] ==
          401 and
          d.request("POST", "/detokenize", {"tokens": [1]}, headers={"Authorization": ""})[0] ==
          401,
          "/v1/models, /metrics, /tokenize and /detokenize need the key too")
    check(d.request("GET", "/healthz", headers={"Authorization": ""})[0] == 200 and
          d.request("GET", "/readyz", headers={"Authorization": ""})[0] == 200,
          "/healthz and /readyz stay open for probes")
    with open(keys_file, "w") as f:  # rotated, as a Secret's volume is
        f.write(f"{KEY2}\n")
    rotated = wait_until(lambda: d.post("/v1/completions", body,
                                        headers={"Authorization": f"Bearer {KEY2}"})[0] == 200,
                         15)
    check(rotated and d.post("/v1/completions", body)[0] == 401,
          "a rotated key file takes effect without a restart; the old key is refused")
    d.api_key = KEY2

    # --- requests that once cost minutes or memory ---------------------------------------------
    t0 = time.monotonic()
    status, _, data = d.post("/v1/completions", {"model": "tiny", "prompt": "he" * (1 << 20),
                                                 "max_tokens": 1}, timeout=60)
    took = time.monotonic() - t0
    check(status == 400 and data["error"]["param"] == "prompt" and
          "maximum context length" in data["error"]["message"],
          f"a 2 MB one-word prompt is refused by its size ({status}, {took:.2f} s)")
    leader = pid_of_rank(0)
    before = rss_mb(leader)
    for i in range(40):
        word = chr(0x4E00 + i) + "\u9f98" * ((1 << 20) // 3)  # 1 MB of UTF-8, one word
        d.post("/v1/completions", {"model": "tiny", "prompt": word, "max_tokens": 1}, timeout=60)
    grew = rss_mb(leader) - before
    check(grew < 64, f"40 distinct 1 MB words leave the leader's memory as it was "
          f"({before:.0f} MB, then +{grew:.0f} MB)")

    # --- malformed and ambiguous requests --------------------------------------------------------
    auth = f"Authorization: Bearer {KEY2}\r\n".encode()
    req = json.dumps(body).encode()
    answer = raw(d.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth +
                 b"Content-Type: text/plain\r\nContent-Length: " + str(len(req)).encode() +
                 b"\r\nConnection: close\r\n\r\n" + req)
    check(answer.startswith(b"HTTP/1.1 415 ") and b"must be JSON" in answer,
          "a text/plain body (what a web page may send) is refused with 415")
    for what, head in [("two different Content-Length",
                        b"Content-Length: 10\r\nContent-Length: " + str(len(req)).encode()),
                       ("Content-Length with Transfer-Encoding",
                        b"Content-Length: 10\r\nTransfer-Encoding: chunked")]:
        answer = raw(d.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth +
                     b"Content-Type: application/json\r\n" + head + b"\r\n\r\n" + req)
        check(answer.startswith(b"HTTP/1.1 400 "), f"{what}: 400 ({answer[:40]!r})")
    status, _, data = d.post("/v1/completions", {"model": "tiny", "prompt": [1, 2],
                                                 "max_tokens": 2**63 - 1})
    check(status == 400 and data["error"]["param"] == "max_tokens",
          f"max_tokens 2^63-1 is refused, naming max_tokens ({status})")
    status, _, data = d.post("/v1/completions", {"model": "tiny", "prompt": [1, 99999]})
    check(status == 400 and data["error"]["param"] == "prompt",
          f"an out-of-vocabulary token id names 'prompt' ({data['error']['param']})")
    status, _, data = d.post("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": 5, "text": "x"}]}]})
    check(status == 400, f"a content part whose type is a number is 400 ({status})")

    # --- 1,000 slow connections ---------------------------------------------------------------
    slow = []
    for port in (d.port, d.metrics_ports[0]):
        for _ in range(500):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            slow.append(s)
    answered = 0
    for round_ in range(3):
        for s in slow:
            try:
                s.sendall(f"X-Slow-{round_}: aaaa\r\n".encode())
            except OSError:
                pass
        answered += sum(probe(p, path) for p, path in
                        [(d.port, "/healthz"), (d.port, "/readyz"), (d.metrics_ports[0], "/metrics")])
        time.sleep(1)
    check(answered == 9, f"under 1,000 slow connections every probe is answered ({answered} of 9)")
    # The API's heads have 4 s: its slow clients are told 408 and closed.
    api_slow = slow[0]
    api_slow.settimeout(10)
    try:
        cut = api_slow.recv(200)
    except OSError:
        cut = b""
    check(cut.startswith(b"HTTP/1.1 408 "), f"a head not finished in time gets 408 ({cut[:40]!r})")
    for s in slow:
        s.close()
    endless = raw(d.port, b"GET /healthz HTTP/1.1\r\nX: " + b"a" * (1 << 20))
    check(endless.startswith(b"HTTP/1.1 431 "), "a header line without end is cut at 16 KiB (431)")
    check(probe(d.port, "/healthz"), "the API answers afterwards")
finally:
    code = d.stop()
check(code == 0, f"the keyed deployment stops cleanly ({code})")

# --- kill -9 of shardserve local orphans nothing ----------------------------------------------------
d = Deployment(BIN, MODEL)
d.proc.kill()
d.proc.wait()
gone = wait_until(lambda: not workers_running(WORKER), 20)
check(gone, "kill -9 of shardserve local: every launcher and rank goes with it")
subprocess.run(["pkill", "-9", "-f", WORKER])
d.stop()  # already gone: removes its scratch directory


# --- stopping ranks that wait at the rendezvous; a leader that cannot start -------------------
def launch(stage, secret_file, model=MODEL, pp=2, port=None):
    env = dict(os.environ, SHARDSERVE_MODEL_PATH=model, SHARDSERVE_TP="2",
               SHARDSERVE_PP=str(pp), SHARDSERVE_STAGE=str(stage),
               SHARDSERVE_LEADER_ADDR=f"127.0.0.1:{port}", SHARDSERVE_JOB_ID=f"h{os.getpid()}",
               SHARDSERVE_RENDEZVOUS_SECRET_FILE=secret_file, SHARDSERVE_METRICS="off",
               SHARDSERVE_API_HOST="127.0.0.1", SHARDSERVE_API_PORT="0",
               SHARDSERVE_HOST="127.0.0.1")
    return subprocess.Popen([WORKER, "launch"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


secret_file = os.path.join(tmp, "secret")
with open(secret_file, "w") as f:
    f.write("a-test-secret-0123456789abcdef")
os.chmod(secret_file, 0o600)
for stage, ranks in ((1, (2, 3)), (0, (0, 1))):  # each stage alone waits at the rendezvous
    port = free_ports(1)
    waiting = launch(stage, secret_file, port=port)
    wait_until(lambda: all(pid_of_rank(r) and listening_addresses(pid_of_rank(r))
                           for r in ranks), 10)
    addresses = [a for r in ranks for a in listening_addresses(pid_of_rank(r))]
    check(addresses and all(a.startswith("127.0.0.1:") for a in addresses) and
          (stage > 0 or f"127.0.0.1:{port}" in addresses),
          f"stage {stage}: local ranks listen on loopback only, the leader's rendezvous too "
          f"({addresses})")
    t0 = time.monotonic()
    waiting.send_signal(signal.SIGTERM)
    out, _ = waiting.communicate(timeout=30)
    check(waiting.returncode == 0 and time.monotonic() - t0 < 5,
          f"stage {stage}: SIGTERM to ranks waiting at the rendezvous stops them at once, cleanly "
          f"(exit {waiting.returncode} in {time.monotonic() - t0:.1f} s)")

broken = os.path.join(tmp, "broken")
gen_model(BIN, broken)
with open(os.path.join(broken, "tokenizer.json"), "w") as f:
    f.write("{ this is not json")
port = free_ports(1)
t0 = time.monotonic()
stage1 = launch(1, secret_file, model=broken, port=port)
stage0 = launch(0, secret_file, model=broken, port=port)
out1, _ = stage1.communicate(timeout=60)
stage0.communicate(timeout=60)
took = time.monotonic() - t0
check(stage1.returncode != 0 and "the leader failed" in out1 and "tokenizer.json" in out1 and
      took < 15, f"a broken tokenizer.json fails every rank fast, named ({took:.1f} s): " +
      out1.strip().splitlines()[-1][:160])
manifest = os.path.join(tmp, "broken.yaml")
with open(manifest, "w") as f:
    f.write(f"""apiVersion: shardserve.io/v1alpha1
kind: ShardedModel
metadata: {{name: broken}}
spec:
  model: {{name: broken, uri: "file://{broken}"}}
  parallelism: {{tensor: 2, pipeline: 2}}
""")
t0 = time.monotonic()
r = subprocess.run([BIN, "local", "-f", manifest], capture_output=True, text=True, timeout=60)
check(r.returncode != 0 and "tokenizer.json" in r.stderr and not workers_running(WORKER),
      f"shardserve local checks tokenizer.json before starting a rank "
      f"({time.monotonic() - t0:.1f} s): {r.stderr.strip()[:160]}")
check(wait_until(lambda: not workers_running(WORKER), 10), "no worker process is left")
check.finish()
