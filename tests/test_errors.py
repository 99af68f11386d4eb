"""Error bodies: OpenAI's shape everywhere but on Anthropic's Messages API."""

from gateway.errors import BadRequest, ErrorShape, ModelNotFound, Overloaded, StoredResponseUnavailable


def test_the_shape_is_chosen_by_path() -> None:
    assert ErrorShape.for_path("/v1/messages") is ErrorShape.ANTHROPIC
    assert ErrorShape.for_path("/v1/messages/count_tokens") is ErrorShape.ANTHROPIC
    assert ErrorShape.for_path("/v1/messagesx") is ErrorShape.OPENAI
    assert ErrorShape.for_path("/v1/chat/completions") is ErrorShape.OPENAI


def test_anthropic_bodies_carry_anthropics_error_types() -> None:
    assert BadRequest("bad").body(ErrorShape.ANTHROPIC) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}
    assert ModelNotFound("m", ["a"]).body(ErrorShape.ANTHROPIC)["error"]["type"] == "not_found_error"
    assert Overloaded("busy", 1).body(ErrorShape.ANTHROPIC)["error"]["type"] == "rate_limit_error"


def test_a_lost_stored_response_says_where_it_lived() -> None:
    error = StoredResponseUnavailable("resp_1", "backend-2", "previous_response_id")
    body = error.body()["error"]
    assert error.status_code == 404 and body["param"] == "previous_response_id"
    assert "resp_1" in body["message"] and "backend-2" in body["message"] and "not available" in body["message"]
