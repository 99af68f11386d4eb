"""Hostile input on every generation endpoint, in-process (tests/inprocess.py): whatever a client sends, the
gateway answers 2xx or 4xx in OpenAI's shape (Anthropic's on /v1/messages; the fake backend always answers 200,
so any 5xx is the gateway's own), keeps serving, and holds nothing afterwards."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.app import GENERATION_PATHS
from tests.inprocess import MODEL, FakeBackend, Harness, running_gateway

PATHS = sorted(GENERATION_PATHS)
FUZZ = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# Text that reaches the rewriter's rules (ids and timestamps near the start) and the encoders (surrogates).
SNIPPETS = ["request 3f2a9c1e-8b7d-4e6f-9a0b-1c2d3e4f5a6b ", "at 2026-12-05T10:59:36Z ", "\ud800", "\udfff",
            "\x00", "\u2028", "é", "🙂", "data: [DONE]\n\n", "\r\n", '"}', "You are a helpful assistant. "]
texts = st.lists(st.one_of(st.sampled_from(SNIPPETS), st.text(max_size=20)), max_size=6).map("".join)
huge_numbers = st.one_of(st.integers(), st.just(10 ** 300), st.just(-(2 ** 70)), st.floats(allow_nan=True),
                         st.just(1e308))
scalars = st.one_of(st.none(), st.booleans(), huge_numbers, texts)
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(texts, inner, max_size=4)),
                           max_leaves=12)
content_parts = st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(texts, json_values)}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "bogus"]),
                           "image_url": st.fixed_dictionaries({"url": texts})}),
    json_values), max_size=4)
messages = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), texts),
                           "content": st.one_of(texts, content_parts, json_values)},
                          optional={"tool_calls": json_values, "name": json_values}),
    json_values), max_size=4)
models = st.one_of(st.just(MODEL), texts, json_values)
prompts = st.one_of(texts, st.lists(texts, max_size=3), st.lists(huge_numbers, max_size=5),
                    st.lists(st.lists(st.integers(), max_size=4), max_size=2), json_values)
bodies = st.fixed_dictionaries({}, optional={
    "model": models, "messages": messages, "prompt": prompts, "text": prompts, "input_ids": prompts,
    "input": prompts, "stream": json_values, "max_tokens": huge_numbers, "tools": json_values,
    "stream_options": json_values, "n": huge_numbers, "extra": json_values})
header_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
headers = st.dictionaries(st.sampled_from(["x-request-id", "content-type", "connection", "x-no-rewrite",
                                           "authorization", "cookie", "x-forwarded-for", "forwarded",
                                           "accept-encoding", "te", "x-custom"]), header_values, max_size=5)


def nested(depth: int, open_: str = "[", close: str = "]") -> bytes:
    return (open_ * depth + close * depth).encode()


raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.integers(1, 200_000).map(nested),
    st.integers(1, 5000).map(lambda depth: b'{"messages": [{"role": "user", "content": ' + nested(depth)
                                           + b"}]}"),
    st.integers(1, 5000).map(lambda depth: b'{"model": ' + nested(depth, '{"a":', "}")[:-depth] + b"1"
                                           + b"}" * depth + b"}"),
    st.sampled_from([b'{"prompt": 1' + b"0" * 5000 + b"}", b'{"prompt": 1e999999}', b'{"prompt": NaN}',
                     b'{"messages": [{"role": "user", "content": "\\ud800"}], "model": "\\udfff"}',
                     b'{"text": "\\ud800\\udc00\\ud800"}', b"\xff\xfe{}", b'{"input": "a"}' * 3]))


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[asyncio.AbstractEventLoop, Harness]]:
    """One gateway for all the examples of this module, in a loop the synchronous hypothesis tests drive."""
    loop = asyncio.new_event_loop()
    started = running_gateway(FakeBackend())
    harness = loop.run_until_complete(started.__aenter__())
    yield loop, harness
    loop.run_until_complete(started.__aexit__(None, None, None))
    loop.close()


async def post(harness: Harness, path: str, raw: bytes, sent_headers: dict[str, str]) -> tuple[int, Any]:
    async with harness.client.post(path, data=raw, headers=sent_headers) as response:
        text = await response.text()
        return response.status, text


def check(served: tuple[asyncio.AbstractEventLoop, Harness], path: str, raw: bytes,
          sent_headers: dict[str, str]) -> None:
    loop, harness = served
    status, text = loop.run_until_complete(post(harness, path, raw, sent_headers))
    assert status < 500, (status, text)
    if status >= 400:  # the gateway's own refusal (the fake backend answers 200), in the endpoint's shape
        answer = json.loads(text)
        if path == "/v1/messages":
            assert answer["type"] == "error" and set(answer["error"]) == {"type", "message"}, answer
        else:
            assert set(answer["error"]) == {"message", "type", "param", "code"}, answer
    harness.assert_nothing_held()


@FUZZ
@given(path=st.sampled_from(PATHS), body=bodies, sent_headers=headers)
def test_fuzzed_json_bodies_and_headers_get_no_gateway_5xx(
        served: tuple[asyncio.AbstractEventLoop, Harness], path: str, body: dict[str, Any],
        sent_headers: dict[str, str]) -> None:
    check(served, path, json.dumps(body).encode(), sent_headers)


@FUZZ
@given(path=st.sampled_from(PATHS), raw=raw_bodies)
def test_malformed_deep_and_huge_bodies_get_no_gateway_5xx(
        served: tuple[asyncio.AbstractEventLoop, Harness], path: str, raw: bytes) -> None:
    check(served, path, raw, {"content-type": "application/json"})


def test_gateway_still_serves_after_the_fuzzing(served: tuple[asyncio.AbstractEventLoop, Harness]) -> None:
    loop, harness = served
    status, _, _ = loop.run_until_complete(harness.chat("a normal question"))
    assert status == 200
    assert harness.gateway.pool.backends[0].healthy
    harness.assert_nothing_held()
