"""Messages as vLLM hands them to a Hugging Face chat template (what the reference renders of our
prompts are made from)."""
import json


def as_vllm_hands_them(messages, list_style=False):
    """content null -> "" ([] for a list-style template: one that iterates content as parts), a
    string -> one text part (list style), parts -> joined by "\\n" (string style); a call's
    arguments as a dict."""
    out = []
    for m in messages:
        m = dict(m)
        content = m.get("content")
        parts = ([] if content is None else
                 [content] if isinstance(content, str) else [p["text"] for p in content])
        m["content"] = ([{"type": "text", "text": p} for p in parts] if list_style
                        else "\n".join(parts))
        if m.get("tool_calls"):
            m["tool_calls"] = [dict(c, function=dict(c["function"], arguments=json.loads(
                c["function"]["arguments"]))) for c in m["tool_calls"]]
        out.append(m)
    return out
