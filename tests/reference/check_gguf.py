#!/usr/bin/env python3
"""GGUF models against Hugging Face transformers loading the same file (it dequantizes the
weights to float32). `check_gguf.py BIN smollm2`: the real SmolLM2-135M-Instruct, Q4_1 with a Q8_0
embedding, the file scripts/setup.sh puts in the cache (skips, 77, where it is absent).
`check_gguf.py BIN generated`: models gen-model writes as GGUF (--format gguf) in every weight
type, llama and qwen2 (the llama q/k rows interleaved as llama.cpp's converter does), with
byte-level BPE and SentencePiece (scores, no merges) tokenizers; the
tokenizer, greedy tokens and logprobs as below, at TP=1, TP=2 and PP=2 (F32, BF16, Q8_0, Q4_0,
Q4_1, Q4_K, Q5_K, Q6_K; transformers expands the blocks with the gguf package's own code). transformers does not
read Mixtral's stacked experts from GGUF, so a Mixtral GGUF is checked against the same model's
safetensors instead; DeepSeek-V3 (deepseek2) and gpt-oss likewise, and their layout against
llama.cpp's gguf-py (check_mla_and_gpt_oss).

For SmolLM2:
  * the tokenizer: our ids for a set of texts equal transformers' (GGUF tokenizer, `smollm`
    pre-tokenizer);
  * greedy decoding: the first 16 tokens identical on several prompts, at TP=1 and sharded
    (TP=3, PP=2, TP=3 x PP=2); the log-probabilities of the chosen token and the top 5 within
    TOL of transformers' and of TP=1.

Tolerances per type: F32 and BF16 weights compute in float32 from the same values as
transformers, 1e-4 covers the summation order; BF16 weights at the CPU kernel level that rounds
their activations to BF16 (avx512bf16: auto's on an AMD CPU with AVX512-BF16) within
BF16_ACTIVATIONS (checks.py), here and against the safetensors and TP=1. The quantized types
round the activations to int16 per block of 32 (backend/cpu/quant.cc), in decode and in the prefill GEMM alike: 2e-3 on
the generated models (worst seen 1.3e-3), 5e-3 on SmolLM2, whose activation outliers coarsen their
blocks' steps (worst seen 2.4e-3); a sharded run sums in another order, and a value that lands
on the other side of a rounding step moves its block by one step, so the sharded runs get the
same bound. Each model also gets a prompt of 40 tokens (SmolLM2: a text of 30), past the decode
batches of up to 12, so that the prefill GEMM is checked too.
  * serving: `shardserve local` at TP=3 answers a chat request with the prompt transformers'
    chat template makes (the same token count) and the greedy answer names Paris.
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "cli"))
from checks import BF16_ACTIVATIONS, Checks, cpu_kernels  # noqa: E402
from deployment import Deployment  # noqa: E402

BIN, WHAT = sys.argv[1], sys.argv[2]
CACHE = os.environ.get("SHARDSERVE_CACHE", os.path.expanduser("~/.cache/shardserve"))
DIR = os.path.join(CACHE, "models", "smollm2-135m-instruct")
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = ["What is the capital of France?", "Numbers 12345 and 3.14; caf\u00e9 na\u00efve \u4f60\u597d!",
         "  two  spaces and\ttabs\nnew line\n\n", "<|im_start|>user\nhi<|im_end|>", "a"]
STEPS = 16
# A prompt past the decode batches (12 tokens): the prefill GEMM's path.
LONG = [1] + [(37 * i + 11) % 500 + 2 for i in range(39)]
TOL = 5e-3
QUANTIZED_TOL = 2e-3
# The CPU kernel level avx512int8 (SHARDSERVE_CPU_KERNELS; AVX512-VNNI): the decode of Q8_0,
# Q4_0, Q4_1, Q4_K and Q6_K multiplies activations rounded to int8 per block of 32 (llama.cpp's
# arithmetic), and every quantized type's prefill; those cases run again at that level (compare:
# relative to the logprobs, a near tie may tip), within INT8_TOL of transformers (worst seen
# 2.0e-2) and of TP=1. SmolLM2's activation outliers take a block's whole int8 range, so that its
# other values keep a step or two: within SMOL_INT8_TOL (worst seen 0.22), and at TP=1 only: a
# sharded run's sums in another order tip those coarse steps, and moved a chosen token's logprob
# by 2.1 at TP=3 (2026-12-05), which no bound worth the name covers.
INT8_TYPES = ("q8_0", "q4_0", "q4_1", "q4_k", "q6_k")
INT8_TOL = 0.05
SMOL_INT8_TOL = 0.5
INT8_ENV = None  # int8_env's answer
HF_GREEDY = {}  # (model path, ids): hf_greedy's answer
check = Checks()


def run(*cmd, env=None):
    r = subprocess.run([BIN, *cmd], capture_output=True, text=True,
                       env=None if env is None else {**os.environ, **env})
    if r.returncode != 0:  # what went wrong, not only that it did
        raise RuntimeError(f"shardserve {' '.join(cmd)} exited {r.returncode}: {r.stderr[-3000:]}")
    return json.loads(r.stdout)


def ours(model, prompt, *extra, env=None):
    """generate's JSON; prompt: text or a list of ids. The KV cache in F32, as transformers' (a
    GGUF file's own is F16, llama.cpp's default: the serving check below runs it)."""
    given = (["--prompt-ids", ",".join(map(str, prompt))] if isinstance(prompt, list)
             else ["--prompt", prompt])
    return run("generate", "--model", model, *given, "--max-tokens", str(STEPS), "--logprobs", "5",
               "--ignore-eos", "--threads", "2", "--format", "json", "--kv-cache-dtype", "f32",
               *extra, env=env)


def bf16_bound(model, tight):
    """`tight` where the default kernels compute BF16 weights in F32, else BF16_ACTIVATIONS."""
    return BF16_ACTIVATIONS if cpu_kernels(BIN, model) == "avx512bf16" else tight


def hf_greedy(model, ids):
    x = torch.tensor([ids])
    want, lps = [], []
    with torch.no_grad():
        for _ in range(STEPS):
            lp = torch.log_softmax(model(x).logits[0, -1].double(), dim=-1)
            t = int(torch.argmax(lp))
            want.append(t)
            lps.append(lp)
            x = torch.cat([x, torch.tensor([[t]])], dim=1)
    return want, lps


def worst_logprob(got, want, lps, relative=False):
    """The largest difference of a chosen or top-5 logprob from transformers' before the first
    token that differs (relative: divided by max(1, |transformers' logprob|))."""
    worst = 0.0

    def off(ours, theirs):
        return abs(ours - theirs) / (max(1.0, abs(theirs)) if relative else 1.0)
    for i, (t, tops) in enumerate(zip(got["tokens"], got["top_logprobs"])):
        if i >= len(lps) or t != want[i]:
            break
        worst = max(worst, off(got["logprobs"][i], float(lps[i][t])))
        for alt in tops:
            worst = max(worst, off(alt["logprob"], float(lps[i][alt["id"]])))
    return worst


def int8_env(model):
    """The environment of the CPU kernel level avx512int8 where this CPU runs it, else None (said
    once, by name)."""
    global INT8_ENV
    if INT8_ENV is None:
        env = {"SHARDSERVE_CPU_KERNELS": "avx512int8"}
        try:
            INT8_ENV = env if cpu_kernels(BIN, model, env) == "avx512int8" else {}
        except RuntimeError as e:  # refused: a CPU without VNNI, or a portable build
            why = next((w for w in ("this CPU lacks AVX512-VNNI",
                                    "this build carries the portable kernels only")
                        if w in str(e)), None)
            if why is None:
                raise
            INT8_ENV = {}
            print(f"skipped: kernel level avx512int8 ({why})")
    return INT8_ENV or None


def compare(name, model_path, hf_model, prompt, ids, shapes, tol, env=None):
    """Greedy tokens and logprobs against transformers at TP=1, then each sharded shape against
    TP=1. env: the level avx512int8's (int8_env): its rounding may tip a near tie, so where its
    greedy tokens first differ from transformers', ours must be within 2 tol of max(1, |top|) of
    the top in transformers' logprobs; each logprob before it within tol of max(1,
    |transformers'|) (its error grows with the logits). A sharded shape's likewise against TP=1
    (its token among TP=1's top 5): a sum in another order, or a prompt's tokens in other
    batches (a pipeline's), moves a value across an int8 rounding step now and then, which the
    next layers carry."""
    key = (model_path, tuple(ids))  # the int8 cases ask again
    if key not in HF_GREEDY:
        HF_GREEDY[key] = hf_greedy(hf_model, ids)
    want, lps = HF_GREEDY[key]
    shown = prompt if not isinstance(prompt, list) or len(prompt) <= 8 else f"{len(ids)} ids"
    single = ours(model_path, prompt, env=env)
    got = single["tokens"]
    agree = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), STEPS)
    if env and agree < STEPS:  # a near tie in transformers' own distribution, or a fault
        lp = lps[agree]
        gap = float(lp[want[agree]] - lp[got[agree]])
        tie = 2 * tol * max(1.0, abs(float(lp[want[agree]])))
        check(gap <= tie, f"{name} {shown!r}: greedy tokens equal transformers' for {agree} of "
              f"{STEPS}, then ours ({got[agree]}) within {tie:.2e} of the top in transformers' "
              f"logprobs (gap {gap:.2e})")
    else:
        check(agree == STEPS, f"{name} {shown!r}: greedy tokens equal transformers' "
              f"({want[:6]}...)" + ("" if agree == STEPS else f" ours {got}"))
    worst = worst_logprob(single, want, lps, relative=bool(env))
    check(worst <= tol, f"{name} {shown!r}: chosen and top-5 logprobs within {tol}"
          + (" of max(1, |logprob|)" if env else "") + f" (worst {worst:.2e})")
    for shape in shapes:
        sharded = ours(model_path, prompt, *shape, env=env)
        where = f"{name} {shown!r} at {' '.join(shape)}"
        split = next((i for i, (a, b) in enumerate(zip(sharded["tokens"], single["tokens"]))
                      if a != b), STEPS)
        if env and split < STEPS:  # a near tie in TP=1's distribution: ours among its top 5
            tops = {alt["id"]: alt["logprob"] for alt in single["top_logprobs"][split]}
            top = single["logprobs"][split]
            gap = top - tops.get(sharded["tokens"][split], float("-inf"))
            tie = 2 * tol * max(1.0, abs(top))
            check(gap <= tie, f"{where}: the same tokens as TP=1 for {split} of {STEPS}, then "
                  f"ours ({sharded['tokens'][split]}) within {tie:.2e} of the top in TP=1's "
                  f"logprobs (gap {gap:.2e})")
        else:
            check(split == STEPS, f"{where}: the same tokens as TP=1")
        diff = max([abs(a - b) for a, b in
                    zip(sharded["logprobs"][:split], single["logprobs"][:split])] or [0.0])
        check(diff <= tol, f"{where}: logprobs within {tol} of TP=1"
              + (f" before step {split}" if split < STEPS else "") + f" (worst {diff:.2e})")


