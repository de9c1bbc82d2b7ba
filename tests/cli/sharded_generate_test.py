#!/usr/bin/env python3
"""Sharded generation through the real binaries: `shardserve generate --tp T --pp P` starts P
stage launchers x T rank processes that meet at a rendezvous, talk over shared memory (TP) and
TCP (PP), and must give the single process's greedy tokens and logprobs for every TP in {1,2,4} x
PP in {1,2,3} on Llama (GQA, 2 KV heads: TP=4 replicates them) and Mixtral, with 3 layers (not
divisible by 2 stages) and a vocabulary of 401. Killing a rank must take every process down with
every rank naming it, and unshardable shapes must fail cleanly."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from checks import Checks, small_models, workers_running

BIN = sys.argv[1]
WORKER = os.path.join(os.path.dirname(BIN), "shardserve-worker")
TOL = 1e-4
check = Checks()


def generate(model, extra, timeout=180):
    cmd = [BIN, "generate", "--model", model, "--prompt-ids", "1,17,42,300,7,99,5,8",
           "--max-tokens", "8", "--ignore-eos", "--logprobs", "3", "--format", "json",
           "--threads", "2"] + extra
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


with tempfile.TemporaryDirectory() as tmp:
    models = small_models(BIN, tmp, "bf16")
    grid = [(tp, pp) for tp in (1, 2, 4) for pp in (1, 2, 3) if tp * pp > 1]
    for arch, shapes in [("llama", grid), ("mixtral", grid)]:
        base = generate(models[arch], [])
        want = json.loads(base.stdout)
        for tp, pp in shapes:
            r = generate(models[arch], ["--tp", str(tp), "--pp", str(pp)])
            if r.returncode != 0:
                check(False, f"{arch} tp {tp} pp {pp} ran: {r.stderr[-500:]}")
                continue
            got = json.loads(r.stdout)
            d = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"]))
            check(got["tokens"] == want["tokens"] and d <= TOL,
                  f"{arch} tp {tp} pp {pp}: same tokens, max |dlogprob| {d:.1e} <= {TOL}")

    # Kill rank 3 (stage 1, tp 1) mid-generation.
    big = os.path.join(tmp, "big")
    subprocess.run([BIN, "gen-model", "--out", big, "--layers", "4", "--hidden", "256",
                    "--heads", "8", "--kv-heads", "2", "--intermediate", "512", "--vocab", "512",
                    "--max-position", "8192"], check=True, capture_output=True)
    proc = subprocess.Popen([BIN, "generate", "--model", big, "--prompt-ids", "1,2,3",
                             "--max-tokens", "4000", "--ignore-eos", "--tp", "2", "--pp", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    victim = None
    for _ in range(600):  # wait until rank 3 runs (its process name carries the rank)
        out = subprocess.run(["pgrep", "-f", f"{WORKER} rank --rank 3"], capture_output=True,
                             text=True).stdout.split()
        if out:
            victim = int(out[0])
            break
        time.sleep(0.05)
    check(victim is not None, "rank 3 started")
    time.sleep(2.0)  # let it load and generate for a while
    killed_at = time.monotonic()
    if victim:
        os.kill(victim, signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    took = time.monotonic() - killed_at
    print(f"kill -9 rank 3: the whole replica was down {took:.2f} s later")
    print("\n".join("  | " + l for l in err.strip().splitlines()[-8:]))
    check(proc.returncode != 0, "generate exits non-zero when a rank dies")
    check("rank 3 (stage 1, tp 1)" in err, "the error names rank 3 (stage 1, tp 1)")
    rank_lines = [l for l in err.splitlines() if l.startswith("shardserve-worker rank:")]
    check(len(rank_lines) == 3 and all("rank 3 (stage 1, tp 1)" in l for l in rank_lines),
          f"each of the 3 other ranks exits naming rank 3 ({len(rank_lines)} rank errors)")
    time.sleep(0.5)
    check(not workers_running(WORKER), "no worker process is left behind")

    # A shape that cannot be sharded: 4 heads over 3 ranks.
    r = generate(models["llama"], ["--tp", "3"], timeout=120)
    check(r.returncode != 0 and
          "num_attention_heads 4 is not divisible by tensor parallelism 3" in r.stderr,
          "tp 3 on 4 heads fails with the numbers")
    check(not workers_running(WORKER), "no worker process is left behind after a bad shape")
    r = generate(models["llama"], ["--pp", "4"], timeout=120)
    check(r.returncode != 0 and "the model has 3 layers: too few for 4 pipeline stages" in r.stderr,
          "pp 4 on 3 layers fails with the numbers")

check.finish()
