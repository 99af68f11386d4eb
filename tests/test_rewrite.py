import copy
import json
from typing import Any

import pytest
from multidict import CIMultiDict

from gateway.api.prompts import Endpoint
from gateway.errors import BadRequest, ConfigError
from gateway.rewrite import BUILTIN_RULE_NAMES, MARKER, Action, RewriteConfig, Rewriter, RuleSpec, enabled_for

UUID = "8f1c2d3e-4b5a-4c6d-9e8f-0a1b2c3d4e5f"
TRAILER = "\n\n" + MARKER + "\n"


def rewrite_prompt(text: str, config: RewriteConfig | None = None) -> str | None:
    result = Rewriter(config or RewriteConfig()).rewrite(Endpoint.COMPLETION, {"prompt": text}, "m")
    return None if result.body is None else result.body["prompt"]


def chat(*messages: tuple[str, Any]) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": role, "content": content} for role, content in messages]}


@pytest.mark.parametrize(("rule", "span"), [
    ("uuid", UUID),
    ("uuid", UUID.upper()),
    ("ulid", "01HZX3K4M5N6P7Q8R9S0T1V2W3"),
    ("hex_nonce", "7f3a9c1e5b2d4f60a8e1"),
    ("hex_nonce", "0x7f3a9c1e5b2d4f60"),
    ("base64_nonce", "Zk9xR2tTbDN1V0hQcWE4"),
    ("base64_nonce", "q8Zr-T3_xW9yKp2LmN7vB4=="),
    ("iso_datetime", "2024-05-01T10:00:00.123Z"),
    ("iso_datetime", "2024-05-01 10:00:00+02:00"),
    ("iso_datetime", "2024-05-01T10:00"),
    ("epoch", "1715000000"),
    ("epoch", "1715000000123"),
    ("epoch", "1715000000.123456"),
])
def test_builtin_rule_moves_bare_span_to_trailer(rule: str, span: str) -> None:
    result = Rewriter(RewriteConfig()).rewrite(Endpoint.COMPLETION, {"prompt": f"Run {span} now. Be brief."}, "m")
    assert result.body is not None
    assert result.body["prompt"] == f"Run now. Be brief.{TRAILER}{span}"
    assert [hit.rule for hit in result.hits] == [rule]
    assert result.moved == 1


@pytest.mark.parametrize("line", [
    f"Request ID: {UUID}", "request_id=abc123", "req-id: 42af", "x-request-id: r-9f8e7d", "Session: 91ab77cd",
    "session_id = s_1234", "Trace: 00f067aa0ba902b7", "trace id: t1234", "span id: 00f067aa", "nonce: n0nce42",
    "Timestamp: 2024-05-01 10:00:00 UTC", "correlation id: c-0042", "conversation_id: conv_77",
    "run id: run-2024-05", "requestId: abc123",
])
def test_id_line_moves_whole_key_value_line(line: str) -> None:
    assert rewrite_prompt(f"{line}\nYou are a helpful assistant.") == f"You are a helpful assistant.{TRAILER}{line}"


def test_billing_header_line_moved_whole() -> None:
    header = "x-anthropic-billing-header: cc_version=1.0.83.abc; cc_entrypoint=cli; cch=7f3a9c1e5b2d4f60;"
    assert rewrite_prompt(f"{header}\nYou are Claude Code.") == f"You are Claude Code.{TRAILER}{header}"


@pytest.mark.parametrize("text", [
    "Use Python 3.11.7 or v1.2.3 (build 2024.05).",
    "The magic words are deadbeef and cafe; commit abc1234 fixed it.",
    "It costs $1234567890.00 in total, or 1234567890,50 EUR.",
    "Call +1 415 555 0100 or 415-555-0100.",
    "internationalization counterrevolutionaries Pneumonoultramicroscopic",
    "def getUserAccountSettings2(self): return self._cache['user_id']",
    "Paths: /home/User1/Projects/Python3/src and C:\\Users\\Admin2\\Documents",
    "session = requests.Session()  # session: active, trace: on",
    "Today is 2024-05-01. Chapter 12:30 reading.",
    "Order 12345678901234 and 17150000001 and 0123456789.",
    "x" * 40 + " " + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + " " + "Content_Type_Options_Header",
    "日本語のテキスト — émoji 🎉 and ünïcödé words only",
])
def test_near_misses_are_left_alone(text: str) -> None:
    assert rewrite_prompt(text) is None


