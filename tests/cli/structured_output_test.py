#!/usr/bin/env python3
"""Structured output against the real SmolLM2-135M-Instruct served by `shardserve local` at TP=3:
200 chat requests over 10 JSON schemas (nested objects, arrays, enums, bounded numbers, required
and optional properties), at temperature 0 and 1, streamed and not, each answer parsed and
validated with the `jsonschema` package; vLLM's regex, Lark and choice extensions on
/v1/completions; grammars that do not compile are 400s naming the field. Prints the validity
figures and the leader's mask cost per token (shardserve_grammar_mask_seconds). Skips (77)
without the model file (scripts/setup.sh fetches it)."""
import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema

sys.path.insert(0, os.path.dirname(__file__))
from checks import Checks  # noqa: E402
from deployment import Deployment  # noqa: E402

BIN = sys.argv[1]
CACHE = os.environ.get("SHARDSERVE_CACHE", os.path.expanduser("~/.cache/shardserve"))
DIR = os.path.join(CACHE, "models", "smollm2-135m-instruct")
if not os.path.exists(os.path.join(DIR, "SmolLM2-135M-Instruct.Q4_1.gguf")):
    print(f"SKIP: no SmolLM2 at {DIR} (scripts/setup.sh fetches it)")
    sys.exit(77)
check = Checks()

S = lambda **kw: dict(kw)  # noqa: E731
SCHEMAS = [
    ("a person", S(type="object", properties={
        "name": S(type="string", maxLength=20), "age": S(type="integer", minimum=0, maximum=120)},
        required=["name", "age"], additionalProperties=False)),
    ("a colour", S(type="object", properties={
        "colour": S(enum=["red", "green", "blue", "yellow"]), "hex": S(type="string",
                                                                     pattern="^#[0-9a-f]{6}$")},
        required=["colour"], additionalProperties=False)),
    ("a shopping list", S(type="object", properties={
        "items": S(type="array", items=S(type="string", maxLength=12), minItems=1, maxItems=4)},
        required=["items"], additionalProperties=False)),
    ("a point", S(type="object", properties={
        "x": S(type="number", minimum=-10, maximum=10), "y": S(type="number", minimum=-10,
                                                               maximum=10)},
        required=["x", "y"], additionalProperties=False)),
    ("a book", S(type="object", properties={
        "title": S(type="string", maxLength=30),
        "author": S(type="object", properties={"first": S(type="string", maxLength=12),
                                               "last": S(type="string", maxLength=12)},
                    required=["last"], additionalProperties=False),
        "year": S(type="integer", minimum=1500, maximum=2030)},
        required=["title", "author"], additionalProperties=False)),
    ("a yes or no answer", S(type="object", properties={"answer": S(type="boolean"),
                                                        "confidence": S(type="integer", minimum=0,
                                                                        maximum=100)},
                             required=["answer", "confidence"], additionalProperties=False)),
    ("a weather report", S(type="object", properties={
        "city": S(type="string", maxLength=16), "temp_c": S(type="integer", minimum=-40,
                                                            maximum=50),
        "sky": S(enum=["sunny", "cloudy", "rain", "snow"])},
        required=["city", "temp_c", "sky"], additionalProperties=False)),
    ("a matrix of digits", S(type="object", properties={
        "rows": S(type="array", maxItems=3, items=S(type="array", maxItems=3,
                                                    items=S(type="integer", minimum=0,
                                                            maximum=9)))},
        required=["rows"], additionalProperties=False)),
    ("an order", S(type="object", properties={
        "id": S(type="integer", minimum=1, maximum=99999), "status": S(enum=["new", "paid",
                                                                              "sent"]),
        "lines": S(type="array", maxItems=3, items=S(
            type="object", properties={"sku": S(type="string", maxLength=8),
                                       "qty": S(type="integer", minimum=1, maximum=9)},
            required=["sku", "qty"], additionalProperties=False))},
        required=["id", "status", "lines"], additionalProperties=False)),
    ("a list of tags", S(type="array", items=S(type="string", maxLength=10), minItems=1,
                         maxItems=5)),
]
N = 200

