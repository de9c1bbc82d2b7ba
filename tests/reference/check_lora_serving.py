#!/usr/bin/env python3
"""LoRA adapters served (issue 54): a base model transformers made and adapters PEFT wrote on it
(peft from PyPI), declared in the manifest (spec.adapters) and run by `shardserve local`.

  * numerics: requests for three adapters (different ranks, targets, rsLoRA, rank and alpha
    patterns, some layers only) and for the base, sent at once so that their sequences share
    steps, each answer's greedy text and per-token log-probabilities equal to PEFT's greedy
    decoding with that adapter (the base: without one), at TP=1, TP=2 and TP=2 x PP=2; on a Qwen2
    base (q/k/v biases) at TP=2; on a GGUF base (Q8_0, as transformers dequantizes it) at TP=2;
  * the API: /v1/models lists each adapter with its parent; a request naming an adapter that is
    not there is a 404 naming it; the leader exports the adapters running and waiting
    (shardserve_lora_requests_info, vLLM's lora_requests_info form);
  * the prefix cache: a prompt cached under one adapter is not reused under another or the base
    (cached_tokens 0, and the answer still PEFT's), and is reused under the same adapter.

Tolerances as check_reference.py and check_gguf.py: 1e-4 on F32 weights (summation order),
2e-3 on Q8_0 (the activations' int16 blocks).

usage: check_lora_serving.py --shardserve path/to/shardserve"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "cli"))
from checks import Checks  # noqa: E402
from deployment import Deployment  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--shardserve", required=True)
args = p.parse_args()
BIN = args.shardserve
check = Checks()
tmp = tempfile.mkdtemp(prefix="shardserve-lora-serving-")
STEPS = 10
VOCAB = 512

ADAPTERS = {
    "sql": dict(r=8, lora_alpha=16, target_modules="all-linear"),
    "chat-qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "patterns": dict(r=16, lora_alpha=8, target_modules=["k_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"],
                     rank_pattern={"down_proj": 4}, alpha_pattern={"o_proj": 32},
                     layers_to_transform=[1, 2]),
}
# Prompts of different lengths (one past a decode batch, so that the prefill GEMM runs too).
PROMPTS = [[1, 17, 99, 4, 250, 31], [1] + [(37 * i + 11) % 500 + 2 for i in range(23)],
           [1, 300, 301, 302]]


def tokenizer_files(out):
    """A trained tokenizer of VOCAB ids (gen-model's), for the leader's API."""
    gen = os.path.join(tmp, "gen")
    if not os.path.isdir(gen):
        subprocess.run([BIN, "gen-model", "--out", gen, "--layers", "1", "--hidden", "64",
                        "--heads", "4", "--kv-heads", "2", "--intermediate", "64", "--vocab",
                        str(VOCAB)], check=True, capture_output=True)
    for f in os.listdir(gen):
        if f.startswith("tokenizer") or f == "special_tokens_map.json":
            shutil.copy(os.path.join(gen, f), out)


def make_base(kind):
    torch.manual_seed(0)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(
            hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=1024,
            torch_dtype="float32"))
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=1024,
        torch_dtype="float32"))


def write_adapters(base, prefix):
    """Each adapter PEFT makes on `base` (random A and B), saved; their directories."""
    dirs = {}
    for i, (name, options) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + i)
        model = get_peft_model(base, LoraConfig(init_lora_weights=False, **options),
                               adapter_name=name)
        d = os.path.join(tmp, f"{prefix}-{name}")
        model.save_pretrained(d, selected_adapters=[name])
        # save_pretrained puts a named adapter in a subdirectory of its name
        dirs[name] = os.path.join(d, name) if os.path.isdir(os.path.join(d, name)) else d
        base = model.unload()  # the base without the LoRA layers, for the next adapter
    return dirs


def peft_greedy(base, adapter_dir, ids):
    """PEFT's greedy tokens and the log-probability of each (the base alone: adapter_dir None)."""
    model = PeftModel.from_pretrained(base, adapter_dir) if adapter_dir else base
    model.eval()
    x = torch.tensor([ids])
    tokens, lps = [], []
    with torch.no_grad():
        for _ in range(STEPS):
            logits = model(x).logits[0, -1].double()
            lp = torch.log_softmax(logits, -1)
            t = int(torch.argmax(logits))
            tokens.append(t)
            lps.append(float(lp[t]))
            x = torch.cat([x, torch.tensor([[t]])], 1)
    if adapter_dir:
        model.unload()
    return tokens, lps


def references(base, dirs):
    want = {}
    for name in [None, *ADAPTERS]:
        for k, ids in enumerate(PROMPTS):
            want[(name, k)] = peft_greedy(base, dirs.get(name), ids)
    return want


def spec_yaml(dirs):
    lines = ["  adapters:"]
    for name, d in dirs.items():
        lines += [f"    - name: {name}", f"      uri: file://{d}"]
    lines += ["  lora:", "    maxLoras: 4", "    maxLoraRank: 16"]
    return "\n".join(lines) + "\n"


def ask(dep, model, ids, out, key):
    status, _, body = dep.post("/v1/completions", {
        "model": model, "prompt": ids, "max_tokens": STEPS, "temperature": 0, "logprobs": 0,
        "ignore_eos": True})
    out[key] = (status, body)


def served(dep, base_name, tokenizer, want, tol, what):
    """Every adapter's and the base's requests at once; each equal to PEFT's."""
    got, threads = {}, []
    for name in [None, *ADAPTERS]:
        for k, ids in enumerate(PROMPTS):
            t = threading.Thread(target=ask, args=(dep, name or base_name, ids, got, (name, k)))
            threads.append(t)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = []
    for key, (status, body) in got.items():
        tokens, lps = want[key]
        if status != 200:
            bad.append((key, status, body))
            continue
        choice = body["choices"][0]
        ours = choice["logprobs"]["token_logprobs"]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        worst = max(abs(a - b) for a, b in zip(ours, lps)) if len(ours) == len(lps) else 1e9
        if choice["text"] != text or worst > tol:
            bad.append((key, choice["text"], text, worst))
    check(not bad, f"{what}: the base's and {len(ADAPTERS)} adapters' requests at once, each "
                   f"greedy text and logprob within {tol} of PEFT's ({bad[:2]})")


def api_checks(dep, base_name):
    status, _, body = dep.request("GET", "/v1/models")
    models = {m["id"]: m for m in json.loads(body)["data"]}
    check(status == 200 and set(models) == {base_name, *ADAPTERS} and
          all(models[a].get("parent") == base_name for a in ADAPTERS),
          f"/v1/models lists the base and each adapter with its parent ({sorted(models)})")
    status, _, body = dep.post("/v1/completions", {"model": "no-such-adapter", "prompt": [1, 2],
                                                   "max_tokens": 2})
    check(status == 404 and "no-such-adapter" in json.dumps(body),
          f"an unknown adapter is a 404 naming it ({status} {str(body)[:200]})")


def exports(dep):
    """The leader's shardserve_lora_requests_info (vLLM's lora_requests_info form): 'sql' among
    the running adapters while a long request of it runs, none once it is done."""
    def info():
        return [ln for ln in dep.metrics_page().splitlines()
                if ln.startswith("shardserve_lora_requests_info{")]
    long = threading.Thread(target=dep.post, args=("/v1/completions", {
        "model": "sql", "prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0,
        "ignore_eos": True}))
    long.start()
    seen = []
    for _ in range(500):
        seen = info()
        if any('running_lora_adapters="sql"' in ln for ln in seen):
            break
    long.join()
    check(any('running_lora_adapters="sql"' in ln and 'max_lora="4"' in ln for ln in seen),
          f"while a request of 'sql' runs, the leader exports it running ({seen})")
    after = info()
    check(len(after) == 1 and 'running_lora_adapters=""' in after[0] and
          'waiting_lora_adapters=""' in after[0], f"one series, none running once done ({after})")


def cache_checks(dep, base_name, tokenizer, base, dirs):
    """A prompt of 24 tokens (one full block of 16) none sent before, under 'sql', then
    'chat-qv', the base and 'sql' again."""
    prompt = [1] + [(53 * i + 5) % 500 + 2 for i in range(23)]
    want = {name: peft_greedy(base, dirs[name], prompt) for name in ("sql", "chat-qv")}

    def cached(model):
        status, _, body = dep.post("/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": STEPS, "temperature": 0,
            "ignore_eos": True})
        return (body["usage"]["prompt_tokens_details"]["cached_tokens"], body["choices"][0]["text"]
                if status == 200 else None)
    first = cached("sql")
    other, base, again = cached("chat-qv"), cached(base_name), cached("sql")
    check(other[0] == 0 and base[0] == 0 and again[0] >= 16,
          f"a prefix cached under one adapter is reused by it alone (cached tokens: sql "
          f"{first[0]}, chat-qv {other[0]}, base {base[0]}, sql again {again[0]})")
    check(other[1] == tokenizer.decode(want["chat-qv"][0], skip_special_tokens=True) and
          again[1] == tokenizer.decode(want["sql"][0], skip_special_tokens=True),
          "and the answers after it are still each adapter's own")


