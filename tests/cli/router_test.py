#!/usr/bin/env python3
"""shardserve-router through real processes and sockets (issue 35 part 2).

1. `shardserve local` with 2 replicas puts the router on the model's port: every turn of a
   conversation (a long shared start, a growing history) goes to the replica that caches it and
   is answered from its cache; conversations spread over both replicas; answers equal a replica's
   own, streamed too; keys are checked at the router and the leaders' KV events need the
   router's token; a hot prefix spreads once its replica is loaded; the router's /metrics is
   promtool-clean, counts its decisions and is read with the router token (not an API key); a
   leader killed mid-stream (greedy, then seeded sampling): the router migrates the stream to the
   other replica, which goes on from the tokens sent, and the client's stream ends exactly as an
   undisturbed one; the dead replica is out at once, the other serves, and shardserve local
   restarts it.
2. A router in front of two single-replica deployments: one stops, requests keep being answered
   by the other; it comes back on the same address with an empty cache, and the router follows it
   again without routing by what it held before. The replica answering a long stream is stopped
   and drains: the router hands the stream to the other at once, and it ends as undisturbed."""
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from checks import (Checks, free_ports, listening_pid, metric,  # noqa: E402
                    promtool_clean, wait_until)
from deployment import Deployment, gen_model  # noqa: E402

BIN = sys.argv[1]
ROUTER = os.path.join(os.path.dirname(BIN), "shardserve-router")
check = Checks()
tmp = tempfile.mkdtemp(prefix="shardserve-router-")
MODEL = os.path.join(tmp, "model")
gen_model(BIN, MODEL)
KEY = "sk-router-cli-0123456789"
KEYS = os.path.join(tmp, "keys")
with open(KEYS, "w") as f:
    f.write(KEY + "\n")
TOKEN = "router-token-cli-0123456789"
TOKEN_FILE = os.path.join(tmp, "token")
with open(TOKEN_FILE, "w") as f:
    f.write(TOKEN + "\n")


def completion(d, prompt, max_tokens=4, port=None, **extra):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    body.update(extra)
    status, headers, data = d.request("POST", "/v1/completions", body, port=port)
    headers = {k.lower(): v for k, v in headers.items()}
    try:
        data = json.loads(data)
    except ValueError:
        pass
    return status, headers.get("x-shardserve-replica"), data


def conversation(c, turn):
    """Conversation c's prompt at its turn: a 160-token start of its own, then its history."""
    start = [1] + [(7 * c + 3 * k) % 400 + 50 for k in range(159)]
    history = [(11 * c + 5 * k) % 300 + 100 for k in range(24 * turn)]
    return start + history


# A moved stream ends exactly as the undisturbed one where the KV cache is F32: the other replica
# computes the prompt and the tokens sent in one prefill, whose sums run in another order than
# the steps' did, and BF16 (the model's dtype, kvCacheDtype auto) can round a key that differs in
# its last F32 bit to the next BF16 value, which over 160 sampled tokens may move a near tie.
EXACT = {"kvCacheDtype": "f32"}

# --- 1. the routed local deployment -------------------------------------------------------
d = Deployment(BIN, MODEL, tp=1, pp=1, replicas=2, max_batch=2, max_seq=2048,
               args=("--api-key-file", KEYS, "--router-token-file", TOKEN_FILE), api_key=KEY,
               serving=EXACT)
