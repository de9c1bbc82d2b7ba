#!/usr/bin/env python3
"""The Responses API (POST /v1/responses) driven by clients written by others: the official
`openai` package's client.responses on `shardserve local` TP=2 x PP=2 deployments of generated
models, and OpenAI's Agents SDK (its default model is the Responses one) running an agent with a
function tool to a structured final output. Checked: `input` as text and as items, with
`instructions` (the prompt the chat with a system message renders, token for token), function
tools constrained under tool_choice required / named (a function_call item, valid arguments),
the round trip back (function_call and function_call_output items), text.format json_schema,
streamed events (their order and numbering, the deltas joined equal the whole), reasoning items
on a thinking template, max_output_tokens (status incomplete), the router in front of two
replicas, and what is not served refused by the field's name."""
import asyncio
import json
import os
import sys
import tempfile

import jsonschema
import openai

sys.path.insert(0, os.path.dirname(__file__))
from checks import Checks  # noqa: E402
from deployment import Deployment, gen_model  # noqa: E402

BIN = sys.argv[1]
check = Checks()
tmp = tempfile.mkdtemp(prefix="shardserve-responses-")

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "strict": True,
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"type": "string", "enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
COLOUR = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
          "required": ["colour"], "additionalProperties": False}


def refused(client, name, kw, param):
    try:
        client.responses.create(model="tiny", **kw)
        check(False, f"refused by name: {name}")
    except openai.BadRequestError as e:
        body = e.body if isinstance(e.body, dict) else {}
        check(e.status_code == 400 and body.get("param") == param,
              f"refused by name: {name} ({body.get('param')}: {body.get('message')})")


