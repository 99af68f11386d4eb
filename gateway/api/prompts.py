"""What a request asks for: which endpoint, which model, and the routing text the engine will see.

The routing text is what the prefix index hashes. It must grow the way the engine's KV cache grows: for chat,
turn k's text is a prefix of turn k+1's, so a conversation keeps matching its own history. The Responses and
Messages APIs render the same way as chat (tools, then the system part, then each turn on its own), so a client
that resends its conversation keeps matching too. Endpoints that generate nothing from a prompt (tokenize,
rerank, audio, ...) have no routing text: they go to the least loaded backend.
"""

from __future__ import annotations

import json
import re
from enum import Enum
from typing import Any

import orjson

from gateway.errors import BadRequest


class Endpoint(str, Enum):
    CHAT = "chat"                # POST /v1/chat/completions
    COMPLETION = "completion"    # POST /v1/completions
    GENERATE = "generate"        # POST /generate (SGLang native)
    EMBEDDING = "embedding"      # POST /v1/embeddings
    RESPONSES = "responses"      # POST /v1/responses (OpenAI Responses API), and its stored responses
    MESSAGES = "messages"        # POST /v1/messages (Anthropic Messages API)
    TOKENIZE = "tokenize"        # /tokenize, /detokenize, /v1/messages/count_tokens
    SCORE = "score"              # rerank and score
    POOLING = "pooling"          # /pooling, /classify, SGLang's /encode
    AUDIO = "audio"              # /v1/audio/* (multipart, never parsed as JSON)
    UTILITY = "utility"          # SGLang's parsers (/parse_function_call, /separate_reasoning)

    @property
    def generates(self) -> bool:
        """Its prompt is generated from: the rewriter applies."""
        return self in _GENERATING

    @property
    def routes_by_prefix(self) -> bool:
        """It fills the engine's prefix cache: the policy chooses. Otherwise the least loaded backend does."""
        return self in _GENERATING or self is Endpoint.EMBEDDING

    @property
    def json_body(self) -> bool:
        return self is not Endpoint.AUDIO


_GENERATING = frozenset({Endpoint.CHAT, Endpoint.COMPLETION, Endpoint.GENERATE, Endpoint.RESPONSES,
                         Endpoint.MESSAGES})


# Above this, bodies are parsed by json: orjson 3.x parses through scratch memory of ~13x the document (a 30 MB
# body peaked at 390 MB in flight; json peaks at 2-3x), and from a few hundred KB up it is no faster than json.
_ORJSON_MAX_BYTES = 256 * 1024


def parse_json(raw: bytes) -> Any:
    """JSON as Python's json module reads it, at orjson's speed (3-4x) for every document orjson accepts.
    orjson refuses a few that json accepts (lone surrogate escapes, integers past 64 bits, NaN, nesting past
    1,024): those are read by json, so what the gateway accepts does not change."""
    if len(raw) > _ORJSON_MAX_BYTES:
        return json.loads(raw)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


# What json reads as a float that is not finite: NaN, Infinity, or a number too large for a float (1e400, or 309
# digits and more); a false match only costs the slower writer.
_MAYBE_NOT_FINITE = re.compile(rb"NaN|Infinity|[eE]\+?[0-9]{3}|[0-9]{309}")


def dump_json(body: Any, source: bytes) -> bytes:
    """`body`, parsed from `source`, as compact JSON in UTF-8. orjson writes it in one copy (json makes a str, then
    its bytes: 60 MB for a 30 MB prompt) and 6x as fast. What orjson cannot write as json would goes through
    json: it refuses lone surrogates and integers past 64 bits, and writes a float that is not finite as null,
    so a source that may hold one (one regex scan, rarely a match) never reaches it."""
    if _MAYBE_NOT_FINITE.search(source) is None:
        try:
            return orjson.dumps(body)
        except orjson.JSONEncodeError:
            pass
    try:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate escape in the client's JSON: keep its own escapes
        return json.dumps(body, separators=(",", ":")).encode("ascii")


# Sequences that cannot occur in JSON-decoded text by accident keep role and content boundaries unambiguous.
_ROLE_OPEN, _ROLE_CLOSE = "\x1e", "\x1f"


def read_json(raw: bytes, endpoint: Endpoint) -> dict[str, Any]:
    try:
        body = parse_json(raw)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc}.") from None
    problem = validate_body(endpoint, body)
    if problem:
        raise BadRequest(problem)
    return body  # validate_body checked it is an object


def routing_text(endpoint: Endpoint, body: dict[str, Any]) -> str:
    """The prompt as the engine will see it, for hashing. Only for bodies `validate_body` accepted."""
    if endpoint is Endpoint.CHAT:
        return render_chat(body["messages"], body.get("tools"))
    if endpoint is Endpoint.COMPLETION:
        return render_prompt(body.get("prompt"))
    if endpoint is Endpoint.GENERATE:
        return render_prompt(body["text"] if body.get("text") is not None else body.get("input_ids"))
    if endpoint is Endpoint.RESPONSES:
        return render_responses(body)
    if endpoint is Endpoint.MESSAGES:
        return render_messages(body)
    if endpoint is Endpoint.EMBEDDING:
        return render_prompt(body.get("input"))
    return ""


