#!/usr/bin/env python3
"""Generation on the CUDA backend through the real binaries (`SHARDSERVE_BACKEND=cuda shardserve
generate`: rank processes, rendezvous, NCCL where the ranks have GPUs of their own) against the
CPU backend on generated models (F32, FP8 expanded and computed as FP8, GGUF files in each block
type the GPU runs): the same
greedy tokens and logprobs, the same sampled tokens
for a seed (the device sampler draws from the sequence's generator), with one stage and with two
(hidden states over an NCCL link when the stages have different GPUs, through the host when they
share one), and TP=2 on two GPUs or a clear error on one. Exits 77 (skipped) where there is no
GPU or no CUDA build."""
import json
import os
import subprocess
import sys
import tempfile

from checks import Checks, small_models

BIN = sys.argv[1]
TOL = 2e-3
check = Checks()


def generate(model, extra, backend, timeout=300, env=None):
    cmd = [BIN, "generate", "--model", model, "--prompt-ids", "1,17,42,300,7,99,5,8",
           "--max-tokens", "12", "--ignore-eos", "--logprobs", "3", "--format", "json",
           "--threads", "2"] + extra
    env = dict(os.environ, SHARDSERVE_BACKEND=backend, **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def agrees(label, r, want, tol, prefix=False):
    """Checks a GPU run `r` against the CPU's answer `want`: every token the CPU's and every
    logprob within tol, or with prefix, the tokens up to the first that differs (the first must
    not) and the logprobs up to it within tol (the differing step's too: the two chosen tokens'
    logprobs, close only where the flip was at a near tie). Returns the run's answer, None if it
    failed."""
    if r.returncode != 0:
        check(False, f"{label}: ran on the GPU: {r.stderr[-800:]}")
        return None
    got = json.loads(r.stdout)
    n = len(want["tokens"])
    same = next((i for i, (a, b) in enumerate(zip(got["tokens"], want["tokens"])) if a != b), n)
    upto = same + 1 if prefix else n
    d = max(abs(a - b) for a, b in zip(got["logprobs"][:upto], want["logprobs"][:upto]))
    check((same > 0 if prefix else same == n) and len(got["tokens"]) == n and d <= tol,
          f"{label}: {same} of {n} tokens the CPU's, max |dlogprob| {d:.1e} <= {tol}")
    return got


def gpus():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
        return out.stdout.count("GPU ")
    except (OSError, subprocess.TimeoutExpired):
        return 0


with tempfile.TemporaryDirectory() as tmp:
    models = small_models(BIN, tmp, "f32")
    # A fine-grained FP8 checkpoint in blocks of 32: each rank expands its slice at load, then the
    # GPU runs F32.
    models["llama-fp8"] = os.path.join(tmp, "llama-fp8")
    subprocess.run([BIN, "gen-model", "--arch", "llama", "--out", models["llama-fp8"],
                    "--layers", "3", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                    "--intermediate", "96", "--vocab", "401", "--dtype", "f32", "--fp8-block", "32"],
                   check=True, capture_output=True)
    # FP8 computed as FP8 (F8_128 blocks: the GPU's quantized GEMV and tile expansion), with
    # 128 x 128 block scales and with one scale per tensor.
    for name, block in [("llama-fp8-128", "128"), ("qwen3-fp8-tensor", "tensor")]:
        models[name] = os.path.join(tmp, name)
        subprocess.run([BIN, "gen-model", "--arch", name.split("-")[0], "--out", models[name],
                        "--layers", "3", "--hidden", "256", "--heads", "4", "--kv-heads", "2",
                        "--intermediate", "512", "--vocab", "401", "--dtype", "f32",
                        "--fp8-block", block], check=True, capture_output=True)
    # DeepSeek-V3: latent attention (HeadGemm, WriteLatentKv, LatentAttention), grouped routing;
    # its multi-token-prediction layer (speculative method mtp, below).
    models["deepseek-v3"] = os.path.join(tmp, "deepseek-v3")
    subprocess.run([BIN, "gen-model", "--arch", "deepseek_v3", "--out", models["deepseek-v3"],
                    "--layers", "3", "--hidden", "64", "--heads", "4", "--intermediate", "96",
                    "--vocab", "401", "--dtype", "bf16", "--q-lora", "32", "--groups", "2",
                    "--rope-scaling", "yarn", "--mtp"], check=True, capture_output=True)
    # gpt-oss: attention with a window and sinks, the clamped SwiGLU, biased experts.
    models["gpt-oss"] = os.path.join(tmp, "gpt-oss")
    subprocess.run([BIN, "gen-model", "--arch", "gpt_oss", "--out", models["gpt-oss"],
                    "--layers", "3", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                    "--intermediate", "96", "--vocab", "401", "--dtype", "bf16",
                    "--sliding-window", "4", "--swiglu-limit", "1.5"],
                   check=True, capture_output=True)

    # GGUF files in every block type the GPU runs (hidden 256: the K-quants' super-blocks), and a
    # Mixtral in Q4_K (quantized experts on the decode path).
    quantized = ["q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k"]
    for t in quantized + ["mixtral-q4_k"]:
        arch, gtype = ("mixtral", "q4_k") if t.startswith("mixtral") else ("llama", t)
        models[t] = os.path.join(tmp, t + ".gguf")
        subprocess.run([BIN, "gen-model", "--arch", arch, "--out", models[t], "--layers", "3",
                        "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--intermediate",
                        "512", "--vocab", "401", "--experts", "4", "--dtype", "f32", "--format",
                        "gguf", "--gguf-type", gtype], check=True, capture_output=True)

    probe = generate(models["llama"], [], "cuda")
    if probe.returncode != 0 and ("no GPU is visible" in probe.stderr
                                  or "has no CUDA backend" in probe.stderr):
        print("SKIP: " + probe.stderr.strip().splitlines()[-1])
        sys.exit(77)
    n_gpus = gpus()
    print(f"{n_gpus} GPU(s)")

    cases = [("greedy", []), ("sampled", ["--temperature", "0.8", "--top-p", "0.9",
                                          "--seed", "5"])]
    # Quantized weights: the CPU multiplies with its activations rounded to 16-bit integers
    # (kernels_test.cc), the GPU's float GEMV with them in F32 (forced here; on an H200, worst
    # |dlogprob| 1.8e-4); its default dp4a GEMV (int8 inputs) is compared below.
    float_gemv = {"SHARDSERVE_CUDA_QUANT_GEMV": "float"}
    for arch in ["llama", "mixtral", "llama-fp8", "llama-fp8-128", "qwen3-fp8-tensor",
                 "deepseek-v3", "gpt-oss"] + quantized + ["mixtral-q4_k"]:
        for name, sampling in cases:
            want = json.loads(generate(models[arch], sampling, "cpu").stdout)
            for shape in (["--pp", "1"], ["--pp", "2"]):
                r = generate(models[arch], sampling + shape, "cuda", env=float_gemv)
                if agrees(f"{arch} {name} {shape}", r, want, TOL):
                    check("CUDA backend on GPU" in r.stderr,
                          f"{arch} {name} {shape}: the ranks report the CUDA backend")

    # The GGUF types through the default dp4a GEMV: the inputs rounded to int8 per 32 values (a
    # step of max |x| / 127, 129 times the CPU's int16 step), as llama.cpp's mmvq multiplies them,
    # so the answers part from the CPU's by more than rounding: the greedy tokens compared up to
    # the first that differs (the first must not), logprobs up to it within DP4A_TOL (agrees).
    DP4A_TOL = 0.1
    for arch in quantized + ["mixtral-q4_k"]:
        want = json.loads(generate(models[arch], [], "cpu").stdout)
        agrees(f"{arch} dp4a", generate(models[arch], [], "cuda"), want, DP4A_TOL, prefix=True)

    # FP8's staged GEMV (SHARDSERVE_CUDA_FP8_GEMV=staged; the default reads each block straight):
    # the same values (each byte times its scale, one rounding) in another order of sums.
    for arch in ["llama-fp8-128", "qwen3-fp8-tensor"]:
        want = json.loads(generate(models[arch], [], "cpu").stdout)
        agrees(f"{arch} FP8 staged", generate(models[arch], [], "cuda",
                                             env={"SHARDSERVE_CUDA_FP8_GEMV": "staged"}), want, TOL)

    # The KV cache in another dtype (kvCacheDtype) on the GPU against the CPU's with the same
    # dtype (the BF16 models above already keep theirs in BF16): full attention with head groups
    # in F16, BF16 and FP8, a window with sinks and DeepSeek's latent cache in FP8. Both backends
    # round the same values the same way (nearest even), so the answers agree as closely as with
    # F32 caches (on an H200, worst |dlogprob| 1.4e-6): the same tokens, within TOL.
    for arch, kv in [("llama", "f16"), ("llama", "bf16"), ("llama", "fp8"), ("gpt-oss", "fp8"),
                     ("deepseek-v3", "fp8")]:
        want = json.loads(generate(models[arch], ["--kv-cache-dtype", kv], "cpu").stdout)
        agrees(f"{arch} KV {kv}", generate(models[arch], ["--kv-cache-dtype", kv], "cuda"), want,
               TOL)

    # Speculative decoding on the GPU: a draft model (a Q4_K GGUF of the vocabulary) on the
    # leader's GPU, and DeepSeek-V3's MTP layer on the last stage's; the CPU's plain greedy tokens,
    # and the MTP's drafts the CPU's.
    for target, extra in (("llama", ["--speculative", "draft", "--draft-model", models["q4_k"]]),
                          ("deepseek-v3", ["--speculative", "mtp"])):
        want = json.loads(generate(models[target], [], "cpu").stdout)
        cpu = json.loads(generate(models[target], extra, "cpu").stdout)
        for shape in (["--pp", "1"], ["--pp", "2"]):
            r = generate(models[target], extra + shape, "cuda")
            if r.returncode != 0:
                check(False, f"{target} {extra[1]} {shape}: ran on the GPU: {r.stderr[-800:]}")
                continue
            got = json.loads(r.stdout)
            spec = got["speculation"]
            check(got["tokens"] == want["tokens"] and spec["drafted"] > 0 and
                  (extra[1] != "mtp" or spec["drafts"] == cpu["speculation"]["drafts"]),
                  f"{target} {extra[1]} {shape}: the CPU's greedy tokens, {spec['accepted']} of "
                  f"{spec['drafted']} drafts kept" + (", the CPU's drafts" if extra[1] == "mtp"
                                                       else ""))
        if extra[1] == "draft":
            check("the draft model on GPU" in r.stderr, "the draft model runs on the GPU")

    # TP=2: NCCL needs a GPU per rank.
    r = generate(models["llama"], ["--tp", "2"], "cuda")
    if n_gpus >= 2:
        want = json.loads(generate(models["llama"], [], "cpu").stdout)
        check(r.returncode == 0 and json.loads(r.stdout)["tokens"] == want["tokens"],
              f"TP=2 over NCCL gives the CPU's tokens: {r.stderr[-500:]}")
    else:
        check(r.returncode != 0 and "tensor parallelism of 2 on the CUDA backend needs 2 GPUs"
              in r.stderr, f"TP=2 on one GPU fails naming the cause: {r.stderr[-500:]}")

check.finish()
