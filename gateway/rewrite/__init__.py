"""Move request IDs, nonces and timestamps off the start of a prompt so the prefix cache can match it.

A request ID at the top of a system prompt makes every prompt unique from its first tokens: the engine reports
``cached_tokens: 0`` and a prefix router loses affinity. SGLang's advice is "move the ID to the end or remove
it"; this step does that before routing. The rules themselves are in `gateway/rewrite/rules.py`.

What is searched (the *head*): in a chat, the system and developer messages and the first user message, up to
and including that first user message (``content`` as a string, or the ``text`` of ``{"type": "text"}``
parts; other parts are never touched); a completion ``prompt`` or a ``/generate`` ``text`` (a string, or each
string of a list — every string of a list is a separate prompt of a batch, with its own window and trailer;
token-id lists and ``input_ids`` are never touched). An Anthropic Messages request is searched as a chat whose
first message is its ``system`` (a string, or its text blocks): Claude Code's billing header, a text block of
its own at the top of ``system``, is what the ``billing_header`` rule is for. A Responses API request is searched
as a chat too: ``instructions`` as its system message, a string ``input`` as one user message, input items with a
role as messages (their ``input_text`` parts); items without a role (function calls and their outputs) are
neither searched nor given a trailer. Embedding requests are never rewritten: it would change the vector.

The window: only spans that *start* within the first ``window_chars`` characters (default 2048) of the prompt
text are acted on, counting the text of the head's messages in order (non-searched messages in the head, such
as a leading assistant message, count but are not searched). The window is measured on the rewritten text:
text that slides into the window because a span before it was removed is searched too, until nothing is left
to act on. That is what makes a rewrite idempotent.

Actions: ``move`` (default) removes the span and appends it at the end of the prompt — the end of the last
message of a chat (its string content, its last text part, or a new text part when its content array has
none), or the end of the prompt string — in a trailer:

    <prompt text>\\n\\n[prefix-gateway: moved from prompt start]\\n<span 1>\\n<span 2>...

The *label* is the blank line before the marker (omitted when the text before it is empty), the marker line
``[prefix-gateway: moved from prompt start]``, and the newline before each span; everything after the marker
line is the moved spans, verbatim and in prompt order. A trailer is recognised by its marker: the text from
the last ``\\n\\n[prefix-gateway: moved from prompt start]\\n`` (or a text starting with the marker line) is
never searched, and spans moved by a later rewrite are appended to it as more lines. ``strip`` removes the
span; ``keep`` leaves it and only counts it. If a chat's last message cannot hold a trailer (content of an
unknown type), ``move`` acts as ``keep``.

Examples (``move``; the id_line rule takes the whole ``key: value``, so no dangling ``Request ID:`` remains):

    "Request ID: 8f1c2d3e-4b5a-4c6d-9e8f-0a1b2c3d4e5f\\nYou are a helpful assistant."
    -> "You are a helpful assistant.\\n\\n[prefix-gateway: moved from prompt start]\\n"
       "Request ID: 8f1c2d3e-4b5a-4c6d-9e8f-0a1b2c3d4e5f"
    "Session 8f1c2d3e-4b5a-4c6d-9e8f-0a1b2c3d4e5f started at 2024-05-01T10:00:00Z. Be brief."
    -> "Session started at. Be brief.\\n\\n[prefix-gateway: moved from prompt start]\\n"
       "8f1c2d3e-4b5a-4c6d-9e8f-0a1b2c3d4e5f\\n2024-05-01T10:00:00Z"

In a chat the head does not change from turn to turn, so the rewritten messages before the last one are the
same on every turn: turn k's rewritten prompt, up to its last message, is a prefix of turn k+1's.

Config: the ``[rewrite]`` table (`gateway/rewrite/config.py`). A request opts out with the header
``x-gateway-rewrite: off`` (see `enabled_for`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from gateway.api.prompts import Endpoint
from gateway.errors import BadRequest
from gateway.rewrite.config import RewriteConfig
from gateway.rewrite.rules import (
    BUILTIN_RULE_NAMES,
    BUILTINS,
    MARKER,
    Action,
    Rule,
    RuleSet,
    RuleSpec,
    SpanHit,
    embeddable,
    split_trailer,
    with_trailer,
)

__all__ = ["Action", "BUILTIN_RULE_NAMES", "MARKER", "OPT_OUT_HEADER", "RewriteConfig", "RewriteResult",
           "Rewriter", "RuleSpec", "SpanHit", "enabled_for"]

OPT_OUT_HEADER = "x-gateway-rewrite"


class RewriteResult(NamedTuple):
    body: dict[str, Any] | None   # None: the request goes upstream as it came
    hits: tuple[SpanHit, ...]

    @property
    def moved(self) -> int:
        return sum(1 for hit in self.hits if hit.action is Action.MOVE)


def enabled_for(headers: Mapping[str, str]) -> bool:
    """False when the request says ``x-gateway-rewrite: off``; ``on`` or no header means rewrite. `headers` look
    names up regardless of case, as the server's do."""
    value = headers.get(OPT_OUT_HEADER)
    if value is None or value.strip().lower() == "on":
        return True
    if value.strip().lower() == "off":
        return False
    raise BadRequest(f"Header {OPT_OUT_HEADER} must be 'on' or 'off' (got {value!r}).", param=OPT_OUT_HEADER)


