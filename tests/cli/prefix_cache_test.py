#!/usr/bin/env python3
"""Automatic prefix caching through `shardserve local` at TP=2 x PP=2, on a generated model and on
a GGUF one: a prompt sent again, and another with the same start, skip the prefill of the cached
blocks (usage.prompt_tokens_details.cached_tokens, the leader's prefix-cache metrics) and answer
as the uncached request did (tokens equal, logprobs within float tolerance);
spec.serving.prefixCaching: false caches nothing. Tenants (issue 49): with
spec.serving.prefixCacheIsolation perKey one API key's cached prompt is not cached for another key
(cached_tokens 0), and is for the same key; a request's cache_salt shares only with that salt;
the leader's KV events refuse an API key."""
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from checks import Checks  # noqa: E402
from deployment import Deployment, gen_model  # noqa: E402

BIN = sys.argv[1]
check = Checks()
tmp = tempfile.mkdtemp(prefix="shardserve-prefix-")
SYSTEM = " ".join(f"rule {i}: answer briefly and cite the rule number." for i in range(30))


def ask(d, prompt, key=None, **extra):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1,
            "ignore_eos": True}
    body.update(extra)
    headers = {"Authorization": f"Bearer {key}"} if key else None
    status, _, r = d.post("/v1/completions", body, headers=headers)
    assert status == 200, r
    c = r["choices"][0]
    return (c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"],
            r["usage"]["prompt_tokens"], r["usage"]["prompt_tokens_details"]["cached_tokens"])


def close(a, b):
    return len(a) == len(b) and all(abs(x - y) <= 1e-3 for x, y in zip(a, b))


for name, extra in [("safetensors", []), ("gguf", ["--format", "gguf", "--gguf-type", "q8_0"])]:
    model = os.path.join(tmp, name + (".gguf" if extra else ""))
    gen_model(BIN, model, "--arch", "llama", *extra)
    for caching in (True, False):
        d = Deployment(BIN, model, tp=2, pp=2,
                       serving=None if caching else {"prefixCaching": "false"})
        try:
            first = ask(d, SYSTEM + " Question one?")
            again = ask(d, SYSTEM + " Question one?")
            other = ask(d, SYSTEM + " A second question, longer?")
            fresh = ask(d, "Something else entirely. " + SYSTEM)
            label = f"{name}, caching {'on' if caching else 'off'}"
            check(first[3] == 0 and fresh[3] == 0, f"{label}: a new prefix is computed whole")
            if caching:
                check(again[3] >= again[2] - 16 and again[3] % 16 == 0 and again[3] > 0,
                      f"{label}: the same prompt again takes all its full blocks but the last "
                      f"token's ({again[3]} of {again[2]} cached)")
                check(0 < other[3] < other[2], f"{label}: a prompt with the same start takes "
                      f"the shared blocks ({other[3]} of {other[2]})")
                page = d.metrics_page(d.metrics_ports[0])
                hit = float(re.search(r"^shardserve_prefix_cache_hit_tokens_total\{[^}]*\} (\S+)",
                                      page, re.M).group(1))
                check(hit == again[3] + other[3], f"{label}: the hit tokens metric ({hit})")
            else:
                check(again[3] == 0 and other[3] == 0, f"{label}: nothing is cached")
            check(again[0] == first[0] and close(again[1], first[1]),
                  f"{label}: the cached answer equals the uncached one ({first[0]} vs "
                  f"{again[0]})")
        finally:
            d.stop()

# --- tenants -------------------------------------------------------------------------------
model = os.path.join(tmp, "safetensors")
KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-0123456789"
keys = os.path.join(tmp, "keys")
with open(keys, "w") as f:
    f.write(f"{KEY_A}\n{KEY_B}\n")
d = Deployment(BIN, model, tp=1, pp=1, args=("--api-key-file", keys),
               serving={"prefixCacheIsolation": "perKey"})
try:
    secret = SYSTEM + " My account number is 4242."
    first = ask(d, secret, KEY_A)
    by_b = ask(d, secret, KEY_B)
    by_a = ask(d, secret, KEY_A)
    check(first[3] == 0 and by_b[3] == 0 and by_a[3] > 0,
          f"perKey: another key's prompt is not cached for this one ({by_b[3]} cached), the same "
          f"key's is ({by_a[3]} of {by_a[2]})")
    check(by_b[0] == first[0] and close(by_b[1], first[1]), "perKey: the answers are the same")
    salted = ask(d, secret, KEY_A, cache_salt="project-1")
    salted_again = ask(d, secret, KEY_A, cache_salt="project-1")
    other_salt = ask(d, secret, KEY_A, cache_salt="project-2")
    check(salted[3] == 0 and salted_again[3] > 0 and other_salt[3] == 0,
          f"cache_salt: shared only with the same salt ({salted[3]}, {salted_again[3]}, "
          f"{other_salt[3]} cached)")
    status, _, _ = d.request("GET", "/v1/kv-events", timeout=10,
                             headers={"Authorization": f"Bearer {KEY_A}"})
    check(status == 403, f"a leader without a router token serves its KV events to no API key "
                         f"({status})")
finally:
    d.stop()
check.finish()
