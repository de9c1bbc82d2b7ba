#!/usr/bin/env python3
"""A client written by others against our server: the official `openai` Python package drives
completions, chat and streaming on a `shardserve local` TP=2 x PP=2 deployment that requires an
API key, and its error types see our errors (a wrong key is an AuthenticationError). With
transformers in the same environment, the chat prompt the server renders is checked against
transformers' apply_chat_template for each chat family, and, on the templates with tools (Hermes,
Llama 3 JSON, Mistral, DeepSeek-V3.1, gpt-oss's harmony), with tools and a tool round trip (an assistant's calls, a
tool's answer) and constrained calls in each format; on a thinking template, the reasoning as the
client reads it (reasoning_content) and structured output after it."""
import json
import os
import signal
import sys
import tempfile

import openai

sys.path.insert(0, os.path.dirname(__file__))
from checks import BF16_ACTIVATIONS, Checks, cpu_kernels  # noqa: E402
from deployment import Deployment, gen_model  # noqa: E402
from vllm_messages import as_vllm_hands_them  # noqa: E402

BIN = sys.argv[1]
check = Checks()
tmp = tempfile.mkdtemp(prefix="shardserve-openai-")
KEY = "sk-shardserve-test-0123456789"
KEYS = os.path.join(tmp, "api-keys")
with open(KEYS, "w") as f:
    f.write(KEY + "\n")

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one, please."}]

# One model per chat family: the server's prompt must be transformers' prompt, token for token
# (checked through usage.prompt_tokens and through the greedy answer to the same token ids).
FAMILIES = [("llama3", ["--arch", "llama"]), ("chatml", ["--arch", "qwen2"]),
            ("llama2", ["--arch", "llama", "--tokenizer", "sentencepiece"]),
            ("mistral", ["--arch", "mistral", "--tokenizer", "sentencepiece"]),
            ("hermes", ["--arch", "qwen2", "--chat-template", "hermes"]),
            ("llama3-tools", ["--arch", "llama", "--chat-template", "llama3-tools"]),
            ("mistral-tools", ["--arch", "mistral", "--tokenizer", "sentencepiece",
                               "--chat-template", "mistral-tools"]),
            ("deepseek-tools", ["--arch", "qwen2", "--chat-template", "deepseek-tools"]),
            ("chatml-think", ["--arch", "qwen2", "--chat-template", "chatml-think"]),
            ("harmony", ["--arch", "qwen2", "--chat-template", "harmony"])]
TOOL_FAMILIES = ("hermes", "llama3-tools", "mistral-tools", "deepseek-tools", "harmony")
THINK_FAMILIES = ("chatml-think",)

# A tool round trip as an application sends it: the tools (their schema's keys not in sorted
# order), the assistant's call with its arguments as a JSON string, the tool's answer.
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]},
                                                    "city": {"type": "string"}},
                   "required": ["city"]}}}]
