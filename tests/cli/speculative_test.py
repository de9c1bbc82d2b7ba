#!/usr/bin/env python3
"""Speculative decoding through the real binaries. `shardserve generate --speculative ngram`
(prompt lookup) at TP 1 x PP 1 and TP 2 x PP 2 gives exactly the greedy tokens (and the target's
logprobs and alternatives) of decoding without it, on Llama and Mixtral, while drafts are verified
and kept (the generated models repeat themselves); so does `--speculative draft` with a Q4_K GGUF
of the same model as the draft; sampled decoding with drafts runs to its length. `shardserve
local` with spec.serving.speculative drafts for a request (the leader's drafted and accepted
counters move), answers as a request that opted out ("speculative": false, which drafts nothing),
stops at the same stop string, and under a JSON schema drafts what the grammar allows and still
answers as the request that opted out."""
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from checks import Checks, small_models  # noqa: E402
from deployment import Deployment, gen_model  # noqa: E402

BIN = sys.argv[1]
TOL = 1e-4
check = Checks()


def generate(model, extra, tokens=160):
    cmd = [BIN, "generate", "--model", model, "--prompt-ids", "1,17,42,300,7,99,5,8",
           "--max-tokens", str(tokens), "--ignore-eos", "--logprobs", "2", "--format", "json",
           "--threads", "2"] + extra
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        check(False, f"generate {' '.join(extra)} ran: {r.stderr[-600:]}")
        return None
    return json.loads(r.stdout)


def top_ids(result):
    return [[a["id"] for a in step] for step in result["top_logprobs"]]