def check_mla_and_gpt_oss(tmp):
    """DeepSeek-V3 as llama.cpp's deepseek2 and gpt-oss as its gpt-oss. transformers reads
    neither back (it has no deepseek2; its gpt-oss reader fails on the file's YaRN keys), so each
    GGUF is checked against the safetensors it was made from, whose weights check_reference.py
    compares with transformers: (1) the layout, with llama.cpp's own gguf-py (gguf_layout.py):
    every tensor one of the architecture's names, and the weights, undone as llama.cpp's converter
    does them, equal to the directory's (exactly: F32, BF16 from BF16, MXFP4 repacked); (2) our
    answers from the GGUF equal to our answers from the directory (F32, BF16), or, for Q8_0, to
    our answers from the GGUF's weights dequantized by gguf-py into a safetensors directory; at
    TP=1 and TP=2, PP=2, TP=2 x PP=2."""
    from safetensors.numpy import save_file
    import gguf_layout

    ds = ["--arch", "deepseek_v3", "--layers", "3", "--hidden", "128", "--heads", "8",
          "--vocab", "512", "--experts", "8", "--top-k", "2", "--kv-lora", "32",
          "--rope-dim", "16", "--nope-dim", "32", "--v-dim", "32", "--moe-intermediate", "64",
          "--seed", "3", "--max-position", "512"]
    ds_lora = ds + ["--q-lora", "64", "--groups", "4", "--topk-groups", "2", "--rope-scaling",
                    "yarn"]
    ds_plain = ds + ["--shared-experts", "2", "--first-dense", "0", "--no-norm-topk-prob"]
    go = ["--arch", "gpt_oss", "--layers", "2", "--hidden", "128", "--heads", "8",
          "--kv-heads", "4", "--head-dim", "16", "--vocab", "512", "--experts", "8", "--top-k",
          "2", "--intermediate", "64", "--sliding-window", "16", "--rope-scaling", "yarn",
          "--seed", "3", "--max-position", "512"]
    cases = [("deepseek_v3 f32", ds_lora + ["--dtype", "f32"], ["--gguf-type", "f32"]),
             ("deepseek_v3 f32 legacy kv_b", ds_lora + ["--dtype", "f32"],
              ["--gguf-type", "f32", "--gguf-legacy-mla"]),
             ("deepseek_v3 plain bf16", ds_plain + ["--dtype", "bf16"], ["--gguf-type", "bf16"]),
             ("deepseek_v3 q8_0", ds_lora + ["--dtype", "f32"], ["--gguf-type", "q8_0"]),
             ("gpt_oss f32", go + ["--dtype", "f32"], ["--gguf-type", "f32"]),
             ("gpt_oss mxfp4", go + ["--dtype", "bf16", "--mxfp4"], ["--gguf-type", "bf16"]),
             ("gpt_oss q8_0", go + ["--dtype", "f32"], ["--gguf-type", "q8_0"])]
    shapes = (["--tp", "2"], ["--pp", "2"], ["--tp", "2", "--pp", "2"])
    for name, args, gguf_args in cases:
        base = os.path.join(tmp, name.replace(" ", "-"))
        subprocess.run([BIN, "gen-model", "--out", base, *args], check=True, capture_output=True)
        path = base + ".gguf"
        subprocess.run([BIN, "gen-model", "--out", path, *args, "--format", "gguf", *gguf_args],
                       check=True, capture_output=True)
        reader = gguf_layout.GGUFReader(path)
        stray = gguf_layout.tensor_names_of_arch(reader)
        check(not stray, f"{name}: every tensor is one of llama.cpp's {gguf_layout.arch_of(reader)}"
              f" names" + (f" (not: {stray[:4]})" if stray else ""))
        want = gguf_layout.safetensors_weights(base)
        got = gguf_layout.hf_weights(path, want.keys())
        quantized = "q8_0" in gguf_args
        worst = max(float(np.abs(got[k] - want[k]).max()) for k in want)
        bound = 0.02 if quantized else 0.0  # Q8_0: half a step of |w| <= 1 / 127 scales
        check(worst <= bound, f"{name}: the weights where llama.cpp reads them equal the "
              f"directory's{' within Q8_0 rounding' if quantized else ''} (worst {worst:.2e})")
        ref = base
        if quantized:  # the GGUF's own weights, as safetensors
            ref = base + "-dequantized"
            gguf_layout.config_without_quantization(base, ref)
            save_file({k: np.ascontiguousarray(v) for k, v in got.items()},
                      os.path.join(ref, "model.safetensors"))
        tol = (QUANTIZED_TOL if quantized else
               bf16_bound(path, 1e-5) if "bf16" in gguf_args else 1e-5)
        for ids in ([1, 5, 9, 13], [1, 300, 7], LONG):
            want_run, single = ours(ref, ids), ours(path, ids)
            diff = max(abs(a - b) for a, b in zip(want_run["logprobs"], single["logprobs"]))
            check(single["tokens"] == want_run["tokens"] and diff <= tol,
                  f"{name} {ids if len(ids) <= 8 else f'{len(ids)} ids'}: the GGUF's tokens "
                  f"and logprobs are the safetensors' (worst {diff:.2e}, bound {tol})")
            for shape in shapes:  # the quantized types' activation rounding moves with the order
                sharded = ours(path, ids, *shape)
                diff = max(abs(a - b) for a, b in zip(sharded["logprobs"], single["logprobs"]))
                bound = QUANTIZED_TOL if quantized else max(tol, 1e-4)
                check(sharded["tokens"] == single["tokens"] and diff <= bound,
                      f"{name} {len(ids)} ids at {' '.join(shape)}: the same tokens, logprobs "
                      f"within {bound} of TP=1 (worst {diff:.2e})")


