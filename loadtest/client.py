"""The async driver: sends a scenario's conversations to one OpenAI-compatible URL and times every request.

Arrivals are open loop (Poisson at `rate_per_s`, wall-clock) or closed loop (`max_concurrency` in flight), as
in SGLang's bench. Multi-turn works like SGLang's multi-turn bench: the first round of every conversation is
queued in order; a conversation's next round is queued only when its previous round has answered, with that
real answer appended to the history; a round with an idle time is queued that much later (agent sessions that
pause). A failed round continues with an empty answer, so every policy sends the same number of requests.
A conversation that names itself (`SessionKeys`) sends its key with every round, as `prompt_cache_key`, `user` or
the `x-session-id` header.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx2

from loadtest.scenarios import SessionKeys
from loadtest.workload import Conversation, RequestKind, seeded

Message = dict[str, str]


@dataclass(frozen=True)
class RequestResult:
    """One request as the client saw it; times in wall-clock seconds."""

    conversation: int
    turn: int
    kind: RequestKind
    start_s: float                 # since the run started
    ttft_s: float | None           # None when no token arrived
    e2e_s: float
    itl_s: tuple[float, ...]       # gaps between successive content chunks
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    replica: str | None            # x-replica-id of the replica that served it
    error: str | None
    route: str | None = None       # x-gateway-route: why the gateway chose that replica


@dataclass(frozen=True)
class Sent:
    """What was sent and answered, in dispatch order: the oracle replays these."""

    messages: tuple[Message, ...]
    answer: str
    kind: RequestKind


@dataclass(frozen=True)
class DriveResult:
    results: tuple[RequestResult, ...]
    sent: tuple[Sent, ...]
    duration_s: float


@dataclass(frozen=True)
class DriveOptions:
    rate_per_s: float | None = None       # wall-clock Poisson arrival rate; None = as fast as allowed
    max_concurrency: int | None = None    # closed loop cap on requests in flight
    stream: bool = True
    seed: int = 0
    timeout_s: float = 600.0
    ignore_eos: bool = True               # SGLang/vLLM extension: generate exactly max_tokens
    time_scale: float = 1.0               # wall seconds per simulated second, for turns' idle times


@dataclass
class _State:
    """The run's mutable bookkeeping, owned by one `drive()` call."""

    queue: asyncio.Queue[tuple[Conversation, int, tuple[Message, ...]]]
    start: float
    results: list[RequestResult] = field(default_factory=list)
    sent: list[Sent] = field(default_factory=list)


def make_client(timeout_s: float = 600.0) -> httpx2.AsyncClient:
    # trust_env=False: a host proxy variable must never capture loopback traffic (seed 000's 502).
    return httpx2.AsyncClient(trust_env=False, timeout=httpx2.Timeout(timeout_s, connect=10.0),
                             limits=httpx2.Limits(max_connections=2000, max_keepalive_connections=2000))


async def drive(base_url: str | Sequence[str], conversations: tuple[Conversation, ...], options: DriveOptions,
                on_done: Callable[[RequestResult], None] | None = None) -> DriveResult:
    """Send every turn of every conversation; returns results sorted by dispatch order. Several URLs (gateway
    instances) take the requests in turn, each request to the next, as a round-robin load balancer would."""
    urls = [base_url] if isinstance(base_url, str) else list(base_url)
    state = _State(asyncio.Queue(), time.perf_counter())
    for conversation in conversations:
        state.queue.put_nowait((conversation, 0, ()))
    total = sum(len(conversation.turns) for conversation in conversations)
    limit = asyncio.Semaphore(options.max_concurrency) if options.max_concurrency else None
    rng = seeded(options.seed, "arrivals")
    tasks: list[asyncio.Task[None]] = []
    async with make_client(options.timeout_s) as client:
        next_at = time.perf_counter()
        for sent in range(total):
            item = await state.queue.get()
            if options.rate_per_s:
                next_at = max(next_at, time.perf_counter() - 0.1) + rng.expovariate(options.rate_per_s)
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            if limit is not None:
                await limit.acquire()
            url = urls[sent % len(urls)]
            tasks.append(asyncio.create_task(_send(client, url, item, options, state, limit, on_done)))
        await asyncio.gather(*tasks)
    duration = time.perf_counter() - state.start
    return DriveResult(tuple(state.results), tuple(state.sent), duration)


async def _send(client: httpx2.AsyncClient, base_url: str, item: tuple[Conversation, int, tuple[Message, ...]],
                options: DriveOptions, state: _State, limit: asyncio.Semaphore | None,
                on_done: Callable[[RequestResult], None] | None) -> None:
    conversation, turn_index, history = item
    turn = conversation.turns[turn_index]
    messages = _messages(conversation, history, turn.user_text)
    slot = len(state.sent)
    state.sent.append(Sent(messages, "", conversation.kind))
    try:
        if conversation.kind is RequestKind.EMBEDDING:
            result, answer = await _embed(client, base_url, conversation, turn.user_text, state.start)
        else:
            result, answer = await _chat(client, base_url, conversation, messages, turn.max_tokens, options,
                                         state.start)
    finally:
        if limit is not None:
            limit.release()
    result = _with_position(result, conversation.index, turn_index)
    state.sent[slot] = Sent(messages, answer, conversation.kind)
    state.results.append(result)
    if on_done is not None:
        on_done(result)
    if turn_index + 1 < len(conversation.turns):
        user = {"role": "user", "content": turn.user_text}
        reply = {"role": "assistant", "content": answer}
        following = (conversation, turn_index + 1, (*history, user, reply))
        idle_s = conversation.turns[turn_index + 1].idle_s * options.time_scale
        if idle_s > 0:
            asyncio.get_running_loop().call_later(idle_s, state.queue.put_nowait, following)
        else:
            state.queue.put_nowait(following)


