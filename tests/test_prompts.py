import json

import pytest

from gateway.api import prompts
from gateway.api.prompts import (
    Endpoint,
    dump_json,
    multipart_fields,
    parse_json,
    render_chat,
    routing_text,
    validate_body,
)


def test_chat_rendering_of_a_turn_is_a_prefix_of_the_next_turn() -> None:
    turn1 = [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    turn2 = turn1 + [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert render_chat(turn2, tools).startswith(render_chat(turn1, tools))


def test_roles_and_non_text_parts_change_the_rendering() -> None:
    assert render_chat([{"role": "user", "content": "x"}]) != render_chat([{"role": "system", "content": "x"}])
    image = {"type": "image_url", "image_url": {"url": "data:a"}}
    other = {"type": "image_url", "image_url": {"url": "data:b"}}
    assert render_chat([{"role": "user", "content": [image]}]) != render_chat([{"role": "user", "content": [other]}])


def test_routing_text_of_each_endpoint() -> None:
    assert routing_text(Endpoint.COMPLETION, {"prompt": ["first", "second"]}) == "first"
    assert routing_text(Endpoint.GENERATE, {"text": "native"}) == "native"
    ids = routing_text(Endpoint.GENERATE, {"input_ids": [1, 2, 3]})
    assert len(ids) == 3 and routing_text(Endpoint.GENERATE, {"input_ids": [1, 2, 4]}) != ids
    assert routing_text(Endpoint.EMBEDDING, {"input": "vector me"}) == "vector me"


def test_validation_names_what_is_wrong() -> None:
    assert validate_body(Endpoint.CHAT, {"messages": []}) == "'messages' must contain at least one message."
    assert "required" in (validate_body(Endpoint.COMPLETION, {}) or "")
    assert validate_body(Endpoint.GENERATE, {"text": "x"}) is None
    assert validate_body(Endpoint.CHAT, {"model": 3, "messages": [{}]}) == "'model' must be a string."
    assert validate_body(Endpoint.EMBEDDING, {"input": ["a"]}) is None


def test_a_text_part_whose_text_is_not_a_string_still_renders() -> None:
    odd = [{"role": "user", "content": [{"type": "text", "text": None}, {"type": "text", "text": 7}]}]
    assert render_chat(odd) != render_chat([{"role": "user", "content": []}])  # the engine judges it, not us


TOOLS = [{"type": "function", "name": "search", "parameters": {"type": "object"}}]


def test_responses_text_of_a_turn_is_a_prefix_of_the_next_when_the_conversation_is_resent() -> None:
    turn1 = {"instructions": "Be brief.", "input": "What is KV caching?", "tools": TOOLS}
    answer = {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
              "content": [{"type": "output_text", "text": "Reusing attention state.", "annotations": []}]}
    call = {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "search", "arguments": "{}"}
    turn2 = {**turn1, "input": [{"role": "user", "content": "What is KV caching?"}, answer, call,
                                {"type": "function_call_output", "call_id": "c1", "output": "found"}]}
    turn3 = {**turn2, "input": [*turn2["input"], {"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "And paging?"}]}]}
    texts = [routing_text(Endpoint.RESPONSES, turn) for turn in (turn1, turn2, turn3)]
    assert texts[1].startswith(texts[0]) and texts[2].startswith(texts[1])
    assert "Reusing attention state." in texts[1] and "Be brief." in texts[0]


def test_responses_items_render_without_the_engines_ids_and_statuses() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "search", "arguments": "{}"}
    with_ids = {"input": [{**call, "id": "fc_9", "status": "completed"}]}
    assert routing_text(Endpoint.RESPONSES, with_ids) == routing_text(Endpoint.RESPONSES, {"input": [call]})


def test_responses_instructions_and_tools_change_the_text() -> None:
    plain = routing_text(Endpoint.RESPONSES, {"input": "hi"})
    assert routing_text(Endpoint.RESPONSES, {"input": "hi", "instructions": "x"}) != plain
    assert routing_text(Endpoint.RESPONSES, {"input": "hi", "tools": TOOLS}) != plain


def test_messages_text_of_a_turn_is_a_prefix_of_the_next() -> None:
    system = [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}]
    turn1 = {"system": system, "tools": [{"name": "bash", "input_schema": {"type": "object"}}],
             "messages": [{"role": "user", "content": "List files."}]}
    use = {"type": "tool_use", "id": "tu_1", "name": "bash", "input": {"cmd": "ls"}}
    result = {"type": "tool_result", "tool_use_id": "tu_1", "content": "a.py"}
    turn2 = {**turn1, "messages": [*turn1["messages"], {"role": "assistant", "content": [use]},
                                   {"role": "user", "content": [result]}]}
    first, second = routing_text(Endpoint.MESSAGES, turn1), routing_text(Endpoint.MESSAGES, turn2)
    assert second.startswith(first) and "You are a coding agent." in first


def test_messages_system_as_a_string_or_a_text_block_routes_alike() -> None:
    messages = [{"role": "user", "content": "hi"}]
    as_string = routing_text(Endpoint.MESSAGES, {"system": "Be kind.", "messages": messages})
    as_block = routing_text(Endpoint.MESSAGES, {"system": [{"type": "text", "text": "Be kind."}],
                                                "messages": messages})
    assert as_string == as_block


def test_new_endpoints_are_validated_for_what_routing_reads() -> None:
    assert validate_body(Endpoint.RESPONSES, {"input": "x", "previous_response_id": "resp_1"}) is None
    assert validate_body(Endpoint.RESPONSES, {"input": 3}) == "'input' has the wrong type."
    assert validate_body(Endpoint.MESSAGES, {"messages": []}) == "'messages' must contain at least one message."
    assert validate_body(Endpoint.MESSAGES, {"system": 1, "messages": [{}]}) == "'system' has the wrong type."
    assert validate_body(Endpoint.TOKENIZE, {"prompt": "x"}) is None
    assert routing_text(Endpoint.SCORE, {"query": "q", "documents": ["d"]}) == ""


def test_multipart_fields_are_found_without_decoding_the_upload() -> None:
    body = (b'--B\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\nContent-Type: audio/wav\r\n\r\n'
            b'RIFF\x00\xff\r\nname="model"\r\n--B\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper\r\n'
            b'--B\r\ncontent-disposition: form-data; name="stream"\r\n\r\ntrue\r\n--B--\r\n')
    assert multipart_fields(body, "multipart/form-data; boundary=B") == {"model": "whisper", "stream": True}
    assert multipart_fields(body, "application/json") == {}


def test_large_bodies_are_parsed_without_orjson_and_read_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    document = {"messages": [{"role": "user", "content": "x" * 300_000}], "n": 2**70, "s": "\ud800"}
    raw = json.dumps(document).encode()
    assert parse_json(raw) == json.loads(raw)

    def no_orjson(raw: bytes) -> object:  # it parses through scratch memory of ~13x the document
        raise AssertionError("orjson used for a large body")

    monkeypatch.setattr(prompts.orjson, "loads", no_orjson)
    assert parse_json(raw)["n"] == 2**70


def test_a_rewritten_body_is_written_as_json_reads_it_back_whatever_it_holds() -> None:
    for source in ('{"m":[{"c":"héllo \\u2028"}],"t":0.1,"x":1e16}', '{"n":100000000000000000000000}',
                   '{"s":"\\ud800"}', '{"f":NaN,"g":-Infinity}', '{"c":"about NaN"}', '{"t":1e400,"u":-2E+308}',
                   '{"v":' + "9" * 320 + '.5}'):
        body = parse_json(source.encode())
        written = dump_json(body, source.encode())
        assert json.dumps(json.loads(written)) == json.dumps(body), source  # NaN is not null, 2**70 not refused
    assert dump_json({"c": "é"}, b"{}") == '{"c":"é"}'.encode()  # compact UTF-8, as the engine's own JSON