def test_span_inside_longer_word_or_number_is_not_matched() -> None:
    assert rewrite_prompt(f"x{UUID}y and 7f3a9c1e5b2d4f60a8e1g and 91715000000 and a1715000000") is None


@pytest.mark.parametrize(("text", "expected"), [
    (f"Request ID: {UUID}\nYou are X.", "You are X."),
    (f"You are X.\nRequest ID: {UUID}", "You are X."),
    (f"{UUID} You are X.", "You are X."),
    (f"  {UUID} indented", "  indented"),
    (f"Session {UUID}", "Session"),
    (f"id {UUID} ok", "id ok"),
    (f"started at {UUID}.", "started at."),
    (f"({UUID})", "()"),
    (f"A\n{UUID}\n\nB", "A\n\nB"),
    (f"line one\r\nRequest ID: {UUID}\r\nline three", "line one\r\nline three"),
])
def test_removal_leaves_clean_text(text: str, expected: str) -> None:
    config = RewriteConfig(default_action=Action.STRIP)
    assert rewrite_prompt(text, config) == expected


def test_strip_removes_and_keep_only_counts() -> None:
    text = f"Request ID: {UUID}\nHello"
    assert rewrite_prompt(text, RewriteConfig(default_action=Action.STRIP)) == "Hello"
    result = Rewriter(RewriteConfig(default_action=Action.KEEP)).rewrite(Endpoint.COMPLETION, {"prompt": text}, "m")
    assert result.body is None
    assert [(hit.rule, hit.action) for hit in result.hits] == [("id_line", Action.KEEP)]
    assert result.moved == 0


def test_per_rule_action_overrides_default() -> None:
    config = RewriteConfig(actions={"iso_datetime": Action.STRIP})
    assert rewrite_prompt(f"At 2024-05-01T10:00:00Z run {UUID} ok", config) == f"At run ok{TRAILER}{UUID}"


def test_only_the_window_is_searched() -> None:
    text = "a" * 100 + f" {UUID} " + "b" * 100 + f" {UUID}"
    config = RewriteConfig(window_chars=120)
    assert rewrite_prompt(text, config) == "a" * 100 + " " + "b" * 100 + f" {UUID}{TRAILER}{UUID}"


def test_text_sliding_into_window_is_searched_so_rewrite_is_idempotent() -> None:
    text = f"{UUID} " * 3 + "x" * 10
    config = RewriteConfig(window_chars=40)
    once = rewrite_prompt(text, config)
    assert once == "x" * 10 + TRAILER + "\n".join([UUID] * 3)
    assert rewrite_prompt(once or "", config) is None


def test_short_prompt_trailer_is_not_moved_again() -> None:
    once = rewrite_prompt(f"Request ID: {UUID}")
    assert once == MARKER + "\n" + f"Request ID: {UUID}"
    assert rewrite_prompt(once or "") is None


def test_later_rewrite_appends_to_existing_trailer() -> None:
    once = rewrite_prompt(f"Run {UUID} and 1715000000.", RewriteConfig(disabled=frozenset({"epoch"})))
    assert once == f"Run and 1715000000.{TRAILER}{UUID}"
    assert rewrite_prompt(once or "") == f"Run and.{TRAILER}{UUID}\n1715000000"


def test_chat_searches_system_and_first_user_and_appends_to_last_message() -> None:
    body = chat(("system", f"Session: {UUID}\nYou are X."), ("user", f"Hi, my ticket {UUID}"),
                ("assistant", f"Noted {UUID}"), ("user", f"Again {UUID}"))
    original = copy.deepcopy(body)
    result = Rewriter(RewriteConfig()).rewrite(Endpoint.CHAT, body, "m")
    assert body == original
    assert result.body is not None
    messages = result.body["messages"]
    assert messages[0]["content"] == "You are X."
    assert messages[1]["content"] == "Hi, my ticket"
    assert messages[2] is body["messages"][2]
    assert messages[3]["content"] == f"Again {UUID}{TRAILER}Session: {UUID}\n{UUID}"
    assert result.moved == 2
    json.dumps(result.body)