# Where one string of a chat's head is: (message, None) for messages[message].content as a string, (message, part)
# for its text part `part`.
_Place = tuple[int, int | None]
_SEARCHED_ROLES = ("system", "developer", "user")  # a tuple: a role of any JSON type is compared, not hashed


class _Host(NamedTuple):
    """Where a chat's trailer goes; ``part == len(content)`` means a new text part."""

    message: int
    part: int | None
    body: str
    trailer: str


class Rewriter:
    def __init__(self, config: RewriteConfig) -> None:
        self._config = config
        rules = [Rule(spec.name, embeddable(spec.pattern),
                      config.actions.get(spec.name, spec.action or config.default_action))
                 for spec in config.custom_rules]
        rules += [Rule(rule.name, rule.pattern, config.actions.get(rule.name, config.default_action),
                       rule.check, builtin=True)
                  for rule in BUILTINS if rule.name not in config.disabled]
        self._rules = RuleSet(rules)

    @property
    def rule_names(self) -> tuple[str, ...]:
        """Active rules in priority order (user rules first), for metrics labels and --help."""
        return self._rules.names

    def applies(self, endpoint: Endpoint, model: str | None, opted_out: bool = False) -> bool:
        if opted_out or not endpoint.generates or not self._rules.rules:
            return False
        return self._config.models.get(model, self._config.enabled) if model is not None else self._config.enabled

    def rewrite(self, endpoint: Endpoint, body: Mapping[str, Any], model: str | None,
                opted_out: bool = False) -> RewriteResult:
        if not self.applies(endpoint, model, opted_out):
            return RewriteResult(None, ())
        if endpoint is Endpoint.CHAT:
            return self._rewrite_chat(body)
        if endpoint is Endpoint.MESSAGES:
            return self._rewrite_messages(body)
        if endpoint is Endpoint.RESPONSES:
            return self._rewrite_responses(body)
        return self._rewrite_prompts(body, "prompt" if endpoint is Endpoint.COMPLETION else "text")

    def _rewrite_prompts(self, body: Mapping[str, Any], key: str) -> RewriteResult:
        value = body.get(key)
        prompts = [value] if isinstance(value, str) else value if isinstance(value, list) else []
        new_prompts = list(prompts)
        hits: list[SpanHit] = []
        changed = False
        for index, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                text, trailer = split_trailer(prompt)
                texts, moved, prompt_hits = self._rewrite_texts([text], [True], can_move=True)
                hits += prompt_hits
                if texts[0] != text:
                    new_prompts[index] = with_trailer(texts[0], trailer, moved)
                    changed = True
        if not changed:
            return RewriteResult(None, tuple(hits))
        new_body = dict(body)
        new_body[key] = new_prompts[0] if isinstance(value, str) else new_prompts
        return RewriteResult(new_body, tuple(hits))

    def _rewrite_responses(self, body: Mapping[str, Any]) -> RewriteResult:
        instructions, value = body.get("instructions"), body.get("input")
        system = [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []
        items = [{"role": "user", "content": value}] if isinstance(value, str) else (
            value if isinstance(value, list) else [])
        result = self._rewrite_chat({"messages": system + items}, new_part="input_text")
        if result.body is None:
            return result
        rewritten = result.body["messages"]
        new_body = {**body, "input": rewritten[-1]["content"] if isinstance(value, str) else rewritten[len(system):]}
        if system:
            new_body["instructions"] = rewritten[0]["content"]
        return RewriteResult(new_body, result.hits)

    def _rewrite_chat(self, body: Mapping[str, Any], new_part: str = "text") -> RewriteResult:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return RewriteResult(None, ())
        host = _chat_host(messages)
        places, texts, searchable = _chat_head(messages, host)
        rewritten, moved, hits = self._rewrite_texts(texts, searchable, can_move=host is not None)
        if rewritten is texts:  # nothing acted on (the common case: known clean text)
            return RewriteResult(None, tuple(hits))
        changes = {place: new for place, old, new in zip(places, texts, rewritten, strict=True) if new != old}
        if host is not None:
            host_body = changes.get((host.message, host.part), host.body)
            if moved or (host.message, host.part) in changes:
                changes[(host.message, host.part)] = with_trailer(host_body, host.trailer, moved)
        new_body = dict(body)
        new_body["messages"] = _apply(messages, changes, new_part)
        return RewriteResult(new_body, tuple(hits))

    def _rewrite_messages(self, body: Mapping[str, Any]) -> RewriteResult:
        """Anthropic's blocks are shaped as chat's text parts, so its `system` is searched as a system message."""
        system, messages = body.get("system"), body.get("messages")
        if system is None or not isinstance(messages, list):
            return self._rewrite_chat(body)
        result = self._rewrite_chat({"messages": [{"role": "system", "content": system}, *messages]})
        if result.body is None:
            return result
        rewritten = result.body["messages"]
        return RewriteResult({**body, "system": rewritten[0]["content"], "messages": rewritten[1:]}, result.hits)

    def _rewrite_texts(self, texts: list[str], searchable: list[bool],
                       can_move: bool) -> tuple[list[str], list[str], list[SpanHit]]:
        """Rewrite the strings of one prompt until a pass over the window finds nothing to act on; the same list
        `texts` comes back when nothing was acted on."""
        current = texts
        moved: list[str] = []
        acted: list[SpanHit] = []
        while True:
            kept: list[SpanHit] = []
            changed = False
            budget = self._config.window_chars
            for index, text in enumerate(current):
                if budget <= 0:
                    break
                if searchable[index] and (result := self._rules.rewrite(text, budget, can_move)) is not None:
                    kept += [hit for hit in result.hits if hit.action is Action.KEEP]
                    if result.changed:
                        changed = True
                        if current is texts:
                            current = list(texts)
                        current[index] = result.text
                        moved += result.moved
                        acted += [hit for hit in result.hits if hit.action is not Action.KEEP]
                budget -= len(current[index])
            if not changed:
                return current, moved, acted + kept


def _chat_host(messages: list[Any]) -> _Host | None:
    last = messages[-1]
    if not isinstance(last, dict) or "role" not in last:  # a Responses function call or its output
        return None
    content = last.get("content")
    if content is None or isinstance(content, str):
        body, trailer = split_trailer(content or "")
        return _Host(len(messages) - 1, None, body, trailer)
    if not isinstance(content, list):
        return None
    for part in range(len(content) - 1, -1, -1):
        text = _part_text(content[part])
        if text is not None:
            body, trailer = split_trailer(text)
            return _Host(len(messages) - 1, part, body, trailer)
    return _Host(len(messages) - 1, len(content), "", "")


def _chat_head(messages: list[Any], host: _Host | None) -> tuple[list[_Place], list[str], list[bool]]:
    """The strings of the messages up to and including the first user message, in order: where each is, its
    text and whether it is searched."""
    places: list[_Place] = []
    texts: list[str] = []
    searchable: list[bool] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        searched = role in _SEARCHED_ROLES
        content = message.get("content")
        if isinstance(content, str):
            places.append((index, None))
            texts.append(content)
            searchable.append(searched)
        elif isinstance(content, list):
            for part, item in enumerate(content):
                if (text := _part_text(item)) is not None:
                    places.append((index, part))
                    texts.append(text)
                    searchable.append(searched)
        if role == "user":
            break
    if host is not None and places and places[-1] == (host.message, host.part):  # the host is the head's last
        texts[-1] = host.body  # the trailer of an earlier rewrite is never searched
    return places, texts, searchable


# Text parts: chat's and Anthropic's "text", the Responses API's "input_text" and "output_text".
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


def _part_text(part: Any) -> str | None:
    if isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str):
        text: str = part["text"]
        return text
    return None


def _apply(messages: list[Any], changes: Mapping[tuple[int, int | None], str], new_part: str) -> list[Any]:
    """A copy of messages with the changed strings replaced; untouched messages and parts are shared."""
    by_message: dict[int, dict[int | None, str]] = {}
    for (index, part), text in changes.items():
        by_message.setdefault(index, {})[part] = text
    new_messages = list(messages)
    for index, parts in by_message.items():
        message = dict(messages[index])
        if None in parts:
            message["content"] = parts[None]
        else:
            content = list(message["content"])
            for part, text in sorted((part, text) for part, text in parts.items() if part is not None):
                if part == len(content):
                    content.append({"type": new_part, "text": text})
                else:
                    content[part] = {**content[part], "text": text}
            message["content"] = content
        new_messages[index] = message
    return new_messages