try:
    status, _, body = d.request("GET", "/readyz")
    check(status == 200 and json.loads(body)["routable_replicas"] == 2,
          "the router on the model's port is ready with both replicas routable")
    placed = {}
    ok = True
    for turn in range(3):
        for c in range(6):
            status, replica, body = completion(d, conversation(c, turn))
            ok &= status == 200
            cached = body["usage"]["prompt_tokens_details"]["cached_tokens"] if status == 200 else 0
            if turn == 0:
                placed[c] = replica
            else:
                ok &= replica == placed[c] and cached >= 160
    check(ok, f"every turn of a conversation goes to the replica that caches it and is answered "
              f"from its cache ({placed})")
    check(len(set(placed.values())) == 2, "conversations spread over both replicas")
    page = d.metrics_page(token=TOKEN)
    prefix = metric(page, "shardserve_router_decisions_total", reason="prefix") or 0
    expected = metric(page, "shardserve_router_expected_cached_tokens_total")
    prompts = metric(page, "shardserve_router_prompt_tokens_total")
    check(prefix == 12 and expected / prompts > 0.5,
          f"the router counts its decisions (prefix {prefix}) and the hit rate it expected "
          f"({expected:.0f} of {prompts:.0f} prompt tokens)")
    lint = promtool_clean(page)
    check(not lint, f"promtool check metrics is clean on the router {lint}".strip())

    # The router's answers are a replica's own, streamed too.
    prompt = conversation(0, 1)
    _, replica, via = completion(d, prompt, 8)
    port = int(replica.rsplit(":", 1)[1])
    _, _, direct = completion(d, prompt, 8, port=port)
    status, events, done = d.stream("/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "stream": True})
    streamed = "".join(e["choices"][0]["text"] for e in events)
    check(via["choices"][0]["text"] == direct["choices"][0]["text"] == streamed and done,
          "answers through the router equal the replica's own, streamed too")

    # Keys: checked at the router; the leaders' KV events want the router's token.
    saved, d.api_key = d.api_key, None
    status, _, _ = completion(d, [1, 2, 3])
    d.api_key = "sk-not-the-key-0123456789"
    status_wrong, _, _ = completion(d, [1, 2, 3])
    d.api_key = saved
    check(status == 401 and status_wrong == 401, "the router answers 401 without a valid key")
    for p in d.replica_ports:
        s1, _, _ = d.request("GET", "/v1/kv-events", port=p, timeout=10,
                             headers={"Authorization": "Bearer " + KEY})
        d.api_key = None
        s2, _, _ = d.request("GET", "/v1/kv-events", port=p, timeout=10)
        d.api_key = saved
        check(s1 == 401 and s2 == 401,
              f"a leader's KV events want the router's token, not an API key ({s1}, {s2})")

    # A hot prefix: 8 requests at once (batches of 2) spread once its replica is loaded.
    hot = conversation(9, 0)
    completion(d, hot)
    seen, lock = [], threading.Lock()

    def one(i):
        _, replica, _ = completion(d, hot + [400 + i], 256)
        with lock:
            seen.append(replica)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    load = metric(d.metrics_page(token=TOKEN), "shardserve_router_decisions_total",
                  reason="load") or 0
    check(len(set(seen)) == 2 and load >= 1,
          f"a hot prefix spreads to the other replica once its own is loaded "
          f"({seen.count(seen[0])} of 8 on one, {load:.0f} chosen by load)")
    page = d.metrics_page(token=KEY)
    check("shardserve_router_expected_cached_tokens_total" not in page,
          "the router's expected hits are not readable with an API key")

    # Request migration (issue 55): a leader dies in the middle of a stream; the router goes on
    # with it on the other replica from the tokens already sent, and the client's stream ends
    # as the undisturbed one does (greedy, and seeded sampling): same text, same stream id, no
    # error, [DONE]. The dead replica is out at once and the other answers; shardserve local
    # restarts it. Both leaders' pids are found before the stream, so the one serving it dies at
    # once; which one serves it is the router's choice (cache or load), read from its header.
    def events(raw):
        out = []
        for block in raw.decode().split("\n\n"):
            if block.startswith("data: ") and block != "data: [DONE]":
                out.append(json.loads(block[6:]))
        return out

    def body(extra):
        b = {"model": "tiny", "prompt": conversation(0, 0), "stream": True, "max_tokens": 1500,
             "temperature": 0, "ignore_eos": True}
        b.update(extra)
        return b

    def stream(extra, kill=False):
        """(replica, the stream's bytes); with kill, the leader answering it dies after its
        first event."""
        victim = {p: listening_pid(p) for p in d.replica_ports} if kill else {}
        conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=120)
        conn.request("POST", "/v1/completions", body=json.dumps(body(extra)),
                     headers={"Content-Type": "application/json",
                              "Authorization": f"Bearer {KEY}"})
        r = conn.getresponse()
        port = int(r.getheader("x-shardserve-replica", ":0").rsplit(":", 1)[1])
        first = r.readline()
        if kill:
            os.kill(victim[port], signal.SIGKILL)
        raw = first + r.read()
        conn.close()
        return port, raw

    def both_routable():
        s, _, b = d.request("GET", "/readyz", timeout=5)
        return s == 200 and json.loads(b)["routable_replicas"] == 2

    # Only the router resumes a stream: a client's "shardserve_resume" is refused by name.
    status, _, refused = completion(d, [1, 2, 3], port=d.replica_ports[0], stream=True,
                                    shardserve_resume={"tokens": [5]})
    check(status == 403 and "shardserve_resume" in str(refused),
          f"a client may not resume a stream at a leader ({status} {refused})")
    status, _, refused = completion(d, [1, 2, 3], stream=True, shardserve_resume={"tokens": [5]})
    check(status == 401 and "shardserve_resume" in str(refused),
          f"nor through the router, which relays with its token ({status} {refused})")
    victim_port = None
    for name, extra in [("greedy", {}), ("seeded", {"temperature": 0.9, "seed": 1234})]:
        _, whole = stream(extra)
        port, moved = stream(extra, kill=True)
        victim_port = victim_port or port
        want, got = events(whole), events(moved)
        text = lambda evs: "".join(e["choices"][0]["text"] for e in evs if e.get("choices"))
        check(b"[DONE]" in moved and not any("error" in e for e in got) and
              text(got) == text(want) and len(text(want)) > 0 and
              {e["id"] for e in got} == {got[0]["id"]},
              f"{name}: a stream whose leader dies goes on on the other replica and ends as the "
              f"undisturbed one ({len(text(got))} vs {len(text(want))} characters, "
              f"{len({e['id'] for e in got})} stream id(s), end {moved[-80:]!r})")
        if name == "greedy":
            status, _, b = d.request("GET", "/readyz")
            check(status == 200 and json.loads(b)["routable_replicas"] == 1,
                  f"the dead replica is out of routing at once ({b!r})")
            answered = {completion(d, conversation(0, 0) + [i])[:2] for i in range(3)}
            other = next(p for p in d.replica_ports if p != victim_port)
            check(answered == {(200, f"127.0.0.1:{other}")},
                  f"the healthy replica keeps serving ({answered})")
            check(wait_until(lambda: "restarting it" in d.log(), 20),
                  "shardserve local says it restarts the failed replica")
        check(wait_until(both_routable, 90), f"{name}: the restarted replica is routed again")
    # A whole (non-streamed) answer whose leader dies is asked of the other replica: it answers.
    _, _, want = completion(d, conversation(0, 0), 1500)
    got = {}
    t = threading.Thread(target=lambda: got.update(r=completion(d, conversation(0, 0), 1500)))
    pids = {p: listening_pid(p) for p in d.replica_ports}
    t.start()

    def serving():
        page = d.metrics_page(token=TOKEN)
        return next((p for p in d.replica_ports if metric(
            page, "shardserve_router_replica_in_flight", replica=f"127.0.0.1:{p}") == 1), None)
    victim, deadline = None, time.monotonic() + 20
    while victim is None and time.monotonic() < deadline:
        victim = serving()
    if victim:
        os.kill(pids[victim], signal.SIGKILL)
    t.join()
    status, replica, answer = got["r"]
    check(victim and status == 200 and replica != f"127.0.0.1:{victim}" and
          answer["choices"][0]["text"] == want["choices"][0]["text"],
          f"a whole answer whose leader dies is answered by the other replica ({status}, "
          f"{replica}, killed {victim})")
    check(wait_until(both_routable, 90), "the restarted replica is routed again")
    page = d.metrics_page(token=TOKEN)
    moved_n = metric(page, "shardserve_router_migrations_total", reason="failure") or 0
    check(moved_n >= 3, f"the router counts the migrations ({moved_n:.0f})")

