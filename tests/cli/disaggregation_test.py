"""Disaggregated prefill and decode over HTTP between two `shardserve local` deployments of one
model, sharded differently (prefill TP=2 x PP=1, decode TP=1 x PP=2), real processes and sockets,
the KV crossing over UCX: a request's prefill leg (kv_transfer_params do_remote_decode, with the
router's token) answers the handoff; its decode leg (the handoff) answers what the decode replica
answers alone — text, tokens and logprobs, greedy and seeded, n, stop strings, structured output,
streamed; a forged ticket is prefilled on the decode replica with the same answer; a leg without
the router's token or on the wrong role is refused by name. Then shardserve-router pairs them:
a client's request is prefilled on the prefill replica and decoded on the decode replica, the
same answers, streamed too; a decode rank killed mid-stream: the stream waits for the restarted
replica and goes on there to its end; with the prefill replica gone, the decode replica serves
alone.
Then `shardserve local` runs a ShardedModel with spec.disaggregation (both roles and the router)
and `shardserve plan` places both roles. Last, the two legs on a GGUF model (Q8_0): the same
answers."""
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from checks import (Checks, cpu_kernels, free_ports, listening_pid, metric,  # noqa: E402
                    wait_until)
from deployment import Deployment, gen_model  # noqa: E402

BIN = sys.argv[1]
ROUTER_BIN = os.path.join(os.path.dirname(BIN), "shardserve-router")
check = Checks()
tmp = tempfile.mkdtemp(prefix="shardserve-disagg-")
MODEL = os.path.join(tmp, "model")
gen_model(BIN, MODEL)
# The roles are sharded differently, so they sum a row-parallel projection's halves in other
# orders: in F32 arithmetic a few 1e-7, at the CPU kernel level that rounds BF16 weights'
# activations (avx512bf16, auto's on AMD with AVX512-BF16) ~1e-2 in logprobs, which would move a
# sampled token. What this test compares (the decode leg against the decode replica alone) is the
# KV's transfer, so there it runs the F32 level.
if cpu_kernels(BIN, MODEL) == "avx512bf16":
    os.environ["SHARDSERVE_CPU_KERNELS"] = "avx512"
TOKEN = "router-token-disagg-0123456789"
TOKEN_FILE = os.path.join(tmp, "router-token")
with open(TOKEN_FILE, "w") as f:
    f.write(TOKEN + "\n")
ROUTER = {"x-shardserve-router": f"Bearer {TOKEN}"}
LONG = [1] + [(37 * i) % 500 + 3 for i in range(70)]  # 71 tokens: whole blocks and a part


def deployment(name, role, tp, pp, model=MODEL):
    # A pull waits at most 3 s before the decode replica prefills by itself.
    return Deployment(BIN, model, name="tiny", tp=tp, pp=pp, max_seq=2048,
                      env={"SHARDSERVE_KV_ROLE": role, "SHARDSERVE_KV_TRANSFER_TIMEOUT_MS": "3000"},
                      args=("--router-token-file", TOKEN_FILE))


def ready(d):
    try:
        return d.request("GET", "/readyz", timeout=5)[0] == 200
    except OSError:
        return False


def disaggregated(path, body, forge=False, roles=None):
    """The prefill leg, then the decode leg with its handoff: (status, body) of the decode leg.
    `roles`: the (prefill, decode) deployments, else the first two."""
    prefill, decode = roles or (globals()["prefill"], globals()["decode"])
    status, _, pre = prefill.post(path, dict(body, kv_transfer_params={"do_remote_decode": True}),
                                  headers=ROUTER)
    if status != 200:
        return status, pre
    params = pre["kv_transfer_params"]
    if forge:
        for s in params["sequences"]:
            t = s["ticket"]
            s["ticket"] = ("0" if t[0] != "0" else "1") + t[1:]
    status, _, out = decode.post(path, dict(body, kv_transfer_params=params), headers=ROUTER)
    return status, out


