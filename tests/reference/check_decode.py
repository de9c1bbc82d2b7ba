#!/usr/bin/env python3
"""Text as Hugging Face `tokenizers` decodes it, through the real API: on generated SentencePiece
(byte fallback) and byte-level BPE models served by `shardserve local` (TP=2 x PP=2), greedy
completions from token-id prompts — non-streamed, and streamed then joined — equal
`tokenizers`' decode of the tokens `shardserve generate` produces for the same prompt, and so does
generate's own text. Random weights emit byte tokens freely, so the outputs hold bytes that form
no character (U+FFFD), which the check counts."""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "cli"))
from checks import Checks  # noqa: E402
from deployment import Deployment, gen_model  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

BIN = sys.argv[1]
PROMPTS = [[1, 3], [1, 5, 9], [1, 17, 42, 300], [1, 7], [1, 99, 100, 101], [1, 250, 4]]
check = Checks()

with tempfile.TemporaryDirectory() as tmp:
    for style in ("sentencepiece", "bytelevel"):
        model = os.path.join(tmp, style)
        gen_model(BIN, model, *(["--tokenizer", "sentencepiece"] if style == "sentencepiece"
                                else []))
        hf = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
        d = Deployment(BIN, model)
        try:
            replaced = 0
            for prompt in PROMPTS:
                gen = json.loads(subprocess.run(
                    [BIN, "generate", "--model", model, "--prompt-ids", ",".join(map(str, prompt)),
                     "--max-tokens", "32", "--ignore-eos", "--format", "json"],
                    check=True, capture_output=True, text=True).stdout)
                want = hf.decode(gen["tokens"], skip_special_tokens=True)
                replaced += want.count("\ufffd")
                check(gen["text"] == want, f"{style} {prompt}: generate's text is `tokenizers`' "
                      f"decode ({gen['text']!r} vs {want!r})")
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 32, "temperature": 0,
                        "ignore_eos": True}
                status, _, r = d.post("/v1/completions", body)
                got = r["choices"][0]["text"] if status == 200 else f"HTTP {status}: {r}"
                check(got == want, f"{style} {prompt}: the completion's text is `tokenizers`' "
                      f"decode ({got!r} vs {want!r})")
                status, events, done = d.stream("/v1/completions", dict(body, stream=True))
                joined = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
                check(status == 200 and done and joined == want,
                      f"{style} {prompt}: the streamed pieces join to it ({joined!r})")
            print(f"{style}: {replaced} U+FFFD in the expected texts (bytes that formed no "
                  "character)")
        finally:
            d.stop()
check.finish()
