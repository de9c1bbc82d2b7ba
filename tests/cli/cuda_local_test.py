#!/usr/bin/env python3
"""`shardserve local` on the CUDA backend answers completions with the CPU backend's tokens: the
same manifest and generated model (F32 and BF16), PP 1 and 2, greedy, through the real API; with
echo, the prompt's log-probabilities too (the LM head on every prompt row).
Exits 77 (skipped) where there is no GPU or no CUDA build."""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from checks import Checks  # noqa: E402
from deployment import Deployment, gen_model  # noqa: E402

BIN = sys.argv[1]
PROMPTS = ["The quick brown fox", "Sharded serving of a model too large for one GPU", "a b c"]
check = Checks()


def answers(model, backend, pp):
    """{prompt: (text, [token logprob])} from a deployment on the backend, and its log."""
    d = Deployment(BIN, model, tp=1, pp=pp, env={"SHARDSERVE_BACKEND": backend})
    try:
        out = {}
        for p in PROMPTS:
            status, _, body = d.post("/v1/completions", {
                "model": "tiny", "prompt": p, "max_tokens": 16, "temperature": 0,
                "ignore_eos": True, "logprobs": 1, "echo": True})
            if status != 200:
                raise RuntimeError(f"{backend} pp={pp}: HTTP {status}: {body}")
            lp = body["choices"][0]["logprobs"]
            out[p] = (body["choices"][0]["text"], lp["tokens"], lp["token_logprobs"])
        return out, d.log()
    finally:
        d.stop()


with tempfile.TemporaryDirectory() as tmp:
    for dtype, tol in (("f32", 2e-3), ("bf16", 2e-2)):
        model = os.path.join(tmp, dtype)
        gen_model(BIN, model, "--dtype", dtype)
        if dtype == "f32":
            r = subprocess.run([BIN, "generate", "--model", model, "--prompt-ids", "1,2,3",
                                "--max-tokens", "1"], capture_output=True, text=True,
                               env=dict(os.environ, SHARDSERVE_BACKEND="cuda"))
            if r.returncode != 0 and ("no GPU is visible" in r.stderr
                                      or "has no CUDA backend" in r.stderr):
                print("SKIP: " + r.stderr.strip().splitlines()[-1])
                sys.exit(77)
        want, _ = answers(model, "cpu", 1)
        for pp in (1, 2):
            try:
                got, log = answers(model, "cuda", pp)
            except RuntimeError as e:
                check(False, f"{dtype} pp={pp}: the CUDA deployment answers: {e}")
                continue
            check("CUDA backend on GPU" in log, f"{dtype} pp={pp}: the ranks report the CUDA "
                  "backend")
            for p in PROMPTS:
                d = max(abs(a - b) for a, b in zip(got[p][2], want[p][2]) if a is not None)
                check(got[p][:2] == want[p][:2] and d <= tol,
                      f"{dtype} pp={pp} {p!r}: the CPU's tokens {got[p][1] == want[p][1]}, "
                      f"max |dlogprob| {d:.1e} <= {tol}")
check.finish()