# The same function with bounded arguments and strict: what constrained calls are checked with.
BOUNDED_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}]
ROUND_TRIP = [{"role": "user", "content": "Weather in Oslo?"},
              {"role": "assistant", "content": None, "tool_calls": [{
                  "id": "call_1", "type": "function",
                  "function": {"name": "get_weather",
                               "arguments": "{\"city\": \"Oslo\", \"unit\": \"c\"}"}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 3}"}]


def tool_checks(family, client, d, tok):
    """Tools on the templates that render them (Hermes; Llama 3 with tools): the prompt is
    transformers' apply_chat_template(tools=...) token for token (/tokenize, and
    usage.prompt_tokens); tool_choice none leaves them out; streamed and whole answers agree; what
    we cannot run yet is refused by name; a template that renders no tools refuses them."""
    if family not in TOOL_FAMILIES:
        try:
            client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                           max_tokens=4)
            check(False, f"{family}: tools on a template without them are refused")
        except openai.BadRequestError as e:
            check(e.status_code == 400 and "does not render tools" in str(e),
                  f"{family}: tools on a template without them are refused: {e.message}")
        return
    status, _, body = d.post("/tokenize", {"model": "tiny", "messages": ROUND_TRIP,
                                           "tools": TOOLS})
    check(status == 200, f"{family}: /tokenize of a tool round trip answers ({status})")
    chat = client.chat.completions.create(model="tiny", messages=ROUND_TRIP, tools=TOOLS,
                                          max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
    check(chat.choices[0].finish_reason in ("length", "tool_calls"),
          f"{family}: a tool round trip is answered ({chat.choices[0].finish_reason})")
    plain = client.chat.completions.create(model="tiny", messages=ROUND_TRIP, tools=TOOLS,
                                           tool_choice="none", max_tokens=4, temperature=0)
    if tok is not None:
        want = tok.apply_chat_template(as_vllm_hands_them(ROUND_TRIP), tools=TOOLS,
                                       add_generation_prompt=True, tokenize=True, return_dict=False)
        check(status == 200 and body["tokens"] == list(want),
              f"{family}: the tool round trip's prompt is transformers', token for token "
              f"({body.get('count')} vs {len(want)})")
        check(chat.usage.prompt_tokens == len(want),
              f"{family}: chat with tools prompts transformers' tokens ({chat.usage.prompt_tokens} "
              f"vs {len(want)})")
        bare = tok.apply_chat_template(as_vllm_hands_them(ROUND_TRIP), add_generation_prompt=True,
                                       tokenize=True, return_dict=False)
        check(plain.usage.prompt_tokens == len(bare) < len(want),
              f"{family}: tool_choice none leaves the tools out ({plain.usage.prompt_tokens} vs "
              f"{len(bare)})")
        same = client.completions.create(model="tiny", prompt=list(want), max_tokens=12,
                                         temperature=0, extra_body={"ignore_eos": True})
        text = chat.choices[0].message.content or ""
        check(text == same.choices[0].text or chat.choices[0].message.tool_calls,
              f"{family}: the answer with tools == the completion of transformers' prompt ids")
    content, calls, finish = [], [], None
    for chunk in client.chat.completions.create(model="tiny", messages=ROUND_TRIP, tools=TOOLS,
                                                max_tokens=12, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True}):
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    check("".join(content) == (chat.choices[0].message.content or "") and
          len(calls) == len(chat.choices[0].message.tool_calls or []) and
          finish == chat.choices[0].finish_reason,
          f"{family}: the streamed answer with tools equals the whole")
    # tool_choice required / a named function: the call is constrained (llguidance), so even
    # this random model's answer is a call of the function, its arguments valid for the schema
    # (strict), whole and streamed.
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        for stream in (False, True):
            kw = dict(model="tiny", messages=MESSAGES, tools=BOUNDED_TOOLS, tool_choice=choice,
                      max_tokens=120, temperature=1.0, seed=5, parallel_tool_calls=False)
            if stream:
                calls, finish = {}, None
                for chunk in client.chat.completions.create(stream=True, **kw):
                    for c in chunk.choices[0].delta.tool_calls or []:
                        entry = calls.setdefault(c.index, {"name": "", "arguments": ""})
                        entry["name"] += (c.function.name or "") if c.function else ""
                        entry["arguments"] += (c.function.arguments or "") if c.function else ""
                    finish = chunk.choices[0].finish_reason or finish
                calls = list(calls.values())
            else:
                r = client.chat.completions.create(**kw)
                finish = r.choices[0].finish_reason
                calls = [{"name": c.function.name, "arguments": c.function.arguments}
                         for c in r.choices[0].message.tool_calls or []]
            try:
                args = json.loads(calls[0]["arguments"]) if calls else None
            except ValueError:
                args = None
            check(len(calls) == 1 and calls[0]["name"] == "get_weather" and
                  isinstance(args, dict) and args.get("unit") in ("c", "f") and
                  isinstance(args.get("city"), str) and len(args["city"]) <= 12 and
                  finish == "tool_calls",
                  f"{family}: tool_choice {choice} gives a valid call "
                  f"({'streamed' if stream else 'whole'}): {calls} {finish}")

def harmony_checks(family, client):
    """gpt-oss's harmony: a JSON answer with tools auto would need calls and the answer in
    different channels; refused by name rather than half kept."""
    if family != "harmony":
        return
    try:
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=BOUNDED_TOOLS, max_tokens=4,
            tool_choice="auto", response_format={"type": "json_object"})
        check(False, f"{family}: response_format with tools auto is refused by name")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and "harmony" in str(e),
              f"{family}: response_format with tools auto is refused by name ({e.message})")


