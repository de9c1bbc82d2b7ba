#!/usr/bin/env python3
"""A client written by others against our server: the official `openai` Python package drives
completions, chat and streaming on a `shardserve local` TP=2 x PP=2 deployment that requires an
API key, and its error types see our errors (a wrong key is an AuthenticationError). With transformers in the same environment, the chat prompt the server
renders is checked against transformers' apply_chat_template for each chat family."""
import os
import signal
import sys
import tempfile

import openai

sys.path.insert(0, os.path.dirname(__file__))
from checks import Checks  # noqa: E402
from deployment import Deployment, gen_model  # noqa: E402

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
            ("mistral", ["--arch", "mistral", "--tokenizer", "sentencepiece"])]

try:
    from transformers import AutoTokenizer
except ImportError:
    AutoTokenizer = None

for family, args in FAMILIES:
    model = os.path.join(tmp, family)
    gen_model(BIN, model, *args)
    d = Deployment(BIN, model, tp=2, pp=2, args=("--api-key-file", KEYS), api_key=KEY)
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
        if AutoTokenizer is not None:
            tok = AutoTokenizer.from_pretrained(model)
            ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
            check(chat.usage.prompt_tokens == len(ids),
                  f"{family}: the chat prompt has transformers' length ({chat.usage.prompt_tokens}"
                  f" vs {len(ids)})")
            same = client.completions.create(model="tiny", prompt=list(ids), max_tokens=10,
                                             temperature=0, extra_body={"ignore_eos": True})
            check(same.choices[0].text == chat.choices[0].message.content,
                  f"{family}: chat answer == completion of transformers' chat prompt ids")
        if family != "llama3":
            continue
        comp = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8,
                                         temperature=0, logprobs=2)
        check(comp.usage.completion_tokens >= 1 and comp.choices[0].logprobs is not None and
              len(comp.choices[0].logprobs.token_logprobs) == comp.usage.completion_tokens,
              "completions.create with logprobs")
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
