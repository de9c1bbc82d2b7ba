#!/usr/bin/env python3
"""LoRA adapters written by PEFT itself (peft from PyPI) on bases transformers made (Llama, Qwen2),
read by `shardserve inspect-adapter` (model/lora.h): every module PEFT holds, with its rank, its
sizes and its scaling as PEFT applies it (lora_alpha / r, or / sqrt(r) with use_rslora; per-module
ranks and alphas from rank_pattern and alpha_pattern; layers_to_transform), and its A and B
matrices (their sums and sums of squares); then what PEFT can write and shardserve does not run
(DoRA, modules_to_save, embedding LoRA, trained biases) refused by name.

usage: check_lora.py --shardserve path/to/shardserve"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "cli"))
from checks import Checks  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--shardserve", required=True)
args = p.parse_args()
check = Checks()
tmp = tempfile.mkdtemp(prefix="shardserve-lora-")

BASES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=256)),
}

ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all_rslora_patterns": dict(r=4, lora_alpha=16, target_modules="all-linear", use_rslora=True,
                                rank_pattern={"down_proj": 8, "model.layers.1.self_attn.q_proj": 2},
                                alpha_pattern={"o_proj": 32}),
    "some_layers": dict(r=6, lora_alpha=3, target_modules=["k_proj", "o_proj", "up_proj"],
                        layers_to_transform=[1]),
}

REFUSED = {
    "dora": (dict(r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True), "use_dora"),
    "modules_to_save": (dict(r=4, lora_alpha=8, target_modules=["q_proj"],
                             modules_to_save=["lm_head"]), "modules_to_save"),
    "embedding": (dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]),
                  "embedding LoRA"),
    "bias": (dict(r=4, lora_alpha=8, target_modules=["q_proj"], bias="all"), 'bias "all"'),
}


def inspect(base_dir, adapter_dir):
    r = subprocess.run([args.shardserve, "inspect-adapter", "--model", base_dir, "--adapter",
                        adapter_dir], capture_output=True, text=True)
    return r.returncode, (json.loads(r.stdout) if r.returncode == 0 else None), r.stderr


def peft_modules(model):
    """(layer, projection) -> (rank, in, out, scaling, A, B) as PEFT holds them."""
    out = {}
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A") or "default" not in module.lora_A:
            continue
        parts = name.split(".")
        layer = int(parts[parts.index("layers") + 1])
        a = module.lora_A["default"].weight.detach().double()
        b = module.lora_B["default"].weight.detach().double()
        out[(layer, parts[-1])] = (a.shape[0], a.shape[1], b.shape[0],
                                   module.scaling["default"], a, b)
    return out


for base_name, make_base in BASES.items():
    torch.manual_seed(0)
    base = make_base()
    base_dir = os.path.join(tmp, base_name)
    base.save_pretrained(base_dir)
    for adapter_name, options in ADAPTERS.items():
        torch.manual_seed(1)
        model = get_peft_model(make_base(), LoraConfig(init_lora_weights=False, **options))
        adapter_dir = os.path.join(tmp, f"{base_name}-{adapter_name}")
        model.save_pretrained(adapter_dir)
        want = peft_modules(model)
        code, got, err = inspect(base_dir, adapter_dir)
        what = f"{base_name} / {adapter_name}"
        check(code == 0, f"{what}: shardserve reads the adapter PEFT wrote {err.strip()}")
        if code != 0:
            continue
        mods = {(m["layer"], m["target"]): m for m in got["modules"]}
        check(set(mods) == set(want),
              f"{what}: the same {len(want)} modules ({sorted(set(mods) ^ set(want))[:4]})")
        bad = []
        for key, (rank, fan_in, fan_out, scaling, a, b) in want.items():
            m = mods.get(key)
            if m is None:
                continue
            ok = (m["rank"] == rank and m["in"] == fan_in and m["out"] == fan_out and
                  math.isclose(m["scale"], scaling, rel_tol=1e-6) and
                  math.isclose(m["a_sum"], a.sum().item(), rel_tol=1e-5, abs_tol=1e-6) and
                  math.isclose(m["a_sq"], (a * a).sum().item(), rel_tol=1e-5) and
                  math.isclose(m["b_sum"], b.sum().item(), rel_tol=1e-5, abs_tol=1e-6) and
                  math.isclose(m["b_sq"], (b * b).sum().item(), rel_tol=1e-5))
            if not ok:
                bad.append((key, m, (rank, fan_in, fan_out, scaling)))
        check(not bad, f"{what}: each module's rank, sizes, scaling and A, B as PEFT's "
                       f"({bad[:2]})")

    for refused_name, (options, words) in REFUSED.items():
        torch.manual_seed(1)
        model = get_peft_model(make_base(), LoraConfig(init_lora_weights=False, **options))
        adapter_dir = os.path.join(tmp, f"{base_name}-{refused_name}")
        model.save_pretrained(adapter_dir)
        code, _, err = inspect(base_dir, adapter_dir)
        check(code != 0 and words in err,
              f"{base_name} / {refused_name}: refused, naming {words!r} ({err.strip()[:200]})")
check.finish()