d = Deployment(BIN, DIR, name="smollm2", tp=3, pp=1, max_batch=16, max_seq=2048)
try:
    def ask(i):
        name, schema = SCHEMAS[i % len(SCHEMAS)]
        temperature = 0.0 if i % 2 == 0 else 1.0
        stream = (i // 2) % 2 == 1
        body = {"model": "smollm2", "max_tokens": 256, "temperature": temperature, "seed": i,
                "messages": [{"role": "user", "content": f"Describe {name} as JSON."}],
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": f"s{i % len(SCHEMAS)}",
                                                    "schema": schema, "strict": True}}}
        if stream:
            body["stream"] = True
            status, events, done = d.stream("/v1/chat/completions", body, timeout=300)
            text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                           if e.get("choices"))
            finish = [e["choices"][0].get("finish_reason") for e in events if e.get("choices")]
            finish = next((f for f in reversed(finish) if f), None)
            ok = status == 200 and done
        else:
            status, _, r = d.post("/v1/chat/completions", body, timeout=300)
            ok = status == 200
            text = r["choices"][0]["message"]["content"] if ok else str(r)
            finish = r["choices"][0]["finish_reason"] if ok else None
        try:
            jsonschema.validate(json.loads(text), schema)
            valid = ok and finish == "stop"
        except (ValueError, jsonschema.ValidationError) as e:
            valid = False
            text += f"  <- {type(e).__name__}: {str(e)[:120]}"
        return i, valid, temperature, stream, text

    t0 = time.time()
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(ask, range(N)))
    took = time.time() - t0
    valid = [r for r in results if r[1]]
    for temp in (0.0, 1.0):
        for stream in (False, True):
            part = [r for r in results if r[2] == temp and r[3] == stream]
            print(f"temperature {temp}, {'streamed' if stream else 'whole'}: "
                  f"{sum(r[1] for r in part)}/{len(part)} valid")
    print(f"{len(valid)}/{N} answers valid against their schema in {took:.1f} s")
    for r in results:
        if not r[1]:
            print(f"  invalid #{r[0]} (schema {r[0] % len(SCHEMAS)}): {r[4][:300]!r}")
    check(len(valid) == N, f"every answer parses and validates ({len(valid)}/{N})")
    print("samples:", *[repr(r[4][:100]) for r in results[:10]], sep="\n  ")

    # The leader's mask cost, per token of a constrained sequence.
    page = d.metrics_page(d.metrics_ports[0])
    total = float(re.search(r'^shardserve_grammar_mask_seconds_sum\{[^}]*\} (\S+)', page,
                            re.M).group(1))
    count = float(re.search(r'^shardserve_grammar_mask_seconds_count\{[^}]*\} (\S+)', page,
                            re.M).group(1))
    check(count > 0, "the masks were measured")
    print(f"mask cost: {1e6 * total / max(count, 1):.1f} us per token over {count:.0f} tokens")

    # vLLM's extensions on /v1/completions (its older guided_* fields and structured_outputs).
    for field, value, pattern in [
            ("guided_regex", "[0-9]{3}-[0-9]{4}", r"[0-9]{3}-[0-9]{4}"),
            ("guided_grammar", 'start: "The answer is " ("yes" | "no") "."',
             r"The answer is (yes|no)\."),
            ("guided_choice", ["alpha", "beta", "gamma"], r"alpha|beta|gamma"),
            ("structured_outputs", {"regex": "[a-c]{4}"}, r"[a-c]{4}")]:
        for temperature in (0.0, 1.0):
            status, _, r = d.post("/v1/completions", {
                "model": "smollm2", "prompt": "Answer:", "max_tokens": 32, field: value,
                "temperature": temperature, "seed": 3})
            text = r["choices"][0]["text"] if status == 200 else r
            check(status == 200 and re.fullmatch(pattern, text) is not None
                  and r["choices"][0]["finish_reason"] == "stop",
                  f"{field} at temperature {temperature}: {text!r}")
    # Grammars that do not compile: a 400 naming the field and quoting llguidance.
    for body, param in [
            ({"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
             "response_format"),
            ({"guided_regex": "(unclosed"}, "guided_regex"),
            ({"guided_grammar": "start: ("}, "guided_grammar")]:
        status, _, r = d.post("/v1/chat/completions", {
            "model": "smollm2", "messages": [{"role": "user", "content": "x"}], **body})
        check(status == 400 and r["error"]["param"] == param,
              f"{param} that does not compile: 400 naming it ({status}, {r})")
    status, _, r = d.post("/v1/chat/completions", {"model": "smollm2", "max_tokens": 4,
                                                   "messages": [{"role": "user", "content": "hi"}]})
    check(status == 200, "the server still answers")
finally:
    d.stop()
check.finish()
