#!/usr/bin/env python3
"""Reasoning as clients read it, from models that reason and then answer: three formats, each a
`shardserve local` TP=2 x PP=2 deployment of a scripted model (scripted_model.py: weights set so
that greedy decoding writes a thought and an answer, as transformers confirms):
- qwen3: Qwen3's template; the model opens its own <think> block (DeepSeek-R1's first form too);
- chatml-think: the template opens the block (DeepSeek-R1's and Qwen3-2507's thinking form), the
  model closes it;
- harmony: gpt-oss's analysis channel, then the final one; and (harmony-call) the analysis, then
  a call in the commentary channel, as gpt-oss calls a tool.
The official `openai` client reads message.reasoning_content apart from message.content (whole
and streamed), a response_format constrains the answer after the thought (not the thought), the
Responses API gives a reasoning item and a message; LangChain's ChatOpenAI sees the answer alone
(it drops reasoning_content, as langchain-openai documents) and with_structured_output parses the
answer after the thought; the thought and a call in one reply give reasoning_content and the
call (tool_calls, streamed; a function_call item; LangChain's tool_calls)."""
import json
import os
import signal
import sys
import tempfile

import openai
from langchain_openai import ChatOpenAI
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(__file__))
from checks import Checks  # noqa: E402
from deployment import Deployment  # noqa: E402
from scripted_model import gen_scripted, script_model, transformers_writes  # noqa: E402

BIN = sys.argv[1]
check = Checks()
tmp = tempfile.mkdtemp(prefix="shardserve-reasoning-")

QUESTION = "What colour is the sky?"
MESSAGES = [{"role": "user", "content": QUESTION}]
THOUGHT, ANSWER = "I think about the sky", "Hello there"
THOUGHT_TOKENS = ["I", "Ġthink", "Ġabout", "Ġthe", "Ġsky"]
ANSWER_TOKENS = ["Hello", "Ġthere"]
WORDS = ["assistant", "analysis", "final", "Hello there", THOUGHT, QUESTION,
         "commentary to=functions.get_weather", 'json{"city":"Oslo"}']
CALL_TOKENS = ["commentary", "Ġto", "=", "functions", ".", "get", "_", "weather", "Ġ",
               "<|constrain|>", "json", "<|message|>", '{"', "city", '":"', "Oslo", '"}']
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
COLOUR = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
          "required": ["colour"], "additionalProperties": False}

# Each reply: its name, the chat template, what the model writes after the prompt, the token from
# which on a repeated token takes its later successor (harmony's second header), its end token.
HARMONY_THOUGHT = ["<|channel|>", "analysis", "<|message|>", *THOUGHT_TOKENS, "<|end|>",
                   "<|start|>", "assistant", "<|channel|>"]
FORMATS = [
    ("qwen3", "qwen3", ["<think>", *THOUGHT_TOKENS, "</think>", *ANSWER_TOKENS], None, None),
    ("chatml-think", "chatml-think", [*THOUGHT_TOKENS, "</think>", *ANSWER_TOKENS], None, None),
    ("harmony", "harmony", [*HARMONY_THOUGHT, "final", "<|message|>", *ANSWER_TOKENS], "I",
     "<|return|>"),
]
CALLS = [("harmony-call", "harmony", [*HARMONY_THOUGHT, *CALL_TOKENS], "I", "<|call|>")]


def make_model(name, template, words, marker, eos, tools=None):
    model = os.path.join(tmp, name)
    gen_scripted(BIN, model, template, WORDS)
    tok = AutoTokenizer.from_pretrained(model)
    prompt = tok.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    script = [prompt[-1], *tok.convert_tokens_to_ids(words)]
    if tok.unk_token_id is not None and tok.unk_token_id in script:
        raise ValueError(f"{name}: a script token is not in the vocabulary: {words}")
    script_model(model, script, None if marker is None else 1 + words.index(marker),
                 None if eos is None else tok.convert_tokens_to_ids(eos))
    wrote = transformers_writes(model, prompt, len(script) + 2)
    check(wrote[:len(script) - 1] == script[1:],
          f"{name}: transformers' greedy decoding writes the script "
          f"({tok.decode(wrote, skip_special_tokens=False)!r})")
    return model, len(prompt)