def reasoning_checks(family, client, tok):
    """A template that opens the reply in <think> (DeepSeek-R1's, Qwen3's way): the client reads
    the output as message.reasoning_content (and delta.reasoning_content streamed), apart from
    the content; a response_format applies to the answer after </think> (the model pushed to
    close its block at once by a bias on </think>)."""
    if family not in THINK_FAMILIES:
        return
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(**kw)
    message = chat.choices[0].message
    reasoning = getattr(message, "reasoning_content", None)
    check(reasoning and not message.content,
          f"{family}: message.reasoning_content holds the thought ({message})")
    streamed = ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            streamed += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
    check(streamed == reasoning, f"{family}: streamed as delta.reasoning_content "
                                 f"({streamed!r} vs {reasoning!r})")
    if tok is None:
        return
    close_id = tok.convert_tokens_to_ids("</think>")
    answer = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=30, temperature=0,
        logit_bias={str(close_id): 100},
        response_format={"type": "json_schema", "json_schema": {
            "name": "colour", "schema": {"type": "object", "properties": {
                "colour": {"enum": ["red", "green"]}}, "required": ["colour"],
                "additionalProperties": False}}})
    content = answer.choices[0].message.content or ""
    try:
        value = json.loads(content)
    except ValueError:
        value = None
    check(isinstance(value, dict) and value.get("colour") in ("red", "green"),
          f"{family}: response_format applies to the answer after the reasoning ({content!r})")


try:
    from transformers import AutoTokenizer
except ImportError:
    AutoTokenizer = None

