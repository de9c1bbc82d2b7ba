#!/usr/bin/env python3
"""Real chat templates rendered by us and by transformers, token for token.

Each template file given (or each *.jinja under a directory given) is sent as a request's own
chat_template to /tokenize on a `shardserve local` deployment that trusts request templates, over
seven conversations an application sends (a system prompt; several turns; tools; a tool round trip
with the assistant's content null; text parts; enable_thinking false; an earlier assistant turn
with its reasoning_content), and rendered by transformers' apply_chat_template on the messages as
vLLM hands them over (null content "", a call's arguments as a dict, text parts joined by "\\n"
for a template that reads content as a string, kept as parts for one that iterates it). Prints,
per template and in all: same tokens / different / refused by both (the template raising, as for
roles that do not alternate) / refused by us by name (tools on a template that renders none or
shows no call format we parse, a chat_template_kwargs the template does not read: what vLLM would
render while ignoring it) / refused by us otherwise / by transformers alone. The tokenizer is read
as its tokenizer.json says (PreTrainedTokenizerFast): transformers 5 would put a model class's own
pre-tokenizer in its place (Qwen2's splits digits).

    python3 bench/templates.py build/bin/shardserve DIR_OR_FILE...

No template is committed here: give checkouts (the figures in the notes name theirs)."""
import argparse
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "cli"))
from deployment import Deployment, gen_model  # noqa: E402
from vllm_messages import as_vllm_hands_them  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string",
                                                             "enum": ["c", "f"]}},
                   "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}
CONVERSATIONS = [
    ("system prompt", [{"role": "system", "content": "You are terse."},
                       {"role": "user", "content": "Name a colour."}], {}),
    ("several turns", [{"role": "user", "content": "Name a colour."},
                       {"role": "assistant", "content": "Blue."},
                       {"role": "user", "content": "Another one."}], {}),
    ("tools", [{"role": "user", "content": "Weather in Oslo?"}], {"tools": TOOLS}),
    ("tool round trip", [{"role": "user", "content": "Weather in Oslo?"},
                         {"role": "assistant", "content": None, "tool_calls": [CALL]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "3 C"}],
     {"tools": TOOLS}),
    ("text parts", [{"role": "user", "content": [{"type": "text", "text": "Name"},
                                                 {"type": "text", "text": "a colour."}]}], {}),
    ("enable_thinking false", [{"role": "user", "content": "Name a colour."}],
     {"chat_template_kwargs": {"enable_thinking": False}}),
    ("reasoning in history", [{"role": "user", "content": "Name a colour."},
                              {"role": "assistant", "content": "Blue.",
                               "reasoning_content": "The sky."},
                              {"role": "user", "content": "Another one."}], {}),
]
# Our refusals of what a template cannot do with a request (the field named).
BY_NAME = ("does not render tools", "shows no tool-call format", "does not read")
# vLLM's test of a template's content format: it iterates message content (as parts).
ITERATES_CONTENT = re.compile(
    r"\{%-?\s*for\s+\w+\s+in\s+\w+(\.content|\[\s*['\"]content['\"]\s*\])\s*(\||-?%\})")


def templates(paths):
    for p in paths:
        if os.path.isdir(p):
            for root, _, files in os.walk(p):
                for f in sorted(files):
                    if f.endswith(".jinja"):
                        yield os.path.join(root, f)
        else:
            yield p


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("binary")
    ap.add_argument("paths", nargs="+")
    ap.add_argument("-v", "--verbose", action="store_true", help="show each difference")
    args = ap.parse_args()
    from transformers import PreTrainedTokenizerFast
    tmp = tempfile.mkdtemp(prefix="shardserve-templates-bench-")
    model = os.path.join(tmp, "model")
    gen_model(args.binary, model, "--arch", "qwen2", "--think-tokens")
    tok = PreTrainedTokenizerFast.from_pretrained(model)
    d = Deployment(args.binary, model, tp=1, pp=1, max_seq=4096,
                   serving={"trustRequestChatTemplate": "true"})
    kinds = ["same", "different", "both refuse", "we refuse by name", "we refuse", "they refuse"]
    total = dict.fromkeys(kinds, 0)
    try:
        for path in templates(args.paths):
            with open(path, encoding="utf-8") as f:
                template = f.read()
            list_style = bool(ITERATES_CONTENT.search(template))
            row = dict.fromkeys(kinds, 0)
            notes = []
            for name, messages, extra in CONVERSATIONS:
                status, _, body = d.post("/tokenize", {"model": "tiny", "messages": messages,
                                                       "chat_template": template, **extra})
                ours = body.get("tokens") if status == 200 else None
                try:
                    theirs = list(tok.apply_chat_template(
                        as_vllm_hands_them(messages, list_style), tools=extra.get("tools"),
                        chat_template=template, add_generation_prompt=True, tokenize=True,
                        return_dict=False, **extra.get("chat_template_kwargs", {})))
                except Exception as e:  # noqa: BLE001 (the template raised)
                    theirs, why = None, f"{type(e).__name__}: {e}"
                if ours is not None and theirs is not None:
                    kind = "same" if ours == theirs else "different"
                    if kind == "different":
                        at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                                  min(len(ours), len(theirs)))
                        notes.append(f"{name}: from token {at}: ours "
                                     f"{tok.decode(ours[at:at + 12])!r} vs transformers "
                                     f"{tok.decode(theirs[at:at + 12])!r}")
                elif ours is None and theirs is None:
                    kind = "both refuse"
                    notes.append(f"{name}: both refuse (transformers: {why[:120]})")
                elif ours is None:
                    message = body.get("error", {}).get("message", "")
                    kind = "we refuse by name" if any(w in message for w in BY_NAME) else "we refuse"
                    notes.append(f"{name}: we refuse ({status}: "
                                 f"{body.get('error', {}).get('message', body)})")
                else:
                    kind = "they refuse"
                    notes.append(f"{name}: transformers refuses ({why[:160]})")
                row[kind] += 1
                total[kind] += 1
            print(f"{os.path.relpath(path):80s} " +
                  " ".join(f"{row[k]}" for k in kinds) + (" (parts)" if list_style else ""))
            if args.verbose:
                for n in notes:
                    print(f"    {n}")
        n = sum(total.values())
        print(f"\n{n} renders: " + ", ".join(f"{total[k]} {k}" for k in kinds))
    finally:
        d.stop()


if __name__ == "__main__":
    main()
