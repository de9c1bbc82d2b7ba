#!/usr/bin/env python3
"""Flow control through real processes and sockets (issue 55 part 2): `shardserve local` with a
flow-control config (--flow-control-file, what spec.serving.flowControl mounts on a cluster),
two keys of two tenants:

  - a key past its requestsPerSecond is answered 429 with Retry-After, naming the limit and its
    tenant (never the key); the other key is not affected;
  - a key past its tokensPerMinute (prompt and completion tokens) is answered 429 likewise;
  - the config file changed (the limit raised): it takes effect within seconds, without a
    restart; a broken one keeps the last good config;
  - /v1/responses takes the same limits; a request's `priority` outside its bounds is a 400
    naming it;
  - a manifest naming a ConfigMap for its flow control without --flow-control-file is refused
    by name (shardserve local cannot read a cluster's ConfigMap);
  - the same limits at the router in front of two replicas (its 429, Retry-After and message);
  - latency targets (spec.serving.slo): the leaders and the router export how far each replica
    is from them (shardserve_slo_ratio, shardserve_router_slo_ratio), promtool-clean.

usage: flow_control_test.py path/to/shardserve"""
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from checks import Checks, free_ports, metric, promtool_clean, wait_until  # noqa: E402
from deployment import MANIFEST, Deployment, gen_model  # noqa: E402

BIN = sys.argv[1]
check = Checks()
tmp = tempfile.mkdtemp(prefix="shardserve-flow-")
MODEL = os.path.join(tmp, "model")
gen_model(BIN, MODEL)
BATCH, CHAT = "sk-flow-batch-0123456789", "sk-flow-chat-0123456789"
FREE = "sk-flow-default-0123456789"  # the default class: no limits
KEYS = os.path.join(tmp, "keys")
with open(KEYS, "w") as f:
    f.write(f"{BATCH}\n{CHAT}\n{FREE}\n")
TOKEN_FILE = os.path.join(tmp, "router-token")
with open(TOKEN_FILE, "w") as f:
    f.write("router-token-flow-0123456789\n")
FLOW = os.path.join(tmp, "flow.yaml")


def write_flow(rps):
    with open(FLOW + ".new", "w") as f:
        f.write(f"""tenants:
  - name: batch-jobs
    key: {BATCH}
    priority: 5
    requestsPerSecond: {rps}
  - name: chat
    key: {CHAT}
    tokensPerMinute: 60
default: {{weight: 1}}
""")
    os.replace(FLOW + ".new", FLOW)