def check_mtp(tmp):
    """DeepSeek-V3's multi-token-prediction layer in a GGUF: the block after the model's
    (block_count counts it, nextn_predict_layers names it), its tensors under llama.cpp's names
    for nextn layers (blk.N.nextn.eh_proj, ...: gguf-py's, which llama.cpp gives the
    architectures it converts with one) beside the block's deepseek2 ones. Speculation with it
    from the GGUF drafts exactly what it drafts from the safetensors (whose drafts
    check_reference.py compares with transformers), at TP=1 and TP=2 x PP=2."""
    import gguf_layout
    from gguf import MODEL_TENSOR, TENSOR_NAMES

    args = ["--arch", "deepseek_v3", "--layers", "2", "--hidden", "128", "--heads", "8",
            "--vocab", "512", "--experts", "8", "--top-k", "2", "--kv-lora", "32",
            "--rope-dim", "16", "--nope-dim", "32", "--v-dim", "32", "--moe-intermediate", "64",
            "--q-lora", "64", "--seed", "5", "--max-position", "512", "--dtype", "f32", "--mtp"]
    base = os.path.join(tmp, "deepseek-mtp")
    subprocess.run([BIN, "gen-model", "--out", base, *args], check=True, capture_output=True)
    path = base + ".gguf"
    subprocess.run([BIN, "gen-model", "--out", path, *args, "--format", "gguf",
                    "--gguf-type", "f32"], check=True, capture_output=True)
    reader = gguf_layout.GGUFReader(path)
    nextn = {TENSOR_NAMES[t].format(bid=2) for t in MODEL_TENSOR if t.name.startswith("NEXTN_")}
    stray = [n for n in gguf_layout.tensor_names_of_arch(reader) if n.rsplit(".", 1)[0] not in nextn]
    mtp = [n for n in gguf_layout.tensor_names_of_arch(reader) if n.rsplit(".", 1)[0] in nextn]
    check(not stray and len(mtp) == 6,
          f"deepseek_v3 mtp: the MTP block's {len(mtp)} nextn tensors under llama.cpp's names, "
          f"every other tensor deepseek2's" + (f" (not: {stray[:4]})" if stray else ""))
    for ids in ([1, 5, 9, 13], LONG):
        want = ours(base, ids, "--speculative", "mtp")
        for shape in ([], ["--tp", "2", "--pp", "2"]):
            got = ours(path, ids, "--speculative", "mtp", *shape)
            check(got["tokens"] == want["tokens"] and
                  got["speculation"]["drafts"] == want["speculation"]["drafts"],
                  f"deepseek_v3 mtp {len(ids)} ids {' '.join(shape)}: the GGUF drafts as the "
                  f"safetensors do ({len(want['speculation']['drafts'])} drafts)")


