from gateway.prompts import Endpoint, render_chat, routing_text, validate_body


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
