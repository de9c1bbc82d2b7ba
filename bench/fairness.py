#!/usr/bin/env python3
"""Fair queuing between tenants (issue 55): one key floods a `shardserve local` replica while
another key sends one streamed request at a time; the other key's time to first token (TTFT),
p50 and p99, alone and under the flood:

  - alone: the light key's requests on an idle replica;
  - flood, two tenants: the flood from its own key (flow control shares the batch between the
    keys' tenants: the light key's request takes a slot at once);
  - flood, one tenant: the light requests sent with the flooding key itself (what any engine
    without tenants does: they queue behind the flood).

With --replicas 2, `shardserve local` puts its router in front of two replicas: the flood fills
both batches and the rest waits in the router's queue, which lets the light key's request out
first (weighted fair between tenants).

Usage: bench/fairness.py BUILD_BIN_DIR [--flood 24] [--requests 40] [--max-batch 8]
[--replicas 1].
Prints figures; asserts nothing."""
import argparse
import http.client
import json
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "cli"))
from deployment import Deployment, gen_model  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("bin")
ap.add_argument("--flood", type=int, default=24, help="the flooding key's concurrent clients")
ap.add_argument("--requests", type=int, default=40, help="the light key's requests per phase")
ap.add_argument("--max-batch", type=int, default=8)
ap.add_argument("--replicas", type=int, default=1)
args = ap.parse_args()
BIN = os.path.join(args.bin, "shardserve")

tmp = tempfile.mkdtemp(prefix="shardserve-fairness-")
model = os.path.join(tmp, "model")
gen_model(BIN, model, "--hidden", "512", "--intermediate", "1024", "--heads", "8",
          "--kv-heads", "4", "--layers", "8", "--vocab", "2048")
FLOOD, LIGHT = "sk-bench-flood-0123456789", "sk-bench-light-0123456789"
keys = os.path.join(tmp, "keys")
with open(keys, "w") as f:
    f.write(f"{FLOOD}\n{LIGHT}\n")
flow = os.path.join(tmp, "flow.yaml")
with open(flow, "w") as f:
    f.write(f"tenants:\n  - {{name: flood, key: {FLOOD}}}\n  - {{name: light, key: {LIGHT}}}\n")


def ttft(port, key, prompt, max_tokens):
    """Seconds to the first event carrying text of a streamed completion (the stream then read
    to its end)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
         "ignore_eos": True, "temperature": 0}),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    r = conn.getresponse()
    first = None
    for line in r:
        if first is None and line.startswith(b"data: {") and b'"text":""' not in line:
            first = time.perf_counter() - t0
    conn.close()
    return first


def percentile(xs, p):
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def light_phase(d, key):
    out = []
    for i in range(args.requests):
        out.append(ttft(d.port, key, [1] + [(37 * i + 11 * k) % 2000 + 3 for k in range(63)], 8))
    return out


d = Deployment(BIN, model, tp=1, pp=1, max_batch=args.max_batch, max_seq=2048,
               replicas=args.replicas, args=("--api-key-file", keys, "--flow-control-file", flow))
try:
    ttft(d.port, LIGHT, [1, 2, 3], 4)  # warm
    results = {"alone": light_phase(d, LIGHT)}
    for phase, key in [("flood, two tenants", LIGHT), ("flood, one tenant", FLOOD)]:
        stop = threading.Event()

        def flood(c):
            while not stop.is_set():
                ttft(d.port, FLOOD, [1] + [(13 * c + k) % 2000 + 3 for k in range(63)], 256)
        threads = [threading.Thread(target=flood, args=(c,), daemon=True)
                   for c in range(args.flood)]
        for t in threads:
            t.start()
        time.sleep(3)  # the flood holds the batch and queues
        results[phase] = light_phase(d, key)
        stop.set()
        for t in threads:
            t.join(600)
    base = percentile(results["alone"], 99)
    for phase, xs in results.items():
        p50, p99 = percentile(xs, 50), percentile(xs, 99)
        print(f"figure: light key's TTFT, {phase}: p50 {p50 * 1000:.1f} ms, p99 "
              f"{p99 * 1000:.1f} ms ({p99 / base:.2f}x alone's p99; {args.flood} flooding "
              f"clients, max batch {args.max_batch}, {args.replicas} replica(s))", flush=True)
finally:
    d.stop()