for family, args in FAMILIES:
    model = os.path.join(tmp, family)
    gen_model(BIN, model, *args)
    # The KV cache in F32, as transformers' in float32: echo's prompt logprobs are compared
    # with its to 1e-3 (the model's BF16 cache moves them by up to 5e-3), to BF16_ACTIVATIONS
    # at the CPU kernel level that rounds BF16 weights' activations (auto's on AMD's Zen 4/5).
    d = Deployment(BIN, model, tp=2, pp=2, args=("--api-key-file", KEYS), api_key=KEY,
                   max_seq=2048, serving={"kvCacheDtype": "f32"})
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{d.port}/v1", api_key=KEY,
                               max_retries=0)
        stranger = openai.OpenAI(base_url=f"http://127.0.0.1:{d.port}/v1",
                                 api_key="sk-not-the-key-0123456789", max_retries=0)
        try:
            stranger.models.list()
            check(False, f"{family}: a wrong key raises AuthenticationError")
        except openai.AuthenticationError as e:
            check(e.status_code == 401 and e.code == "invalid_api_key",
                  f"{family}: a wrong key raises AuthenticationError ({e.message})")
        models = client.models.list()
        check([m.id for m in models.data] == ["tiny"], f"{family}: models.list()")
        chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10,
                                              temperature=0, extra_body={"ignore_eos": True})
        check(chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 10,
              f"{family}: chat.completions.create")
        tok = None
        if AutoTokenizer is not None:
            tok = AutoTokenizer.from_pretrained(model)
            ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
            check(chat.usage.prompt_tokens == len(ids),
                  f"{family}: the chat prompt has transformers' length ({chat.usage.prompt_tokens}"
                  f" vs {len(ids)})")
            same = client.completions.create(model="tiny", prompt=list(ids), max_tokens=10,
                                             temperature=0, extra_body={"ignore_eos": True})
            # A thinking template's output is all reasoning (the block the prompt opened).
            answer = chat.choices[0].message.content
            if family in THINK_FAMILIES:
                answer = getattr(chat.choices[0].message, "reasoning_content", None)
            check(same.choices[0].text == answer,
                  f"{family}: chat answer == completion of transformers' chat prompt ids")
        tool_checks(family, client, d, tok)
        reasoning_checks(family, client, tok)
        harmony_checks(family, client)
        if family != "llama3":
            continue
        comp = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8,
                                         temperature=0, logprobs=2)
        check(comp.usage.completion_tokens >= 1 and comp.choices[0].logprobs is not None and
              len(comp.choices[0].logprobs.token_logprobs) == comp.usage.completion_tokens,
              "completions.create with logprobs")
        if tok is not None:  # echo with logprobs: the prompt scored as transformers scores it
            import torch
            from transformers import AutoModelForCausalLM
            ids = tok("Once upon a time, in a land far away")["input_ids"]
            hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
            with torch.no_grad():
                lsm = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)
            want = [float(lsm[q - 1, ids[q]]) for q in range(1, len(ids))]
            echo = client.completions.create(model="tiny", prompt=ids, max_tokens=1,
                                             temperature=0, logprobs=1, echo=True)
            got = echo.choices[0].logprobs.token_logprobs
            diff = max(abs(a - b) for a, b in zip(got[1:len(ids)], want))
            kernels = cpu_kernels(BIN, model)
            bound = BF16_ACTIVATIONS if kernels == "avx512bf16" else 1e-3
            check(got[0] is None and len(got) == len(ids) + 1 and diff < bound,
                  f"echo with logprobs gives transformers' prompt log-probabilities at TP=2 x "
                  f"PP=2 (max diff {diff:.1e}, bound {bound}: CPU kernels {kernels})")
        pieces, finish = [], None
        for chunk in client.completions.create(model="tiny", prompt="Once upon a time",
                                               max_tokens=8, temperature=0, stream=True):
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        check("".join(pieces) == comp.choices[0].text and finish == comp.choices[0].finish_reason,
              "streamed completions equal the whole")
        deltas = []
        stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True})
        usage = None
        for chunk in stream:
            if chunk.choices:
                deltas.append(chunk.choices[0].delta.content or "")
            usage = chunk.usage or usage
        check("".join(deltas) == chat.choices[0].message.content and usage.completion_tokens == 10,
              "streamed chat equals the whole, with usage")
        try:
            client.completions.create(model="tiny", prompt="x", temperature=5)
            check(False, "a bad parameter raises BadRequestError")
        except openai.BadRequestError as e:
            check(e.status_code == 400 and "temperature" in str(e),
                  "a bad parameter raises BadRequestError naming it")
        try:
            client.completions.create(model="other", prompt="x")
            check(False, "an unknown model raises NotFoundError")
        except openai.NotFoundError as e:
            check(e.status_code == 404, "an unknown model raises NotFoundError")
    finally:
        d.stop(signal.SIGINT)

# A model without a chat template says so.
model = os.path.join(tmp, "plain")
gen_model(BIN, model, "--chat-template", "none")
d = Deployment(BIN, model, tp=1, pp=1, args=("--api-key-file", KEYS), api_key=KEY)
try:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{d.port}/v1", api_key=KEY,
                           max_retries=0)
    try:
        client.chat.completions.create(model="tiny", messages=MESSAGES[:2], max_tokens=4)
        check(False, "chat without a template is refused")
    except openai.BadRequestError as e:
        check("no chat template" in str(e), f"chat without a template is refused: {e.message}")
finally:
    d.stop(signal.SIGINT)
check.finish()
