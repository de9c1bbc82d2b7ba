"""The weights of a DeepSeek-V3 (deepseek2) or gpt-oss GGUF file as Hugging Face holds them, read
with llama.cpp's own Python package (gguf-py: its reader, its dequantizers, its table of which
tensor names each architecture has), undoing what llama.cpp's convert_hf_to_gguf.py does to them:

  * deepseek2: kv_b_proj is written as attn_k_b (each head's key rows, transposed: [H][kv_lora]
    [nope]) and attn_v_b (its value rows), or, in files converted before that, as one attn_kv_b;
    e_score_correction_bias is exp_probs_b.bias; the experts are stacked [E][out][in].
  * gpt-oss: gate_up_proj ([E][in][2 x out], gate and up interleaved) is written as
    ffn_gate_exps and ffn_up_exps ([E][out][in]), down_proj ([E][in][out]) transposed, the biases
    split likewise; sinks are attn_sinks.weight, the norm before the experts post_attention_norm.
    MXFP4 experts are ggml's MXFP4 blocks.

`hf_weights(path, names)` gives the Hugging Face tensors `names` (float32 numpy arrays) from the
file; `safetensors_weights(dir)` gives a model directory's, gpt-oss's MXFP4 experts dequantized
(E2M1 codes, the low nibble first, times 2^(scale - 127)) into the same fused layout. Equal
dictionaries mean the file holds the directory's weights where llama.cpp looks for them.
"""
import json
import os
import re

import numpy as np
import torch
from gguf import GGUFReader, MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES
from gguf import get_tensor_name_map
from gguf.quants import dequantize
from safetensors.torch import load_file

FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def safetensors_weights(model_dir):
    out = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            for k, v in load_file(os.path.join(model_dir, f)).items():
                out[k] = v.numpy() if v.dtype == torch.uint8 else v.float().numpy()
    for k in [k for k in out if k.endswith("_blocks")]:
        blocks, scales = out.pop(k), out.pop(k[:-len("_blocks")] + "_scales")
        codes = np.stack([blocks & 0xF, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
        vals = FP4[codes] * np.ldexp(1.0, scales.astype(np.int32) - 127)[..., None]
        out[k[:-len("_blocks")]] = vals.reshape(*vals.shape[:-2], -1).swapaxes(-1, -2)  # [E][in][out]
    return {k: np.asarray(v, dtype=np.float32) for k, v in out.items()}


def arch_of(reader):
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def tensor_names_of_arch(reader):
    """The file's tensor names that are not among llama.cpp's for its architecture."""
    arch = arch_of(reader)
    model_arch = next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch)
    blocks = int(reader.fields[f"{arch}.block_count"].parts[-1][0])
    allowed = set()
    for t in MODEL_TENSORS[model_arch]:
        for bid in range(blocks):
            allowed.add(TENSOR_NAMES[t].format(bid=bid))
    return [t.name for t in reader.tensors if t.name.rsplit(".", 1)[0] not in allowed]


def _values(t):
    """A tensor's float32 values, dimensions slowest first (numpy's order)."""
    data = dequantize(t.data, t.tensor_type)
    return np.asarray(data, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))


def hf_weights(path, names):
    reader = GGUFReader(path)
    arch = arch_of(reader)
    model_arch = MODEL_ARCH.DEEPSEEK2 if arch == "deepseek2" else MODEL_ARCH.GPT_OSS
    blocks = int(reader.fields[f"{arch}.block_count"].parts[-1][0])
    name_map = get_tensor_name_map(model_arch, blocks)
    tensors = {t.name: t for t in reader.tensors}
    got = lambda n: _values(tensors[n])  # noqa: E731
    out = {}
    for name in names:
        m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        bid, rest = (int(m.group(1)), m.group(2)) if m else (None, name)
        blk = f"blk.{bid}."
        if rest == "self_attn.kv_b_proj.weight":
            if blk + "attn_kv_b.weight" in tensors:
                out[name] = got(blk + "attn_kv_b.weight")
                continue
            k_b, v_b = got(blk + "attn_k_b.weight"), got(blk + "attn_v_b.weight")
            out[name] = np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1).reshape(
                -1, k_b.shape[1])
        elif e := re.match(r"mlp\.experts\.(\d+)\.(\w+)_proj\.weight", rest):
            out[name] = got(f"{blk}ffn_{e.group(2)}_exps.weight")[int(e.group(1))]
        elif rest == "mlp.gate.e_score_correction_bias":
            out[name] = got(blk + "exp_probs_b.bias")
        elif rest in ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"):
            suffix = "weight" if rest.endswith("proj") else "bias"
            gate, up = got(f"{blk}ffn_gate_exps.{suffix}"), got(f"{blk}ffn_up_exps.{suffix}")
            both = np.stack([gate, up], axis=2).reshape(gate.shape[0], -1, *gate.shape[2:])
            out[name] = both.swapaxes(1, 2) if suffix == "weight" else both
        elif rest == "mlp.experts.down_proj":
            out[name] = got(blk + "ffn_down_exps.weight").swapaxes(1, 2)
        elif rest == "mlp.experts.down_proj_bias":
            out[name] = got(blk + "ffn_down_exps.bias")
        else:
            hf = name + ".weight" if rest == "self_attn.sinks" else name
            gguf_name = name_map.get_name(hf, try_suffixes=(".weight", ".bias"))
            if gguf_name is None or gguf_name not in tensors:
                raise KeyError(f"{name}: no tensor where llama.cpp's names put it ({gguf_name})")
            out[name] = got(gguf_name)
    return out


def config_without_quantization(model_dir, out_dir):
    """config.json for float32 weights in out_dir (the tokenizer files beside it)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    for name in os.listdir(model_dir):
        if name.startswith("tokenizer") or name == "generation_config.json":
            with open(os.path.join(model_dir, name), "rb") as src, \
                    open(os.path.join(out_dir, name), "wb") as dst:
                dst.write(src.read())
