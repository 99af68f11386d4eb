"""Session keys through the real gateway and simulated replicas, sent by the `openai` SDK and as a header.

The gateway's index is made small (`--max-tree-size`) beside the replicas' caches, so one request records no more
than the head of the system prompt every conversation shares: the index cannot tell conversations apart, and
only the key knows which replica holds the rest of one (as for an agent's context longer than a quarter of a
real index).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx2
import openai
import pytest

from simulator.fleet import running_fleet
from tests.conftest import FAST_GATEWAY, FAST_REPLICA
from tests.policy_fixtures import text

MODEL = "sim-llama-8b"
SYSTEM = text("You are the build agent of a compiler team; call tools, answer tersely.", 4000)


@dataclass
class SessionFleet:
    gateway: str
    http: httpx2.Client

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateway + "/v1", api_key="unused", max_retries=0, http_client=self.http)


@pytest.fixture(scope="module")
def sessions() -> Iterator[SessionFleet]:
    with running_fleet() as fleet, httpx2.Client(trust_env=False, timeout=30) as http:
        replicas = fleet.start_replicas(3, args=[*FAST_REPLICA, "--kv-capacity-tokens", "200000"])
        gateway = fleet.start_gateway(replicas.urls, args=[*FAST_GATEWAY, "--max-tree-size", "8000"])
        yield SessionFleet(gateway.url, http)


def churn(fleet: SessionFleet, label: str) -> None:
    """Other conversations behind the same system prompt: every backend's index holds its head."""
    for i in range(6):
        fleet.openai().chat.completions.create(model=MODEL, max_tokens=1, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": text(f"{label} other {i}", 800)}])


Turn = tuple[str, str, int, int]  # backend, route, prompt tokens, cached tokens


def converse(fleet: SessionFleet, label: str, send: Any) -> list[Turn]:
    """Three turns of one conversation with churn between them."""
    messages: list[Any] = [{"role": "system", "content": SYSTEM}]
    seen = []
    churn(fleet, f"{label} before")
    for turn in range(3):
        messages.append({"role": "user", "content": text(f"{label} tool output {turn}", 2000)})
        raw = send(messages)
        answer = raw.parse()
        usage = answer.usage
        seen.append((raw.headers["x-gateway-backend"], raw.headers["x-gateway-route"],
                     usage.prompt_tokens,
                     usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0))
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
        churn(fleet, f"{label} {turn}")
    return seen


def assert_stayed_home(seen: list[Turn]) -> None:
    """One backend served every turn and had the previous turns cached, though the index had forgotten them."""
    assert len({backend for backend, _, _, _ in seen}) == 1, seen
    for (_, _, previous_prompt, _), (_, route, _, cached) in zip(seen, seen[1:], strict=False):
        assert route == "session", seen  # the index knew only the shared head: the key alone brought it here
        assert cached >= previous_prompt * 0.9, seen


def test_prompt_cache_key_keeps_a_conversation_on_its_backend(sessions: SessionFleet) -> None:
    chat = sessions.openai().chat.completions.with_raw_response
    assert_stayed_home(converse(sessions, "pck", lambda messages: chat.create(
        model=MODEL, messages=messages, max_tokens=4, prompt_cache_key="agent-session-1")))


def test_user_field_keeps_a_conversation_on_its_backend(sessions: SessionFleet) -> None:
    chat = sessions.openai().chat.completions.with_raw_response
    assert_stayed_home(converse(sessions, "user", lambda messages: chat.create(
        model=MODEL, messages=messages, max_tokens=4, user="alice@example.com")))


def test_session_header_keeps_a_conversation_on_its_backend(sessions: SessionFleet) -> None:
    chat = sessions.openai().chat.completions.with_raw_response
    assert_stayed_home(converse(sessions, "header", lambda messages: chat.create(
        model=MODEL, messages=messages, max_tokens=4, extra_headers={"x-session-id": "agent-session-3"})))
