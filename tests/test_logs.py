"""Log set-up: text lines as before, or one JSON object per line with the fields passed through `extra=`."""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Iterator

import httpx2
import pytest

from gateway.observe.logs import JsonFormatter, configure_logging
from simulator.fleet import Fleet
from tests.conftest import FAST_REPLICA


def record(message: str, *args: object, extra: dict[str, object] | None = None,
           exc_info: bool = False) -> logging.LogRecord:
    logger = logging.getLogger("gateway.access")
    return logger.makeRecord(logger.name, logging.INFO, __file__, 1, message, args,
                             sys.exc_info() if exc_info else None, extra=extra)


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    """The root logger, its handlers and level put back after the test."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_line_has_time_level_logger_message_and_every_extra_field() -> None:
    fields = {"request_id": "abc", "backend": "http://127.0.0.1:30001", "route": "prefix", "match": 0.75,
              "status": 200, "duration_ms": 12.5, "model": "m", "path": "/v1/chat/completions", "error": None}
    line = JsonFormatter().format(record("POST %s", "/v1/chat/completions", extra=fields))
    entry = json.loads(line)
    assert "\n" not in line
    assert entry.pop("level") == "INFO"
    assert entry.pop("logger") == "gateway.access"
    assert entry.pop("message") == "POST /v1/chat/completions"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", entry.pop("time"))
    assert entry == fields  # nothing else: LogRecord's own attributes are left out


def test_json_line_carries_the_traceback_and_stringifies_what_json_cannot_hold() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        entry = json.loads(JsonFormatter().format(record("failed", exc_info=True, extra={"when": object})))
    assert "ValueError: boom" in entry["exception"]
    assert entry["when"] == str(object)


def test_text_format_is_unchanged(root_logger: logging.Logger, capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info")
    logging.getLogger("gateway.app").info("gateway ready: policy %s", "prefix_aware", extra={"backend": "x"})
    line = capsys.readouterr().err.strip()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO gateway.app: gateway ready: policy prefix_aware",
                        line)


def test_json_format_writes_one_object_per_line(root_logger: logging.Logger,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("warning", "json")
    logging.getLogger("gateway.fleet.health").info("not shown")
    logging.getLogger("gateway.fleet.health").warning("backend %s down", "b1", extra={"backend": "b1"})
    lines = capsys.readouterr().err.splitlines()
    assert [json.loads(line)["message"] for line in lines] == ["backend b1 down"]
    assert json.loads(lines[0])["backend"] == "b1"


def test_gateway_with_json_logs_writes_only_json_lines(fleet: Fleet) -> None:
    replica = fleet.start_replica(args=FAST_REPLICA)
    gateway = fleet.start_gateway(replica.urls, args=["--log-format", "json", "--log-level", "info"])
    body = {"model": "sim-llama-8b", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    assert httpx2.post(gateway.url + "/v1/chat/completions", json=body, timeout=30, trust_env=False).status_code == 200
    gateway.stop()
    with open(gateway.log_path, encoding="utf-8") as log:
        entries = [json.loads(line) for line in log if line.strip()]
    access = [entry for entry in entries if entry["logger"] == "gateway.access"]
    assert len(access) == 1
    assert access[0]["status"] == "200" and access[0]["path"] == "/v1/chat/completions"
    assert access[0]["backend"] == replica.url and access[0]["route"]
    assert any(entry["logger"] == "gateway.server" for entry in entries)  # the server's own lines too