finally:
    code = d.stop(signal.SIGINT)
check(code == 0, f"Ctrl-C stops the routed deployment cleanly (exit {code})")

# --- 2. a replica goes away and comes back -----------------------------------------------
# Single-replica deployments whose leaders take the router's token (--router-token-file).
# They drain for up to a minute when stopped (the router hands their streams on at once).
TOKENED = ("--router-token-file", TOKEN_FILE)
DRAIN = {"SHARDSERVE_DRAIN_SECONDS": "60"}
a = Deployment(BIN, MODEL, tp=1, pp=1, max_seq=4096, env=DRAIN, args=TOKENED, serving=EXACT)
b = Deployment(BIN, MODEL, tp=1, pp=1, max_seq=4096, env=DRAIN, args=TOKENED, serving=EXACT)
router_port = free_ports(1)
router = subprocess.Popen([ROUTER, "--leader", f"127.0.0.1:{a.port},127.0.0.1:{b.port}",
                           "--model", MODEL, "--port", str(router_port), "--host", "127.0.0.1",
                           "--model-label", "tiny", "--leader-token-file", TOKEN_FILE],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
a2 = None
try:
    def routable():
        try:
            s, _, body = a.request("GET", "/readyz", port=router_port, timeout=5)
            return json.loads(body).get("routable_replicas", 0) if s == 200 else 0
        except OSError:
            return 0

    check(wait_until(lambda: routable() == 2), "the standalone router follows both leaders")
    x = conversation(3, 0)
    _, first, _ = completion(a, x, port=router_port)
    stop, other = (a, b) if first.endswith(f":{a.port}") else (b, a)
    stop.stop(signal.SIGINT)
    statuses = set()
    for i in range(4):
        s, replica, body = completion(other, x + [i], port=router_port)
        statuses.add((s, replica))
    check(statuses == {(200, f"127.0.0.1:{other.port}")},
          f"with one replica gone, every request is answered by the other ({statuses})")
    check(wait_until(lambda: routable() == 1), "the router stops routing to the gone replica")
    # It comes back on the same address, with an empty cache.
    a2 = Deployment(BIN, MODEL, tp=1, pp=1, max_seq=4096, env=DRAIN, base_port=stop.port,
                    args=TOKENED, serving=EXACT)
    check(wait_until(lambda: routable() == 2, 30), "the router follows the recreated replica")
    page = other.metrics_page(router_port, token=TOKEN)
    cached = metric(page, "shardserve_router_replica_cached_blocks", replica=f"127.0.0.1:{a2.port}")
    check(cached == 0, f"the recreated replica's cache starts empty at the router ({cached})")
    s, replica, _ = completion(other, x + [99], port=router_port)
    check(s == 200 and replica == f"127.0.0.1:{other.port}",
          "the prompt goes to the replica that still caches it, not by what the old one held")

    # Drain (issue 55): the replica answering a long stream is stopped and drains; the router
    # hands the stream to the other replica at once (rather than waiting up to the minute),
    # which goes on from the tokens sent: the client's stream ends as the undisturbed one.
    long = {"model": "tiny", "prompt": conversation(4, 0), "stream": True, "max_tokens": 3800,
            "temperature": 0, "ignore_eos": True}

    def long_stream(stop_it):
        conn = http.client.HTTPConnection("127.0.0.1", router_port, timeout=120)
        conn.request("POST", "/v1/completions", body=json.dumps(long),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        port = int(r.getheader("x-shardserve-replica", ":0").rsplit(":", 1)[1])
        raw = r.readline()
        if stop_it:
            {a2.port: a2, other.port: other}[port].proc.send_signal(signal.SIGINT)
        raw += r.read()
        conn.close()
        return raw

    def text(raw):
        return "".join(json.loads(e[6:])["choices"][0]["text"] for e in raw.decode().split("\n\n")
                       if e.startswith("data: {") and '"error"' not in e)

    whole = long_stream(False)
    t0 = time.monotonic()
    moved = long_stream(True)
    took = time.monotonic() - t0
    page = other.metrics_page(router_port, token=TOKEN)
    drained = metric(page, "shardserve_router_migrations_total", reason="drain") or 0
    check(b"[DONE]" in moved and b'"error"' not in moved and text(moved) == text(whole) and
          drained == 1,
          f"a stream whose replica drains goes on on the other at once and ends as the "
          f"undisturbed one ({len(text(moved))} vs {len(text(whole))} characters, {drained:.0f} "
          f"drain migration(s), {took:.1f} s)")
finally:
    router.send_signal(signal.SIGINT)
    try:
        rc = router.wait(30)
    except subprocess.TimeoutExpired:
        router.kill()
        rc = -1
    for dep in (a, b, a2):
        if dep is not None:
            dep.stop(signal.SIGINT)
check(rc == 0, f"the router stops cleanly on SIGINT (exit {rc})")
check.finish()