def same(a, b, what):
    """Two completions: the same texts, finish reasons and (where given) tokens and logprobs."""
    ok = len(a["choices"]) == len(b["choices"])
    for x, y in zip(a["choices"], b["choices"]):
        ok &= x.get("text", x.get("message")) == y.get("text", y.get("message"))
        ok &= x["finish_reason"] == y["finish_reason"]
        lx, ly = x.get("logprobs"), y.get("logprobs")
        if lx and "tokens" in lx:
            ok &= lx["tokens"] == ly["tokens"]
            ok &= all(abs(p - q) < 1e-3 for p, q in zip(lx["token_logprobs"],
                                                         ly["token_logprobs"]))
    check(ok, what if ok else f"{what}\n  {json.dumps(a)[:600]}\n  {json.dumps(b)[:600]}")


prefill = deployment("prefill", "prefill", 2, 1)
decode = deployment("decode", "decode", 1, 2)
try:
    greedy = {"model": "tiny", "prompt": LONG, "max_tokens": 12, "temperature": 0,
              "ignore_eos": True, "logprobs": 2}
    status, out = disaggregated("/v1/completions", greedy)
    check(status == 200, f"the two legs answer ({status})")
    _, _, alone = decode.post("/v1/completions", greedy)
    same(out, alone, "greedy tokens and logprobs after a TP=2 prefill equal the decode replica's "
                     "own (TP=1 x PP=2)")
    check(out["usage"]["prompt_tokens"] == len(LONG) and
          out["usage"]["completion_tokens"] == 12, f"usage counts the prompt ({out['usage']})")
    page = decode.metrics_page()
    pulled = metric(page, "shardserve_kv_transfers_total", outcome="pulled")
    moved = metric(page, "shardserve_kv_transfer_bytes_total")
    # 71 positions in 5 blocks of 16, 4 layers, K and V, 2 KV heads of 32 dims: f32 or bf16.
    roles = (metric(prefill.metrics_page(), "shardserve_queued_prompt_tokens", role="prefill"),
             metric(page, "shardserve_running_sequences", role="decode"))
    check(None not in roles, f"each leader reports its backlog under its role {roles}")
    usage = (metric(prefill.metrics_page(prefill.metrics_ports[1]),
                    "shardserve_rank_kv_cache_usage_ratio", role="prefill"),
             metric(decode.metrics_page(decode.metrics_ports[1]),
                    "shardserve_rank_kv_cache_usage_ratio", role="decode"))
    check(None not in usage, f"and every rank its KV cache usage under its role {usage}")
    check(pulled == 1 and moved in (5 * 16 * 4 * 2 * 64 * 4, 5 * 16 * 4 * 2 * 64 * 2),
          f"the decode replica took the prompt's KV from the prefill replica ({pulled} pulled, "
          f"{moved} bytes)")

    # The decode replica caches the prompt's first 4 blocks: a longer prompt moves only the rest.
    longer = dict(greedy, prompt=LONG + [9] * 12)  # 83 positions: 6 blocks
    status, out = disaggregated("/v1/completions", longer)
    more = metric(decode.metrics_page(), "shardserve_kv_transfer_bytes_total") - moved
    same(out, decode.post("/v1/completions", longer)[2],
         "a prompt whose start the decode replica caches gives the same answer")
    check(more in (2 * 16 * 4 * 2 * 64 * 4, 2 * 16 * 4 * 2 * 64 * 2) and
          out["usage"]["prompt_tokens_details"]["cached_tokens"] == 64,
          f"and only the blocks past the decode replica's cached prefix move ({more} bytes, "
          f"{out['usage']['prompt_tokens_details']['cached_tokens']} tokens cached)")

    sampled = {"model": "tiny", "prompt": LONG[:40], "max_tokens": 10, "temperature": 0.9,
               "seed": 7, "n": 2, "ignore_eos": True, "logprobs": 1, "presence_penalty": 0.5}
    same(disaggregated("/v1/completions", sampled)[1],
         decode.post("/v1/completions", sampled)[2],
         "seeded sampling with n=2 and a penalty goes on from the prefill replica's first token")

    text = alone["choices"][0]["text"]
    stop = text[3:6] if len(text) > 6 else text[-2:]
    stopped = dict(greedy, stop=[stop])
    same(disaggregated("/v1/completions", stopped)[1], decode.post("/v1/completions", stopped)[2],
         f"a stop string ({stop!r}) ends both the same")

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x " * 40}],
            "max_tokens": 16, "temperature": 0, "seed": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
                "type": "object", "properties": {"n": {"type": "integer"}},
                "required": ["n"]}}}}
    status, out = disaggregated("/v1/chat/completions", chat)
    _, _, alone_chat = decode.post("/v1/chat/completions", chat)
    same(out, alone_chat, "structured output: the grammar follows the first token across")

    # The decode leg streamed: the same text as the decode replica's own.
    status, _, pre = prefill.post("/v1/completions",
                                  dict(greedy, kv_transfer_params={"do_remote_decode": True}),
                                  headers=ROUTER)
    body = dict(greedy, stream=True, kv_transfer_params=pre["kv_transfer_params"])
    conn = http.client.HTTPConnection("127.0.0.1", decode.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json", **ROUTER})
    events = [json.loads(line[6:]) for line in conn.getresponse().read().decode().splitlines()
              if line.startswith("data: {")]
    conn.close()
    streamed = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    check(streamed == text, f"streamed, the decode leg's text is the same ({streamed!r})")

    # A ticket nobody offered: the decode replica prefills by itself, same answer.
    status, out = disaggregated("/v1/completions", greedy, forge=True)
    same(out, alone, "a forged ticket is refused by the prefill replica; the decode replica "
                     "prefills itself and answers the same")
    failed = metric(decode.metrics_page(), "shardserve_kv_transfers_total", outcome="failed")
    check(failed == 1, f"the failed transfer is counted ({failed})")

    # Faults on the prefill replica between its leg and the decode leg: a rank that stops
    # answering (SIGSTOP: the transfer stalls) and one that dies. The decode replica answers the
    # same within seconds, by itself.
    for sig, what in ((signal.SIGSTOP, "stalls"), (signal.SIGKILL, "dies")):
        check(wait_until(lambda: ready(prefill), 90), "the prefill replica is ready")
        status, _, pre = prefill.post("/v1/completions",
                                      dict(greedy, kv_transfer_params={"do_remote_decode": True}),
                                      headers=ROUTER)
        rank1 = listening_pid(prefill.metrics_ports[1])
        os.kill(rank1, sig)
        t0 = time.monotonic()
        status, _, out = decode.post("/v1/completions",
                                     dict(greedy, kv_transfer_params=pre["kv_transfer_params"]),
                                     headers=ROUTER)
        took = time.monotonic() - t0
        if sig == signal.SIGSTOP:
            os.kill(rank1, signal.SIGKILL)  # its replica is restarted
        same(out, alone, f"a prefill rank that {what} mid-transfer: the decode replica prefills "
                         f"itself and answers the same in {took:.1f} s")
    check(wait_until(lambda: ready(prefill), 90), "the prefill replica is restarted")
    # Refusals, by name.
    s1, _, b1 = prefill.post("/v1/completions",
                             dict(greedy, kv_transfer_params={"do_remote_decode": True}))
    s2, _, b2 = prefill.post("/v1/completions",
                             dict(greedy, kv_transfer_params={"do_remote_decode": True}),
                             headers={"x-shardserve-router": "Bearer not-the-token-0123456789"})
    check(s1 == 401 and s2 == 401 and "x-shardserve-router" in b1["error"]["message"],
          f"a leg without the router's token is refused ({s1}, {s2}: {b1['error']['message']})")
    s3, _, b3 = decode.post("/v1/completions",
                            dict(greedy, kv_transfer_params={"do_remote_decode": True}),
                            headers=ROUTER)
    check(s3 == 400 and "not a prefill replica" in b3["error"]["message"],
          f"a prefill leg on a decode replica is refused ({b3['error']['message']})")
    s4, _, b4 = decode.post("/v1/completions",
                            dict(greedy, kv_transfer_params={"do_remote_prefill": True}),
                            headers=ROUTER)
    check(s4 == 400 and "'kv_transfer_params': 'shape' is missing" in b4["error"]["message"],
          f"a handoff without its fields is refused by name ({b4['error']['message']})")
    s5, _, b5 = prefill.post("/v1/completions", dict(greedy, kv_transfer_params={"x": 1}),
                             headers=ROUTER)
    check(s5 == 400 and b5["error"]["param"] == "kv_transfer_params",
          f"kv_transfer_params of neither leg is refused ({b5['error']['message']})")
    s7, _, b7 = prefill.post("/v1/completions",
                             dict(greedy, stream=True, kv_transfer_params={"do_remote_decode": True}),
                             headers=ROUTER)
    check(s7 == 400 and b7["error"]["param"] == "stream",
          f"a streamed prefill leg is refused by name ({b7['error']['message']})")
    s6, _, b6 = prefill.post("/v1/completions", dict(greedy, echo=True, max_tokens=1,
                                                     kv_transfer_params={"do_remote_decode": True}),
                             headers=ROUTER)
    check(s6 == 400 and "echo with logprobs" in b6["error"]["message"],
          f"a prompt scored on one replica is not split ({b6['error']['message']})")

    # --- shardserve-router pairs them ---------------------------------------------------------
    port = free_ports(1)
    router = subprocess.Popen([ROUTER_BIN, "--leader", f"127.0.0.1:{decode.port}",
                               "--prefill-leader", f"127.0.0.1:{prefill.port}", "--model", MODEL,
                               "--port", str(port), "--host", "127.0.0.1", "--model-label",
                               "tiny", "--leader-token-file", TOKEN_FILE],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def routable():
            try:
                s, _, body = decode.request("GET", "/readyz", port=port, timeout=5)
                return json.loads(body).get("routable_replicas", 0) if s == 200 else 0
            except OSError:
                return 0

        def router_log():
            router.send_signal(signal.SIGINT)
            return router.communicate(timeout=30)[0][-3000:]

        def paired(outcome):
            page = decode.metrics_page(port, token=TOKEN)
            return metric(page, "shardserve_router_disaggregated_total", outcome=outcome) or 0

        check(wait_until(lambda: routable() == 2, 90), "the router follows both roles' leaders")
        pulled0 = metric(decode.metrics_page(), "shardserve_kv_transfers_total", outcome="pulled")
        fresh = dict(greedy, prompt=[2] + LONG[1:])
        status, headers, out = decode.post("/v1/completions", fresh, port=port)
        pulled1 = metric(decode.metrics_page(), "shardserve_kv_transfers_total", outcome="pulled")
        same(out, decode.post("/v1/completions", fresh)[2],
             "through the router: the decode replica's own answer")
        check(headers.get("x-shardserve-replica") == f"127.0.0.1:{decode.port}" and
              paired("paired") == 1 and pulled1 == pulled0 + 1,
              f"the router paired the roles: prefilled on one, decoded on the other after a KV "
              f"transfer ({headers.get('x-shardserve-replica')}, {pulled1 - pulled0} pulled)" +
              ("" if pulled1 == pulled0 + 1 else decode.log()[-3000:] + router_log()))
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps(dict(greedy, stream=True)),
                     headers={"Content-Type": "application/json"})
        events = [json.loads(line[6:])
                  for line in conn.getresponse().read().decode().splitlines()
                  if line.startswith("data: {")]
        conn.close()
        check("".join(e["choices"][0]["text"] for e in events if e["choices"]) == text and
              paired("paired") == 2, "streamed through the router, the same text")
        s, _, b = decode.post("/v1/completions",
                              dict(greedy, kv_transfer_params={"do_remote_prefill": True}),
                              port=port)
        check(s == 401, f"a client's own kv_transfer_params is refused ({s})")
        # A decode rank dies mid-stream (a stream the router paired): the decode replica is
        # restarted, and the router, which has no other decode replica meanwhile, waits for it
        # and the stream goes on there to its end (request migration), no error event.
        victim = listening_pid(decode.metrics_ports[1])  # stage 1's rank
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions",
                     body=json.dumps(dict(greedy, prompt=[3] + LONG[1:], max_tokens=1900,
                                          stream=True)),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        first = r.readline()
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        rest = first + r.read()
        took = time.monotonic() - t0
        conn.close()
        check(b'"error"' not in rest and rest.rstrip().endswith(b"data: [DONE]") and
              paired("paired") == 3,
              f"a decode rank killed mid-stream: the paired stream goes on at the restarted "
              f"replica and ends after {took:.1f} s with [DONE], no error ({rest[-160:]!r})")
        check(wait_until(lambda: ready(decode), 90) and wait_until(lambda: routable() == 2, 60),
              "the decode replica is restarted, and the router follows it again")
        # The prefill replica goes: the decode replica serves alone.
        prefill.stop()
        status, _, out = decode.post("/v1/completions", greedy, port=port)
        same(out, alone, "with the prefill replica gone, the decode replica answers alone")
        check(paired("prefill_failed") >= 1, "and the router counts it")
    finally:
        router.send_signal(signal.SIGINT)
        router.wait(30)
finally:
    prefill.stop()
    decode.stop()

# --- shardserve local and plan with spec.disaggregation ----------------------------------------
MANIFEST = f"""apiVersion: shardserve.io/v1alpha1
kind: ShardedModel
metadata:
  name: tiny
spec:
  replicas: 1
  model:
    name: tiny
    uri: file://{MODEL}
  parallelism:
    tensor: 1
    pipeline: 2
  disaggregation:
    prefill:
      replicas: 1
      parallelism:
        tensor: 2
        pipeline: 1
  worker:
    image: w
  serving:
    maxSequenceLength: 2048
"""
manifest = os.path.join(tmp, "disaggregated.yaml")
with open(manifest, "w") as f:
    f.write(MANIFEST)
out = subprocess.run([BIN, "plan", "-f", manifest, "--nodes",
                      os.path.join(os.path.dirname(__file__), "..", "..", "examples",
                                   "nodes.yaml")], capture_output=True, text=True)
placed = (out.returncode == 0 and "tiny: decode 1 replica(s) of TP=1 x PP=2" in out.stdout and
          "tiny: prefill 1 replica(s) of TP=2 x PP=1" in out.stdout and
          "prefill replica 0: stage 0 ->" in out.stdout)
check(placed, "shardserve plan places both roles" + ("" if placed else out.stdout + out.stderr))
port = free_ports(2 + 2 + 4)
local = subprocess.Popen([BIN, "local", "-f", manifest, "--port", str(port),
                          "--metrics-port-base", str(port + 3)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
lines = []
try:
    for line in local.stdout:
        lines.append(line)
        if "shardserve local: serving" in line or local.poll() is not None:
            break
    log = "".join(lines)
    both = ("plan: decode: 1 replica(s) x 2 stage(s) x 1 tensor-parallel rank(s)" in log and
            "plan: prefill: 1 replica(s) x 1 stage(s) x 2 tensor-parallel rank(s)" in log and
            "shardserve local: serving" in log)
    check(both, "shardserve local runs both roles, the router in front" + ("" if both else log))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(greedy),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    body = json.loads(r.read())
    conn.close()
    check(r.status == 200 and body["choices"][0]["text"] == text,
          "and answers as the decode replica alone did")
    page = decode.metrics_page(port + 1)  # the decode replica's leader
    check(metric(page, "shardserve_kv_transfers_total", outcome="pulled") == 1,
          "after a KV transfer between them")
finally:
    local.send_signal(signal.SIGINT)
    check(local.wait(60) == 0, "Ctrl-C stops both roles and the router")

# A GGUF model (Q8_0 weights): the same transfer, the same answers.
GGUF = os.path.join(tmp, "model.gguf")
gen_model(BIN, GGUF, "--format", "gguf", "--gguf-type", "q8_0")
roles = (deployment("prefill-gguf", "prefill", 2, 1, GGUF), deployment("decode-gguf", "decode", 1,
                                                                       2, GGUF))
try:
    for body in (greedy, sampled):
        status, out = disaggregated("/v1/completions", body, roles=roles)
        check(status == 200, f"GGUF: the two legs answer ({status})")
        if status == 200:
            same(out, roles[1].post("/v1/completions", body)[2],
                 f"GGUF (Q8_0): {'greedy' if body is greedy else 'seeded, n=2'} tokens and "
                 "logprobs after a TP=2 prefill equal the decode replica's own (TP=1 x PP=2)")
    page = roles[1].metrics_page()
    pulls = (metric(page, "shardserve_kv_transfers_total", outcome="pulled"),
             metric(page, "shardserve_kv_transfers_total", outcome="failed"))
    check(pulls[0] == 3 and not pulls[1], f"GGUF: each sequence's KV taken from the prefill replica "
                              f"(1 + n=2; pulled, failed: {pulls})")
finally:
    for d in roles:
        d.stop()
check.finish()
