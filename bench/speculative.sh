#!/usr/bin/env bash
# Speculative decoding at batch 1 on a real model: SmolLM2-135M-Instruct in BF16 (the Q4_1 GGUF
# that setup fetches, dequantized by transformers' GGUF loader into safetensors) decoding greedily
# without speculation, with n-gram prompt lookup and with its own Q4_1 GGUF as the draft model,
# each through the rank runtime (`shardserve generate --speculative`, one rank on THREADS
# threads), on an editing prompt (the answer copies the prompt: n-gram's workload) and an open
# question. Prints tokens/s over the whole generation (prefill included), the speedup over no
# speculation, the drafts kept, and whether the text is the same. Usage:
# bench/speculative.sh [THREADS] [TOKENS] [DRAFTED]
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS="${1:-2}"
TOKENS="${2:-160}"
DRAFTED="${3:-4}"
bash scripts/setup.sh
bash scripts/build.sh
CACHE="${SHARDSERVE_CACHE:-$HOME/.cache/shardserve}"
GGUF="$CACHE/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
DIR=build/bench-models/smollm2-135m-instruct-bf16
if [ ! -f "$DIR/model.safetensors" ]; then
  "$CACHE/refvenv/bin/python" - "$GGUF" "$DIR" <<'EOF'
import json, os, sys
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = sys.argv[1], sys.argv[2]
src, name = os.path.dirname(gguf), os.path.basename(gguf)
model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.bfloat16)
os.makedirs(out, exist_ok=True)
weights = {k: v.contiguous() for k, v in model.state_dict().items()}
if model.config.tie_word_embeddings:
    weights.pop("lm_head.weight", None)
save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(out)
config = model.config.to_dict()
config.pop("quantization_config", None)
config["architectures"] = ["LlamaForCausalLM"]
config["torch_dtype"] = "bfloat16"
with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(config, f, indent=1)
EOF
fi
python3 - "$DIR" "$GGUF" "$THREADS" "$TOKENS" "$DRAFTED" <<'EOF'
import json, subprocess, sys
model, gguf, threads, tokens, drafted = sys.argv[1:6]
def chat(text):
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = {
    "edit": chat("Fix the typo in this paragraph and write out the corrected paragraph in full:\n\n"
                 "The Kubernetes scheduler watches for newly created pods that have no node "
                 "assigned. For every pod that the scheduler discovers, the scheduler becomes "
                 "responsible for finding the best node for that pod to run on. The scheduler "
                 "reaches this placement decision taking into acount the scheduling principles "
                 "described below. Nodes that meet the scheduling requirements for a pod are "
                 "called feasible nodes; if none of the nodes are suitable, the pod remains "
                 "unscheduled until the scheduler is able to place it.\n"),
    "question": chat("Explain how a hash map works, in a few paragraphs."),
}
METHODS = [("none", []), ("ngram", []), ("draft", ["--draft-model", gguf])]
print(f"SmolLM2-135M-Instruct BF16, batch 1, greedy, {threads} threads, up to {tokens} tokens, "
      f"{drafted} drafted a step")
print(f"{'prompt':9} {'method':6} {'tokens':>6} {'tok/s':>7} {'speedup':>7} {'kept':>11} same")
for name, prompt in PROMPTS.items():
    base = None
    for method, extra in METHODS:
        cmd = ["build/bin/shardserve", "generate", "--model", model, "--prompt", prompt,
               "--max-tokens", tokens, "--format", "json", "--threads", threads,
               "--speculative", method, "--speculative-tokens", drafted] + extra
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        n = len(r["tokens"])
        rate = n / r["timing"]["seconds"]
        base = base or (rate, r["tokens"])
        spec = r.get("speculation") or {}
        kept = (f"{spec['accepted']}/{spec['drafted']}" if spec.get("drafted") else "-")
        print(f"{name:9} {method:6} {n:6} {rate:7.2f} {rate / base[0]:6.2f}x {kept:>11} "
              f"{'yes' if r['tokens'] == base[1] else 'NO'}")
EOF