def test_chat_content_parts_other_than_text_are_untouched() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAA"}}
    body = chat(("system", [{"type": "text", "text": f"Request ID: {UUID}\nBe X."}, image]),
                ("user", [image, {"type": "text", "text": "What is it?"}]))
    result = Rewriter(RewriteConfig()).rewrite(Endpoint.CHAT, body, "m")
    assert result.body is not None
    system, user = result.body["messages"]
    assert system["content"] == [{"type": "text", "text": "Be X."}, image]
    assert system["content"][1] is image
    assert user["content"] == [image, {"type": "text", "text": f"What is it?{TRAILER}Request ID: {UUID}"}]


def test_chat_without_text_part_in_last_message_gets_new_part() -> None:
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    body = chat(("system", f"Request ID: {UUID}\nBe X."), ("user", [image]))
    result = Rewriter(RewriteConfig()).rewrite(Endpoint.CHAT, body, "m")
    assert result.body is not None
    assert result.body["messages"][1]["content"] == [image, {"type": "text", "text": f"{MARKER}\nRequest ID: {UUID}"}]
    assert Rewriter(RewriteConfig()).rewrite(Endpoint.CHAT, result.body, "m").body is None


def test_chat_last_message_of_unknown_shape_downgrades_move_to_keep() -> None:
    body = {"messages": [{"role": "system", "content": f"Request ID: {UUID}\nBe X."}, {"role": "user", "content": 7}]}
    result = Rewriter(RewriteConfig()).rewrite(Endpoint.CHAT, body, "m")
    assert result.body is None
    assert [hit.action for hit in result.hits] == [Action.KEEP]


def test_completion_prompt_list_rewrites_each_string_and_leaves_token_ids() -> None:
    body = {"model": "m", "prompt": [f"Request ID: {UUID}\nA", "plain", [1, 2, 3]], "max_tokens": 5}
    result = Rewriter(RewriteConfig()).rewrite(Endpoint.COMPLETION, body, "m")
    assert result.body is not None
    assert result.body["prompt"] == [f"A{TRAILER}Request ID: {UUID}", "plain", [1, 2, 3]]
    assert result.body["prompt"][2] is body["prompt"][2]
    assert result.body["max_tokens"] == 5
    assert Rewriter(RewriteConfig()).rewrite(Endpoint.COMPLETION, {"prompt": [[1, 2], [3]]}, "m").body is None


def test_generate_text_rewritten_and_input_ids_untouched() -> None:
    body = {"text": f"{UUID} hello", "sampling_params": {"max_new_tokens": 4}}
    result = Rewriter(RewriteConfig()).rewrite(Endpoint.GENERATE, body, "m")
    assert result.body == {"text": f"hello{TRAILER}{UUID}", "sampling_params": {"max_new_tokens": 4}}
    assert result.body["sampling_params"] is body["sampling_params"]
    assert Rewriter(RewriteConfig()).rewrite(Endpoint.GENERATE, {"input_ids": [1, 2]}, "m").body is None


def test_embedding_endpoint_is_never_rewritten() -> None:
    result = Rewriter(RewriteConfig()).rewrite(Endpoint.EMBEDDING, {"input": f"{UUID} hello"}, "m")
    assert result.body is None and result.hits == ()


def test_opt_out_flag_and_header() -> None:
    body = {"prompt": f"{UUID} hello"}
    assert Rewriter(RewriteConfig()).rewrite(Endpoint.COMPLETION, body, "m", opted_out=True).body is None
    assert enabled_for(CIMultiDict({"X-Gateway-Rewrite": "OFF"})) is False
    assert enabled_for(CIMultiDict({"x-gateway-rewrite": "on"})) is True
    assert enabled_for(CIMultiDict()) is True
    with pytest.raises(BadRequest, match="x-gateway-rewrite.*'maybe'"):
        enabled_for(CIMultiDict({"x-gateway-rewrite": "maybe"}))


