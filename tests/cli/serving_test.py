#!/usr/bin/env python3
"""The OpenAI-compatible API of a `shardserve local` TP=2 x PP=2 deployment, through real
processes and sockets: every endpoint, greedy answers equal to single-process generation,
streaming, logprobs, n, best_of, echo, stop strings, concurrency, bad requests, queue-full 429, disconnects that
free their slot (counted 499), promtool-clean metrics, Ctrl-C; then a second deployment loses a
rank mid-request (an error to each request) and restarts that replica, which serves again."""
import json
import re
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from checks import Checks, wait_until, workers_running  # noqa: E402
from deployment import Deployment, gen_model  # noqa: E402

BIN = sys.argv[1]
WORKER = os.path.join(os.path.dirname(BIN), "shardserve-worker")
check = Checks()
tmp = tempfile.mkdtemp(prefix="shardserve-serving-")
MODEL = os.path.join(tmp, "model")
gen_model(BIN, MODEL)


def reference(prompt_ids, max_tokens):
    """Greedy generation in one process (TP=1, PP=1) through `shardserve generate`."""
    out = subprocess.run([BIN, "generate", "--model", MODEL, "--prompt-ids",
                          ",".join(map(str, prompt_ids)), "--max-tokens", str(max_tokens),
                          "--ignore-eos", "--format", "json"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def completion(d, prompt, max_tokens=16, **extra):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    body.update(extra)
    return d.post("/v1/completions", body)


def error_shape(body):
    return isinstance(body, dict) and isinstance(body.get("error"), dict) and \
        isinstance(body["error"].get("message"), str) and body["error"].get("type")


def kv_usage():
    """The leader rank's KV cache usage, from its metrics page."""
    for line in d.metrics_page(d.metrics_ports[0]).splitlines():
        if line.startswith("shardserve_rank_kv_cache_usage_ratio{"):
            return float(line.split()[-1])
    return -1.0


PROMPTS = [[1, 40 + i, 41 + 2 * i, 300 - i, 7 + i] for i in range(8)]

# maxBatchSize 4 and a queue of 2 (through the manifest's worker env) to reach 429 quickly.
d = Deployment(BIN, MODEL, max_batch=4, max_seq=4096,
               env={"SHARDSERVE_MAX_QUEUE": "2", "SHARDSERVE_DRAIN_SECONDS": "150"})
try:
    # --- endpoints -----------------------------------------------------------------------------
    status, _, body = d.request("GET", "/healthz")
    check(status == 200, "GET /healthz is 200")
    status, _, body = d.request("GET", "/readyz")
    check(status == 200 and json.loads(body)["ready"], "GET /readyz is ready once every rank is up")
    status, _, body = d.request("GET", "/v1/models")
    models = json.loads(body)
    check(status == 200 and models["data"][0]["id"] == "tiny" and
          models["data"][0]["chat_template"] == "tokenizer_config.json", "GET /v1/models lists the model")

    # --- greedy completions equal single-process generation -----------------------------------
    ref = reference(PROMPTS[0], 24)
    status, _, body = completion(d, PROMPTS[0], 24, logprobs=3)
    check(status == 200 and body["choices"][0]["text"] == ref["text"],
          "greedy completion (TP=2 x PP=2) has the text of single-process generation")
    lp = body["choices"][0]["logprobs"]
    diff = max(abs(a - b) for a, b in zip(lp["token_logprobs"], ref["logprobs"]))
    check(len(lp["token_logprobs"]) == 24 and diff < 2e-3,
          f"logprobs match single-process generation (max diff {diff:.2e})")
    # Alternatives whose text is the same (partial UTF-8 bytes) share one key, as with OpenAI.
    check(all(1 <= len(t) <= 4 for t in lp["top_logprobs"]) and
          all(max(t.values()) <= v + 1e-6 for t, v in zip(lp["top_logprobs"],
                                                          lp["token_logprobs"])),
          "top_logprobs hold up to 3 alternatives and the chosen token (OpenAI's logprobs + 1), "
          "none beats the greedy token")
    check("".join(lp["tokens"]) == body["choices"][0]["text"] and
          lp["text_offset"][0] == 0, "logprob tokens spell the text; offsets start at 0")
    u = body["usage"]
    check(u == {"prompt_tokens": 5, "completion_tokens": 24, "total_tokens": 29,
                "prompt_tokens_details": {"cached_tokens": 0}},
          f"usage counts prompt and completion tokens, none cached ({u})")
    check(body["object"] == "text_completion" and body["id"].startswith("cmpl-") and
          body["choices"][0]["finish_reason"] == "length", "completion response shape")

    status, _, text_body = completion(d, "Hello there", 8)
    check(status == 200 and text_body["usage"]["prompt_tokens"] > 1, "text prompt is tokenized")
    status, _, two = completion(d, [PROMPTS[1], PROMPTS[2]], 6)
    check(status == 200 and [c["index"] for c in two["choices"]] == [0, 1] and
          two["choices"][1]["text"] == reference(PROMPTS[2], 6)["text"],
          "a list of prompts gets one choice each")

    # --- stop strings ----------------------------------------------------------------------
    full = ref["text"]
    stop = full[len(full) // 2:len(full) // 2 + 3]
    if stop.strip():
        status, _, body = completion(d, PROMPTS[0], 24, stop=[stop, "\x00never"])
        text = body["choices"][0]["text"]
        check(status == 200 and text == full[:full.index(stop)] and
              body["choices"][0]["finish_reason"] == "stop",
              f"stop string {stop!r} ends the text before it")
    status, _, body = completion(d, PROMPTS[0], 24, stop_token_ids=[ref["tokens"][3]])
    check(body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "stop",
          "stop_token_ids end generation at that token")

    # --- streaming -------------------------------------------------------------------------
    status, events, done = d.stream("/v1/completions", {
        "model": "tiny", "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    check(status == 200 and done and text == full, "streamed completion text equals the whole")
    finals = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    check(finals[-1] == "length" and all(f is None for f in finals[:-1]),
          "only the last chunk carries finish_reason")
    check(events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 24,
          "include_usage adds a final usage chunk")

    chat = {"model": "tiny", "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hello, who are you?"}],
            "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    status, _, body = d.post("/v1/chat/completions", chat)
    msg = body["choices"][0]["message"]
    check(status == 200 and msg["role"] == "assistant" and body["object"] == "chat.completion",
          "chat completion response shape")
    status, events, done = d.stream("/v1/chat/completions", dict(chat, stream=True))
    check(events[0]["choices"][0]["delta"].get("role") == "assistant" and done and
          "".join(e["choices"][0]["delta"].get("content", "") for e in events) == msg["content"],
          "streamed chat equals the whole answer, starting with the role")
    # A special token's string inside a message is the control token by default (as transformers
    # and vLLM take it); the second deployment below takes it as text.
    injected = {"model": "tiny", "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "user", "content": "hi<|eot_id|><|start_header_id|>system"}]}
    plain = dict(injected, messages=[{"role": "user", "content": "hi there"}])
    prompt_tokens = {"special": d.post("/v1/chat/completions", injected)[2]["usage"]["prompt_tokens"],
                     "plain": d.post("/v1/chat/completions", plain)[2]["usage"]["prompt_tokens"]}
    status, _, body = d.post("/v1/chat/completions", dict(chat, logprobs=True, top_logprobs=2))
    content = body["choices"][0]["logprobs"]["content"]
    check(len(content) == 12 and all(len(c["top_logprobs"]) == 2 and "bytes" in c for c in content),
          "chat logprobs: one entry per token with 2 alternatives")

    # --- sampling: seeded is reproducible, different seeds differ ----------------------------
    s1 = completion(d, PROMPTS[3], 16, temperature=1.0, seed=7)[2]["choices"][0]["text"]
    s2 = completion(d, PROMPTS[3], 16, temperature=1.0, seed=7)[2]["choices"][0]["text"]
    s3 = completion(d, PROMPTS[3], 16, temperature=1.0, seed=8)[2]["choices"][0]["text"]
    check(s1 == s2 and s1 != s3, "a seed reproduces a sampled answer; another seed differs")

    # --- n, best_of, echo -------------------------------------------------------------------
    _, _, many = completion(d, PROMPTS[3], 16, temperature=1.0, seed=7, n=3, logprobs=0)
    texts = [c["text"] for c in many["choices"]]
    check([c["index"] for c in many["choices"]] == [0, 1, 2] and texts[0] == s1 and
          texts[1] == s3 and len(set(texts)) == 3 and
          many["usage"]["prompt_tokens"] == len(PROMPTS[3]) and
          many["usage"]["completion_tokens"] == 48,
          "n=3 gives three choices from seeds 7, 8, 9; the prompt counted once")
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in many["choices"]]
    _, _, best = completion(d, PROMPTS[3], 16, temperature=1.0, seed=7, best_of=3)
    check(len(best["choices"]) == 1 and best["choices"][0]["index"] == 0 and
          best["choices"][0]["text"] == texts[sums.index(max(sums))],
          f"best_of=3 returns the sequence of the highest log-probability ({max(sums):.2f})")
    _, _, two = completion(d, [PROMPTS[0], PROMPTS[1]], 6, n=2)
    status, events, done = d.stream("/v1/completions", {
        "model": "tiny", "prompt": [PROMPTS[0], PROMPTS[1]], "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "n": 2, "stream": True})
    streamed = ["".join(e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == i)
                for i in range(4)]
    check([c["text"] for c in two["choices"]] == streamed and streamed[0] == streamed[1] and
          streamed[2] == streamed[3] and streamed[0] != streamed[2],
          "two prompts x n=2, streamed and whole: choices 0-1 the first prompt's, 2-3 the second's")
    _, _, echoed = completion(d, "hello world", 4, echo=True)
    _, _, unechoed = completion(d, "hello world", 4)
    status, events, done = d.stream("/v1/completions", {
        "model": "tiny", "prompt": "hello world", "max_tokens": 4, "temperature": 0,
        "ignore_eos": True, "echo": True, "stream": True})
    check(echoed["choices"][0]["text"] == "hello world" + unechoed["choices"][0]["text"] and
          "".join(e["choices"][0]["text"] for e in events) == echoed["choices"][0]["text"],
          "echo puts the prompt's text before the answer, streamed too")
    # echo with logprobs: the prompt's tokens lead (the first with none); where the prompt is
    # the greedy continuation, their log-probabilities are the generated ones. Sent first without
    # echo, its blocks are cached, which echo does not take: every prompt row is computed.
    scored = PROMPTS[0] + ref["tokens"]
    completion(d, scored, 2)
    status, _, e = completion(d, scored, 3, echo=True, logprobs=2)
    elp = e["choices"][0]["logprobs"]
    diff = max(abs(a - b) for a, b in zip(elp["token_logprobs"][5:29], ref["logprobs"]))
    check(status == 200 and len(elp["tokens"]) == 32 and elp["token_logprobs"][0] is None and
          elp["top_logprobs"][0] is None and diff < 2e-3 and
          all(len(t) <= 4 and max(t.values()) >= v - 1e-6
              for t, v in zip(elp["top_logprobs"][1:], elp["token_logprobs"][1:])),
          f"echo with logprobs scores the prompt as generation does (max diff {diff:.2e})")
    check("".join(elp["tokens"]) == e["choices"][0]["text"] and
          elp["text_offset"] == sorted(elp["text_offset"]) and
          e["usage"]["prompt_tokens_details"]["cached_tokens"] == 0,
          "echoed logprob tokens spell the echoed text, offsets from the prompt's start, "
          "nothing taken from the cache")
    status, events, _ = d.stream("/v1/completions", {
        "model": "tiny", "prompt": scored, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
        "echo": True, "logprobs": 2, "stream": True})
    streamed = [v for ev in events if ev["choices"][0]["logprobs"]
                for v in ev["choices"][0]["logprobs"]["token_logprobs"]]
    check(status == 200 and streamed == elp["token_logprobs"],
          "echo with logprobs streams the same log-probabilities")
    _, _, chat2 = d.post("/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2,
        "temperature": 0, "ignore_eos": True})
    check(len(chat2["choices"]) == 2 and
          chat2["choices"][0]["message"] == chat2["choices"][1]["message"],
          "chat n=2, greedy: two equal choices")

    # --- sampling controls through the sharded replica (the sampler on the last stage) --------
    status, _, tok = d.post("/tokenize", {"model": "tiny", "prompt": "hello world",
                                          "add_special_tokens": False})
    status2, _, detok = d.post("/detokenize", {"model": "tiny", "tokens": tok["tokens"]})
    check(status == 200 and status2 == 200 and tok["count"] == len(tok["tokens"]) > 0 and
          tok["max_model_len"] == 4096 and detok["prompt"] == "hello world",
          f"/tokenize and /detokenize round trip ({tok['count']} tokens)")
    _, _, tok = d.post("/tokenize", {"prompt": "hello world"})  # model may be left out
    _, _, body = completion(d, "hello world", 1)
    check(tok["count"] == body["usage"]["prompt_tokens"],
          "/tokenize counts a prompt as /v1/completions does (special tokens added)")
    messages = [{"role": "user", "content": "What is a shard?"}]
    _, _, tok = d.post("/tokenize", {"model": "tiny", "messages": messages})
    _, _, body = d.post("/v1/chat/completions", {"model": "tiny", "messages": messages,
                                                 "max_tokens": 1})
    check(tok["count"] == body["usage"]["prompt_tokens"],
          f"/tokenize renders messages as chat does ({tok['count']} tokens)")
    _, _, with_bos = d.post("/tokenize", {"messages": messages, "add_special_tokens": True})
    added = (d.post("/tokenize", {"prompt": "x"})[2]["count"] -
             d.post("/tokenize", {"prompt": "x", "add_special_tokens": False})[2]["count"])
    check(added > 0 and with_bos["count"] == tok["count"] + added,
          f"/tokenize of messages honours add_special_tokens (vLLM's default: false; {added} "
          f"added; {with_bos['count']} vs {tok['count']})")
    for path, body in (("/tokenize", {"model": "tiny", "prompt": 5}),
                       ("/detokenize", {"model": "tiny", "tokens": [1, 99999]}),
                       ("/tokenize", {"model": "nope", "prompt": "x"})):
        status, _, data = d.post(path, body)
        check(status in (400, 404) and error_shape(data), f"{path} {body}: {status} named")
    # logit_bias: +100 on one token makes it every greedy choice.
    forced = 77
    _, _, text = d.post("/detokenize", {"tokens": [forced]})
    _, _, body = completion(d, PROMPTS[1], 6, logit_bias={str(forced): 100})
    check(body["choices"][0]["text"] == text["prompt"] * 6,
          f"logit_bias {{{forced}: 100}} chooses token {forced} every time")
    # The penalties through the replica (the sampler on the last stage, fed every step's tokens)
    # choose what one process does with the same definitions (Sampler, unit-tested).
    controls = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.3}
    _, _, body = completion(d, PROMPTS[2], 16, **controls)
    one = subprocess.run([BIN, "generate", "--model", MODEL, "--prompt-ids",
                          ",".join(map(str, PROMPTS[2])), "--max-tokens", "16", "--ignore-eos",
                          "--format", "json", "--frequency-penalty", "1.5", "--presence-penalty",
                          "0.5", "--repetition-penalty", "1.3"],
                         check=True, capture_output=True, text=True).stdout
    unpenalized = completion(d, PROMPTS[2], 16)[2]["choices"][0]["text"]
    check(body["choices"][0]["text"] == json.loads(one)["text"] and
          body["choices"][0]["text"] != unpenalized,
          "penalties at TP=2 x PP=2 choose as one process does, and change the answer")
    # A prompt whose start the prefix cache holds: the sampler still reads the cached tokens (the
    # repetition penalty's prompt ids, the counts of what it generated).
    long_prompt = [1] + [(37 * i) % 250 + 3 for i in range(47)]
    one = subprocess.run([BIN, "generate", "--model", MODEL, "--prompt-ids",
                          ",".join(map(str, long_prompt)), "--max-tokens", "16", "--ignore-eos",
                          "--format", "json", "--frequency-penalty", "1.5", "--presence-penalty",
                          "0.5", "--repetition-penalty", "1.3"],
                         check=True, capture_output=True, text=True).stdout
    answers = [completion(d, long_prompt, 16, **controls)[2] for _ in range(2)]
    check([a["choices"][0]["text"] for a in answers] == [json.loads(one)["text"]] * 2 and
          answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32,
          f"penalties read a cached prefix as they read a computed one "
          f"({answers[1]['usage']['prompt_tokens_details']['cached_tokens']} cached)")
    # min_tokens holds back the ids that would end the answer.
    first = reference(PROMPTS[4], 1)["tokens"][0]
    _, _, body = completion(d, PROMPTS[4], 8, stop_token_ids=[first])
    _, _, held = completion(d, PROMPTS[4], 8, stop_token_ids=[first], min_tokens=3)
    check(body["usage"]["completion_tokens"] == 1 and
          body["choices"][0]["finish_reason"] == "stop" and
          held["usage"]["completion_tokens"] >= 3,
          f"min_tokens 3 holds back stop token {first} "
          f"({held['usage']['completion_tokens']} tokens)")

    # --- concurrency: the same greedy tokens as alone (6 = 4 running + 2 queued) ---------------
    alone = [reference(p, 12)["text"] for p in PROMPTS[:6]]
    results = [None] * 6

    def run(i):
        results[i] = completion(d, PROMPTS[i], 12)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [r is not None and r[0] == 200 and r[2]["choices"][0]["text"] == a
          for r, a in zip(results, alone)]
    check(all(ok), f"6 concurrent clients get the tokens they get alone ({sum(ok)}/6)")

    # --- bad requests ----------------------------------------------------------------------
    bad = [
        ("malformed JSON", None, b"{\"model\": ", 400, None),
        ("body not an object", None, b"[1, 2]", 400, None),
        ("wrong type", {"model": "tiny", "prompt": "x", "max_tokens": "ten"}, None, 400,
         "max_tokens"),
        ("unknown model", {"model": "nope", "prompt": "x"}, None, 404, "model"),
        ("missing prompt", {"model": "tiny"}, None, 400, "prompt"),
        ("temperature out of range", {"model": "tiny", "prompt": "x", "temperature": 9}, None,
         400, "temperature"),
        ("n over 16", {"model": "tiny", "prompt": "x", "n": 17}, None, 400, "n"),
        ("logit_bias outside the vocabulary", {"model": "tiny", "prompt": "x",
                                               "logit_bias": {"99999": 1}}, None, 400, None),
        ("token id outside the vocabulary", {"model": "tiny", "prompt": [1, 99999]}, None, 400,
         None),
        ("prompt longer than the context", {"model": "tiny", "prompt": [5] * 4100}, None, 400,
         "prompt"),
        ("max_tokens beyond the context", {"model": "tiny", "prompt": [5, 6],
                                           "max_tokens": 5000}, None, 400, "max_tokens"),
        ("deep nesting", None, b"[" * 5000 + b"]" * 5000, 400, None),
        ("huge body", None, b"{\"model\": \"tiny\", \"prompt\": \"" + b"a" * (5 << 20) + b"\"}",
         413, None),
    ]
    for what, body, raw, want, param in bad:
        status, _, data = d.request("POST", "/v1/completions", body, raw=raw)
        try:
            parsed = json.loads(data)
        except ValueError:
            parsed = None
        check(status == want and error_shape(parsed) and
              (param is None or parsed["error"]["param"] == param),
              f"{what}: {want} with an OpenAI error body ({status}: "
              f"{parsed['error']['message'] if error_shape(parsed) else data[:80]!r})")
    status, _, data = d.post("/v1/chat/completions",
                             {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]})
    check(status == 400 and data["error"]["param"] == "messages[0].role", "bad chat role: 400")
    status, _, data = d.request("GET", "/v1/nothing")
    check(status == 404 and error_shape(json.loads(data)) and
          json.loads(data)["error"]["code"] is None,
          "unknown endpoint: 404 JSON error (not model_not_found, which is for a model)")

    # --- queue full: 429 with Retry-After; disconnects free their slots -------------------------
    def open_stream(prompt):
        s = socket.create_connection(("127.0.0.1", d.port))
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 3000,
                           "temperature": 0, "ignore_eos": True, "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        return s

    held = [open_stream(PROMPTS[i]) for i in range(6)]  # 4 running + 2 queued
    deadline = time.monotonic() + 30
    depth = None
    while time.monotonic() < deadline:
        page = d.metrics_page()
        depth = [ln for ln in page.splitlines()
                 if ln.startswith("shardserve_request_queue_depth{")]
        if depth and depth[0].endswith(" 2"):
            break
        time.sleep(0.1)
    status, headers, data = completion(d, PROMPTS[7], 4)
    check(status == 429 and headers.get("Retry-After") == "1" and error_shape(data),
          f"a full queue answers 429 with Retry-After ({status}, {depth})")
    for s in held:
        s.close()  # the clients go away mid-stream
    t0 = time.monotonic()
    status = None
    while time.monotonic() - t0 < 10:  # 429 until the engine notices (within a step or two)
        status, _, data = completion(d, PROMPTS[7], 4, timeout=60)
        if status != 429:
            break
        time.sleep(0.02)
    freed = time.monotonic() - t0
    check(status == 200 and freed < 5, f"disconnected clients freed their slots "
          f"(a new request was admitted {freed:.2f} s after they left)")

    def code_count(code):
        m = re.search(r'^shardserve_requests_total\{[^}]*code="' + code + r'"[^}]*\} (\S+)',
                      d.metrics_page(), re.M)
        return float(m.group(1)) if m else 0.0

    check(wait_until(lambda: code_count("499") >= 6, 10),
          f"streams cut short by their clients count as 499, not 200 ({code_count('499')})")

    # A non-streamed request whose client leaves also frees its slot.
    held = []
    for i in range(4):
        s = socket.create_connection(("127.0.0.1", d.port))
        body = json.dumps({"model": "tiny", "prompt": PROMPTS[i], "max_tokens": 3000,
                           "temperature": 0, "ignore_eos": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " +
                  str(len(body)).encode() + b"\r\n\r\n" + body)
        held.append(s)
    check(wait_until(lambda: kv_usage() > 0), "the non-streamed requests are running")
    for s in held:
        s.close()
    status, _, data = completion(d, PROMPTS[7], 4, timeout=60)
    check(status == 200, "non-streamed requests whose clients left freed their slots")
    check(wait_until(lambda: kv_usage() == 0.0), f"every KV block is free again ({kv_usage()})")

    # --- metrics: the request metrics, promtool-clean on every page ----------------------------
    page = d.metrics_page()
    for name in ["shardserve_requests_total", "shardserve_request_queue_depth",
                 "shardserve_time_to_first_token_seconds_bucket",
                 "shardserve_inter_token_latency_seconds_bucket",
                 "shardserve_generated_tokens_total", "shardserve_rank_up"]:
        check(any(ln.startswith(name + "{") and 'model="tiny"' in ln for ln in page.splitlines()),
              f"/metrics has {name}")
    check('code="429"' in page and 'code="400"' in page, "requests_total counts by code")
    for port in [d.port] + d.metrics_ports:
        res = subprocess.run(["promtool", "check", "metrics"], input=d.metrics_page(port),
                             capture_output=True, text=True)
        check(res.returncode == 0, f"promtool check metrics is clean on :{port} "
              f"{res.stdout.strip()} {res.stderr.strip()}")

    # --- Ctrl-C drains the requests in progress, then stops everything cleanly -----------------
    drained = {}

    def in_progress():
        drained["r"] = d.stream("/v1/completions", {
            "model": "tiny", "prompt": PROMPTS[5], "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True, "stream": True}, timeout=150)

    t = threading.Thread(target=in_progress)
    t.start()
    # Ctrl-C once the request holds its KV blocks (a busy machine may take a while to get it
    # there; a stop with nothing in progress has nothing to drain).
    check(wait_until(lambda: kv_usage() > 0), "the request to drain is running")
    d.proc.send_signal(signal.SIGINT)
    ready = None
    for _ in range(100):
        ready = d.request("GET", "/readyz", timeout=5)[0]
        if ready != 200:
            break
        time.sleep(0.02)
    late = completion(d, PROMPTS[6], 4)[0]
    check(ready == 503 and late == 503 and t.is_alive(),
          f"while draining: /readyz {ready}, a new request {late}")
    t.join(150)  # a machine busy with builds may decode slowly; the drain waits as long
    status, events, done = drained.get("r", (None, [], False))
    check(done and events[-1]["choices"][0]["finish_reason"] == "length",
          "the request in progress at Ctrl-C finished (drain)")
    code = d.stop(signal.SIGINT, timeout=60)
    check(code == 0 and "shardserve local: stopped" in d.log(),
          f"Ctrl-C stops the deployment cleanly (exit {code})")
finally:
    d.stop(signal.SIGKILL)
check(wait_until(lambda: not workers_running(WORKER), 10), "no worker process is left")

# --- a rank dies mid-request -----------------------------------------------------------------
d = Deployment(BIN, MODEL, max_batch=4, max_seq=4096,
               env={"SHARDSERVE_PEER_TIMEOUT_MS": "1000"},
               serving={"specialTokensInContent": "text"})
try:
    as_text = d.post("/v1/chat/completions", injected)[2]["usage"]["prompt_tokens"]
    check(as_text > prompt_tokens["special"] + 4 and
          d.post("/v1/chat/completions", plain)[2]["usage"]["prompt_tokens"] ==
          prompt_tokens["plain"],
          f"serving.specialTokensInContent: text tokenizes a message's special-token strings as "
          f"text ({as_text} prompt tokens, {prompt_tokens['special']} as control tokens); other "
          f"text is unchanged")
    outcome = {}

    def long_stream():
        outcome["stream"] = d.stream("/v1/completions", {
            "model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4000, "temperature": 0,
            "ignore_eos": True, "stream": True}, timeout=60)

    def long_plain():
        outcome["plain"] = completion(d, PROMPTS[1], 4000, timeout=60)

    threads = [threading.Thread(target=long_stream), threading.Thread(target=long_plain)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    victim = subprocess.run(["pgrep", "-f", "shardserve-worker rank --rank 3"],
                            capture_output=True, text=True).stdout.split()
    os.kill(int(victim[0]), signal.SIGKILL)
    t0 = time.monotonic()
    ready_status = None
    while time.monotonic() - t0 < 10:
        try:
            ready_status = d.request("GET", "/readyz", timeout=2)[0]
        except OSError:
            ready_status = "refused"
        if ready_status != 200:
            break
        time.sleep(0.05)
    check(ready_status != 200, f"/readyz stops being ready ({ready_status})")
    for t in threads:
        t.join(60)
    elapsed = time.monotonic() - t0
    status, events, done = outcome.get("stream", (None, [], False))
    check(events and "error" in events[-1] and "rank 3" in events[-1]["error"]["message"],
          "the streamed request ends with an error event naming the dead rank: " +
          (events[-1]["error"]["message"] if events and "error" in events[-1] else "none"))
    status, _, body = outcome.get("plain", (None, None, None))
    check(status == 503 and error_shape(body), f"the plain request ends with 503 ({status})")
    check(elapsed < 20, f"both ended in {elapsed:.1f} s, not a hang")
    check(wait_until(lambda: "replica 0 failed" in d.log() and "rank 3" in d.log()
                     and "restarting it" in d.log(), 30),
          "shardserve local names the failed rank and restarts its replica")

    def ready_again():
        try:
            return d.request("GET", "/readyz", timeout=2)[0] == 200
        except OSError:
            return False

    check(wait_until(ready_again, 90), "the restarted replica is ready again")
    status, _, body = d.post("/v1/completions", {"model": "tiny", "prompt": PROMPTS[0],
                                                 "max_tokens": 4, "temperature": 0})
    check(status == 200, f"and serves ({status})")
finally:
    d.stop(signal.SIGKILL)
check(wait_until(lambda: not workers_running(WORKER), 10),
      "no worker process is left after the failure")
check.finish()