with tempfile.TemporaryDirectory() as tmp:
    models = small_models(BIN, tmp, "bf16")
    for arch in ("llama", "mixtral"):
        want = generate(models[arch], [])
        for tp, pp in ((1, 1), (2, 2)):
            got = generate(models[arch], ["--tp", str(tp), "--pp", str(pp), "--speculative",
                                          "ngram", "--speculative-tokens", "4"])
            if not want or not got:
                continue
            spec = got["speculation"]
            d = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"]))
            print(f"{arch} tp {tp} pp {pp}: {spec['accepted']} of {spec['drafted']} drafts kept")
            check(got["tokens"] == want["tokens"] and d <= TOL and top_ids(got) == top_ids(want),
                  f"{arch} tp {tp} pp {pp}: the greedy tokens of plain decoding, logprobs within "
                  f"{d:.1e} <= {TOL}, the same alternatives")
            check(0 < spec["accepted"] <= spec["drafted"],
                  f"{arch} tp {tp} pp {pp}: drafts were verified and kept ({spec})")
    # A draft model: the model's own Q4_K GGUF drafting for its BF16 safetensors.
    shape = ["--layers", "3", "--hidden", "256", "--heads", "4", "--kv-heads", "2",
             "--intermediate", "512", "--vocab", "401"]
    target, draft = os.path.join(tmp, "target"), os.path.join(tmp, "draft.gguf")
    subprocess.run([BIN, "gen-model", "--out", target] + shape, check=True, capture_output=True)
    subprocess.run([BIN, "gen-model", "--out", draft, "--format", "gguf", "--gguf-type", "q4_k"]
                   + shape, check=True, capture_output=True)
    want = generate(target, [])
    for tp, pp in ((1, 1), (2, 2)):
        got = generate(target, ["--tp", str(tp), "--pp", str(pp), "--speculative", "draft",
                                "--draft-model", draft])
        if want and got:
            spec = got["speculation"]
            print(f"draft model, tp {tp} pp {pp}: {spec['accepted']} of {spec['drafted']} kept")
            check(got["tokens"] == want["tokens"] and 0 < spec["accepted"] < spec["drafted"],
                  f"draft model, tp {tp} pp {pp}: the greedy tokens of plain decoding, some "
                  f"drafts kept and some refused ({spec})")
    sampled = generate(models["llama"], ["--tp", "2", "--pp", "2", "--speculative", "ngram",
                                         "--temperature", "0.3", "--seed", "5"])
    if sampled:
        check(len(sampled["tokens"]) == 160 and sampled["speculation"]["drafted"] > 0,
              f"sampled decoding with drafts runs to its length ({sampled['speculation']})")
    bad = subprocess.run([BIN, "generate", "--model", models["llama"], "--prompt-ids", "1,2",
                          "--speculative", "eagle"], capture_output=True, text=True)
    check(bad.returncode != 0 and "--speculative 'eagle' must be none, ngram, draft or mtp" in bad.stderr,
          f"an unknown method is refused by name ({bad.stderr.strip()[-80:]})")
    # mtp: the checkpoint's own layer, one draft a step (reference.deepseek_v3_f32 checks its
    # drafts against transformers); a model without the layer, or more tokens, refused by name.
    for extra, why in ((["--speculative", "mtp"], "multi-token-prediction layer"),
                       (["--speculative", "mtp", "--speculative-tokens", "2"],
                        "--speculative mtp drafts 1 token a step")):
        bad = subprocess.run([BIN, "generate", "--model", models["llama"], "--prompt-ids", "1,2",
                              *extra], capture_output=True, text=True)
        check(bad.returncode != 0 and why in bad.stderr,
              f"{' '.join(extra)} on Llama is refused by name ({bad.stderr.strip()[-100:]})")

    # --- serving ----------------------------------------------------------------------------
    model = os.path.join(tmp, "served")
    gen_model(BIN, model, "--arch", "llama")
    d = Deployment(BIN, model, tp=2, pp=2,
                   serving={"speculative": "{method: ngram, tokens: 4}"})

    def counters():
        page = d.metrics_page(d.metrics_ports[0])
        def value(name):
            m = re.search(r"^" + name + r"\{[^}]*\} (\S+)", page, re.M)
            return float(m.group(1)) if m else None
        return (value("shardserve_spec_decode_draft_tokens_total"),
                value("shardserve_spec_decode_accepted_tokens_total"))

    def ask(**extra):
        body = {"model": "tiny", "prompt": "one two three one two three one two", "max_tokens": 120,
                "temperature": 0, "logprobs": 1, "ignore_eos": True}
        body.update(extra)
        status, _, r = d.post("/v1/completions", body)
        assert status == 200, r
        return r["choices"][0]

    try:
        before = counters()
        plain = ask(speculative=False)
        after_plain = counters()
        check(before[0] is not None and after_plain == before,
              f"a request that opts out drafts nothing ({before} -> {after_plain})")
        drafted = ask()
        after = counters()
        print(f"served: {after[1] - after_plain[1]:.0f} of {after[0] - after_plain[0]:.0f} "
              "drafts kept")
        check(after[0] > after_plain[0] and after[1] > after_plain[1],
              f"a request drafts and keeps drafts ({after_plain} -> {after})")
        lp = [abs(a - b) for a, b in zip(plain["logprobs"]["token_logprobs"],
                                         drafted["logprobs"]["token_logprobs"])]
        check(drafted["text"] == plain["text"] and max(lp) <= 1e-3,
              f"the speculative answer is the plain one (logprobs within {max(lp):.1e})")
        # A stop string in the middle of the answer: both stop there.
        text = plain["text"]
        stop = text[len(text) // 2:len(text) // 2 + 6]
        if stop.strip():
            a, b = ask(stop=[stop], speculative=False), ask(stop=[stop])
            check(a["text"] == b["text"] and a["finish_reason"] == b["finish_reason"] == "stop",
                  f"a stop string ends both answers at the same place ({b['text'][-20:]!r})")
        # Structured output: drafts the grammar allows, each row sampled under the grammar past
        # the drafts before it; the answer is the plain one and follows the schema.
        schema = {"type": "array", "minItems": 4, "maxItems": 8,
                  "items": {"type": "object", "required": ["a"], "additionalProperties": False,
                            "properties": {"a": {"type": "boolean"}}}}
        shaped = {"response_format": {"type": "json_schema",
                                      "json_schema": {"name": "a", "schema": schema}},
                  "ignore_eos": False, "max_tokens": 200}
        before = counters()
        a, b = ask(speculative=False, **shaped), ask(**shaped)
        after = counters()
        print(f"structured: {after[1] - before[1]:.0f} of {after[0] - before[0]:.0f} drafts kept")
        value = json.loads(b["text"])
        check(a["text"] == b["text"] and isinstance(value, list) and len(value) >= 4 and
              b["finish_reason"] == "stop",
              f"under a grammar the speculative answer is the plain one ({b['text'][:40]!r})")
        check(after[1] > before[1], f"drafts under a grammar are kept ({before} -> {after})")
        sampled = dict(shaped, temperature=1.0, seed=5)
        b = ask(**sampled)
        check(isinstance(json.loads(b["text"]), list) and b["finish_reason"] == "stop",
              f"sampled under a grammar with drafts, the answer follows it ({b['text'][:40]!r})")
    finally:
        d.stop()

check.finish()