def openai_checks(name, client, prompt_tokens):
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40,
                                          temperature=0)
    msg = chat.choices[0].message
    check(getattr(msg, "reasoning_content", None) == THOUGHT and msg.content == ANSWER and
          chat.choices[0].finish_reason == "stop",
          f"{name}: message.reasoning_content is the thought, message.content the answer "
          f"({getattr(msg, 'reasoning_content', None)!r}, {msg.content!r}, "
          f"{chat.choices[0].finish_reason})")
    thought, answer, both = "", "", False
    for chunk in client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40,
                                                temperature=0, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            r = getattr(delta, "reasoning_content", None) or ""
            both = both or bool(r and delta.content)
            thought += r
            answer += delta.content or ""
    check(thought == THOUGHT and answer == ANSWER and not both,
          f"{name}: streamed as delta.reasoning_content, then delta.content "
          f"({thought!r}, {answer!r})")
    structured = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=40, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "colour", "schema": COLOUR, "strict": True}})
    msg = structured.choices[0].message
    try:
        value = json.loads(msg.content or "")
    except ValueError:
        value = None
    check(getattr(msg, "reasoning_content", None) == THOUGHT and isinstance(value, dict) and
          value.get("colour") in ("red", "green", "blue"),
          f"{name}: response_format constrains the answer after the thought, not the thought "
          f"({getattr(msg, 'reasoning_content', None)!r}, {msg.content!r})")
    r = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=40,
                                temperature=0)
    kinds = [o.type for o in r.output]
    text = r.output[0].content[0].text if kinds == ["reasoning", "message"] else None
    check(kinds == ["reasoning", "message"] and text == THOUGHT and r.output_text == ANSWER,
          f"{name}: the Responses API gives a reasoning item, then the message "
          f"({kinds}, {text!r}, {r.output_text!r})")


def call_checks(name, client, port):
    """A reply that thinks, then calls: the thought as reasoning_content, the call as tool_calls."""
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER],
                                          max_tokens=60, temperature=0)
    msg = chat.choices[0].message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
    check(getattr(msg, "reasoning_content", None) == THOUGHT and not msg.content and
          calls == [("get_weather", {"city": "Oslo"})] and
          chat.choices[0].finish_reason == "tool_calls",
          f"{name}: the thought as reasoning_content, then the call ({msg}, "
          f"{chat.choices[0].finish_reason})")
    thought, args, names = "", "", []
    for chunk in client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER],
                                                max_tokens=60, temperature=0, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            thought += getattr(delta, "reasoning_content", None) or ""
            for c in delta.tool_calls or []:
                names += [c.function.name] if c.function.name else []
                args += c.function.arguments or ""
    check(thought == THOUGHT and names == ["get_weather"] and json.loads(args or "null") ==
          {"city": "Oslo"}, f"{name}: streamed: the thought, then the call ({thought!r}, "
                            f"{names}, {args!r})")
    r = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=60,
                                temperature=0, tools=[dict(WEATHER["function"], type="function")])
    kinds = [o.type for o in r.output]
    check(kinds == ["reasoning", "function_call"] and r.output[0].content[0].text == THOUGHT and
          r.output[1].name == "get_weather" and
          json.loads(r.output[1].arguments) == {"city": "Oslo"},
          f"{name}: the Responses API gives a reasoning item, then a function_call ({r.output})")
    llm = ChatOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", model="tiny",
                     temperature=0, max_tokens=60, max_retries=0).bind_tools([WEATHER])
    msg = llm.invoke(QUESTION)
    check([(c["name"], c["args"]) for c in msg.tool_calls] == [("get_weather", {"city": "Oslo"})],
          f"{name}: LangChain's bind_tools reads the call after the thought ({msg.tool_calls})")


def langchain_checks(name, port):
    llm = ChatOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", model="tiny",
                     temperature=0, max_tokens=40, max_retries=0)
    msg = llm.invoke(QUESTION)
    check(msg.content == ANSWER, f"{name}: ChatOpenAI.invoke sees the answer alone "
                                 f"({msg.content!r})")
    streamed = "".join(chunk.content for chunk in llm.stream(QUESTION))
    check(streamed == ANSWER, f"{name}: ChatOpenAI.stream sees the answer alone ({streamed!r})")
    schema = dict(COLOUR, title="Colour", description="A colour")
    value = llm.with_structured_output(schema, method="json_schema", strict=True).invoke(QUESTION)
    check(isinstance(value, dict) and value.get("colour") in ("red", "green", "blue"),
          f"{name}: with_structured_output parses the answer after the thought ({value})")


for (name, template, words, marker, eos), calls in [(f, False) for f in FORMATS] + \
        [(c, True) for c in CALLS]:
    model, prompt_tokens = make_model(name, template, words, marker, eos,
                                      tools=[WEATHER] if calls else None)
    d = Deployment(BIN, model, tp=2, pp=2)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{d.port}/v1", api_key="none",
                               max_retries=0)
        if calls:
            call_checks(name, client, d.port)
        else:
            openai_checks(name, client, prompt_tokens)
            langchain_checks(name, d.port)
    finally:
        d.stop(signal.SIGINT)
check.finish()