def safetensors_base(kind, shapes):
    base = make_base(kind)
    base_dir = os.path.join(tmp, kind)
    base.save_pretrained(base_dir)
    tokenizer_files(base_dir)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    dirs = write_adapters(make_base(kind), kind)
    want = references(base, dirs)
    for tp, pp in shapes:
        what = f"{kind} TP={tp} x PP={pp}"
        dep = Deployment(BIN, base_dir, name=kind, tp=tp, pp=pp, spec=spec_yaml(dirs))
        try:
            served(dep, kind, tokenizer, want, 1e-4, what)
            if (kind, tp, pp) == ("llama", 2, 2):
                api_checks(dep, kind)
                exports(dep)
                cache_checks(dep, kind, tokenizer, base, dirs)
        finally:
            code = dep.stop()
            if code not in (0, None):
                print(dep.log()[-3000:])


def gguf_base():
    gguf_dir = os.path.join(tmp, "gguf")
    os.makedirs(gguf_dir)
    subprocess.run([BIN, "gen-model", "--out", os.path.join(gguf_dir, "model.gguf"), "--format",
                    "gguf", "--gguf-type", "q8_0", "--layers", "4", "--hidden", "128", "--heads",
                    "4", "--kv-heads", "2", "--intermediate", "256", "--vocab", str(VOCAB),
                    "--max-position", "1024"], check=True, capture_output=True)
    load = lambda: AutoModelForCausalLM.from_pretrained(  # noqa: E731
        gguf_dir, gguf_file="model.gguf", torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file="model.gguf")
    dirs = write_adapters(load(), "gguf")
    want = references(load(), dirs)
    dep = Deployment(BIN, gguf_dir, name="gguf", tp=2, pp=1, spec=spec_yaml(dirs))
    try:
        served(dep, "gguf", tokenizer, want, 2e-3, "GGUF Q8_0 base TP=2")
    finally:
        dep.stop()


safetensors_base("llama", [(1, 1), (2, 1), (2, 2)])
safetensors_base("qwen2", [(2, 1)])
gguf_base()
shutil.rmtree(tmp, ignore_errors=True)
check.finish()