def test_global_and_per_model_switches() -> None:
    body = {"prompt": f"{UUID} hello"}
    off_but_a = Rewriter(RewriteConfig(enabled=False, models={"a": True}))
    assert off_but_a.rewrite(Endpoint.COMPLETION, body, "a").body is not None
    assert off_but_a.rewrite(Endpoint.COMPLETION, body, "b").body is None
    assert off_but_a.rewrite(Endpoint.COMPLETION, body, None).body is None
    on_but_b = Rewriter(RewriteConfig(models={"b": False}))
    assert on_but_b.rewrite(Endpoint.COMPLETION, body, "b").body is None
    assert on_but_b.rewrite(Endpoint.COMPLETION, body, "c").body is not None


def test_custom_rule_applies_before_builtins() -> None:
    config = RewriteConfig(custom_rules=(RuleSpec("ticket", r"(?i)ticket-[0-9]{4,}"),))
    rewriter = Rewriter(config)
    assert rewriter.rule_names == ("ticket", *BUILTIN_RULE_NAMES)
    result = rewriter.rewrite(Endpoint.COMPLETION, {"prompt": "Re TICKET-12345: help"}, "m")
    assert result.body == {"prompt": f"Re: help{TRAILER}TICKET-12345"}
    assert [hit.rule for hit in result.hits] == ["ticket"]


def test_disabled_builtin_is_not_applied() -> None:
    config = RewriteConfig(disabled=frozenset({"uuid"}))
    assert "uuid" not in Rewriter(config).rule_names
    assert rewrite_prompt(f"{UUID} hello", config) is None


def test_from_toml_reads_documented_example() -> None:
    config = RewriteConfig.from_toml({
        "enabled": True, "window_chars": 1024, "default_action": "move", "disable": ["epoch"],
        "actions": {"iso_datetime": "strip", "ticket": "keep"},
        "rules": [{"name": "ticket", "pattern": "TICKET-[0-9]{4,}", "action": "move"}],
        "models": {"my-embedding-model": False},
    })
    assert config == RewriteConfig(window_chars=1024, disabled=frozenset({"epoch"}),
                                   actions={"iso_datetime": Action.STRIP, "ticket": Action.KEEP},
                                   custom_rules=(RuleSpec("ticket", "TICKET-[0-9]{4,}", Action.MOVE),),
                                   models={"my-embedding-model": False})
    assert RewriteConfig.from_toml({}) == RewriteConfig()
    result = Rewriter(config).rewrite(Endpoint.COMPLETION, {"prompt": "TICKET-1234 x"}, "m")
    assert [(hit.rule, hit.action) for hit in result.hits] == [("ticket", Action.KEEP)]


