"""How the simulated replica reads request bodies and shapes its answers: OpenAI's error body (Anthropic's on
its Messages API), prompt fields (text or token ids), SSE lines, usage with cached tokens, and the
`x-replica-id` header on every response.

Kept apart from the handlers in `simulator/replica.py` so each reads as what it does with a request, not how.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from simulator.engine import Generation
from simulator.tokenizer import tokenize

DEFAULT_MAX_TOKENS = 16


class ApiError(Exception):
    """Answered as OpenAI's error body with `status`; raised anywhere a handler refuses a request."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 error_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.error_type = status, message, param, error_type

    def response(self, anthropic: bool = False) -> JSONResponse:
        """OpenAI's error body, or Anthropic's on its Messages API."""
        if anthropic:
            kind = {404: "not_found_error", 429: "rate_limit_error"}.get(self.status, "invalid_request_error") \
                if self.status < 500 else "api_error"
            return JSONResponse({"type": "error", "error": {"type": kind, "message": self.message}},
                                status_code=self.status)
        body = {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.status}}
        return JSONResponse(body, status_code=self.status)


@dataclass(frozen=True)
class Prompt:
    tokens: list[int]
    text: str | None    # None when the client sent token ids


def body_field(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    # bool is an int subclass; a `true` where a count belongs is a client bug worth a 400.
    if not isinstance(value, kinds) or (isinstance(value, bool) and kinds is int):
        raise ApiError(400, f"'{name}' has the wrong type: {type(value).__name__}", name)
    return value


def max_tokens(body: dict[str, Any], *names: str) -> int:
    for name in names:
        value = body_field(body, name, int)
        if value is not None:
            if value < 1:
                raise ApiError(400, f"'{name}' must be at least 1, got {value}", name)
            return int(value)
    return DEFAULT_MAX_TOKENS


def adapter_named(body: dict[str, Any], model: str, adapters: tuple[str, ...]) -> str | None:
    """The LoRA adapter a request is for (None: the base model `model`), named vLLM's way (`model` is the
    adapter) or SGLang's (`model` as "base:adapter", or a `lora_path` field). Any other model is unknown: 404, as
    vLLM answers it."""
    named, lora_path = body.get("model"), body.get("lora_path")
    if isinstance(named, str) and ":" in named:
        base, _, adapter = named.rpartition(":")
        if base == model and adapter in adapters:
            return adapter
    if named is not None and named != model:
        if named in adapters:
            return str(named)
        raise ApiError(404, f"The model `{named}` does not exist.", "model", error_type="NotFoundError")
    if lora_path is not None and lora_path not in adapters:
        raise ApiError(400, f"The LoRA adapter '{lora_path}' is not loaded.", "lora_path")
    return lora_path if isinstance(lora_path, str) else None


def check_n(body: dict[str, Any]) -> None:
    if body_field(body, "n", int, 1) != 1:
        raise ApiError(400, "only n=1 is supported", "n")


def read_prompts(value: Any, name: str) -> list[Prompt]:
    """A string, a list of strings, a list of token ids or a list of token-id lists, as prompts."""
    if isinstance(value, str):
        return [Prompt(tokenize(value), value)]
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return [Prompt(tokenize(item), item) for item in value]
        if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
            return [Prompt(list(value), None)]
        if all(isinstance(item, list) and all(isinstance(t, int) for t in item) for item in value):
            return [Prompt(list(item), None) for item in value]
    raise ApiError(400, f"'{name}' must be a string, a list of strings or a list of token ids", name)


async def json_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"The request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object")
    return body


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def usage_of(gen: Generation) -> dict[str, Any]:
    prompt, completion = len(gen.prompt_tokens), len(gen.output)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": gen.cached_tokens}}


class ReplicaIdHeader:
    """ASGI middleware adding `x-replica-id`; plain ASGI so streamed bodies pass through untouched."""

    def __init__(self, app: ASGIApp, replica_id: str) -> None:
        self.app = app
        self.header = (b"x-replica-id", replica_id.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_id)
