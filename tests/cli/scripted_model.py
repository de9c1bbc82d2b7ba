"""A model that writes what a test needs: the weights of a small Qwen2 model (gen-model --arch
qwen2 --hidden 128 --heads 2 --kv-heads 2 --dtype f32) set by hand so that greedy decoding after a
prompt writes a given sequence of tokens, as a reasoning model writes its thought and its answer.
A random model never closes a <think> block or opens gpt-oss's analysis channel; this one does,
through the same kernels, sharding and parsers as any model (and transformers reads it alike).

How: each token of the script has an embedding of its own (a basis vector) and the output head
maps it to the token after it (a bigram model: the attention and MLP of both layers add nothing,
but for one head). A token followed by two different tokens (gpt-oss's <|channel|> by `analysis`
first, by `final` later) is told apart by that head: it attends only to the script's marker token
(a high score from a constant query to the marker's key) and so writes "the marker was seen" into
the residual, which favours the later successor. Everything else in the vocabulary embeds in
dimensions no weight reads."""
import json
import os
import subprocess

import numpy as np
from safetensors.numpy import load_file, save_file

HIDDEN, HEAD_DIM = 128, 64
IND, SEEN = 62, 63          # the marker's own dimension; "the marker was seen"
ALPHA, DELTA, BETA = 4.0, 1.0, 2.0  # bigram weight; the later successor's handicap and boost


def gen_scripted(binary, out, chat_template, words):
    """A model of the size script_model needs, its tokenizer trained on `words` (one per line,
    repeated) so that each becomes a token of its own."""
    corpus = out + ".corpus"
    os.makedirs(os.path.dirname(corpus) or ".", exist_ok=True)
    with open(corpus, "w") as f:
        f.write("\n".join(list(words) * 30) + "\n")
    subprocess.run([binary, "gen-model", "--out", out, "--arch", "qwen2", "--hidden", str(HIDDEN),
                    "--heads", "2", "--kv-heads", "2", "--layers", "2", "--dtype", "f32",
                    "--corpus", corpus, "--chat-template", chat_template], check=True,
                   capture_output=True)


def script_model(model_dir, script, marker=None, eos=None):
    """Rewrites model_dir's weights so that after a prompt ending in script[0], greedy decoding
    writes script[1:] and then `eos` (the model's first end id by default). script: token ids;
    marker: the index in script of a token that occurs once, from which on a repeated token
    takes its later successor."""
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    if (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["num_hidden_layers"], cfg["model_type"]) != (HIDDEN, 2, 2, 2, "qwen2"):
        raise ValueError("script_model needs gen-model --arch qwen2 --hidden 128 --heads 2 "
                         "--kv-heads 2 --layers 2 --dtype f32")
    if eos is None:
        gen = json.load(open(os.path.join(model_dir, "generation_config.json")))
        eos = gen["eos_token_id"][0] if isinstance(gen["eos_token_id"], list) \
            else gen["eos_token_id"]
    steps = list(zip(script, script[1:] + [eos]))
    tokens = list(dict.fromkeys(script))
    if len(tokens) > IND:
        raise ValueError(f"a script of at most {IND} distinct tokens")
    if marker is not None and script.count(script[marker]) != 1:
        raise ValueError("the marker must occur once in the script")
    # Each token's successors: one, or two told apart by the marker (before it, from it on).
    after = {}
    for i, (cur, nxt) in enumerate(steps):
        seen = marker is not None and i >= marker
        before_marker, from_marker = after.setdefault(cur, (set(), set()))
        (from_marker if seen else before_marker).add(nxt)
    path = os.path.join(model_dir, "model.safetensors")
    w = load_file(path)
    if w["lm_head.weight"].dtype != np.float32:
        raise ValueError("script_model needs an f32 model (gen-model --dtype f32)")
    vocab = w["lm_head.weight"].shape[0]
    rng = np.random.default_rng(0)
    embed = np.zeros((vocab, HIDDEN), np.float32)
    others = rng.standard_normal((vocab, HIDDEN - 64)).astype(np.float32)
    embed[:, 64:] = others / np.linalg.norm(others, axis=1, keepdims=True)
    head = np.zeros((vocab, HIDDEN), np.float32)
    for j, t in enumerate(tokens):
        embed[t] = 0
        embed[t, j] = 1
    for t, (before_marker, from_marker) in after.items():
        j = tokens.index(t)
        if before_marker and from_marker and before_marker != from_marker:
            if len(before_marker) != 1 or len(from_marker) != 1:
                raise ValueError(f"token {t} has more than two successors")
            (first,), (later,) = before_marker, from_marker
            head[first, j] += ALPHA
            head[later, j] += ALPHA - DELTA
            head[later, SEEN] += BETA
        else:
            nexts = before_marker | from_marker
            if len(nexts) != 1:
                raise ValueError(f"token {t} has two successors the marker does not tell apart")
            head[next(iter(nexts)), j] += ALPHA
    for name, value in w.items():
        if ".layers." in name and not name.endswith("layernorm.weight"):
            value[...] = 0
        elif name.endswith("norm.weight"):
            value[...] = 1
    if marker is not None:
        embed[script[marker], IND] = 1
        a = "model.layers.0.self_attn."
        # A constant query on the slowest rotary pair (its angle barely turns over the context)
        # and a key only the marker has: score 8 * (4 * 8) / sqrt(64) = 32 on the marker, 0
        # elsewhere, so the head reads the marker's value (1) wherever the marker went before.
        w[a + "q_proj.bias"][HEAD_DIM // 2 - 1] = 8.0
        w[a + "k_proj.weight"][HEAD_DIM // 2 - 1, IND] = 4.0
        w[a + "v_proj.weight"][0, IND] = 1.0 / 8
        w[a + "o_proj.weight"][SEEN, 0] = 1.0
    w["model.embed_tokens.weight"] = embed
    w["lm_head.weight"] = head
    save_file(w, path, metadata={"format": "pt"})


def transformers_writes(model_dir, prompt_ids, n):
    """What transformers' greedy decoding writes after prompt_ids (n tokens at most)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt_ids):].tolist()
