#!/usr/bin/env python3
"""Disaggregated prefill/decode against colocated serving, with the same number of ranks (issue
53, part 5): chat streams decode while prompts of 2,000-4,000 tokens arrive. Colocated: one
replica of TP=2. Disaggregated: one prefill replica and one decode replica of TP=1 each, the
router pairing them (prompts of 256 tokens or more: the chats stay on the decode replica). Prints, per setup, the chat streams' inter-token latency (p50/p99) alone and
under the long-prompt arrivals, the long prompts' time to first token (p50/p99), the output
tokens/s, and (disaggregated) the KV transfer's GB/s and its share of the time to first token.

  python3 bench/disaggregation.py build/bin/shardserve [--seconds 40] [--streams 4]
"""
import argparse
import http.client
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "cli"))
from checks import free_ports, metric  # noqa: E402

MANIFEST = """apiVersion: shardserve.io/v1alpha1
kind: ShardedModel
metadata:
  name: bench
spec:
  replicas: 1
  model:
    name: bench
    uri: file://{model}
  parallelism:
    tensor: {tp}
    pipeline: 1
{disaggregation}  worker:
    image: w
  serving:
    maxBatchSize: 16
    maxSequenceLength: 8192
"""
DISAGGREGATION = """  disaggregation:
    prefill:
      replicas: 1
      parallelism:
        tensor: 1
        pipeline: 1
    minPromptTokens: 256
"""


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def stream(port, prompt, max_tokens):
    """(time to first token, the gaps between tokens, tokens) of one streamed completion."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t0 = time.monotonic()
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    times = []
    while True:
        line = r.readline()
        if not line:
            break
        if line.startswith(b"data: {"):
            times.append(time.monotonic())
    conn.close()
    if not times:
        return None, [], 0
    return times[0] - t0, [b - a for a, b in zip(times, times[1:])], len(times)


def run(binary, model, disaggregated, seconds, streams, every):
    tmp = tempfile.mkdtemp(prefix="shardserve-bench-disagg-")
    manifest = os.path.join(tmp, "m.yaml")
    with open(manifest, "w") as f:
        f.write(MANIFEST.format(model=model, tp=1 if disaggregated else 2,
                                disaggregation=DISAGGREGATION if disaggregated else ""))
    port = free_ports(8)
    proc = subprocess.Popen([binary, "local", "-f", manifest, "--port", str(port),
                             "--metrics-port-base", str(port + 3), "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if "shardserve local: serving" in line:
            break
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    rng = random.Random(7)
    stop = threading.Event()
    gaps = {"idle": [], "loaded": []}
    phase = ["idle"]
    out_tokens = [0]
    lock = threading.Lock()

    def chat(i):
        while not stop.is_set():
            prompt = [1] + [rng.randrange(3, 500) for _ in range(32)]
            _, g, n = stream(port, prompt, 48)
            with lock:
                gaps[phase[0]].extend(g)
                out_tokens[0] += n

    ttfts = []
    threads = [threading.Thread(target=chat, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    time.sleep(seconds / 3)
    with lock:
        phase[0] = "loaded"
        gaps["loaded"].clear()
    t_loaded = time.monotonic()
    out_at_load = out_tokens[0]
    arrivals = []

    def long_prompt():
        n = rng.randrange(2000, 4001)
        ttft, _, _ = stream(port, [1] + [rng.randrange(3, 500) for _ in range(n - 1)], 4)
        if ttft is not None:
            with lock:
                ttfts.append(ttft)

    while time.monotonic() - t_loaded < seconds:
        t = threading.Thread(target=long_prompt)
        t.start()
        arrivals.append(t)
        time.sleep(every)
    for t in arrivals:
        t.join()
    elapsed = time.monotonic() - t_loaded
    stop.set()
    for t in threads:
        t.join()
    result = {
        "itl_idle_p50_ms": pct(gaps["idle"], 50) * 1e3, "itl_idle_p99_ms": pct(gaps["idle"], 99) * 1e3,
        "itl_loaded_p50_ms": pct(gaps["loaded"], 50) * 1e3,
        "itl_loaded_p99_ms": pct(gaps["loaded"], 99) * 1e3,
        "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99), "long_prompts": len(ttfts),
        "output_tokens_per_s": (out_tokens[0] - out_at_load) / elapsed,
    }
    if disaggregated:
        conn = http.client.HTTPConnection("127.0.0.1", port + 1, timeout=10)  # the decode leader
        conn.request("GET", "/metrics")
        page = conn.getresponse().read().decode()
        conn.close()
        moved = metric(page, "shardserve_kv_transfer_bytes_total") or 0
        took = metric(page, "shardserve_kv_transfer_seconds_sum") or 0
        count = metric(page, "shardserve_kv_transfer_seconds_count") or 0
        result["transfer_GB_per_s"] = moved / took / 1e9 if took else float("nan")
        result["transfer_share_of_ttft"] = (took / count) / statistics.mean(ttfts) \
            if count and ttfts else float("nan")
        result["transfers_pulled"] = metric(page, "shardserve_kv_transfers_total",
                                            outcome="pulled")
    proc.send_signal(signal.SIGINT)
    proc.wait(60)
    shutil.rmtree(tmp, ignore_errors=True)
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--seconds", type=float, default=40)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--every", type=float, default=4.0, help="seconds between long prompts")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="shardserve-bench-model-")
    model = os.path.join(tmp, "model")
    subprocess.run([args.binary, "gen-model", "--out", model, "--layers", "6", "--hidden", "512",
                    "--heads", "8", "--kv-heads", "2", "--intermediate", "1024", "--vocab", "512",
                    "--max-position", "8192"], check=True, capture_output=True)
    for name, dis in (("colocated (1 replica, TP=2)", False),
                      ("disaggregated (prefill TP=1 + decode TP=1)", True)):
        r = run(args.binary, model, dis, args.seconds, args.streams, args.every)
        print(f"{name}:")
        print(f"  ITL alone p50 {r['itl_idle_p50_ms']:.1f} ms, p99 {r['itl_idle_p99_ms']:.1f} ms; "
              f"under 2,000-4,000-token arrivals p50 {r['itl_loaded_p50_ms']:.1f} ms, "
              f"p99 {r['itl_loaded_p99_ms']:.1f} ms "
              f"({r['itl_loaded_p99_ms'] / r['itl_idle_p99_ms']:.2f}x)")
        print(f"  long prompts' TTFT p50 {r['ttft_p50_s']:.2f} s, p99 {r['ttft_p99_s']:.2f} s "
              f"({r['long_prompts']} prompts); output {r['output_tokens_per_s']:.0f} tokens/s")
        if dis:
            print(f"  KV transfer {r['transfer_GB_per_s']:.2f} GB/s, "
                  f"{100 * r['transfer_share_of_ttft']:.1f} % of TTFT "
                  f"({r['transfers_pulled']:.0f} pulled)")
        sys.stdout.flush()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