def tools_family(d, client):
    # Text in, text out; the prompt is the chat's with a system message (instructions).
    r = client.responses.create(model="tiny", input="Name a colour.", instructions="Be terse.",
                                max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(
        model="tiny", max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": "Be terse."},
                  {"role": "user", "content": "Name a colour."}])
    check(r.object == "response" and r.id.startswith("resp_") and
          r.usage.input_tokens == chat.usage.prompt_tokens and
          r.output_text == chat.choices[0].message.content,
          f"input text with instructions is the chat's prompt and answer "
          f"({r.usage.input_tokens} vs {chat.usage.prompt_tokens}; {r.output_text!r})")
    check(r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens" and
          r.usage.output_tokens == 6,
          f"max_output_tokens reached: status incomplete ({r.status}, {r.incomplete_details})")

    # A constrained call, whole and streamed.
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        r = client.responses.create(model="tiny", input="Weather in Oslo?", tools=[WEATHER],
                                    tool_choice=choice, temperature=1.0, max_output_tokens=120,
                                    parallel_tool_calls=False)
        calls = [o for o in r.output if o.type == "function_call"]
        args = json.loads(calls[0].arguments) if calls else {}
        check(len(calls) == 1 and calls[0].name == "get_weather" and
              calls[0].call_id.startswith("call_") and args.get("unit") in ("c", "f") and
              r.status == "completed",
              f"tool_choice {choice}: a function_call item with valid arguments "
              f"({[o.model_dump() for o in r.output]})")
    call = calls[0]
    events = list(client.responses.create(model="tiny", input="Weather in Oslo?", tools=[WEATHER],
                                          tool_choice="required", temperature=0,
                                          max_output_tokens=120, stream=True,
                                          parallel_tool_calls=False))
    types = [e.type for e in events]
    final = events[-1].response
    streamed_args = "".join(e.delta for e in events
                            if e.type == "response.function_call_arguments.delta")
    done_calls = [o for o in final.output if o.type == "function_call"]
    check(types[:2] == ["response.created", "response.in_progress"] and
          types[-1] == "response.completed" and
          [e.sequence_number for e in events] == list(range(len(events))) and
          "response.output_item.added" in types and
          "response.function_call_arguments.done" in types and len(done_calls) == 1 and
          streamed_args == done_calls[0].arguments,
          f"a streamed call: events in order, numbered, argument deltas joined == the item "
          f"({types})")

    # The round trip: the call and its output back as items.
    items = [{"role": "user", "content": "Weather in Oslo?"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name,
              "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id,
              "output": "{\"temp\": 3}"}]
    r = client.responses.create(model="tiny", input=items, tools=[WEATHER], tool_choice="none",
                                max_output_tokens=4, temperature=0)
    chat = client.chat.completions.create(
        model="tiny", max_tokens=4, temperature=0, tool_choice="none",
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                 if k != "type"}}],
        messages=[{"role": "user", "content": "Weather in Oslo?"},
                  {"role": "assistant", "content": None, "tool_calls": [{
                      "id": call.call_id, "type": "function",
                      "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "{\"temp\": 3}"}])
    check(r.usage.input_tokens == chat.usage.prompt_tokens,
          f"function_call and function_call_output items are the chat's round trip "
          f"({r.usage.input_tokens} vs {chat.usage.prompt_tokens})")

    # Structured output, whole and streamed.
    fmt = {"format": {"type": "json_schema", "name": "colour", "schema": COLOUR, "strict": True}}
    r = client.responses.create(model="tiny", input="A colour as JSON.", text=fmt,
                                temperature=1.0, max_output_tokens=60)
    try:
        jsonschema.validate(json.loads(r.output_text), COLOUR)
        valid = True
    except (ValueError, jsonschema.ValidationError):
        valid = False
    check(valid and r.status == "completed", f"text.format json_schema: {r.output_text!r}")
    events = list(client.responses.create(model="tiny", input="A colour as JSON.", text=fmt,
                                          temperature=0, max_output_tokens=60, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = [e.text for e in events if e.type == "response.output_text.done"]
    check(done and deltas == done[0] == events[-1].response.output_text,
          f"streamed text deltas joined == the done text == the response's ({deltas!r})")

    # A strict tool with tool_choice auto: text, or calls that keep the schema.
    for seed_text in ("Weather in Oslo?", "Say hi.", "Call get_weather."):
        r = client.responses.create(model="tiny", input=seed_text, tools=[WEATHER],
                                    tool_choice="auto", temperature=1.0, max_output_tokens=60,
                                    parallel_tool_calls=False)
        calls = [o for o in r.output if o.type == "function_call"]
        check(all(json.loads(c.arguments).get("unit") in ("c", "f") for c in calls),
              f"a strict tool with tool_choice auto: every call keeps the schema "
              f"({[o.model_dump() for o in r.output]})")

    refused(client, "store true", {"input": "hi", "store": True}, "store")
    refused(client, "previous_response_id", {"input": "hi", "previous_response_id": "resp_x"},
            "previous_response_id")
    refused(client, "a built-in tool", {"input": "hi", "tools": [{"type": "web_search"}]},
            "tools[0].type")
    refused(client, "an image part",
            {"input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": "https://example.com/x.png"}]}]},
            "input[0].content[0]")
    refused(client, "reasoning summaries", {"input": "hi", "reasoning": {"summary": "auto"}},
            "reasoning.summary")
    refused(client, "reasoning effort on a template without it",
            {"input": "hi", "reasoning": {"effort": "low"}}, "reasoning.effort")
    refused(client, "a field not served", {"input": "hi", "extra_body": None,
                                           "max_tool_calls": 2}, "max_tool_calls")


