"""Smoke test of the real engine itself: two llama-servers, one chat each.

Proves that setup.sh's llama-server and tiny model work and that the
official openai SDK parses what they answer. Skipped when setup.sh has not
been run (see tests/llama_fleet.py).
"""

from __future__ import annotations

import httpx2
import pytest

from tests.llama_fleet import llama_fleet

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.real_engine


def test_two_servers_answer_a_chat_each() -> None:
    with llama_fleet(2, parallel=2) as servers:
        assert len({s.port for s in servers}) == 2
        for s in servers:
            # trust_env=False: loopback traffic must not go through a proxy
            # that HTTP(S)_PROXY may name.
            with (
                httpx2.Client(trust_env=False) as http,
                openai.OpenAI(
                    base_url=s.openai_base_url, api_key="unused", http_client=http, max_retries=0, timeout=30
                ) as client,
            ):
                models = client.models.list()
                assert [m.id for m in models.data] == ["tiny-llama"]
                resp = client.chat.completions.create(
                    model=models.data[0].id,
                    messages=[
                        {"role": "system", "content": "You are a helpful assistant."},
                        {"role": "user", "content": "Hello, world! How are you today?"},
                    ],
                    max_tokens=8,
                    temperature=0,
                )
            assert resp.object == "chat.completion"
            assert len(resp.choices) == 1
            choice = resp.choices[0]
            assert choice.message.role == "assistant"
            assert isinstance(choice.message.content, str)
            assert choice.finish_reason in ("length", "stop")
            assert resp.usage is not None
            assert resp.usage.prompt_tokens > 0
            assert 0 < resp.usage.completion_tokens <= 8
            props = s.props()
            assert props["total_slots"] == 2