if WHAT == "generated":
    SHAPE = ["--layers", "2", "--hidden", "128", "--heads", "4", "--kv-heads", "2",
             "--intermediate", "256", "--vocab", "512", "--seed", "3", "--dtype", "f32",
             "--max-position", "512"]
    CASES = [("llama", "f32", []), ("llama", "bf16", []), ("llama", "q8_0", []),
             ("llama", "q4_0", ["--tie-embeddings"]), ("llama", "q4_1", []),
             ("qwen2", "q8_0", []), ("qwen2", "q4_1", [])]
    # transformers reads no head size from a qwen3 GGUF (Qwen3Config's default, 128, stands).
    CASES += [("qwen3", "f32", ["--head-dim", "128"]), ("qwen3", "q8_0", ["--head-dim", "128"])]
    # Qwen3-MoE as llama.cpp's qwen3moe (the chosen experts' weights renormalized); transformers
    # reads no expert size from it either (Qwen3MoeConfig's moe_intermediate_size, 768, stands).
    QWEN_MOE = ["--head-dim", "128", "--intermediate", "768", "--experts", "8", "--top-k", "2"]
    CASES += [("qwen3_moe", "f32", QWEN_MOE), ("qwen3_moe", "q8_0", QWEN_MOE)]
    # The K-quants' super-blocks of 256 need wider rows (and TP=2 column slices of 256).
    WIDE = ["--hidden", "512", "--heads", "8", "--kv-heads", "4", "--intermediate", "1024"]
    CASES += [("llama", "q4_k", WIDE), ("llama", "q5_k", WIDE), ("llama", "q6_k", WIDE)]
    # A SentencePiece tokenizer (tokenizer.ggml.model llama: scores, no merges).
    CASES += [("llama", "q4_0", ["--tokenizer", "sentencepiece"])]
    SHAPES = (["--tp", "2"], ["--pp", "2"])
    with tempfile.TemporaryDirectory() as tmp:
        for arch, wtype, extra in CASES:
            name = (f"{arch} {wtype}{' tied' if '--tie-embeddings' in extra else ''}"
                    f"{' sentencepiece' if 'sentencepiece' in extra else ''}")
            path = os.path.join(tmp, f"{name.replace(' ', '-')}.gguf")
            args = list(SHAPE)
            for i in range(0, len(extra)):  # a flag of SHAPE given again takes the new value
                if extra[i].startswith("--") and extra[i] in args and i + 1 < len(extra):
                    args[args.index(extra[i]) + 1] = extra[i + 1]
                elif extra[i].startswith("--") and extra[i] not in args:
                    args.append(extra[i])
                    if i + 1 < len(extra) and not extra[i + 1].startswith("--"):
                        args.append(extra[i + 1])
            subprocess.run([BIN, "gen-model", "--arch", arch, "--out", path, "--format", "gguf",
                            "--gguf-type", wtype, *args], check=True, capture_output=True)
            tok = AutoTokenizer.from_pretrained(tmp, gguf_file=os.path.basename(path))
            model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=os.path.basename(path),
                                                         dtype=torch.float32)
            model.eval()
            for text in TEXTS:
                got, want = ours(path, text)["prompt_ids"], tok.encode(text)
                check(got == want, f"{name} tokenizer: {text!r}"
                      + ("" if got == want else f" ({want} vs ours {got})"))
            tol = (1e-4 if wtype == "f32" else bf16_bound(path, 1e-4) if wtype == "bf16"
                   else QUANTIZED_TOL)
            for ids in ([1, 5, 9, 13], [1, 300, 7], LONG):
                compare(name, path, model, ids, ids, SHAPES, tol)
                if wtype in INT8_TYPES and int8_env(path):
                    compare(f"{name} avx512int8", path, model, ids, ids, SHAPES, INT8_TOL,
                            int8_env(path))
        # Mixtral: the GGUF against the safetensors of the same weights, and sharded.
        st = os.path.join(tmp, "mixtral")
        common = ["--arch", "mixtral", *SHAPE, "--experts", "4", "--top-k", "2"]
        subprocess.run([BIN, "gen-model", "--out", st, *common], check=True, capture_output=True)
        path = os.path.join(tmp, "mixtral-f32.gguf")
        subprocess.run([BIN, "gen-model", "--out", path, *common, "--format", "gguf",
                        "--gguf-type", "f32"], check=True, capture_output=True)
        for ids in ([1, 5, 9, 13], [1, 300, 7]):
            want, got = ours(st, ids), ours(path, ids)
            diff = max(abs(a - b) for a, b in zip(want["logprobs"], got["logprobs"]))
            check(got["tokens"] == want["tokens"] and diff <= 1e-5,
                  f"mixtral f32 {ids}: the GGUF's tokens and logprobs are the safetensors' "
                  f"(worst {diff:.2e})")
            for shape in SHAPES:
                sharded = ours(path, ids, *shape)
                check(sharded["tokens"] == got["tokens"], f"mixtral f32 {ids} at {' '.join(shape)}")
        check_mla_and_gpt_oss(tmp)
        check_mtp(tmp)
    check.finish()

