#!/usr/bin/env python3
"""Checks shardserve's CPU runtime against Hugging Face transformers (PyTorch) on one generated
model: greedy tokens must be identical and log-probabilities (chosen token and top 5) must agree.

Tolerances (the KV cache in F32):
  * FP8 checkpoints: transformers dequantizes at load into the model's dtype, as shardserve
    does (the same bits), then runs in float32 like the others: 1e-4. MXFP4 experts likewise
    (their values are exact in every dtype).
  * transformers in float32 (bf16/f16 weights are upcast exactly, which is how shardserve's
    kernels compute: file dtype weights, F32 math): |dlogprob| <= 1e-4 for every dtype.
  * transformers in the file's native dtype (bf16/f16 activations too): the logprob it gives
    shardserve's first greedy token is within 0.25 of shardserve's.
And with config.json as transformers itself saves it (its names for every field) the answer is
the same. With the KV cache in the model's dtype (BF16/F16, kvCacheDtype auto) the greedy tokens
are identical and logprobs within KV_BOUNDS["auto"]; in FP8 (under the checkpoint's per-layer
k_scale / v_scale, computed here as vLLM computes them) logprobs up to the first token that
differs within KV_BOUNDS["fp8"]. Where the CPU has the kernel level that rounds BF16 weights'
activations to BF16 (SHARDSERVE_CPU_KERNELS=avx512bf16, backend/cpu/cpu_features.h; auto's on an
AMD CPU with AVX512-BF16, else the levels compute in F32), a BF16 model at that level is checked
as the KV cache's dtypes are, within BF16_ACTIVATIONS (checks.py), and where auto is that level
the checks above run the widest F32 level (avx512) for a BF16 model. Also checks that shardserve's tokenizer encodes like the `tokenizers` library, for the generated
tokenizer and for Llama 3 (regex split, ignore_merges) and Qwen2 (NFC) variants of it.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cli"))
from checks import BF16_ACTIVATIONS, cpu_kernels  # noqa: E402

DEEPSEEK = ["--arch", "deepseek_v3", "--heads", "8", "--experts", "8", "--top-k", "2",
            "--kv-lora", "32", "--rope-dim", "16", "--nope-dim", "16", "--v-dim", "16",
            "--moe-intermediate", "64"]
GPT_OSS = ["--arch", "gpt_oss", "--heads", "8", "--kv-heads", "4", "--head-dim", "16",
           "--experts", "8", "--top-k", "2", "--intermediate", "64", "--sliding-window", "16",
           "--swiglu-limit", "1.5"]
LONG = ["--max-position", "1100"]  # room for the 1,000-token prompt
CASES = {
    "llama_gqa_f32": ["--arch", "llama", "--dtype", "f32", "--kv-heads", "2"],
    "llama_gqa_bf16": ["--arch", "llama", "--dtype", "bf16", "--kv-heads", "2"],
    "llama_mha_f16": ["--arch", "llama", "--dtype", "f16", "--kv-heads", "6"],
    "llama_tied_f32": ["--arch", "llama", "--dtype", "f32", "--tie-embeddings"],
    "llama_bias_f32": ["--arch", "llama", "--dtype", "f32", "--attention-bias"],
    "llama_rope_llama3_f32": ["--arch", "llama", "--dtype", "f32", "--rope-scaling", "llama3"],
    "llama_rope_linear_bf16": ["--arch", "llama", "--dtype", "bf16", "--rope-scaling", "linear"],
    "llama_sharded_sp_bf16": ["--arch", "llama", "--dtype", "bf16", "--shard-size", "200000",
                              "--tokenizer", "sentencepiece"],
    "mistral_bf16": ["--arch", "mistral", "--dtype", "bf16", "--kv-heads", "2"],
    "qwen2_f32": ["--arch", "qwen2", "--dtype", "f32", "--kv-heads", "3"],
    "qwen3_f32": ["--arch", "qwen3", "--dtype", "f32", "--heads", "8", "--kv-heads", "4"] + LONG,
    "qwen3_bias_bf16": ["--arch", "qwen3", "--dtype", "bf16", "--heads", "8", "--kv-heads", "4",
                        "--attention-bias"],
    "qwen3_moe_f32": ["--arch", "qwen3_moe", "--dtype", "f32", "--heads", "8", "--kv-heads", "4",
                      "--experts", "8", "--top-k", "2", "--intermediate", "64"] + LONG,
    "qwen3_moe_nonorm_bf16": ["--arch", "qwen3_moe", "--dtype", "bf16", "--heads", "8",
                              "--kv-heads", "4", "--experts", "4", "--top-k", "3",
                              "--intermediate", "64", "--no-norm-topk-prob"],
    # Fine-grained FP8 checkpoints (E4M3, an F32 scale per 16x16 block; transformers needs the
    # block to divide every dimension): expanded at load into the model's dtype, as transformers'
    # dequantization does.
    "qwen3_fp8_f32": ["--arch", "qwen3", "--dtype", "f32", "--heads", "8", "--kv-heads", "4",
                      "--fp8-block", "16"],
    "qwen3_moe_fp8_bf16": ["--arch", "qwen3_moe", "--dtype", "bf16", "--heads", "8",
                           "--kv-heads", "4", "--experts", "8", "--top-k", "2",
                           "--intermediate", "64", "--fp8-block", "16"],
    # FP8 as the checkpoints of 2026 ship it (128 x 128 blocks) and with one scale per tensor
    # (weight_block_size null): computed in FP8 where a rank's columns fall in groups of 128
    # (F8_128; its values exactly transformers' dequantized F32 ones), expanded where they do not
    # (o_proj at TP=4).
    "qwen3_fp8_128_f32": ["--arch", "qwen3", "--dtype", "f32", "--hidden", "256", "--heads", "4",
                          "--kv-heads", "2", "--intermediate", "512", "--fp8-block", "128"],
    "llama_fp8_tensor_f32": ["--arch", "llama", "--dtype", "f32", "--hidden", "128", "--heads",
                             "4", "--kv-heads", "2", "--intermediate", "256", "--fp8-block",
                             "tensor"],
    # YaRN where the whole head rotates: its attention factor (0.1 ln 4 + 1) on cos and sin.
    "qwen3_yarn_f32": ["--arch", "qwen3", "--dtype", "f32", "--heads", "8", "--kv-heads", "4",
                       "--rope-scaling", "yarn"],
    # DeepSeek-V3: multi-head latent attention (q LoRA, interleaved RoPE with YaRN), grouped
    # sigmoid routing with the correction bias, a shared expert, a dense first layer; a prompt of
    # 1,000 tokens; its multi-token-prediction layer (checked as speculation's drafts: check_mtp).
    "deepseek_v3_f32": DEEPSEEK + ["--dtype", "f32", "--q-lora", "48", "--groups", "4",
                                   "--topk-groups", "2", "--rope-scaling", "yarn",
                                   "--mtp"] + LONG,
    # q_proj (no q LoRA), plain RoPE, one group, two shared experts, every layer sparse, the
    # chosen scores unnormalized.
    "deepseek_v3_plain_bf16": DEEPSEEK + ["--dtype", "bf16", "--shared-experts", "2",
                                          "--first-dense", "0", "--no-norm-topk-prob"],
    "deepseek_v3_fp8_bf16": DEEPSEEK + ["--dtype", "bf16", "--q-lora", "48", "--groups", "4",
                                        "--topk-groups", "2", "--rope-scaling", "yarn",
                                        "--fp8-block", "16"],
    # gpt-oss: sinks, sliding (16 positions) and full layers in turn, biased attention, router and
    # experts, the SwiGLU clamped at 1.5 (random weights pass it), YaRN without truncation; the
    # 1,000-token prompt crosses the window many times over.
    "gpt_oss_f32": GPT_OSS + ["--dtype", "f32", "--rope-scaling", "yarn"] + LONG,
    "gpt_oss_bf16": GPT_OSS + ["--dtype", "bf16"],
    # Its experts in MXFP4, as gpt-oss ships them (transformers dequantizes them on the CPU).
    "gpt_oss_mxfp4_bf16": GPT_OSS + ["--dtype", "bf16", "--mxfp4"],
    "mixtral_f32": ["--arch", "mixtral", "--dtype", "f32", "--experts", "4", "--top-k", "2"],
    "mixtral_bf16": ["--arch", "mixtral", "--dtype", "bf16", "--experts", "8", "--top-k", "2",
                     "--kv-heads", "2"],
}
# Cases also run sharded (TP x PP, through the real process trees) against the same reference.
LAYOUTS = {"qwen3_f32": [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)],
           "qwen3_bias_bf16": [(1, 1), (2, 2)],
           "qwen3_moe_f32": [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)],
           "qwen3_moe_nonorm_bf16": [(1, 1), (2, 2)],
           "qwen3_fp8_f32": [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)],
           "qwen3_moe_fp8_bf16": [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)],
           "qwen3_fp8_128_f32": [(1, 1), (2, 1), (4, 1), (2, 2)],
           "llama_fp8_tensor_f32": [(1, 1), (2, 1), (1, 2)],
           "deepseek_v3_f32": [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)],
           "deepseek_v3_plain_bf16": [(1, 1), (2, 2)],
           "deepseek_v3_fp8_bf16": [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)],
           "gpt_oss_f32": [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)],
           "gpt_oss_bf16": [(1, 1), (2, 2)],
           "gpt_oss_mxfp4_bf16": [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]}
BASE = ["--layers", "3", "--hidden", "96", "--heads", "6", "--intermediate", "160", "--vocab",
        "600", "--seed", "7", "--max-position", "512"]
TEXTS = ["The model is too large for one machine.", "  two  spaces and\ttabs\nnew line",
         "Numbers 12345 and 3.14; cafe\u0301 caf\u00e9 na\u00efve \u00fcber \u4f60\u597d \U0001F600!",
         "<s>special in text</s> ok", "", "a"]
TIGHT = 1e-4
LOOSE = 0.25
# The KV cache in the model's dtype (kvCacheDtype auto: BF16, F16) and in FP8, against
# transformers in float32 (whose cache is float32): with BF16/F16 the greedy tokens are identical;
# every logprob (chosen and top 5) of the steps before the first token that differs (FP8 may
# choose another token where two are close) is within the dtype's bound.
# Seen (2026-11-30, every case): auto up to 1.2e-2 (gpt-oss); fp8 up to 0.11 on most, 0.26 (tied
# embeddings), 0.36 and 0.48 where an expert's routing flips (gpt-oss F32, Qwen3-MoE FP8).
KV_BOUNDS = {"auto": 0.05, "fp8": 0.6}


def kv_worst(got, want_tokens, want_lps):
    """The largest |dlogprob| of got's steps up to its first token unlike want_tokens'."""
    worst = 0.0
    for step, lp in enumerate(want_lps):
        worst = max(worst, abs(got["logprobs"][step] - float(lp[got["tokens"][step]])))
        for alt in got["top_logprobs"][step]:
            worst = max(worst, abs(alt["logprob"] - float(lp[alt["id"]])))
        if got["tokens"][step] != want_tokens[step]:
            break
    return worst


def run(cmd, env=None):
    p = subprocess.run(cmd, capture_output=True, text=True,
                       env=None if env is None else {**os.environ, **env})
    if p.returncode != 0:
        sys.exit(f"command failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr}")
    return p.stdout


def ours(binary, model, prompt_ids, max_tokens, tp=1, pp=1, kv="f32", extra=(), env=None):
    out = run([binary, "generate", "--model", model, "--prompt-ids",
               ",".join(map(str, prompt_ids)), "--max-tokens", str(max_tokens), "--logprobs", "5",
               "--ignore-eos", "--format", "json", "--kv-cache-dtype", kv] + list(extra) +
              (["--threads", "2"] if tp * pp == 1 else ["--tp", str(tp), "--pp", str(pp),
                                                          "--threads", "1"]), env)
    return json.loads(out)


def hf_greedy(model, prompt_ids, steps):
    ids = torch.tensor([prompt_ids])
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(ids).logits[0, -1].double()
            lp = torch.log_softmax(logits, dim=-1)
            tok = int(torch.argmax(lp))
            tokens.append(tok)
            logprobs.append(lp)
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    return tokens, logprobs


LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def tokenizer_variants(model_dir):
    """Yields (name, dir) for the generated tokenizer and Llama 3 / Qwen2 style variants."""
    yield "generated", model_dir
    path = os.path.join(model_dir, "tokenizer.json")
    with open(path) as f:
        tok = json.load(f)
    if not tok["pre_tokenizer"] or tok["pre_tokenizer"]["type"] != "Sequence":
        return
    original = json.dumps(tok)
    tok["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {"Regex": LLAMA3_REGEX}
    tok["model"]["ignore_merges"] = True
    with open(path, "w") as f:
        json.dump(tok, f)
    yield "llama3-style", model_dir
    tok["normalizer"] = {"type": "NFC"}
    tok["model"]["ignore_merges"] = False
    with open(path, "w") as f:
        json.dump(tok, f)
    yield "qwen2-style", model_dir
    with open(path, "w") as f:
        f.write(original)


def check_tokenizer(binary, model_dir):
    for name, d in tokenizer_variants(model_dir):
        check_tokenizer_variant(binary, d)
        print(f"tokenizer ({name}): {len([t for t in TEXTS if t])} texts encode exactly as "
              "`tokenizers` does")


def check_tokenizer_variant(binary, model_dir):
    hf = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    for text in TEXTS:
        if not text:
            continue
        out = json.loads(run([binary, "generate", "--model", model_dir, "--prompt", text,
                              "--max-tokens", "1", "--format", "json"]))
        want = hf.encode(text).ids
        if out["prompt_ids"] != want:
            sys.exit(f"tokenizer mismatch for {text!r}:\n ours {out['prompt_ids']}\n   hf {want}")


def kv_scaled_copy(model_dir, ref, prompts, out_dir):
    """A copy of the model whose checkpoint carries each layer's self_attn.k_scale and v_scale,
    computed as vLLM's calculate_kv_scales computes them (|keys| max / 200, |values| max / 100)
    over the prompts: a generated model's keys and values are far below 1, where E4M3 at scale 1
    (what a checkpoint without scales gets, as in vLLM) keeps few bits."""
    amax = {}
    hooks = []

    def track(layer, kind, cols=None):
        def hook(module, inputs, out):
            t = out if cols is None else out[..., cols]
            amax[(layer, kind)] = max(amax.get((layer, kind), 0.0), float(t.abs().max()))
        return hook

    for i, layer in enumerate(ref.model.layers):
        a = layer.self_attn
        if hasattr(a, "kv_a_layernorm"):  # MLA: the latent and the rotated key dims, k_scale
            rope = ref.config.qk_rope_head_dim
            hooks.append(a.kv_a_layernorm.register_forward_hook(track(i, "k")))
            hooks.append(a.kv_a_proj_with_mqa.register_forward_hook(
                track(i, "k", slice(-rope, None))))
        else:
            keys = a.k_norm if hasattr(a, "k_norm") else a.k_proj
            hooks.append(keys.register_forward_hook(track(i, "k")))
            hooks.append(a.v_proj.register_forward_hook(track(i, "v")))
    with torch.no_grad():
        for prompt in prompts:
            ref(torch.tensor([prompt]))
    for h in hooks:
        h.remove()
    tensors = {}
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(model_dir, name)))
    for (layer, kind), m in amax.items():
        tensors[f"model.layers.{layer}.self_attn.{kind}_scale"] = torch.tensor(
            max(m, 1e-6) / (200.0 if kind == "k" else 100.0), dtype=torch.float32)
    os.makedirs(out_dir)
    for name in os.listdir(model_dir):
        if not name.startswith("model.safetensors") and not name.endswith(".safetensors"):
            os.symlink(os.path.join(model_dir, name), os.path.join(out_dir, name))
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    return out_dir


MTP_MODELS = {}  # model_dir -> (its MTP layer's tensors, the model loaded with one layer more)


def mtp_predictions(model_dir, ref, ids):
    """DeepSeek-V3's multi-token prediction over `ids`, computed with transformers' own decoder
    layer (the checkpoint loaded with one layer more, the MTP layer's) as vLLM's DeepSeekMTP
    computes it: at position q, eh_proj([enorm(embed(ids[q + 1])), hnorm(h_q)]) (the embedding
    zero at position 0; h_q the model's final hidden state, after its norm), the decoder layer
    (causal over the positions), shared_head's norm and head. Returns the greedy token at each
    position q < len(ids) - 1: the MTP's guess for ids[q + 2]."""
    n = ref.config.num_hidden_layers
    p = f"model.layers.{n}."
    if model_dir not in MTP_MODELS:
        tensors = {}
        for name in os.listdir(model_dir):
            if name.endswith(".safetensors"):
                tensors.update({k: v.float() for k, v in
                                load_file(os.path.join(model_dir, name)).items() if k.startswith(p)})
        MTP_MODELS[model_dir] = (tensors, AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, num_hidden_layers=n + 1).float().eval())
    tensors, longer = MTP_MODELS[model_dir]
    layer = longer.model.layers[n]

    def rms(x, w):
        x64 = x.double()
        return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + ref.config.rms_norm_eps)
                ).float() * w

    with torch.no_grad():
        t = torch.tensor([ids])
        hidden = ref.model(t).last_hidden_state[0, :-1]
        pos = torch.arange(len(ids) - 1)
        emb = tensors[p + "embed_tokens.weight"][t[0, 1:]]
        emb[pos == 0] = 0
        x = torch.cat([rms(emb, tensors[p + "enorm.weight"]),
                       rms(hidden, tensors[p + "hnorm.weight"])], -1) @ tensors[p + "eh_proj.weight"].T
        x = x.unsqueeze(0)
        T = x.shape[1]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        out = layer(x, attention_mask=mask, position_ids=pos[None],
                    position_embeddings=longer.model.rotary_emb(x, pos[None]))
        out = out[0] if isinstance(out, tuple) else out
        logits = rms(out[0], tensors[p + "shared_head.norm.weight"]) @ \
            tensors[p + "shared_head.head.weight"].T
    return logits.argmax(-1).tolist()


