#!/usr/bin/env python3
"""The peer of `shardserve bench cuda`: PyTorch + transformers decoding the same model directory
on the same GPU, in BF16, at the same batch sizes, prompt length and step count — eager
`generate`, then (where it works) a static KV cache, with which transformers runs the decoding
step through `torch.compile`. Prints one line per mode
and batch in the form bench/cuda.sh compares:
  peer <mode> batch <B>: <tokens/s> tokens/s, inter-token latency <ms> ms
Usage: cuda_peer.py MODEL_DIR [--batch 1,32] [--steps 64] [--prompt-tokens 128] [--no-compile]"""
import argparse
import sys
import time

import torch
from transformers import AutoModelForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--batch", default="1,32")
ap.add_argument("--steps", type=int, default=64)
ap.add_argument("--prompt-tokens", type=int, default=128)
ap.add_argument("--no-compile", action="store_true")
args = ap.parse_args()

model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
vocab = model.config.vocab_size


def prompt(batch):
    # The token pattern of `shardserve bench cuda`.
    return torch.tensor([[(s * 7919 + i * 104729) % vocab for i in range(args.prompt_tokens)]
                         for s in range(batch)], device="cuda")


def timed(ids, new_tokens, **kw):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kw)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure(mode, batch, **kw):
    ids = prompt(batch)
    timed(ids, 4, **kw)  # warm-up (and compilation)
    timed(ids, 4, **kw)
    # Decode time per step: the difference of two runs, so the prefill cancels out.
    short = min(timed(ids, 1, **kw) for _ in range(3))
    full = min(timed(ids, args.steps + 1, **kw) for _ in range(2))
    step = (full - short) / args.steps
    print(f"peer {mode} batch {batch}: {batch / step:.1f} tokens/s, inter-token latency "
          f"{step * 1e3:.2f} ms", flush=True)


with torch.inference_mode():
    batches = [int(b) for b in args.batch.split(",")]
    for b in batches:
        measure("eager", b)
    if not args.no_compile:
        # transformers compiles the decoding forward itself when the cache is static.
        for b in batches:
            try:
                measure("compiled-static", b, cache_implementation="static")
            except Exception as e:  # a peer mode that does not run here is reported, not fatal
                print(f"peer compiled-static batch {b}: did not run: {type(e).__name__}: "
                      f"{str(e)[:300]}", file=sys.stderr, flush=True)
