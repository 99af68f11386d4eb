"""The simulated replica's agent-facing APIs: OpenAI Responses (with a store), Anthropic Messages, tokenize and
detokenize, rerank and score.

Each generates through the same engine as chat, so its prompt hits the prefix cache the same way and the
cached tokens are reported in the API's own usage shape. Stored responses live in this replica's memory only,
as on vLLM and SGLang: a `previous_response_id` from another replica is "not found" here.
"""

from __future__ import annotations

import collections
import json
import time
import uuid
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from simulator.engine import Generation
from simulator.faults import DroppingEventStream
from simulator.replica_requests import ApiError, Prompt, body_field, json_body, max_tokens, read_prompts
from simulator.tokenizer import CHARS_PER_TOKEN, content_text, render_chat, tokenize

if TYPE_CHECKING:
    from simulator.replica import _Replica

MAX_STORED_RESPONSES = 10_000
MAX_VOCABULARY = 200_000
_BILLING_HEADER = "x-anthropic-billing-header"
_TEXT_PARTS = ("text", "input_text", "output_text")


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # as chat messages, the answer included: what a follow-up continues


def event(name: str, payload: dict[str, Any]) -> str:
    """One SSE event with its name, as the Responses and Messages streams send them."""
    return f"event: {name}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


def responses_usage(gen: Generation) -> dict[str, Any]:
    prompt, output = len(gen.prompt_tokens), len(gen.output)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": gen.cached_tokens},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}


def messages_usage(gen: Generation) -> dict[str, Any]:
    """Anthropic counts cache reads beside `input_tokens`, not inside it."""
    return {"input_tokens": len(gen.prompt_tokens) - gen.cached_tokens, "cache_read_input_tokens": gen.cached_tokens,
            "cache_creation_input_tokens": 0, "output_tokens": len(gen.output)}


def _parts_text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content if isinstance(part, dict)
                         and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str))
    return content_text(content)


