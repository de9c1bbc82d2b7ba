#!/usr/bin/env python3
"""What a hostile client can cost a `shardserve local` TP=2 x PP=2 deployment (issue figures):

  - the time to answer a prompt that is one long word ("he" x N/2, N characters);
  - the leader rank's resident memory after 160 distinct words of 1 MB each;
  - how many health probes (API /healthz and /readyz, rank 0's /metrics) are answered while
    1,000 connections (500 to the API, 500 to rank 0's metrics port) each send one header line
    every 2 s and never finish their headers.

Usage: bench/hardening.py BUILD_BIN_DIR [--slow N] [--only-slow]. Prints figures; asserts nothing.
The
deployment gets an API key through SHARDSERVE_API_KEY (a build without keys ignores it)."""
import argparse
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "cli"))
from deployment import Deployment, gen_model  # noqa: E402

KEY = "bench-key-0123456789"


def leader_rss_mb(local_pid):
    """VmRSS of the process listening as rank 0 (the leader) under `shardserve local`."""
    def children(pid):
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                return [int(c) for c in f.read().split()]
        except OSError:
            return []
    todo, seen = [local_pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo.extend(children(p))
    for p in seen:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if b"rank" in args and b"--rank" in args and args[args.index(b"--rank") + 1] == b"0":
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
    return float("nan")


def timed_completion(d, prompt, timeout):
    t0 = time.monotonic()
    try:
        status, _, body = d.post("/v1/completions",
                                 {"model": "tiny", "prompt": prompt, "max_tokens": 1},
                                 timeout=timeout, headers={"Authorization": f"Bearer {KEY}"})
    except OSError as e:
        return time.monotonic() - t0, f"no answer ({e.__class__.__name__})"
    what = status if status == 200 else f"{status} {str(body)[:80]}"
    return time.monotonic() - t0, what


def probe(port, path, timeout=5):
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        s.settimeout(timeout)
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = s.recv(64)
        s.close()
        return data.startswith(b"HTTP/1.1 ")
    except OSError:
        return False


def open_slow(ports, n):
    """n connections to each port, each having sent a request line and one header."""
    socks = []
    for port in ports:
        for _ in range(n):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                socks.append(s)
            except OSError:
                break
    return socks


def trickle(socks, stop):
    """One more header line on every connection every 2 s, until stopped; the number still open
    at the end."""
    i = 0
    while not stop.wait(2):
        for s in list(socks):
            try:
                s.sendall(f"X-Slow-{i}: {'a' * 16}\r\n".encode())
            except OSError:
                socks.remove(s)
        i += 1
    for s in socks:
        s.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bin_dir")
    ap.add_argument("--slow", type=int, default=500, help="slow connections per port")
    ap.add_argument("--words", type=int, default=160)
    ap.add_argument("--only-slow", action="store_true")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    binary = os.path.join(args.bin_dir, "shardserve")
    tmp = tempfile.mkdtemp(prefix="shardserve-hardening-")
    model = os.path.join(tmp, "model")
    gen_model(binary, model)
    os.environ["SHARDSERVE_API_KEY"] = KEY
    d = Deployment(binary, model, max_seq=1024)
    try:
        if not args.only_slow:
            tokenizer_costs(d, args.words, binary, model)
        slow_connections(d, args.slow)
    finally:
        d.stop()


def tokenizer_costs(d, words, binary, model):
    tokenize = subprocess.run([binary, "bench", "tokenize", "--model", model], text=True,
                              capture_output=True)
    if tokenize.returncode == 0:
        print("the tokenizer alone, no token limit (shardserve bench tokenize):")
        print("".join("  " + line + "\n" for line in tokenize.stdout.splitlines()), end="")
    print("through the API (context 1024): one long word (\"he\" x N/2), seconds to answer:")
    for n in (8192, 16384, 32768, 65536, 131072):
        secs, what = timed_completion(d, "he" * (n // 2), timeout=120)
        print(f"  N = {n:6d} characters: {secs:7.2f} s  {what}")
        if secs > 100:
            break

    before = leader_rss_mb(d.proc.pid)
    t0 = time.monotonic()
    for i in range(words):
        word = chr(0x4E00 + i) + "\u9f98" * ((1 << 20) // 3)  # 1 MB of UTF-8, one word
        timed_completion(d, word, timeout=120)
    after = leader_rss_mb(d.proc.pid)
    print(f"leader resident memory: {before:.0f} MB before, {after:.0f} MB after "
          f"{words} distinct 1 MB words ({time.monotonic() - t0:.1f} s)")


def slow_connections(d, n):
    socks = open_slow([d.port, d.metrics_ports[0]], n)
    opened = len(socks)
    stop = threading.Event()
    t = threading.Thread(target=trickle, args=(socks, stop))
    t.start()
    targets = [(d.port, "/healthz"), (d.port, "/readyz"), (d.metrics_ports[0], "/metrics")]
    answered = {path: 0 for _, path in targets}
    for _ in range(4):  # a round every 3 s while the slow clients go on
        time.sleep(3)
        for p, path in targets:
            answered[path] += probe(p, path)
    stop.set()
    t.join()
    print(f"probes answered under {opened} slow connections ({n} to the API, {n} to rank 0's "
          f"metrics port), of 4 each: " + ", ".join(f"{p} {k}" for p, k in answered.items()))
    print(f"the API still answers afterwards: {probe(d.port, '/healthz')}")


if __name__ == "__main__":
    main()
