#!/usr/bin/env python3
"""Fuzzes the API of a `shardserve local` deployment: thousands of random and mutated requests
(wrong types, missing and extra fields, extreme numbers, broken JSON, random bytes, odd paths and
methods) from several clients at once. Every answer must be 2xx or a 4xx with an OpenAI error
body (never a 5xx, a hang or a dropped connection), valid requests interleaved with the noise must
keep their exact greedy answer, and the deployment must still be up and ready at the end. With
SHARDSERVE_FUZZ_REPLICAS=2 the same goes through shardserve-router in front of two replicas.
Structured output is fuzzed too: response_format, guided_* and structured_outputs, and tools'
parameters under tool_choice required or named, with odd, self-referring, deep and large
grammars (each must be answered 200 or 400, never 5xx or a crash)."""
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading

sys.path.insert(0, os.path.dirname(__file__))
from checks import Checks  # noqa: E402
from deployment import Deployment  # noqa: E402

BIN = sys.argv[1]
TOTAL = int(os.environ.get("SHARDSERVE_FUZZ_REQUESTS", "3000"))
CLIENTS = 4
check = Checks()
tmp = tempfile.mkdtemp(prefix="shardserve-fuzz-")
model = os.path.join(tmp, "model")
subprocess.run([BIN, "gen-model", "--out", model, "--layers", "2", "--hidden", "64",
                "--vocab", "300", "--max-position", "256"], check=True, capture_output=True)

VALID = {"model": "tiny", "prompt": [1, 20, 30, 40], "max_tokens": 6, "temperature": 0,
         "ignore_eos": True}
VALID_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# A tool round trip (the model's template renders no tools: a 400 naming them, when it parses).
VALID_TOOLS = {"model": "tiny", "max_tokens": 4, "messages": [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "2"}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
WEIRD = [None, True, False, 0, -1, 1, 2**31, -2**63, 2**64, 1e308, -1e-308, 0.5, "", "x" * 5000,
         "\u0000", "\ud7ff\u00e9\u4e2d", [], [None], [1.5], [-1], [2**40], {}, {"a": {"b": []}},
         [[1, 2], [3]], ["a", 1], "NaN", "Infinity", [""], [0] * 300]
KEYS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed",
        "stop", "stop_token_ids", "ignore_eos", "stream", "stream_options", "logprobs",
        "top_logprobs", "n", "echo", "best_of", "logit_bias", "suffix", "presence_penalty",
        "max_completion_tokens", "user", "zzz", "tools", "tool_choice", "parallel_tool_calls",
        "functions", "response_format"]
MESSAGE_KEYS = ["role", "content", "x", "tool_calls", "tool_call_id", "name"]
# Structured output and tools' parameters: grammars that are odd, self-referring, deep or large.
SCHEMAS = [{"type": "object"}, {"$ref": "#"}, {"type": "frobnicate"}, {"$ref": "#/$defs/x"},
           {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
           {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(300)} | {
               "d300": {"type": "integer"}}, "$ref": "#/$defs/d0"},
           {"type": "array", "items": {"type": "array", "items": {"type": "string"}},
            "minItems": 2 ** 40}, {"anyOf": [{"const": i} for i in range(500)]},
           {"type": "string", "pattern": "(a+)+$"}, {"properties": {"a": {"$ref": "#"}}}]
GRAMMARS = ["start: start", "start: (", 'start: "a"* "b"', "start: a\na: b\nb: a",
            "start: %json {\"$ref\": \"#\"}", "(" * 150 + "a" + ")" * 150,
            "start: " + " | ".join(f'"w{i}"' for i in range(2000))]
REGEXES = ["(a{1000}){1000}", "(a|a)*b", "[", "\\", "a{99999}", "(?:x*)*y", ".*" * 50]
GUIDED = {
    "guided_json": lambda rng: rng.choice(SCHEMAS + [json.dumps(rng.choice(SCHEMAS))]),
    "guided_regex": lambda rng: rng.choice(REGEXES),
    "guided_grammar": lambda rng: rng.choice(GRAMMARS),
    "guided_choice": lambda rng: rng.choice([[], ["a"], [f"c{i}" for i in range(3000)], [1, 2]]),
    "response_format": lambda rng: rng.choice([
        {"type": "json_schema", "json_schema": {"name": "x", "schema": rng.choice(SCHEMAS)}},
        {"type": "json_object"}, {"type": "json_schema"}, {"type": "grammar"}]),
    "structured_outputs": lambda rng: rng.choice([{"regex": rng.choice(REGEXES)},
                                                  {"grammar": rng.choice(GRAMMARS)},
                                                  {"json": rng.choice(SCHEMAS)}]),
}