def input_messages(value: Any) -> list[dict[str, Any]]:
    """A Responses `input` as chat messages: a string is a user turn; items with a role are turns; other items
    (function calls and their outputs) are rendered as their JSON."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise ApiError(400, "'input' must be a string or an array of items", "input")
    messages = []
    for item in value:
        if not isinstance(item, dict):
            raise ApiError(400, "every input item must be an object", "input")
        if isinstance(item.get("role"), str):
            messages.append({"role": item["role"], "content": _parts_text(item.get("content"))})
        else:
            role = "tool" if item.get("type") == "function_call_output" else "assistant"
            messages.append({"role": role, "content": json.dumps(item, sort_keys=True)})
    return messages


def system_text(system: Any) -> str:
    """Anthropic's `system`, less Claude Code's billing-header block, which vLLM drops too (a per-request hash)."""
    if isinstance(system, list):
        return "".join(block["text"] for block in system if isinstance(block, dict) and block.get("type") == "text"
                       and isinstance(block.get("text"), str) and not block["text"].startswith(_BILLING_HEADER))
    return system if isinstance(system, str) else ""


class AgentApis:
    """The handlers of one replica's Responses, Messages, tokenize and rerank endpoints."""

    def __init__(self, replica: _Replica) -> None:
        self.replica = replica
        self.model = replica.config.model
        self.stored: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self.vocabulary: dict[int, str] = {}  # token id -> its text, learned by /tokenize for /detokenize

    def routes(self) -> list[Route]:
        return [
            Route("/v1/responses", self.create_response, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.get_response, methods=["GET"]),
            Route("/v1/responses/{response_id}", self.delete_response, methods=["DELETE"]),
            Route("/v1/responses/{response_id}/cancel", self.cancel_response, methods=["POST"]),
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
            *(Route(path, self.tokenize, methods=["POST"]) for path in ("/tokenize", "/v1/tokenize")),
            *(Route(path, self.detokenize, methods=["POST"]) for path in ("/detokenize", "/v1/detokenize")),
            *(Route(path, self.rerank, methods=["POST"]) for path in ("/rerank", "/v1/rerank")),
            *(Route(path, self.score, methods=["POST"]) for path in ("/score", "/v1/score")),
        ]

    # --- Responses ---------------------------------------------------------------------------------------

    async def create_response(self, request: Request) -> Response:
        body = await json_body(request)
        history: list[dict[str, Any]] = []
        previous = body_field(body, "previous_response_id", str)
        if previous is not None:
            if previous not in self.stored:
                raise ApiError(404, f"Response with id '{previous}' not found.", "previous_response_id")
            history = self.stored[previous].conversation
        conversation = history + input_messages(body.get("input"))
        instructions = body_field(body, "instructions", str)
        system = [{"role": "system", "content": instructions}] if instructions else []
        text = render_chat(system + conversation, body_field(body, "tools", list))
        [gen] = await self.replica._generate([Prompt(tokenize(text), text)], max_tokens(body, "max_output_tokens"),
                                             self.replica.adapter_of(body))
        head = {"id": "resp_" + uuid.uuid4().hex, "created_at": int(time.time()), "body": body,
                "conversation": conversation}
        if body_field(body, "stream", bool, False):
            return DroppingEventStream(self._response_events(gen, head),
                                       self.replica.faults.settings.drop_after_chunks)
        if not await self.replica._collect([gen], request):
            return Response(status_code=499)
        return JSONResponse(self._finish_response(gen, head))

    def _response(self, head: dict[str, Any], status: str, gen: Generation | None) -> dict[str, Any]:
        body = head["body"]
        output = [] if gen is None else [self._message_item(head, "".join(gen.output), "completed")]
        return {"id": head["id"], "object": "response", "created_at": head["created_at"], "status": status,
                "model": self.model, "output": output, "instructions": body.get("instructions"),
                "previous_response_id": body.get("previous_response_id"), "tools": body.get("tools") or [],
                "tool_choice": "auto", "parallel_tool_calls": True, "store": body.get("store", True) is not False,
                "temperature": 1.0, "top_p": 1.0, "error": None, "incomplete_details": None, "metadata": {},
                "text": {"format": {"type": "text"}}, "truncation": "disabled",
                "usage": None if gen is None else responses_usage(gen)}

    @staticmethod
    def _message_item(head: dict[str, Any], text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
        return {"type": "message", "id": "msg_" + head["id"][5:], "status": status, "role": "assistant",
                "content": content}

    def _finish_response(self, gen: Generation, head: dict[str, Any]) -> dict[str, Any]:
        """The completed response, stored (when asked) before the client can see its id complete."""
        response = self._response(head, "completed", gen)
        if response["store"]:
            answer = {"role": "assistant", "content": "".join(gen.output)}
            self.stored[head["id"]] = StoredResponse(response, head["conversation"] + [answer])
            while len(self.stored) > MAX_STORED_RESPONSES:
                self.stored.popitem(last=False)
        return response

    async def _response_events(self, gen: Generation, head: dict[str, Any]) -> AsyncIterator[str]:
        """The Responses stream: created, in progress, the message item and its text part opened, a delta per
        token, everything closed again, then `response.completed` with the usage."""
        sequence = iter(range(1 << 30))
        item_id = "msg_" + head["id"][5:]
        at = {"item_id": item_id, "output_index": 0, "content_index": 0}

        def emit(name: str, **fields: Any) -> str:
            return event(name, {"type": name, "sequence_number": next(sequence), **fields})

        try:
            yield emit("response.created", response=self._response(head, "in_progress", None))
            yield emit("response.in_progress", response=self._response(head, "in_progress", None))
            yield emit("response.output_item.added", output_index=0,
                       item=self._message_item(head, "", "in_progress"))
            yield emit("response.content_part.added", **at, part={"type": "output_text", "text": "",
                                                                   "annotations": []})
            async for piece in gen.pieces():
                yield emit("response.output_text.delta", **at, delta=piece, logprobs=[])
            text = "".join(gen.output)
            yield emit("response.output_text.done", **at, text=text, logprobs=[])
            yield emit("response.content_part.done", **at, part={"type": "output_text", "text": text,
                                                                  "annotations": []})
            yield emit("response.output_item.done", output_index=0, item=self._message_item(head, text, "completed"))
            yield emit("response.completed", response=self._finish_response(gen, head))
        finally:
            self.replica.engine.abort(gen)

    def _stored(self, request: Request) -> StoredResponse:
        response_id = request.path_params["response_id"]
        if response_id not in self.stored:
            raise ApiError(404, f"Response with id '{response_id}' not found.")
        return self.stored[response_id]

    async def get_response(self, request: Request) -> Response:
        return JSONResponse(self._stored(request).response)

    async def delete_response(self, request: Request) -> Response:
        response_id = self._stored(request).response["id"]
        del self.stored[response_id]
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def cancel_response(self, request: Request) -> Response:
        self._stored(request)
        raise ApiError(400, "Only background responses can be cancelled; this one has completed.")

    # --- Anthropic Messages ------------------------------------------------------------------------------

    async def messages(self, request: Request) -> Response:
        body = await json_body(request)
        text = self._messages_prompt(body)
        [gen] = await self.replica._generate([Prompt(tokenize(text), text)], max_tokens(body, "max_tokens"),
                                             self.replica.adapter_of(body))
        message_id = "msg_" + uuid.uuid4().hex
        if body_field(body, "stream", bool, False):
            return DroppingEventStream(self._message_events(gen, message_id),
                                       self.replica.faults.settings.drop_after_chunks)
        if not await self.replica._collect([gen], request):
            return Response(status_code=499)
        return JSONResponse({**self._message(message_id, "max_tokens", gen),
                             "content": [{"type": "text", "text": "".join(gen.output)}]})

    async def count_tokens(self, request: Request) -> Response:
        return JSONResponse({"input_tokens": len(tokenize(self._messages_prompt(await json_body(request))))})

    @staticmethod
    def _messages_prompt(body: dict[str, Any]) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "messages: must be a non-empty array of message objects", "messages")
        system = system_text(body.get("system"))
        chat = ([{"role": "system", "content": system}] if system else []) + [
            {"role": message.get("role"), "content": _parts_text(message.get("content"))} for message in messages]
        try:
            return render_chat(chat, body_field(body, "tools", list))
        except TypeError as exc:
            raise ApiError(400, str(exc), "messages") from exc

    def _message(self, message_id: str, stop_reason: str | None, gen: Generation) -> dict[str, Any]:
        return {"id": message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": stop_reason, "stop_sequence": None, "usage": messages_usage(gen)}

    async def _message_events(self, gen: Generation, message_id: str) -> AsyncIterator[str]:
        """Anthropic's stream: message_start (sent with the first token, when the cache hit is known), one text
        block of deltas, message_delta with the stop reason and final usage, message_stop."""
        try:
            async for piece in gen.pieces():
                if len(gen.output) == 1:
                    yield event("message_start", {"type": "message_start",
                                                  "message": self._message(message_id, None, gen)})
                    yield event("content_block_start", {"type": "content_block_start", "index": 0,
                                                        "content_block": {"type": "text", "text": ""}})
                yield event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                    "delta": {"type": "text_delta", "text": piece}})
            yield event("content_block_stop", {"type": "content_block_stop", "index": 0})
            yield event("message_delta", {"type": "message_delta", "usage": messages_usage(gen),
                                          "delta": {"stop_reason": "max_tokens", "stop_sequence": None}})
            yield event("message_stop", {"type": "message_stop"})
        finally:
            self.replica.engine.abort(gen)

    # --- tokenize, rerank, score -------------------------------------------------------------------------

    async def tokenize(self, request: Request) -> Response:
        body = await json_body(request)
        if isinstance(body.get("messages"), list):
            text = render_chat(body["messages"])
        else:
            text = body_field(body, "prompt", str) or ""
        tokens = tokenize(text)
        for index, token in enumerate(tokens):
            if len(self.vocabulary) < MAX_VOCABULARY:
                self.vocabulary[token] = text[index * CHARS_PER_TOKEN:(index + 1) * CHARS_PER_TOKEN]
        return JSONResponse({"count": len(tokens), "max_model_len": self.replica.config.engine.max_context_tokens,
                             "tokens": tokens})

    async def detokenize(self, request: Request) -> Response:
        tokens = body_field(await json_body(request), "tokens", list, [])
        if not all(isinstance(token, int) for token in tokens):
            raise ApiError(400, "'tokens' must be a list of token ids", "tokens")
        return JSONResponse({"prompt": "".join(self.vocabulary.get(token, "\ufffd") for token in tokens)})

    async def _relevance(self, request: Request, query: str, documents: list[str]) -> tuple[list[float], Any]:
        """Each (query, document) pair is prefilled as one prompt, query first, so a shared query hits the cache."""
        prompts = [Prompt(tokenize(query + "\n" + document), query + "\n" + document) for document in documents]
        gens = await self.replica._admit(prompts, 0)
        if not await self.replica._collect(gens, request):
            return [], None
        tokens = sum(len(gen.prompt_tokens) for gen in gens)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens,
                 "prompt_tokens_details": {"cached_tokens": sum(gen.cached_tokens for gen in gens)}}
        return [zlib.crc32(prompt.text.encode()) % 10_000 / 10_000 for prompt in prompts if prompt.text], usage

    async def rerank(self, request: Request) -> Response:
        body = await json_body(request)
        query = body_field(body, "query", str)
        documents = body_field(body, "documents", list)
        if query is None or not documents:
            raise ApiError(400, "'query' and a non-empty 'documents' are required", "documents")
        texts = [doc["text"] if isinstance(doc, dict) and isinstance(doc.get("text"), str) else str(doc)
                 for doc in documents]
        scores, usage = await self._relevance(request, query, texts)
        if usage is None:
            return Response(status_code=499)
        ranked = sorted(range(len(texts)), key=lambda i: -scores[i])[: body_field(body, "top_n", int, len(texts))]
        return JSONResponse({"id": "rerank-" + uuid.uuid4().hex, "model": self.model, "usage": usage, "results": [
            {"index": i, "document": {"text": texts[i]}, "relevance_score": scores[i]} for i in ranked]})

    async def score(self, request: Request) -> Response:
        body = await json_body(request)
        first, second = body.get("text_1"), body.get("text_2")
        if not isinstance(first, str):
            raise ApiError(400, "'text_1' must be a string", "text_1")
        seconds = [p.text or "" for p in read_prompts(second, "text_2")]
        scores, usage = await self._relevance(request, first, seconds)
        if usage is None:
            return Response(status_code=499)
        return JSONResponse({"id": "score-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()),
                             "model": self.model, "usage": usage,
                             "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]})
