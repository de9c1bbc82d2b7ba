#!/usr/bin/env python3
"""Schemas as apps write them, through `response_format`: each schema of a corpus is sent to a
`shardserve local` deployment of SmolLM2-135M-Instruct (temperature 0) as a chat completion's
json_schema, and the answer is parsed and validated with the `jsonschema` package (the schema's
own draft, its formats checked where the package knows them). Prints, per dataset and in all:
refused (a 400: the reason is printed), valid, invalid (goal: none), unfinished (max_tokens
reached before the value closed: the grammar was kept, the budget was not enough) and unchecked
(the validator itself cannot read the schema, e.g. a remote $ref).

  python3 bench/schemas.py build/bin/shardserve                 # bench/schemas/, ours
  python3 bench/schemas.py build/bin/shardserve --corpus DIR    # DIR/<dataset>/*.json

The default corpus is schemas of our own in the shapes JSONSchemaBench collects (its repository,
github.com/guidance-ai/jsonschemabench, states no licence, so none of its files are committed);
`--corpus` takes a checkout's `data/` (or a sample of it: `--per-dataset N` takes N files of each
dataset, evenly spaced in name order)."""
import argparse
import collections
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import referencing.exceptions

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "cli"))
from deployment import Deployment  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("binary")
parser.add_argument("--corpus", default=os.path.join(os.path.dirname(__file__), "schemas"))
parser.add_argument("--per-dataset", type=int, default=0, help="0: every file")
parser.add_argument("--max-tokens", type=int, default=384)
parser.add_argument("--tp", type=int, default=1)
args = parser.parse_args()

CACHE = os.environ.get("SHARDSERVE_CACHE", os.path.expanduser("~/.cache/shardserve"))
MODEL = os.path.join(CACHE, "models", "smollm2-135m-instruct")
if not os.path.exists(os.path.join(MODEL, "SmolLM2-135M-Instruct.Q4_1.gguf")):
    sys.exit(f"no SmolLM2 at {MODEL} (scripts/setup.sh fetches it)")


def corpus():
    """(dataset, name, schema) for each file; a dataset is a folder (the corpus itself when its
    files lie at its top)."""
    out = []
    for root, _, files in sorted(os.walk(args.corpus)):
        names = sorted(f for f in files if f.endswith(".json"))
        if args.per_dataset and len(names) > args.per_dataset:
            names = [names[i * len(names) // args.per_dataset] for i in range(args.per_dataset)]
        for name in names:
            with open(os.path.join(root, name), encoding="utf-8") as f:
                out.append((os.path.relpath(root, args.corpus), name, json.load(f)))
    return out


def validator(schema):
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def ask(d, item):
    dataset, name, schema = item
    # As apps ask: the schema in the prompt too (cut to fit the context), greedy decoding with a
    # mild repetition penalty (a 135M model otherwise loops inside free-form objects).
    text = json.dumps(schema)
    body = {"model": "smollm2", "max_tokens": args.max_tokens, "temperature": 0,
            "repetition_penalty": 1.1,
            "messages": [{"role": "user", "content": "Give a short example JSON document for "
                          f"this schema:\n{text[:1500]}"}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "s", "schema": schema, "strict": True}}}
    status, _, r = d.post("/v1/chat/completions", body, timeout=600)
    if status == 400:
        return dataset, name, "refused", r.get("error", {}).get("message", str(r))
    if status != 200:
        return dataset, name, "error", f"HTTP {status}: {str(r)[:200]}"
    choice = r["choices"][0]
    text = choice["message"]["content"] or ""
    if choice["finish_reason"] == "length":
        return dataset, name, "unfinished", text[:120]
    try:
        value = json.loads(text)
    except ValueError as e:
        return dataset, name, "invalid", f"not JSON ({e}): {text[:200]}"
    try:
        errors = list(validator(schema).iter_errors(value))
    except (referencing.exceptions.Unresolvable, jsonschema.SchemaError) as e:
        return dataset, name, "unchecked", f"{type(e).__name__}: {str(e)[:120]}"
    if errors:
        return dataset, name, "invalid", f"{errors[0].message[:200]} in {text[:200]}"
    return dataset, name, "valid", ""


items = corpus()
d = Deployment(args.binary, MODEL, name="smollm2", tp=args.tp, pp=1, max_batch=8, max_seq=2048)
try:
    t0 = time.time()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda item: ask(d, item), items))
    took = time.time() - t0
finally:
    d.stop()

KINDS = ["refused", "valid", "invalid", "unfinished", "unchecked", "error"]
by_set = collections.defaultdict(collections.Counter)
for dataset, _, kind, _ in results:
    by_set[dataset][kind] += 1
    by_set["all"][kind] += 1
print(f"{'dataset':<20}" + "".join(f"{k:>11}" for k in KINDS))
for dataset in sorted(by_set, key=lambda s: (s == "all", s)):
    print(f"{dataset:<20}" + "".join(f"{by_set[dataset][k]:>11}" for k in KINDS))
total = len(results)
print(f"{total} schemas in {took:.0f} s: {100 * by_set['all']['refused'] / max(total, 1):.1f} % "
      f"refused, {by_set['all']['invalid']} invalid")
for dataset, name, kind, why in results:
    if kind != "valid":
        print(f"  {kind:<10} {dataset}/{name}: {why}")
sys.exit(1 if by_set["all"]["invalid"] or by_set["all"]["error"] else 0)
