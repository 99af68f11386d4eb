"""A deterministic stand-in for a real tokenizer and chat template.

`tokenize` cuts text into 4-character chunks (real BPE tokenizers average about 4 characters of English per
token) and gives each chunk a stable 32-bit id (CRC-32 of its UTF-8 bytes). Python's `hash()` is salted per
process, so it would give the gateway, the replicas and the load-test oracle different ids for the same text.

Because chunks are cut from the start of the text, tokenize(a) is a prefix of tokenize(a + b) except for the
last partial chunk of `a` -- the property that makes prefix caching work on a real tokenizer too.

`render_chat` is a ChatML-like template. It is prefix-stable across turns: turn k's rendering without the
trailing generation prompt is a prefix of turn k+1's rendering, as with the templates SGLang and vLLM apply.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

CHARS_PER_TOKEN = 4
GENERATION_PROMPT = "<|im_start|>assistant\n"


def tokenize(text: str) -> list[int]:
    """Token ids of `text`: one per 4-character chunk, ceil(len(text) / 4) in all."""
    step = CHARS_PER_TOKEN
    return [zlib.crc32(text[i:i + step].encode("utf-8", "surrogatepass")) for i in range(0, len(text), step)]


def count_tokens(text: str) -> int:
    """len(tokenize(text)) without computing the ids."""
    return -(-len(text) // CHARS_PER_TOKEN)


def content_text(content: Any) -> str:
    """The text of a message's `content`: a string, or the text parts of a content array joined by newlines.

    Non-text parts (images, audio) contribute nothing; `None` (an assistant turn with only tool calls) is "".
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        return "\n".join(text for text in texts if isinstance(text, str))
    raise TypeError(f"message content must be a string, an array of parts or null, not {type(content).__name__}")


def _message_text(message: dict[str, Any]) -> str:
    text = content_text(message.get("content"))
    tool_calls = message.get("tool_calls")
    if tool_calls:
        # Sorted keys, so the same call renders the same way when the client sends it back next turn.
        text += "".join("\n<tool_call>" + json.dumps(call, sort_keys=True) + "</tool_call>" for call in tool_calls)
    return text


def _tools_text(tools: list[Any]) -> str:
    listed = "\n".join(json.dumps(tool, sort_keys=True) for tool in tools)
    return "# Tools\nYou may call these functions:\n<tools>\n" + listed + "\n</tools>"


def render_chat(messages: list[dict[str, Any]], tools: list[Any] | None = None) -> str:
    """The prompt text the engine sees for a chat request, ending with the generation prompt.

    Tools go into the system turn (a leading system message gets them appended; otherwise one is created),
    so they sit in front of the conversation and are shared by every turn.
    """
    parts: list[str] = []
    remaining = list(messages)
    if tools:
        system = ""
        if remaining and remaining[0].get("role") == "system":
            system = _message_text(remaining.pop(0)) + "\n\n"
        parts.append(f"<|im_start|>system\n{system}{_tools_text(tools)}<|im_end|>\n")
    for message in remaining:
        role = message.get("role")
        if not isinstance(role, str):
            raise TypeError("every message needs a string 'role'")
        parts.append(f"<|im_start|>{role}\n{_message_text(message)}<|im_end|>\n")
    parts.append(GENERATION_PROMPT)
    return "".join(parts)
