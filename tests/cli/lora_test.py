#!/usr/bin/env python3
"""LoRA adapters loaded at runtime (issue 54) through `shardserve local` (TP=2): POST
/v1/load_lora_adapter and /v1/unload_lora_adapter behind an admin key, four adapters on a
replica holding two at once (spec.lora.maxLoras 2), each request's answer equal to the same
adapter declared in a deployment that holds all four; the paths bounded to the adapters'
directory; a bad adapter, a name taken, an unknown one refused by name.

usage: lora_test.py path/to/shardserve"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402
from deployment import Deployment, gen_model  # noqa: E402

BIN = sys.argv[1]
check = Checks()
tmp = tempfile.mkdtemp(prefix="shardserve-lora-")
model = os.path.join(tmp, "model")
gen_model(BIN, model)
root = os.path.join(tmp, "adapters")
NAMES = ["a0", "a1", "a2", "a3"]
for i, name in enumerate(NAMES):
    os.makedirs(root, exist_ok=True)
    import subprocess
    subprocess.run([BIN, "gen-adapter", "--model", model, "--out", os.path.join(root, name),
                    "--rank", "8", "--seed", str(i + 1)], check=True, capture_output=True)
USER, ADMIN = "sk-user-0123456789abcdef", "sk-admin-0123456789abcdef"
keys = os.path.join(tmp, "keys")
admin_keys = os.path.join(tmp, "admin-keys")
for path, key in ((keys, USER), (admin_keys, ADMIN)):
    with open(path, "w") as f:
        f.write(key + "\n")
    os.chmod(path, 0o600)
PROMPT = [1, 17, 99, 4, 250, 31, 7, 8]
LONG = [1] + [(37 * i + 11) % 500 + 2 for i in range(39)]  # two full KV blocks


def answer(dep, name, prompt=PROMPT):
    status, _, body = dep.post("/v1/completions", {
        "model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 0,
        "ignore_eos": True})
    return body["choices"][0]["logprobs"]["token_logprobs"] if status == 200 else (status, body)


declared = "  adapters:\n" + "".join(
    f"    - {{name: {n}, uri: \"file://{os.path.join(root, n)}\"}}\n" for n in NAMES)
ref = Deployment(BIN, model, name="m", tp=2, pp=1, args=["--api-key-file", keys],
                 api_key=USER, spec=declared)
try:
    want = {n: answer(ref, n) for n in NAMES}
    want_long = answer(ref, "a0", LONG)
finally:
    ref.stop()

dep = Deployment(BIN, model, name="m", tp=2, pp=1,
                 args=["--api-key-file", keys, "--admin-key-file", admin_keys], api_key=USER,
                 spec=f"  lora: {{maxLoras: 2, maxLoraRank: 16, maxCpuLoras: 4, "
                      f"source: \"file://{root}\"}}\n")
try:
    def admin(path, body, key=ADMIN):
        return dep.post(path, body, headers={"Authorization": f"Bearer {key}"})

    status, _, _ = admin("/v1/load_lora_adapter", {"lora_name": "a0", "lora_path": "a0"}, USER)
    check(status == 403, f"a user's key may not load adapters ({status})")
    status, _, _ = admin("/v1/load_lora_adapter", {"lora_name": "a0", "lora_path": "a0"},
                         "sk-nobody-0123456789abcdef")
    check(status == 401, f"an unknown key is not authenticated ({status})")
    for n in NAMES:
        status, _, body = admin("/v1/load_lora_adapter",
                                {"lora_name": n, "lora_path": os.path.join(root, n) if n == "a0"
                                 else n})
        check(status == 200 and "added successfully" in str(body),
              f"{n} loaded at runtime ({status} {str(body)[:200]})")
    got = {}
    for rnd in range(2):  # four adapters through two slots, twice: swapped in and out
        for n in NAMES:
            got[(rnd, n)] = answer(dep, n)
    bad = [(k, got[k]) for k in got
           if not isinstance(got[k], list) or
           max(abs(a - b) for a, b in zip(got[k], want[k[1]])) > 1e-4]
    check(not bad, f"four adapters through two slots, each answer the declared adapter's "
                   f"({bad[:2]})")
    page = dep.metrics_page()
    check('max_lora="2"' in page, "the leader exports its two slots")
    for body, words in (({"lora_name": "x", "lora_path": "../.."}, "inside the adapters'"),
                        ({"lora_name": "x", "lora_path": "/etc"}, "inside the adapters'"),
                        ({"lora_name": "a1", "lora_path": "a1"}, "a1"),
                        ({"lora_name": "x", "lora_path": "nowhere"}, "lora_path"),
                        ({"lora_name": "x", "lora_path": "a1", "pinned": True}, "pinned"),
                        ({"lora_name": "m", "lora_path": "a1"}, "base model"),
                        ({"lora_name": "x", "lora_path": "a1"}, "maxCpuLoras 4")):
        status, _, reply = admin("/v1/load_lora_adapter", body)
        check(status == 400 and words in str(reply),
              f"load {body} refused naming {words!r} ({status} {str(reply)[:160]})")
    status, _, body = admin("/v1/unload_lora_adapter", {"lora_name": "a2"})
    check(status == 200 and "removed successfully" in str(body), f"a2 unloaded ({status})")
    status, _, body = dep.post("/v1/completions", {"model": "a2", "prompt": PROMPT,
                                                   "max_tokens": 2})
    check(status == 404 and "a2" in str(body), f"a2 is then a 404 ({status})")
    status, _, body = admin("/v1/unload_lora_adapter", {"lora_name": "a2"})
    check(status == 404, f"unloading it again is a 404 ({status} {str(body)[:120]})")
    # a3 reloaded with a0's files: its long prompt's cached blocks (a3's) are not reused.
    answer(dep, "a3", LONG)
    admin("/v1/unload_lora_adapter", {"lora_name": "a3"})
    status, _, _ = admin("/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": "a0"})
    got_long = answer(dep, "a3", LONG)
    check(status == 200 and isinstance(got_long, list) and
          max(abs(a - b) for a, b in zip(got_long, want_long)) < 1e-4,
          f"a name reloaded with other files answers with them, not its old cached KV ({status})")
    status, _, body = dep.request("GET", "/v1/models")
    check(status == 200 and b'"a2"' not in body and b'"a3"' in body,
          "/v1/models lists the adapters loaded, not the unloaded one")
finally:
    code = dep.stop()
    if check.failures:
        print(dep.log()[-3000:])
check.finish()