def ask(d, key, max_tokens=2, **extra):
    body = {"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}
    status, headers, data = d.request("POST", "/v1/completions", body,
                                      headers={"Authorization": f"Bearer {key}"})
    headers = {k.lower(): v for k, v in headers.items()}
    try:
        data = json.loads(data)
    except ValueError:
        pass
    return status, headers.get("retry-after"), data


def limits(d, where):
    # requestsPerSecond 1: a burst of 4 at once, the second to fourth refused with Retry-After.
    got = [ask(d, BATCH) for _ in range(4)]
    refused = [g for g in got if g[0] == 429]
    check(got[0][0] == 200 and len(refused) >= 2 and all(
        r[1] and int(r[1]) >= 1 and "requestsPerSecond 1" in r[2]["error"]["message"] and
        "batch-jobs" in r[2]["error"]["message"] and BATCH not in r[2]["error"]["message"]
        for r in refused),
        f"{where}: a key past its requestsPerSecond is answered 429 with Retry-After naming the "
        f"limit and its tenant ({[(g[0], g[1]) for g in got]}; "
        f"{refused[0][2] if refused else None})")
    # The other tenant is not affected; its tokens of the minute (4 prompt + 16 a request) run
    # out at the fourth request.
    chat = [ask(d, CHAT, max_tokens=16) for _ in range(5)]
    codes = [c[0] for c in chat]
    over = [c for c in chat if c[0] == 429]
    check(codes[:3] == [200, 200, 200] and over and
          "tokensPerMinute 60" in over[0][2]["error"]["message"] and int(over[0][1]) >= 1,
          f"{where}: the other key is served; past its tokensPerMinute it is answered 429 "
          f"naming the limit ({codes}; {over[0][2] if over else None})")


write_flow(1)
d = Deployment(BIN, MODEL, tp=1, pp=1, args=("--api-key-file", KEYS, "--flow-control-file", FLOW))
try:
    limits(d, "leader")
    # /v1/responses takes the same limits.
    time.sleep(1.1)
    answered = [d.request("POST", "/v1/responses",
                          {"model": "tiny", "input": "hi", "max_output_tokens": 2},
                          headers={"Authorization": f"Bearer {BATCH}"})[0] for _ in range(3)]
    check(answered[0] == 200 and 429 in answered[1:],
          f"/v1/responses: a key past its requestsPerSecond is answered 429 ({answered})")
    status, _, body = ask(d, CHAT, priority=1 << 30)
    check(status == 400 and body["error"]["param"] == "priority",
          f"a priority out of bounds is a 400 naming it ({status} {body})")
    # The limit raised in the file: within seconds, a burst of 4 passes, without a restart.
    time.sleep(1.2)
    write_flow(100)
    check(wait_until(lambda: all(ask(d, BATCH)[0] == 200 for _ in range(4)), 10),
          "the config changed on disk takes effect without a restart")
    with open(FLOW, "w") as f:
        f.write("tenants: [{key: x, weight: -1}]\n")
    time.sleep(1.5)
    check(all(ask(d, BATCH)[0] == 200 for _ in range(4)),
          "a broken config keeps the last good one in force")
    check(wait_until(lambda: "the last good config stays in force" in d.log(), 5),
          "and the leader says why")
finally:
    d.stop()

# A manifest whose flow control is a cluster's ConfigMap: refused by name without the file.
manifest = os.path.join(tmp, "cluster-flow.yaml")
with open(manifest, "w") as f:
    f.write(MANIFEST.format(name="tiny", replicas=1, uri=f"file://{MODEL}", files="", tp=1, pp=1,
                            env="      []", port=free_ports(1), max_batch=8, max_seq=1024,
                            serving="    flowControl: {configMap: tenants}\n", spec=""))
run = subprocess.run([BIN, "local", "-f", manifest, "--api-key-file", KEYS],
                     capture_output=True, text=True, timeout=60)
check(run.returncode != 0 and
      "spec.serving.flowControl names a Kubernetes ConfigMap" in run.stderr + run.stdout and
      "--flow-control-file" in run.stderr + run.stdout,
      f"shardserve local refuses a manifest's flowControl it cannot read "
      f"({(run.stderr + run.stdout)[-200:]!r})")

write_flow(1)
r = Deployment(BIN, MODEL, tp=1, pp=1, replicas=2,
               args=("--api-key-file", KEYS, "--flow-control-file", FLOW,
                     "--router-token-file", TOKEN_FILE),
               serving={"slo": "{ttftMilliseconds: 5000, itlMilliseconds: 2000, percentile: 95}"})
try:
    limits(r, "router")
    # Latency targets: streams through the router, then each page says how far it is from them.
    r.api_key = FREE
    for i in range(4):
        status, events, done = r.stream("/v1/completions", {
            "model": "tiny", "prompt": [5, 6, 7, i], "max_tokens": 6, "stream": True,
            "ignore_eos": True})
        check(status == 200 and done, f"a stream through the router ({status})")
    page = r.metrics_page(token="router-token-flow-0123456789")
    ttft = [float(line.split()[-1]) for line in page.splitlines()
            if line.startswith("shardserve_router_slo_ratio{") and 'slo="ttft"' in line]
    itl = metric(page, "shardserve_router_slo_ratio", slo="itl")
    check(ttft and max(ttft) > 0 and max(ttft) < 1 and itl is not None and
          metric(page, "shardserve_router_slo_target_seconds", slo="ttft") == 5 * len(ttft),
          f"the router exports each replica's distance from the targets as its clients saw it "
          f"(ttft {ttft}, itl {itl})")
    lint = promtool_clean(page)
    check(not lint, f"promtool check metrics is clean on the router {lint}".strip())
    leaders = [r.metrics_page(port=p) for p in r.metrics_ports]
    ratios = [metric(p, "shardserve_slo_ratio", slo="ttft") for p in leaders]
    check(all(x is not None for x in ratios) and max(ratios) > 0 and
          all(metric(p, "shardserve_slo_target_seconds", slo="itl") == 2 for p in leaders),
          f"each leader exports its replica's distance from the targets ({ratios})")
finally:
    r.stop()
check.finish()