def _messages(conversation: Conversation, history: tuple[Message, ...], user_text: str) -> tuple[Message, ...]:
    system = ({"role": "system", "content": conversation.system_text},) if conversation.system_text else ()
    return (*system, *history, {"role": "user", "content": user_text})


def _with_position(result: RequestResult, conversation: int, turn: int) -> RequestResult:
    fields = {**result.__dict__, "conversation": conversation, "turn": turn}
    return RequestResult(**fields)


def _failed(kind: RequestKind, start_s: float, e2e_s: float, error: str, replica: str | None = None
            ) -> RequestResult:
    return RequestResult(0, 0, kind, start_s, None, e2e_s, (), 0, 0, 0, replica, error)


async def _chat(client: httpx2.AsyncClient, base_url: str, conversation: Conversation,
                messages: tuple[Message, ...], max_tokens: int, options: DriveOptions, run_start: float
                ) -> tuple[RequestResult, str]:
    body: dict[str, Any] = {"model": conversation.model, "messages": list(messages), "max_tokens": max_tokens,
                            "temperature": 0.0, "stream": options.stream}
    if options.ignore_eos:
        body["ignore_eos"] = True
    if options.stream:
        body["stream_options"] = {"include_usage": True}
    headers = _name_session(conversation, body)
    start = time.perf_counter()
    try:
        if options.stream:
            return await _chat_stream(client, base_url, body, headers, start, run_start)
        response = await client.post(f"{base_url}/v1/chat/completions", json=body, headers=headers)
        e2e = time.perf_counter() - start
        if response.status_code != 200:
            return _failed(RequestKind.CHAT, start - run_start, e2e, _error_text(response),
                           response.headers.get("x-replica-id")), ""
        payload = response.json()
        answer = payload["choices"][0]["message"].get("content") or ""
        prompt, cached, output = _usage(payload.get("usage"))
        return RequestResult(0, 0, RequestKind.CHAT, start - run_start, e2e, e2e, (), prompt, cached, output,
                             response.headers.get("x-replica-id"), None, response.headers.get("x-gateway-route")), \
            answer
    except (httpx2.HTTPError, ValueError, KeyError, IndexError) as exc:
        return _failed(RequestKind.CHAT, start - run_start, time.perf_counter() - start, _describe(exc)), ""


def _name_session(conversation: Conversation, body: dict[str, Any]) -> dict[str, str]:
    """Put the conversation's session key where its `session_keys` says; the headers to send."""
    keys = conversation.session_keys
    if keys is SessionKeys.HEADER:
        return {"x-session-id": conversation.session_key}
    if keys is not SessionKeys.NONE:
        body[keys.value] = conversation.session_key
    return {}


async def _chat_stream(client: httpx2.AsyncClient, base_url: str, body: dict[str, Any], headers: dict[str, str],
                       start: float, run_start: float) -> tuple[RequestResult, str]:
    chunk_times: list[float] = []
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    async with client.stream("POST", f"{base_url}/v1/chat/completions", json=body, headers=headers) as response:
        replica, route = response.headers.get("x-replica-id"), response.headers.get("x-gateway-route")
        if response.status_code != 200:
            await response.aread()
            return _failed(RequestKind.CHAT, start - run_start, time.perf_counter() - start,
                           _error_text(response), replica), ""
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                return _failed(RequestKind.CHAT, start - run_start, time.perf_counter() - start,
                               str(chunk["error"]), replica), ""
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    chunk_times.append(time.perf_counter())
                    pieces.append(content)
    e2e = time.perf_counter() - start
    ttft = chunk_times[0] - start if chunk_times else None
    itl = tuple(later - earlier for earlier, later in zip(chunk_times, chunk_times[1:], strict=False))
    prompt, cached, output = _usage(usage)
    return RequestResult(0, 0, RequestKind.CHAT, start - run_start, ttft, e2e, itl, prompt, cached,
                         output or len(chunk_times), replica, None, route), "".join(pieces)


async def _embed(client: httpx2.AsyncClient, base_url: str, conversation: Conversation, text: str,
                 run_start: float) -> tuple[RequestResult, str]:
    start = time.perf_counter()
    try:
        response = await client.post(f"{base_url}/v1/embeddings", json={"model": conversation.model, "input": text})
        e2e = time.perf_counter() - start
        replica = response.headers.get("x-replica-id")
        if response.status_code != 200:
            return _failed(RequestKind.EMBEDDING, start - run_start, e2e, _error_text(response), replica), ""
        prompt, cached, _ = _usage(response.json().get("usage"))
        return RequestResult(0, 0, RequestKind.EMBEDDING, start - run_start, e2e, e2e, (), prompt, cached, 0,
                             replica, None), ""
    except (httpx2.HTTPError, ValueError) as exc:
        return _failed(RequestKind.EMBEDDING, start - run_start, time.perf_counter() - start, _describe(exc)), ""


def _usage(usage: dict[str, Any] | None) -> tuple[int, int, int]:
    """(prompt, cached, completion) tokens; cached_tokens is null or absent on engines without a cache report."""
    if not usage:
        return 0, 0, 0
    details = usage.get("prompt_tokens_details") or {}
    return int(usage.get("prompt_tokens") or 0), int(details.get("cached_tokens") or 0), \
        int(usage.get("completion_tokens") or 0)


def _error_text(response: httpx2.Response) -> str:
    return f"HTTP {response.status_code}: {response.text[:200]}"


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]
