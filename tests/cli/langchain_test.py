#!/usr/bin/env python3
"""LangChain's ChatOpenAI (langchain-openai, in the reference venv) against `shardserve local`
TP=2 x PP=2 deployments of generated models, one per tool-call format (Hermes, Llama 3 JSON,
DeepSeek-V3.1's section): bind_tools with a required call (invoke and stream), the tool round
trip back into the conversation (the assistant's calls and a ToolMessage), and
with_structured_output (json_schema, strict) giving a validated object; on a thinking template
(the reply opened in <think>), with_structured_output reads the answer after the reasoning
(ChatOpenAI itself drops reasoning_content, as langchain-openai documents). The models' weights
are random: what makes their answers usable is the server constraining them."""
import json
import os
import sys
import tempfile

from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI

sys.path.insert(0, os.path.dirname(__file__))
from checks import Checks  # noqa: E402
from deployment import Deployment, gen_model  # noqa: E402

BIN = sys.argv[1]
check = Checks()
tmp = tempfile.mkdtemp(prefix="shardserve-langchain-")
FAMILIES = [("hermes", ["--arch", "qwen2", "--chat-template", "hermes"]),
            ("llama3-tools", ["--arch", "llama", "--chat-template", "llama3-tools"]),
            ("deepseek-tools", ["--arch", "qwen2", "--chat-template", "deepseek-tools"]),
            ("chatml-think", ["--arch", "qwen2", "--chat-template", "chatml-think"])]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
PERSON = {"title": "Person", "description": "A person", "type": "object",
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def valid_call(call):
    a = call.get("args") or {}
    return (call.get("name") == "get_weather" and a.get("unit") in ("c", "f") and
            isinstance(a.get("city"), str) and len(a["city"]) <= 12)



def family_checks(family, llm):
    if family == "chatml-think":
        return
    tools = llm.bind_tools([WEATHER], tool_choice="get_weather", strict=True)
    msg = tools.invoke([HumanMessage("What is the weather in Oslo?")])
    check(len(msg.tool_calls) == 1 and valid_call(msg.tool_calls[0]) and
          msg.response_metadata.get("finish_reason") == "tool_calls",
          f"{family}: bind_tools(tool_choice=name).invoke gives a valid call: {msg.tool_calls}")
    # Llama 3's calls are read whole at the end: a random model chaining calls past max_tokens
    # would leave none, so it gets one.
    required = llm.bind_tools([WEATHER], tool_choice="required",
                              parallel_tool_calls=family != "llama3-tools").invoke(
                                  "Weather, please.")
    check(len(required.tool_calls) >= 1 and all(valid_call(c) for c in required.tool_calls),
          f"{family}: bind_tools(tool_choice='required') gives valid calls: {required.tool_calls}")

    gathered = None
    for chunk in tools.stream([HumanMessage("What is the weather in Oslo?")]):
        gathered = chunk if gathered is None else gathered + chunk
    check(gathered is not None and len(gathered.tool_calls) == 1 and
          valid_call(gathered.tool_calls[0]) and gathered.tool_calls[0]["args"] ==
          msg.tool_calls[0]["args"],
          f"{family}: the streamed call, its argument deltas joined, equals the whole: "
          f"{gathered.tool_calls if gathered else None}")

    # The round trip: the call and the tool's answer back into the conversation.
    call = msg.tool_calls[0]
    answer = llm.invoke([HumanMessage("What is the weather in Oslo?"), msg,
                         ToolMessage(json.dumps({"temp": 3}), tool_call_id=call["id"])],
                        max_tokens=8)
    check(isinstance(answer.content, str) and answer.usage_metadata["output_tokens"] > 0,
          f"{family}: the tool round trip is answered: {answer.content!r}")


for family, args in FAMILIES:
    model = os.path.join(tmp, family)
    gen_model(BIN, model, *args)
    d = Deployment(BIN, model, tp=2, pp=2, max_seq=2048)
    try:
        bias = {}
        if family == "chatml-think":  # the thought closed at once: </think> pushed
            with open(os.path.join(model, "tokenizer.json")) as f:
                added = json.load(f)["added_tokens"]
            bias = {next(t["id"] for t in added if t["content"] == "</think>"): 100}
        llm = ChatOpenAI(base_url=f"http://127.0.0.1:{d.port}/v1", api_key="unused",
                         model="tiny", temperature=1.0, max_tokens=120, seed=7, max_retries=0,
                         logit_bias=bias or None)
        family_checks(family, llm)
        structured = llm.with_structured_output(PERSON, method="json_schema", strict=True)
        person = structured.invoke("Invent a person.")
        check(isinstance(person, dict) and set(person) == {"name", "age"} and
              isinstance(person["name"], str) and len(person["name"]) <= 10 and
              isinstance(person["age"], int) and 0 <= person["age"] <= 120,
              f"{family}: with_structured_output(json_schema) gives a valid object: {person}")
    finally:
        d.stop()
check.finish()