def session_key(endpoint: Endpoint, body: dict[str, Any], header: str | None) -> str | None:
    """The client's session key, or None: the session header (`--session-header`) if sent, else the body's
    `prompt_cache_key` (OpenAI's explicit cache routing key), else its `user` (Anthropic Messages:
    `metadata.user_id`). The most explicit wins: a header is set for routing alone, `user` names an end user who
    may hold several conversations (harmless: a key only weighs for a request continuing its last prompt)."""
    if header:
        return header
    key = body.get("prompt_cache_key")
    if isinstance(key, str) and key:
        return key
    if endpoint is Endpoint.MESSAGES:
        metadata = body.get("metadata")
        key = metadata.get("user_id") if isinstance(metadata, dict) else None
    else:
        key = body.get("user")
    return key if isinstance(key, str) and key else None


def render_responses(body: dict[str, Any]) -> str:
    """A Responses request as a chat: `instructions` as the system turn, then each input item as a turn.

    A string `input` is one user turn, rendered as the item `{"role": "user", "content": input}` is, so a client
    that starts with a string and resends the conversation as items next turn keeps its prefix. Items without a
    role (function calls and their outputs, reasoning) render as their JSON, which the client resends unchanged.
    With `previous_response_id` the engine prepends a history the gateway does not see; that request goes to
    the response's owner anyway (gateway/api/responses.py), so its text only has to be stable.
    """
    value = body.get("input")
    items: list[Any] = [{"role": "user", "content": value}] if isinstance(value, str) else (
        value if isinstance(value, list) else [])
    messages: list[Any] = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    for item in items:
        if isinstance(item, dict) and "role" in item:
            messages.append(item)
        elif isinstance(item, dict):
            messages.append({"role": str(item.get("type", "item")), "content": _without_ids(item)})
    return render_chat(messages, body.get("tools"))


def _without_ids(item: dict[str, Any]) -> str:
    """An item's stable rendering: `id` and `status` are the engine's bookkeeping, which some clients resend
    and others drop."""
    stable = {key: value for key, value in item.items() if key not in ("id", "status")}
    return json.dumps(stable, sort_keys=True, separators=(",", ":"))


def render_messages(body: dict[str, Any]) -> str:
    """An Anthropic Messages request as a chat: `system` (a string or text blocks) as the system turn, then the
    messages. Text blocks render as OpenAI text parts do; tool_use and tool_result blocks as their JSON."""
    messages: list[Any] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": body["system"]})
    messages += body["messages"]
    return render_chat(messages, body.get("tools"))


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


# Text parts: chat's and Anthropic's "text", the Responses API's "input_text" and "output_text".
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text kept, other parts by a stable rendering
        return "".join(part["text"] if isinstance(part, dict) and part.get("type") in _TEXT_PARTS
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
    Endpoint.MESSAGES: ("messages", list),
}
# Optional fields routing reads, and the types it can read.
_OPTIONAL: dict[Endpoint, tuple[tuple[str, type | tuple[type, ...]], ...]] = {
    Endpoint.RESPONSES: (("input", (str, list)), ("instructions", str), ("previous_response_id", str)),
    Endpoint.MESSAGES: (("system", (str, list)),),
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
    for field, kinds in _OPTIONAL.get(endpoint, ()):
        if body.get(field) is not None and not isinstance(body[field], kinds):
            return f"'{field}' has the wrong type."
    if endpoint not in _REQUIRED:
        return None
    field, kinds = _REQUIRED[endpoint]
    if field not in body:
        return f"'{field}' is a required property."
    if not isinstance(body[field], kinds):
        return f"'{field}' has the wrong type."
    if endpoint in (Endpoint.CHAT, Endpoint.MESSAGES) and not body[field]:
        return "'messages' must contain at least one message."
    return None


# A small form field of a multipart body: its part's headers, a blank line, one short line of value.
_FORM_FIELD = re.compile(rb'(?i)content-disposition:[ \t]*form-data;[ \t]*name="(model|stream)"[^\r\n]*\r\n'
                         rb'(?:[^\r\n]+\r\n)*\r\n([^\r\n]{0,256})\r\n')


def multipart_fields(raw: bytes, content_type: str) -> dict[str, Any]:
    """`model` and `stream` of a multipart/form-data body (an audio upload), found by a bytes search: the file
    part is never decoded. Fields not found are left out."""
    if not content_type.lower().startswith("multipart/form-data"):
        return {}
    fields: dict[str, Any] = {}
    for match in _FORM_FIELD.finditer(raw):
        name, value = match.group(1).decode().lower(), match.group(2).decode("utf-8", "replace")
        fields.setdefault(name, value)
    if "stream" in fields:
        fields["stream"] = fields["stream"].strip().lower() == "true"
    return fields