def mtp_drafts(pred, prompt_len, tokens):
    """The drafts speculation with the MTP layer proposes (one a step) for output `tokens`:
    after a step whose last token is tokens[m - 1] (the m-th), the draft for the (m+1)-th is the
    MTP's guess at the position before it; a draft equal to the token that follows was kept (a
    greedy draft refused is never the token resampled after it), and a step is drafted for only
    while two more tokens fit in max_tokens."""
    drafts, m = [], 1
    while m <= len(tokens) - 2:
        d = pred[prompt_len + m - 2]
        drafts.append([d])
        m += 2 if d == tokens[m] else 1
    return drafts


def check_mtp(binary, model_dir, ref, prompts, steps, layouts):
    """Speculation with the checkpoint's MTP layer: greedy output identical to transformers',
    and every step's draft the one transformers' layer gives (so its KV cache, the hidden states
    it reads and the next tokens it is fed are right, across TP x PP and prompts fed 4 tokens a
    step, each chunk's last row reading the next chunk's first token); sampled at TP=2, the
    drafts follow the sampled tokens just as well."""
    drafted = kept = 0
    for prompt in prompts:
        want_tokens, _ = hf_greedy(ref, prompt, steps)
        pred = mtp_predictions(model_dir, ref, prompt + want_tokens)
        want = mtp_drafts(pred, len(prompt), want_tokens)
        for tp, pp in layouts:
            chunked = ["--max-step-tokens", "4"] if len(prompt) < 100 else []
            got = ours(binary, model_dir, prompt, steps, tp, pp,
                       extra=["--speculative", "mtp"] + chunked)
            if got["tokens"] != want_tokens:
                sys.exit(f"with MTP speculation the greedy tokens differ (prompt {prompt[:8]}..., "
                         f"TP={tp} PP={pp}):\n ours {got['tokens']}\n   hf {want_tokens}")
            if got["speculation"]["drafts"] != want:
                sys.exit(f"MTP drafts differ (prompt {prompt[:8]}..., TP={tp} PP={pp}):\n"
                         f" ours {got['speculation']['drafts']}\n   hf {want}")
            drafted += got["speculation"]["drafted"]
            kept += got["speculation"]["accepted"]
    prompt = prompts[1]
    got = ours(binary, model_dir, prompt, steps, 2, 1,
               extra=["--speculative", "mtp", "--temperature", "1", "--seed", "5"])
    pred = mtp_predictions(model_dir, ref, prompt + got["tokens"])
    want = mtp_drafts(pred, len(prompt), got["tokens"])
    if got["speculation"]["drafts"] != want:
        sys.exit(f"sampled with MTP at TP=2, the drafts are not the MTP layer's:\n"
                 f" ours {got['speculation']['drafts']}\n   hf {want}")
    shapes = ", ".join(f"TP={tp} PP={pp}" for tp, pp in layouts)
    print(f"MTP: greedy tokens identical with its drafts ({shapes}), each draft transformers' "
          f"(and sampled at TP=2); {kept} of {drafted} drafts kept")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shardserve", required=True)
    ap.add_argument("--case", required=True, choices=sorted(CASES))
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, args.case)
        run([args.shardserve, "gen-model", "--out", model_dir] + BASE + CASES[args.case])
        check_tokenizer(args.shardserve, model_dir)
        native_dtype = {"bf16": torch.bfloat16, "f16": torch.float16}.get(args.case[-4:].strip("_"))
        # An FP8 checkpoint's weights become the model's dtype (rounded once from the F32
        # product, in transformers and in shardserve alike), then compute in F32.
        ref32 = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=native_dtype if "fp8" in args.case and native_dtype else
            torch.float32).float().eval()
        native = (AutoModelForCausalLM.from_pretrained(model_dir, dtype=native_dtype).eval()
                  if native_dtype else None)
        # The kernel level that rounds BF16 weights' activations, for a BF16 model, where this
        # CPU has it (a CPU without AVX512-BF16 refuses it by name: skipped, said below).
        bf16_env = {"SHARDSERVE_CPU_KERNELS": "avx512bf16"}
        bf16_activations = False
        if native_dtype == torch.bfloat16:
            probe = subprocess.run([args.shardserve, "generate", "--model", model_dir,
                                    "--prompt-ids", "1", "--max-tokens", "1", "--format", "json"],
                                   capture_output=True, text=True, env={**os.environ, **bf16_env})
            if probe.returncode != 0 and "lacks AVX512-BF16" not in probe.stderr and \
                    "carries the portable kernels only" not in probe.stderr:
                sys.exit(f"SHARDSERVE_CPU_KERNELS=avx512bf16 failed otherwise:\n{probe.stderr}")
            bf16_activations = probe.returncode == 0
            # Where auto rounds the activations (AMD), the checks of F32 arithmetic below run
            # the widest F32 level; auto's own arithmetic is the bf16_activations check.
            if bf16_activations and cpu_kernels(args.shardserve, model_dir) == "avx512bf16":
                os.environ["SHARDSERVE_CPU_KERNELS"] = "avx512"
        act_worst, act_same = 0.0, []
        worst = 0.0
        kv_worsts = {kv: 0.0 for kv in KV_BOUNDS}
        layouts = LAYOUTS.get(args.case, [(1, 1)])
        prompts = [[1, 5, 9, 200, 33], list(range(3, 120, 3)), [1]]
        if "--max-position" in CASES[args.case]:  # a long prompt: 1,000 tokens
            prompts.append([(i * 37) % 599 + 1 for i in range(1000)])
        steps = 10
        scaled = kv_scaled_copy(model_dir, ref32, prompts, os.path.join(tmp, "kv-scaled"))
        for prompt in prompts:
            want_tokens, want_lps = hf_greedy(ref32, prompt, steps)
            native_lp = None
            if native is not None:
                with torch.no_grad():
                    native_lp = torch.log_softmax(
                        native(torch.tensor([prompt])).logits[0, -1].double(), -1)
            for tp, pp in layouts:
                got = ours(args.shardserve, model_dir, prompt, steps, tp, pp)
                kernels = got.get("cpu_kernels", "?")
                if got["tokens"] != want_tokens:
                    sys.exit(f"greedy tokens differ for prompt {prompt[:8]}... ({len(prompt)} "
                             f"tokens) at TP={tp} PP={pp}:\n"
                             f" ours {got['tokens']}\n   hf {want_tokens}")
                for step, lp in enumerate(want_lps):
                    d = abs(got["logprobs"][step] - float(lp[want_tokens[step]]))
                    worst = max(worst, d)
                    for alt in got["top_logprobs"][step]:
                        worst = max(worst, abs(alt["logprob"] - float(lp[alt["id"]])))
                    hf_top = torch.topk(lp, 5).indices.tolist()
                    ours_top = [a["id"] for a in got["top_logprobs"][step]]
                    if set(hf_top) != set(ours_top):
                        sys.exit(f"top-5 differs at step {step}: ours {ours_top} hf {hf_top}")
                if worst > TIGHT:
                    sys.exit(f"logprobs differ by {worst:.2e} > {TIGHT} (prompt {prompt[:8]}...)")
                if native_lp is not None:
                    d = abs(float(native_lp[got["tokens"][0]]) - got["logprobs"][0])
                    if d > LOOSE:
                        sys.exit(f"native-{native_dtype} logprob differs by {d:.3f} > {LOOSE}")
            # The KV cache in the model's dtype and in FP8, and the default kernels where they
            # round BF16 activations: the first and the longest prompt, at the largest layout.
            if prompt is not prompts[0] and len(prompt) < 1000:
                continue
            tp, pp = layouts[-1]
            if bf16_activations:
                got = ours(args.shardserve, model_dir, prompt, steps, tp, pp, env=bf16_env)
                act_worst = max(act_worst, kv_worst(got, want_tokens, want_lps))
                act_same.append(next((i for i, (a, b) in enumerate(zip(got["tokens"], want_tokens))
                                      if a != b), steps))
                if act_worst > BF16_ACTIVATIONS:
                    sys.exit(f"with activations rounded to BF16 (kernels avx512bf16) logprobs "
                             f"differ by {act_worst:.3f} > {BF16_ACTIVATIONS} (prompt "
                             f"{prompt[:8]}..., TP={tp} PP={pp})")
            for kv, bound in KV_BOUNDS.items():
                if kv == "auto" and native_dtype is None:
                    continue  # an F32 model's auto is F32, checked above
                got = ours(args.shardserve, scaled if kv == "fp8" else model_dir, prompt, steps,
                           tp, pp, kv)
                if kv == "auto" and got["tokens"] != want_tokens:
                    sys.exit(f"with the KV cache in {args.case[-4:]} the greedy tokens differ for "
                             f"prompt {prompt[:8]}... at TP={tp} PP={pp}:\n"
                             f" ours {got['tokens']}\n   hf {want_tokens}")
                kv_worsts[kv] = max(kv_worsts[kv], kv_worst(got, want_tokens, want_lps))
                if kv_worsts[kv] > bound:
                    sys.exit(f"with the KV cache in {kv} logprobs differ by {kv_worsts[kv]:.3f} > "
                             f"{bound} (prompt {prompt[:8]}..., TP={tp} PP={pp})")
        # The same model with its config.json as the reference venv's transformers saves it
        # (transformers 5's names: num_local_experts, rope_parameters, dtype): the same answer.
        resaved = os.path.join(tmp, "resaved")
        os.makedirs(resaved)
        for f in os.listdir(model_dir):
            if f != "config.json":
                os.symlink(os.path.join(model_dir, f), os.path.join(resaved, f))
        AutoConfig.from_pretrained(model_dir).save_pretrained(resaved)
        with open(os.path.join(model_dir, "config.json")) as f:
            before = set(json.load(f))
        with open(os.path.join(resaved, "config.json")) as f:
            renamed = sorted(before - set(json.load(f)))
        again = ours(args.shardserve, resaved, prompts[0], steps, 1, 1)
        want_tokens, _ = hf_greedy(ref32, prompts[0], steps)
        if again["tokens"] != want_tokens:
            sys.exit(f"with transformers' own config.json (without {renamed}) the greedy tokens "
                     f"differ:\n ours {again['tokens']}\n   hf {want_tokens}")
        if "--mtp" in CASES[args.case]:
            check_mtp(args.shardserve, model_dir, ref32, prompts, steps,
                      [(1, 1), layouts[-1], (1, 2)])
        shapes = ", ".join(f"TP={tp} PP={pp}" for tp, pp in layouts)
        longest = max(len(p) for p in prompts)
        print(f"{args.case}: greedy tokens identical to transformers on {len(prompts)} prompts "
              f"(up to {longest} tokens; {shapes}; CPU kernels {kernels}); "
              f"max |dlogprob| = {worst:.2e} (tolerance {TIGHT}); the same with the config "
              f"transformers saves (without {renamed}); KV cache "
              + ", ".join(f"{kv}{' (identical greedy tokens)' if kv == 'auto' else ''}: "
                          f"max |dlogprob| {w:.2e} (bound {KV_BOUNDS[kv]})"
                          for kv, w in kv_worsts.items()
                          if kv != "auto" or native_dtype is not None)
              + (f"; kernels avx512bf16 (BF16 activations): max |dlogprob| {act_worst:.2e} (bound "
                 f"{BF16_ACTIVATIONS}), greedy tokens identical for {act_same} of {steps} steps"
                 if bf16_activations else
                 "; kernels avx512bf16 skipped (this CPU or build lacks AVX512-BF16)"
                 if native_dtype == torch.bfloat16 else ""))


if __name__ == "__main__":
    main()
