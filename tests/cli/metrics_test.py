#!/usr/bin/env python3
"""Per-rank Prometheus metrics through the real binaries: while a TP=2 x PP=2 generation runs,
every rank serves /metrics (local mode: base port + global rank) with the metric names and labels
of DESIGN.md §6, `promtool check metrics` is clean on every page, and the counters move."""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from checks import Checks, free_ports, workers_running

BIN = sys.argv[1]
WORKER = os.path.join(os.path.dirname(BIN), "shardserve-worker")
check = Checks()


def value(page, name, labels):
    pat = re.compile(r"^" + re.escape(name) + r"\{([^}]*)\} (\S+)$", re.M)
    for m in pat.finditer(page):
        if all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    return None


with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "m")
    subprocess.run([BIN, "gen-model", "--out", model, "--layers", "4", "--hidden", "256",
                    "--heads", "8", "--kv-heads", "2", "--intermediate", "512", "--vocab", "512",
                    "--max-position", "8192"], check=True, capture_output=True)
    base = free_ports(4)
    proc = subprocess.Popen([BIN, "generate", "--model", model, "--prompt-ids", "1,2,3",
                             "--max-tokens", "8000", "--ignore-eos", "--tp", "2", "--pp", "2",
                             "--metrics-port-base", str(base)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    pages = {}
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and len(pages) < 4:
        for rank in range(4):
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{base + rank}/metrics",
                                              timeout=2).read().decode()
            except OSError:
                continue
            labels = {"stage": rank // 2, "tp_rank": rank % 2}
            if value(body, "shardserve_rank_up", labels) == 1 and \
                    (value(body, "shardserve_rank_tokens_total", labels) or 0) > 0:
                pages[rank] = body
        time.sleep(0.2)
    check(len(pages) == 4, f"all 4 ranks serve /metrics and are up ({sorted(pages)})")
    for rank, body in sorted(pages.items()):
        labels = {"model": "model", "replica": "0", "stage": rank // 2, "tp_rank": rank % 2}
        lint = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True,
                              text=True)
        check(lint.returncode == 0 and not lint.stdout.strip() and not lint.stderr.strip(),
              f"rank {rank}: promtool check metrics is clean {lint.stdout}{lint.stderr}".strip())
        for name in ["shardserve_rank_up", "shardserve_rank_weights_bytes",
                     "shardserve_rank_kv_cache_usage_ratio", "shardserve_rank_tokens_total",
                     "shardserve_rank_forward_seconds_count"]:
            check(value(body, name, labels) is not None, f"rank {rank}: {name} with its labels")
        check(value(body, "shardserve_rank_weights_bytes", labels) > 0, f"rank {rank}: weights")
        check(value(body, "shardserve_rank_kv_cache_usage_ratio", dict(labels, role="colocated"))
              is not None, f"rank {rank}: its KV cache usage under its role (colocated)")
        check(value(body, "shardserve_rank_load_progress_ratio", labels) == 1,
              f"rank {rank}: its weights loaded in full")
        kernels = re.search(r'^shardserve_rank_backend_info\{[^}]*backend="cpu"[^}]*'
                            r'kernels="(avx2|avx512|avx512bf16|avx512int8)"[^}]*\} 1$', body, re.M)
        check(kernels is not None and f'tp_rank="{rank % 2}"' in kernels.group(0),
              f"rank {rank}: its backend and CPU kernel level "
              f"({kernels.group(1) if kernels else 'none'})")
        startupz = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{base + rank}/startupz",
                                                     timeout=5).read())
        check(startupz == {"state": "serving"},
              f"rank {rank}: /startupz says it serves ({startupz})")
        check(value(body, "shardserve_rank_comm_bytes_total", dict(labels, op="all_reduce")) > 0,
              f"rank {rank}: TP all-reduce bytes counted")
        link = "send" if rank < 2 else "recv"  # stage 0 sends hidden states, stage 1 receives
        check(value(body, "shardserve_rank_comm_seconds_count", dict(labels, op=link)) > 0,
              f"rank {rank}: pipeline {link} timed")
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    deadline = time.monotonic() + 10
    while workers_running(WORKER) and time.monotonic() < deadline:
        time.sleep(0.05)
    check(not workers_running(WORKER), "SIGTERM to generate stops every process")

check.finish()
