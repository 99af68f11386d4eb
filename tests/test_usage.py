import json
from pathlib import Path

import pytest

from gateway.api.responses import response_id_of
from gateway.api.usage import Usage, UsageTap, usage_from


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def test_reads_openai_sglang_and_llama_cpp_shapes() -> None:
    assert usage_from({"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}}) == Usage(9, 4)
    assert usage_from({"usage": {"prompt_tokens": 9}}) == Usage(9, None)
    assert usage_from({"meta_info": {"prompt_tokens": 7, "cached_tokens": 3}}) == Usage(7, 3)
    assert usage_from({"usage": {"prompt_tokens": 9}, "timings": {"cache_n": 6, "prompt_n": 3}}) == Usage(9, 6)
    assert usage_from({"timings": {"cache_n": 6, "prompt_n": 3}}) == Usage(9, 6)
    assert usage_from({"choices": []}) is None


def test_stream_usage_comes_from_the_last_usage_event_whatever_the_chunking() -> None:
    stream = sse({"choices": [{"delta": {"content": "a"}}]},
                 {"choices": [], "usage": {"prompt_tokens": 50, "prompt_tokens_details": {"cached_tokens": 32}}},
                 b"[DONE]")
    for size in (1, 7, 64, len(stream)):
        tap = UsageTap(streaming=True)
        for start in range(0, len(stream), size):
            tap.feed(stream[start:start + size])
        assert tap.usage() == Usage(50, 32)


def test_sglang_generate_stream_takes_the_final_meta_info() -> None:
    tap = UsageTap(streaming=True)
    tap.feed(sse({"text": "a", "meta_info": {"prompt_tokens": 5, "cached_tokens": 0}},
                 {"text": "ab", "meta_info": {"prompt_tokens": 5, "cached_tokens": 2}}, b"[DONE]"))
    assert tap.usage() == Usage(5, 2)


def test_non_stream_body_is_parsed_once_at_the_end_and_junk_is_ignored() -> None:
    tap = UsageTap(streaming=False)
    body = json.dumps({"usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}}}).encode()
    tap.feed(body[:5])
    tap.feed(body[5:])
    assert tap.usage() == Usage(3, 0)
    junk = UsageTap(streaming=False)
    junk.feed(b"<html>")
    assert junk.usage() is None


def test_non_stream_body_over_the_cap_is_dropped_not_kept_in_pieces() -> None:
    tap = UsageTap(streaming=False, max_body_bytes=64)
    tap.feed(b'{"padding": "' + b"x" * 100)  # over the cap: nothing of this body is held any more
    tap.feed(b'{"usage": {"prompt_tokens": 3}}')  # a small tail must not be parsed as if it were the body
    assert tap.usage() is None


def named(name: str, payload: object) -> bytes:
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode()


def test_reads_the_responses_api_and_anthropic_shapes() -> None:
    responses = {"usage": {"input_tokens": 90, "input_tokens_details": {"cached_tokens": 64}, "output_tokens": 5}}
    assert usage_from(responses) == Usage(90, 64)
    # Anthropic counts cache reads (and writes) beside input_tokens; vLLM's Messages server sends input_tokens alone.
    anthropic = {"usage": {"input_tokens": 26, "cache_read_input_tokens": 64, "cache_creation_input_tokens": 0}}
    assert usage_from(anthropic) == Usage(90, 64)
    assert usage_from({"usage": {"input_tokens": 90, "output_tokens": 5}}) == Usage(90, None)


def test_responses_stream_usage_and_id_come_from_response_completed() -> None:
    def response(status: str, usage: object) -> dict[str, object]:
        return {"id": "resp_1", "status": status, "usage": usage}

    stream = (named("response.created", {"type": "response.created", "response": response("in_progress", None)})
              + named("response.output_text.delta", {"type": "response.output_text.delta", "delta": "hi"})
              + named("response.completed", {"type": "response.completed", "response": response("completed", {
                  "input_tokens": 40, "input_tokens_details": {"cached_tokens": 32}})}))
    tap = UsageTap(streaming=True)
    for start in range(0, len(stream), 9):
        tap.feed(stream[start:start + 9])
    assert tap.usage() == Usage(40, 32)
    assert response_id_of(tap.payload()) == "resp_1"


def test_anthropic_stream_usage_comes_from_message_delta() -> None:
    tap = UsageTap(streaming=True)
    tap.feed(named("message_start", {"type": "message_start", "message": {"id": "msg_1", "usage": {
        "input_tokens": 10, "cache_read_input_tokens": 30, "output_tokens": 1}}}))
    tap.feed(named("content_block_delta", {"type": "content_block_delta", "delta": {"text": "x"}}))
    assert tap.usage() == Usage(40, 30)  # message_start alone is enough when the stream breaks
    tap = UsageTap(streaming=True)
    tap.feed(named("message_delta", {"type": "message_delta", "usage": {
        "input_tokens": 8, "cache_read_input_tokens": 32, "output_tokens": 4}}) + named("message_stop", {}))
    assert tap.usage() == Usage(40, 32)


FIXTURES = Path(__file__).parent / "fixtures" / "engines"
REPORTED = Usage(812, 768)  # what every fixture's answer says when the engine reports its cache hit
UNREPORTED = Usage(812, None)


@pytest.mark.parametrize(("engine", "name", "expected"), [
    ("vllm", "chat_completion.json", UNREPORTED),  # no --enable-prompt-tokens-details
    ("vllm", "chat_completion_prompt_tokens_details.json", REPORTED),
    ("sglang", "chat_completion.json", UNREPORTED),  # no --enable-cache-report
    ("sglang", "chat_completion_cache_report.json", REPORTED),
    ("sglang", "generate.json", REPORTED),
    ("llama_cpp", "chat_completion.json", REPORTED),
    ("vllm", "error_model_not_found.json", None),
    ("sglang", "error_bad_request.json", None),
    ("llama_cpp", "error_exceed_context.json", None),
])
def test_reads_each_engines_json_answer(engine: str, name: str, expected: Usage | None) -> None:
    body = (FIXTURES / engine / name).read_bytes()
    tap = UsageTap(streaming=False)
    tap.feed(body)
    assert tap.usage() == expected


@pytest.mark.parametrize(("engine", "name", "expected"), [
    ("vllm", "chat_stream.sse", UNREPORTED),
    ("vllm", "chat_stream_prompt_tokens_details.sse", REPORTED),
    ("sglang", "chat_stream.sse", UNREPORTED),
    ("sglang", "chat_stream_cache_report.sse", REPORTED),
    ("sglang", "generate_stream.sse", REPORTED),
    ("llama_cpp", "chat_stream.sse", REPORTED),  # no usage chunk: the last chunk's timings say it
    ("llama_cpp", "chat_stream_include_usage.sse", REPORTED),
    ("llama_cpp", "chat_stream_error.sse", None),
])
def test_reads_each_engines_stream_in_any_chunking(engine: str, name: str, expected: Usage | None) -> None:
    stream = (FIXTURES / engine / name).read_bytes()
    for size in (1, 13, len(stream)):
        tap = UsageTap(streaming=True)
        for start in range(0, len(stream), size):
            tap.feed(stream[start:start + size])
        assert tap.usage() == expected