def agents_family(port):
    """OpenAI's Agents SDK: an agent with a function tool and a structured final output; the
    first turn must call the tool (tool_choice required), the SDK runs it and sends its output
    back, the second turn (tool_choice reset to auto) answers in the output type's schema."""
    from typing import Annotated

    from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool,
                        set_tracing_disabled)
    from pydantic import BaseModel, Field

    set_tracing_disabled(True)
    asked = []

    # The SDK's default: a strict tool (its schema closed, every property required); bounded, or
    # a random model would write a city without end.
    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
        """The weather in a city."""
        asked.append(city)
        return json.dumps({"temp": 3})

    class Report(BaseModel):
        colour: str = Field(json_schema_extra={"enum": ["red", "green", "blue"]})

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                max_retries=0)
    agent = Agent(name="weather", instructions="Answer with a colour.", tools=[get_weather],
                  output_type=Report,
                  model=OpenAIResponsesModel(model="tiny", openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=160,
                                               temperature=1.0, parallel_tool_calls=False))
    try:
        # After the first call the SDK sets tool_choice back to auto: a random model sampling at
        # temperature 1 may call again before it answers (half the time, say), so the run gets
        # room: 12 turns, not 4 (where about 1 run in 8 ran out).
        result = asyncio.run(Runner.run(agent, "What colour is the weather in Oslo?",
                                        max_turns=12))
    except Exception as e:  # noqa: BLE001 (the SDK's own error, reported)
        check(False, f"Agents SDK: the run ends ({type(e).__name__}: {e})")
        return
    check(len(asked) >= 1 and isinstance(result.final_output, Report) and
          result.final_output.colour in ("red", "green", "blue"),
          f"Agents SDK: the tool ran ({asked}) and the final output is the type "
          f"({result.final_output!r})")


def think_family(client):
    r = client.responses.create(model="tiny", input="Name a colour.", max_output_tokens=8,
                                temperature=0)
    reasoning = [o for o in r.output if o.type == "reasoning"]
    text = reasoning[0].content[0].text if reasoning and reasoning[0].content else ""
    check(reasoning and text and not r.output_text,
          f"a reply that begins in <think> is a reasoning item ({r.output})")
    events = list(client.responses.create(model="tiny", input="Name a colour.",
                                          max_output_tokens=8, temperature=0, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    check(deltas == text, f"... streamed as reasoning_text deltas ({deltas!r} vs {text!r})")
    # Reasoning given back (a reasoning item) reaches the next assistant turn.
    r2 = client.responses.create(model="tiny", max_output_tokens=2, temperature=0, input=[
        {"role": "user", "content": "Name a colour."},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "They want one."}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Red."}]},
        {"role": "user", "content": "Another."}])
    check(r2.status in ("completed", "incomplete") and r2.usage.input_tokens > 0,
          f"reasoning items given back are served ({r2.status})")


def router_checks(model):
    """Through the router (two replicas): the request is routed by the chat it stands for, and a
    streamed response passes whole (its last event response.completed / incomplete, no error the
    router adds for a stream it thinks cut short)."""
    d = Deployment(BIN, model, tp=1, pp=1, replicas=2, max_seq=2048)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{d.port}/v1", api_key="unused",
                               max_retries=0)
        r = client.responses.create(model="tiny", input="Name a colour.", max_output_tokens=5,
                                    temperature=0)
        events = list(client.responses.create(model="tiny", input="Name a colour.",
                                              max_output_tokens=5, temperature=0, stream=True))
        types = [e.type for e in events]
        check(r.status == "incomplete" and types[-1] == "response.incomplete" and
              "error" not in types and events[-1].response.output_text == r.output_text,
              f"through the router: whole and streamed ({types[-3:]})")
    finally:
        d.stop()


for family, args in [("hermes", ["--arch", "qwen2", "--chat-template", "hermes"]),
                     ("chatml-think", ["--arch", "qwen2", "--chat-template", "chatml-think"])]:
    model = os.path.join(tmp, family)
    gen_model(BIN, model, *args)
    d = Deployment(BIN, model, tp=2, pp=2, max_seq=2048)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{d.port}/v1", api_key="unused",
                               max_retries=0)
        if family == "hermes":
            tools_family(d, client)
            agents_family(d.port)
        else:
            think_family(client)
    finally:
        d.stop()
    if family == "hermes":
        router_checks(model)
check.finish()
