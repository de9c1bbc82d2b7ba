"""Shared helpers of the process-level tests: named checks with a closing summary line, the
worker processes still running, free ports, and small generated models."""
import json
import os
import socket
import subprocess
import sys
import time


class Checks:
    def __init__(self):
        self.passed = 0
        self.failures = []

    def __call__(self, cond, what):
        if cond:
            self.passed += 1
            print(f"ok: {what}")
        else:
            self.failures.append(what)
            print(f"FAIL: {what}")

    def finish(self):
        print(f"{self.passed} passed, {len(self.failures)} failed")
        for what in self.failures:
            print(f"failed: {what}")
        sys.exit(1 if self.failures else 0)


# BF16 weights against activations rounded to BF16 (each off by at most 2^-8 of itself): the CPU
# kernel level avx512bf16 (auto's on an AMD CPU with AVX512-BF16, backend/cpu/cpu_features.h),
# against float32 arithmetic (transformers', the other levels'): every logprob before the first
# token that differs. Seen (2026-11-30, every reference.* BF16 case, 10 greedy tokens identical):
# up to 2.9e-2 (gpt-oss); 2026-12-03: GGUF BF16 against transformers 1.2e-2, TP=2 x PP=2 1.4e-2.
BF16_ACTIVATIONS = 0.08


def cpu_kernels(binary, model, env=None):
    """The CPU kernel level `binary generate` runs `model` at (SHARDSERVE_CPU_KERNELS from env,
    else this process's; auto: this CPU's choice)."""
    p = subprocess.run([binary, "generate", "--model", model, "--prompt-ids", "1", "--max-tokens",
                        "1", "--format", "json"], capture_output=True, text=True,
                       env=None if env is None else {**os.environ, **env})
    if p.returncode != 0:
        raise RuntimeError(f"shardserve generate exited {p.returncode}: {p.stderr[-2000:]}")
    return json.loads(p.stdout)["cpu_kernels"]


def wait_until(cond, timeout=20):
    """Polls `cond` until it holds or `timeout` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def workers_running(worker):
    out = subprocess.run(["pgrep", "-f", worker], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def free_ports(n):
    """A base port with n free ports after it."""
    for base in range(20000 + (os.getpid() % 97) * 100, 60000, 131):
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            pass
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def small_models(binary, out_dir, dtype, archs=("llama", "mixtral")):
    """Generated models of every arch with 3 layers (not divisible by 2 stages), GQA with 2 KV
    heads, 4 experts and a vocabulary of 401: {arch: directory}."""
    models = {}
    for arch in archs:
        d = os.path.join(out_dir, arch)
        subprocess.run([binary, "gen-model", "--arch", arch, "--out", d, "--layers", "3",
                        "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate",
                        "96", "--vocab", "401", "--experts", "4", "--dtype", dtype],
                       check=True, capture_output=True)
        models[arch] = d
    return models



def promtool_clean(page):
    """'' when `promtool check metrics` finds nothing wrong with a Prometheus page, else what it
    says."""
    lint = subprocess.run(["promtool", "check", "metrics"], input=page, capture_output=True,
                          text=True)
    return "" if lint.returncode == 0 else (lint.stdout + lint.stderr).strip() or "failed"


def metric(page, name, **labels):
    """The sum of a Prometheus page's samples of `name` with `labels` (None: no such sample)."""
    total = None
    for line in page.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total = (total or 0) + float(line.split()[-1])
    return total


def listening_pid(port):
    """The process listening on 127.0.0.1:port (from /proc: its socket's inode among its fds)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":
                    inodes.add(cols[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in {f"socket:[{i}]" for i in inodes}:
                    return int(pid)
        except OSError:
            continue
    return None
