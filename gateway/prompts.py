"""What a request asks for: which endpoint, which model, and the routing text the engine will see.

The routing text is what the prefix index hashes. It must grow the way the engine's KV cache grows: for chat,
turn k's text is a prefix of turn k+1's, so a conversation keeps matching its own history.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any

import orjson


class Endpoint(str, Enum):
    CHAT = "chat"                # POST /v1/chat/completions
    COMPLETION = "completion"    # POST /v1/completions
    GENERATE = "generate"        # POST /generate (SGLang native)
    EMBEDDING = "embedding"      # POST /v1/embeddings

    @property
    def generates(self) -> bool:
        return self is not Endpoint.EMBEDDING


def parse_json(raw: bytes) -> Any:
    """JSON as Python's json module reads it, at orjson's speed (3-4x) for every document orjson accepts.
    orjson refuses a few that json accepts (lone surrogate escapes, integers past 64 bits, NaN, nesting past
    1,024): those are read by json, so what the gateway accepts does not change."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


# Sequences that cannot occur in JSON-decoded text by accident keep role and content boundaries unambiguous.
_ROLE_OPEN, _ROLE_CLOSE = "\x1e", "\x1f"


def routing_text(endpoint: Endpoint, body: dict[str, Any]) -> str:
    """The prompt as the engine will see it, for hashing. Only for bodies `validate_body` accepted."""
    if endpoint is Endpoint.CHAT:
        return render_chat(body["messages"], body.get("tools"))
    if endpoint is Endpoint.COMPLETION:
        return render_prompt(body.get("prompt"))
    if endpoint is Endpoint.GENERATE:
        return render_prompt(body["text"] if body.get("text") is not None else body.get("input_ids"))
    return render_prompt(body.get("input"))


def render_chat(messages: list[Any], tools: Any = None) -> str:
    """Roles and contents in order, tools first as chat templates put them in the system part.

    The rendering of turn k is a prefix of turn k+1's because each message renders on its own and is closed by
    the next one's opening; no generation prompt is appended.
    """
    parts = []
    if tools:
        parts.append(_ROLE_OPEN + "tools\n" + json.dumps(tools, sort_keys=True, separators=(",", ":")))
    for message in messages:
        if isinstance(message, dict):
            parts.append(f"{_ROLE_OPEN}{message.get('role', '')}\n{_content_text(message.get('content'))}"
                         f"{_tool_calls_text(message)}{_ROLE_CLOSE}")
    return "".join(parts)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: text kept, other parts by a stable rendering
        return "".join(part["text"] if isinstance(part, dict) and part.get("type") == "text"
                       and isinstance(part.get("text"), str)
                       else json.dumps(part, sort_keys=True, separators=(",", ":")) for part in content)
    return "" if content is None else json.dumps(content, sort_keys=True)


def _tool_calls_text(message: dict[str, Any]) -> str:
    calls = message.get("tool_calls")
    return json.dumps(calls, sort_keys=True, separators=(",", ":")) if calls else ""


def render_prompt(prompt: Any) -> str:
    """A completion/generate prompt: a string, the first of a batch of strings, or token ids."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        if isinstance(first, list):  # a batch of token-id lists
            return render_prompt(first)
        # Token ids: one character per token keeps the characters-per-token estimate honest enough.
        return "".join(chr(0x4E00 + (token % 0x5000)) for token in prompt if isinstance(token, int))
    return ""


_REQUIRED: dict[Endpoint, tuple[str, type | tuple[type, ...]]] = {
    Endpoint.CHAT: ("messages", list),
    Endpoint.COMPLETION: ("prompt", (str, list)),
    Endpoint.EMBEDDING: ("input", (str, list)),
}


def validate_body(endpoint: Endpoint, body: Any) -> str | None:
    """Why the body cannot be routed, or None. Only what routing needs is checked; the engine checks the rest."""
    if not isinstance(body, dict):
        return "The request body must be a JSON object."
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return "'model' must be a string."
    if endpoint is Endpoint.GENERATE:
        if body.get("text") is None and body.get("input_ids") is None:
            return "One of 'text' or 'input_ids' is required."
        return None
    field, kinds = _REQUIRED[endpoint]
    if field not in body:
        return f"'{field}' is a required property."
    if not isinstance(body[field], kinds):
        return f"'{field}' has the wrong type."
    if endpoint is Endpoint.CHAT and not body[field]:
        return "'messages' must contain at least one message."
    return None