if not os.path.exists(os.path.join(DIR, FILE)):
    print(f"skipped: {DIR}/{FILE} is absent (scripts/setup.sh fetches it)")
    sys.exit(77)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The farmer walked to the market early in the morning, carrying two baskets of apples "
           "and a jar of honey. When he arrived, the square was already"]

tok = AutoTokenizer.from_pretrained(DIR, gguf_file=FILE)
model = AutoModelForCausalLM.from_pretrained(DIR, gguf_file=FILE, dtype=torch.float32)
model.eval()

for text in TEXTS:
    got = ours(DIR, text)["prompt_ids"] if text else []
    want = tok.encode(text)
    check(got == want, f"tokenizer: {text!r} -> {want[:12]}{'...' if len(want) > 12 else ''}"
          + ("" if got == want else f" (ours: {got})"))

for prompt in PROMPTS:
    compare("SmolLM2", DIR, model, prompt, tok.encode(prompt),
            (["--tp", "3"], ["--pp", "2"], ["--tp", "3", "--pp", "2"]), TOL)
    if int8_env(DIR):  # at TP=1 only (SMOL_INT8_TOL)
        compare("SmolLM2 avx512int8", DIR, model, prompt, tok.encode(prompt), (), SMOL_INT8_TOL,
                int8_env(DIR))

messages = [{"role": "user", "content": "What is the capital of France?"}]
want_prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False)
d = Deployment(BIN, DIR, name="smollm2", tp=3, pp=1)
try:
    status, _, body = d.post("/v1/chat/completions", {"model": "smollm2", "messages": messages,
                                                       "max_tokens": 24, "temperature": 0})
    check(status == 200, f"chat at TP=3: HTTP {status}")
    if status == 200:
        answer = body["choices"][0]["message"]["content"]
        check(body["usage"]["prompt_tokens"] == len(want_prompt),
              f"chat prompt: {body['usage']['prompt_tokens']} tokens, transformers' template "
              f"{len(want_prompt)}")
        check("Paris" in answer, f"chat answer names Paris: {answer!r}")
finally:
    d.stop()
check.finish()