def with_tool_parameters(rng, body):
    """A tool call constrained to a function whose parameters are one of SCHEMAS."""
    body.update({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": rng.choice(SCHEMAS)}}],
        "tool_choice": rng.choice(["required", {"type": "function", "function": {"name": "f"}}])})


def mutate(rng):
    body = json.loads(json.dumps(rng.choice([VALID, VALID_CHAT, VALID_TOOLS])))
    for _ in range(rng.randint(1, 4)):
        op = rng.random()
        if op < 0.35:
            body[rng.choice(KEYS)] = rng.choice(WEIRD)
        elif op < 0.5 and body:
            body.pop(rng.choice(list(body)))
        elif op < 0.6 and "messages" in body and isinstance(body["messages"], list):
            body["messages"].append({rng.choice(MESSAGE_KEYS): rng.choice(WEIRD)})
        elif op < 0.65 and isinstance(body.get("messages"), list) and body["messages"]:
            m = rng.choice(body["messages"])  # a field of a message, or of a call in it
            if isinstance(m, dict):
                calls = m.get("tool_calls")
                if isinstance(calls, list) and calls and isinstance(calls[0], dict):
                    calls[0][rng.choice(["id", "type", "function"])] = rng.choice(WEIRD)
                else:
                    m[rng.choice(MESSAGE_KEYS)] = rng.choice(WEIRD)
        elif op < 0.7:
            body["max_tokens"] = rng.randint(-5, 400)
        elif op < 0.8:
            key = rng.choice(list(GUIDED))
            body[key] = GUIDED[key](rng)
        elif op < 0.84 and "messages" in body:
            with_tool_parameters(rng, body)
        else:
            body[rng.choice(KEYS)] = rng.choice(WEIRD)
    text = json.dumps(body).encode()
    r = rng.random()
    if r < 0.1:
        text = text[:rng.randint(0, len(text))]
    elif r < 0.2:
        b = bytearray(text)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        text = bytes(b)
    elif r < 0.25:
        text = bytes(rng.randrange(256) for _ in range(rng.randint(0, 2000)))
    elif r < 0.27:
        text = b"[" * rng.randint(50, 100000)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    if rng.random() < 0.1:  # the Responses API reads bodies of its own; these are noise there
        path = "/v1/responses"
    if rng.random() < 0.05:
        path = rng.choice(["/v1/completion", "/", "/v1/models/x", "/v1/completions?x=1",
                           "/%00", "/v1/" + "a" * 3000])
    method = "POST" if rng.random() < 0.97 else rng.choice(["GET", "PUT", "DELETE", "PATCH"])
    return method, path, text


d = Deployment(BIN, model, tp=2, pp=1, max_batch=8, max_seq=128,
               replicas=int(os.environ.get("SHARDSERVE_FUZZ_REPLICAS", "1")))