@pytest.mark.parametrize(("table", "key", "value"), [
    ({"enable": True}, "rewrite.enable", "'rewrite.enable'"),
    ({"enabled": 1}, "rewrite.enabled", "1"),
    ({"enabled": "yes"}, "rewrite.enabled", "'yes'"),
    ({"window_chars": True}, "rewrite.window_chars", "True"),
    ({"window_chars": 0}, "rewrite.window_chars", "0"),
    ({"default_action": "drop"}, "rewrite.default_action", "'drop'"),
    ({"disable": "epoch"}, "rewrite.disable", "'epoch'"),
    ({"disable": ["uuid", "guid"]}, "rewrite.disable[1]", "'guid'"),
    ({"actions": {"uuid": "erase"}}, "rewrite.actions.uuid", "'erase'"),
    ({"actions": {"nope": "move"}}, "rewrite.actions.nope", "'nope'"),
    ({"models": {"m": "off"}}, "rewrite.models.m", "'off'"),
    ({"rules": {"name": "x"}}, "rewrite.rules", "'name'"),
    ({"rules": [{"name": "a", "pattern": "A[0-9]+"}, {"name": "b", "pattern": "B"},
                {"name": "c", "pattern": "(ab"}]}, "rewrite.rules[2].pattern", "'(ab'"),
    ({"rules": [{"name": "c", "pattern": "(a)b"}]}, "rewrite.rules[0].pattern", "'(a)b'"),
    ({"rules": [{"name": "c", "pattern": "a*"}]}, "rewrite.rules[0].pattern", "'a*'"),
    ({"rules": [{"name": "c", "pattern": 5}]}, "rewrite.rules[0].pattern", "5"),
    ({"rules": [{"name": "uuid", "pattern": "x"}]}, "rewrite.rules[0].name", "'uuid'"),
    ({"rules": [{"name": "a b", "pattern": "x"}]}, "rewrite.rules[0].name", "'a b'"),
    ({"rules": [{"name": "c"}]}, "rewrite.rules[0].pattern", "missing"),
    ({"rules": [{"name": "c", "pattern": "x", "flags": "i"}]}, "rewrite.rules[0].flags", "'rewrite.rules[0].flags'"),
    ({"rules": [{"name": "c", "pattern": "x", "action": "zap"}]}, "rewrite.rules[0].action", "'zap'"),
])
def test_config_errors_name_key_and_value(table: dict[str, Any], key: str, value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        RewriteConfig.from_toml(table)
    message = str(caught.value)
    assert key + " " in message or repr(key) in message
    assert value in message


def test_config_is_read_only() -> None:
    config = RewriteConfig(actions={"uuid": Action.KEEP})
    with pytest.raises(TypeError):
        config.actions["uuid"] = Action.MOVE  # type: ignore[index]


def test_messages_billing_header_block_of_the_system_is_moved_to_the_last_message() -> None:
    header = "x-anthropic-billing-header: cc_version=1.0.83.abc; cc_entrypoint=cli; cch=7f3a9c1e5b2d4f60;"
    body = {"model": "m", "max_tokens": 8,
            "system": [{"type": "text", "text": header}, {"type": "text", "text": "You are Claude Code."}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Fix the bug.",
                                                       "cache_control": {"type": "ephemeral"}}]}]}
    original = copy.deepcopy(body)
    result = Rewriter(RewriteConfig()).rewrite(Endpoint.MESSAGES, body, "m")
    assert body == original and result.body is not None
    assert [block["text"] for block in result.body["system"]] == ["", "You are Claude Code."]
    last = result.body["messages"][-1]["content"][0]
    assert last["text"] == "Fix the bug." + TRAILER + header and last["cache_control"] == {"type": "ephemeral"}
    assert [hit.rule for hit in result.hits] == ["billing_header"]


def test_messages_with_a_string_system_and_no_system_are_rewritten_too() -> None:
    rewriter = Rewriter(RewriteConfig())
    body = {"system": f"Request ID: {UUID}\nBe brief.", "messages": [{"role": "user", "content": "hi"}]}
    result = rewriter.rewrite(Endpoint.MESSAGES, body, "m")
    assert result.body is not None and result.body["system"] == "Be brief."
    assert result.body["messages"][0]["content"] == "hi" + TRAILER + f"Request ID: {UUID}"
    bare = rewriter.rewrite(Endpoint.MESSAGES, {"messages": [{"role": "user", "content": UUID + " hi"}]}, "m")
    assert bare.body is not None and bare.body["messages"][0]["content"] == "hi" + TRAILER + UUID


def test_responses_instructions_are_searched_and_the_spans_moved_to_the_input() -> None:
    rewriter = Rewriter(RewriteConfig())
    body = {"model": "m", "instructions": f"Request ID: {UUID}\nBe brief.", "input": "hi", "store": True}
    result = rewriter.rewrite(Endpoint.RESPONSES, body, "m")
    assert result.body == {"model": "m", "instructions": "Be brief.", "input": "hi" + TRAILER + f"Request ID: {UUID}",
                           "store": True}
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"{UUID} Go."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
             {"role": "user", "content": [{"type": "input_image", "image_url": "data:a"}]}]
    result = rewriter.rewrite(Endpoint.RESPONSES, {"input": items}, "m")
    assert result.body is not None
    first, _, last = result.body["input"]
    assert first["content"][0] == {"type": "input_text", "text": "Go."}
    assert last["content"][1] == {"type": "input_text", "text": MARKER + "\n" + UUID}


def test_responses_function_call_items_are_neither_searched_nor_given_a_trailer() -> None:
    output = {"type": "function_call_output", "call_id": "c1", "output": f"ran at 2024-05-01T10:00:00Z {UUID}"}
    body = {"instructions": f"Trace ID: {UUID}", "input": [{"role": "user", "content": "go"}, output]}
    result = Rewriter(RewriteConfig()).rewrite(Endpoint.RESPONSES, body, "m")
    assert result.body is None  # nowhere to move the span to: kept, only counted
    assert [hit.action for hit in result.hits] == [Action.KEEP]
