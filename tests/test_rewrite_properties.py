"""Invariants of the rewriter over generated prompts: never corrupts, idempotent, loses nothing, turn-stable.

The label (see gateway/rewrite/__init__.py) is the marker line plus whitespace, so "move loses no characters" is stated
as: the multiset of non-whitespace characters of the prompt text is the same after a rewrite once the
marker's characters are taken out (removal only ever drops whitespace beside a span).
"""

import copy
import json
from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api.prompts import Endpoint
from gateway.rewrite import MARKER, Action, RewriteConfig, Rewriter

SETTINGS = settings(max_examples=150, deadline=None)

_hex = st.text("0123456789abcdef", min_size=4, max_size=40)
_spans = st.one_of(
    st.uuids().map(str),
    _hex.map(lambda h: h + "a1"),
    st.datetimes().map(lambda d: d.isoformat(timespec="seconds") + "Z"),
    st.integers(1_000_000_000, 1_999_999_999_999).map(str),
    st.builds(lambda k, v: f"{k}: {v}", st.sampled_from(["Request ID", "session_id", "trace", "nonce"]), _hex),
    st.just("x-anthropic-billing-header: cc_version=1.0.83.abc; cc_entrypoint=cli; cch=7f3a9c1e5b2d4f60;"),
    st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/_-=", min_size=18, max_size=40),
)
_filler = st.one_of(st.text(max_size=30), st.sampled_from([" ", "\n", "\r\n", "\t", ".", "(", ")", ": ", "\n\n"]),
                    st.sampled_from(["You are a helpful assistant.", "v1.2.3", "deadbeef", "$1234567890.00"]))
texts = st.lists(st.one_of(_spans, _filler), max_size=12).map("".join)
configs = st.builds(
    RewriteConfig,
    window_chars=st.integers(1, 300),
    default_action=st.sampled_from(list(Action)),
    disabled=st.frozensets(st.sampled_from(["uuid", "epoch", "id_line", "hex_nonce"]), max_size=2),
)
_image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,Zk9xR2tTbDN1V0hQcWE4"}}
_content = st.one_of(
    texts,
    st.lists(st.one_of(texts.map(lambda t: {"type": "text", "text": t}), st.just(_image)), max_size=3),
)
_roles = st.sampled_from(["system", "developer", "user", "assistant"])
chats = st.lists(st.fixed_dictionaries({"role": _roles, "content": _content}), min_size=1, max_size=6).map(
    lambda messages: {"model": "m", "messages": messages, "temperature": 0.5})


def prompt_strings(body: dict[str, Any]) -> list[str]:
    strings = []
    for message in body["messages"]:
        content = message["content"]
        if isinstance(content, str):
            strings.append(content)
        else:
            strings += [part["text"] for part in content if part.get("type") == "text"]
    return strings


def non_space(strings: list[str]) -> Counter[str]:
    return Counter(c for s in strings for c in s if not c.isspace())


@SETTINGS
@given(chats, configs)
def test_chat_rewrite_keeps_structure_and_never_mutates_input(body: dict[str, Any], config: RewriteConfig) -> None:
    original = copy.deepcopy(body)
    result = Rewriter(config).rewrite(Endpoint.CHAT, body, "m")
    assert body == original
    if result.body is None:
        return
    json.loads(json.dumps(result.body))
    assert result.body["temperature"] == 0.5
    new, old = result.body["messages"], body["messages"]
    assert [m["role"] for m in new] == [m["role"] for m in old]
    for before, after in zip(old, new, strict=True):
        if isinstance(before["content"], list):
            kept = [part for part in after["content"] if part.get("type") != "text"]
            assert kept == [part for part in before["content"] if part.get("type") != "text"]


@SETTINGS
@given(chats, configs)
def test_chat_rewrite_is_idempotent(body: dict[str, Any], config: RewriteConfig) -> None:
    rewriter = Rewriter(config)
    once = rewriter.rewrite(Endpoint.CHAT, body, "m").body
    if once is not None:
        assert rewriter.rewrite(Endpoint.CHAT, once, "m").body is None


@SETTINGS
@given(texts, configs)
def test_prompt_rewrite_is_idempotent(text: str, config: RewriteConfig) -> None:
    rewriter = Rewriter(config)
    once = rewriter.rewrite(Endpoint.COMPLETION, {"prompt": text}, "m").body
    if once is not None:
        assert rewriter.rewrite(Endpoint.COMPLETION, once, "m").body is None


@SETTINGS
@given(chats, st.integers(1, 300))
def test_move_loses_no_characters(body: dict[str, Any], window: int) -> None:
    result = Rewriter(RewriteConfig(window_chars=window)).rewrite(Endpoint.CHAT, body, "m")
    if result.body is None:
        return
    before, after = prompt_strings(body), prompt_strings(result.body)
    markers = sum(s.count(MARKER) for s in after) - sum(s.count(MARKER) for s in before)
    assert markers == (1 if result.moved else 0)
    assert non_space(after) - non_space([MARKER] * markers) == non_space(before)
    assert non_space([MARKER] * markers) <= non_space(after)


@SETTINGS
@given(texts, st.integers(1, 300))
def test_strip_removes_only_the_spans_and_whitespace(text: str, window: int) -> None:
    config = RewriteConfig(window_chars=window, default_action=Action.STRIP)
    result = Rewriter(config).rewrite(Endpoint.COMPLETION, {"prompt": text}, "m")
    if result.body is not None:
        assert non_space([result.body["prompt"]]) <= non_space([text])
        assert MARKER not in result.body["prompt"]


@SETTINGS
@given(st.uuids().map(str), st.lists(st.tuples(texts, texts), min_size=2, max_size=4), st.integers(20, 400))
def test_rewritten_turn_is_prefix_of_next_turn(session: str, turns: list[tuple[str, str]], window: int) -> None:
    rewriter = Rewriter(RewriteConfig(window_chars=window))
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"Session: {session}\nYou are X."}]
    previous: list[dict[str, Any]] | None = None
    for user, assistant in turns:
        messages.append({"role": "user", "content": user})
        body = {"messages": copy.deepcopy(messages)}
        result = rewriter.rewrite(Endpoint.CHAT, body, "m")
        current = (result.body or body)["messages"]
        assert f"Session: {session}" not in current[0]["content"]
        if previous is not None:
            assert current[:len(previous) - 1] == previous[:-1]
        previous = current
        messages.append({"role": "assistant", "content": assistant})


@SETTINGS
@given(texts, st.integers(0, 50))
def test_gated_builtin_scan_finds_what_a_full_scan_finds(text: str, pos: int) -> None:
    # The gate only skips positions where no built-in can start; a plain leftmost search must agree.
    rules = Rewriter(RewriteConfig())._rules
    builtin = rules._builtin
    assert builtin is not None
    expected = None
    start = pos
    while start < len(text) and (match := builtin.regex.search(text, start)) is not None:
        if (expected := builtin.accept(match)) is not None:
            break
        start = match.start() + 1
    assert rules._next_builtin(text, pos, len(text)) == expected