problems = []
statuses = {}
lock = threading.Lock()
try:
    status, _, base = d.post("/v1/completions", VALID)
    expected = base["choices"][0]["text"]
    check(status == 200, "the valid request is answered before fuzzing")

    def client(seed, count):
        rng = random.Random(seed)
        conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=60)
        for i in range(count):
            valid = i % 25 == 0
            method, path, data = ("POST", "/v1/completions", json.dumps(VALID).encode()) \
                if valid else mutate(rng)
            try:
                conn.request(method, path, body=data,
                             headers={"Content-Type": "application/json"})
                r = conn.getresponse()
                payload = r.read()
                code = r.status
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=60)
                # The server may close a connection after answering a request it could not
                # parse; it must not drop one silently for a well-formed request.
                if valid:
                    with lock:
                        problems.append(f"valid request failed: {e!r}")
                continue
            with lock:
                statuses[code] = statuses.get(code, 0) + 1
            if code >= 500:
                with lock:
                    problems.append(f"{code} for {method} {path} {data[:200]!r}: {payload[:200]!r}")
            elif code >= 400:
                try:
                    err = json.loads(payload)["error"]
                    assert isinstance(err["message"], str) and err["message"]
                except Exception:
                    with lock:
                        problems.append(f"{code} without an error body: {payload[:200]!r}")
            if valid:
                try:
                    text = json.loads(payload)["choices"][0]["text"]
                except Exception:
                    text = None
                if code != 200 or text != expected:
                    with lock:
                        problems.append(f"valid request answered {code} {payload[:200]!r}")
            if code in (200, 201) and r.getheader("Content-Type", "").startswith("text/event-stream"):
                pass  # streamed answers were read whole above
        conn.close()

    threads = [threading.Thread(target=client, args=(1000 + c, TOTAL // CLIENTS))
               for c in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sent = sum(statuses.values())
    print("statuses:", dict(sorted(statuses.items())))
    check(sent >= TOTAL * 0.95, f"{sent} of {TOTAL} fuzzed requests were answered")
    check(not problems, f"no 5xx, no bare error, valid answers unchanged ({len(problems)} "
          f"problems){': ' + problems[0] if problems else ''}")
    check(statuses.get(400, 0) > TOTAL // 4 and statuses.get(200, 0) > TOTAL // 25,
          "the noise reached both the validation and the generation paths")
    # Structure-aware: every path of rich valid requests, each replaced by values of every
    # other type (a content part's "type" as a number, a stop list of objects, ...).
    rich = [
        ("/v1/completions", {"model": "tiny", "prompt": ["hello", [1, 2, 3]], "max_tokens": 3,
                             "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 1,
                             "stop": ["x", "y"], "stop_token_ids": [2], "ignore_eos": True,
                             "logprobs": 2, "n": 1, "best_of": 1, "echo": False,
                             "presence_penalty": 0, "logit_bias": {}, "user": "u"}),
        ("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 2, "stream": True,
                             "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {"model": "tiny", "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 3, "logprobs": True, "top_logprobs": 2, "stop": "x"}),
        ("/v1/responses", {"model": "tiny", "instructions": "be brief", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text",
                                                               "text": "hm"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"}],
            "text": {"format": {"type": "json_schema", "name": "x",
                                "schema": {"type": "object"}}},
            "max_output_tokens": 3, "temperature": 0.5, "top_p": 0.9, "metadata": {"a": "b"},
            "stream": False}),
        ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2,
                           "stream": True, "tool_choice": "none",
                           "tools": [{"type": "function", "name": "f",
                                      "parameters": {"type": "object"}}]}),
    ]
    wrong = [5, -1, 2**64, 1.5, "x", "", None, True, [], [5], {}, {"type": 5}]

    def paths(v, prefix=()):
        yield prefix
        if isinstance(v, dict):
            for k, x in v.items():
                yield from paths(x, prefix + (k,))
        elif isinstance(v, list):
            for i, x in enumerate(v):
                yield from paths(x, prefix + (i,))

    def replaced(v, path, new):
        if not path:
            return new
        v = json.loads(json.dumps(v))
        cur = v
        for p in path[:-1]:
            cur = cur[p]
        cur[path[-1]] = new
        return v

    structured, bad = 0, []
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=60)
    for path_url, body in rich:
        for p in list(paths(body))[1:]:
            for new in wrong:
                data = json.dumps(replaced(body, p, new)).encode()
                conn.request("POST", path_url, body=data,
                             headers={"Content-Type": "application/json"})
                r = conn.getresponse()
                payload = r.read()
                structured += 1
                ok = r.status < 500
                if 400 <= r.status < 500:
                    try:
                        ok = bool(json.loads(payload)["error"]["message"])
                    except Exception:
                        ok = False
                if not ok:
                    bad.append(f"{r.status} for {'.'.join(map(str, p))} = {new!r}: "
                               f"{payload[:160]!r}")
    conn.close()
    check(structured > 300 and not bad,
          f"{structured} requests with a wrong type at every path: no 5xx, every 4xx with an "
          f"error body ({len(bad)} problems){': ' + bad[0] if bad else ''}")

    status, _, body = d.post("/v1/completions", VALID)
    check(status == 200 and body["choices"][0]["text"] == expected,
          "after fuzzing, the valid request still gets its answer")
    check(d.request("GET", "/readyz")[0] == 200 and d.proc.poll() is None,
          "the deployment is still up and ready")
finally:
    code = d.stop(signal.SIGINT)
check(code == 0, f"it stops cleanly afterwards (exit {code})")
check.finish()
