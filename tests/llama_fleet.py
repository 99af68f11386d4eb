"""Start a fleet of real llama.cpp `llama-server` processes for tests.

The binary and the tiny model come from ``scripts/real-engine/setup.sh``,
which records their paths in ``$PREFIX_GATEWAY_CACHE/real-engine.env``
(default ``~/.cache/prefix-gateway``). Without that file the tests that use
this module are skipped.

Usage::

    with llama_fleet(2) as servers:
        for s in servers:
            s.url        # "http://127.0.0.1:PORT"  (OpenAI base: s.url + "/v1")

or, in pytest, the ``llama_fleet_factory`` fixture below.

Each server binds 127.0.0.1 on a free port, runs with one CPU thread, serves
the model under the id ``tiny-llama`` (``--alias``), and is stopped (SIGTERM,
then SIGKILL) when the block ends. Its output goes to a log file whose tail is
shown if it fails to become ready.

Facts about llama-server worth knowing in tests (llama.cpp b11434):

- ``/health`` answers 503 ``{"error":{"message":"Loading model",...}}`` while
  loading and 200 ``{"status":"ok"}`` when ready (also when all slots are busy).
- Prompt-cache reuse is reported as ``usage.prompt_tokens_details.cached_tokens``
  and ``timings.cache_n``. With the default ``--slot-prompt-similarity 0.1``,
  conversations sharing a system prompt all land on the slot that holds it and
  overwrite each other; pass ``extra_args=["-sps", "0"]`` for LRU slot choice,
  which also saves/restores slots through the RAM prompt cache (``--cache-ram``,
  on by default) so a follow-up turn reuses its whole prefix on any slot.
- After a *streamed* response the server often closes the keep-alive
  connection without saying so; a pooled client that reuses it gets
  "Server disconnected without sending a response". Send
  ``Connection: close`` on streamed requests, or retry such failures once.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SETUP_HINT = "run scripts/real-engine/setup.sh to build llama-server and the tiny model"

# Proxies must never be used for loopback traffic, whatever the environment says.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def cache_dir() -> Path:
    return Path(os.environ.get("PREFIX_GATEWAY_CACHE") or Path.home() / ".cache" / "prefix-gateway")


def read_env(path: Path | None = None, required: tuple[str, ...] = ("LLAMA_SERVER", "TINY_MODEL")
             ) -> dict[str, str] | None:
    """The KEY=VALUE pairs of an engine's env file (real-engine.env by default), or None if it is missing or a
    `required` path in it does not exist."""
    path = path or cache_dir() / "real-engine.env"
    try:
        text = path.read_text()
    except OSError:
        return None
    env = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            env[k.strip()] = v.strip()
    for key in required:
        if not env.get(key) or not Path(env[key]).exists():
            return None
    return env


def require_env() -> dict[str, str]:
    env = read_env()
    if env is None:
        pytest.skip(f"llama-server or the tiny model not found ({cache_dir()}/real-engine.env): {SETUP_HINT}")
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """GET without proxies; returns (status, body), status 0 if unreachable."""
    try:
        with _OPENER.open(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


@dataclass
class EngineServer:
    """A real engine's server process on loopback, with its log file."""

    url: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    args: list[str] = field(default_factory=list)

    @property
    def openai_base_url(self) -> str:
        return self.url + "/v1"

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def wait_ready(self, engine: str, deadline: float, poll_s: float) -> None:
        """Until /health answers 200, or raise with the log's tail when the process exits or time is up."""
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{engine} on port {self.port} exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            status, _ = http_get(self.url + "/health", timeout=2.0)
            if status == 200:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{engine} on port {self.port} not ready in time:\n{self.log_tail()}")
            time.sleep(poll_s)


class LlamaServer(EngineServer):

    def props(self) -> dict:
        status, body = http_get(self.url + "/props")
        assert status == 200, (status, body)
        return json.loads(body)


def _stop(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=grace)


@contextlib.contextmanager
def llama_fleet(
    n: int = 2,
    *,
    ctx_size: int = 4096,
    parallel: int = 1,
    threads: int = 1,
    extra_args: Sequence[str] = (),
    ready_timeout: float = 60.0,
    alias: str = "tiny-llama",
    env: dict[str, str] | None = None,
) -> Iterator[list[LlamaServer]]:
    """Start ``n`` llama-servers with the tiny model; yield them once all are ready.

    ``ctx_size`` is the total context of a server, shared by its ``parallel``
    slots (each slot gets ctx_size / parallel tokens). Skips the test when
    setup.sh has not been run.
    """
    paths = require_env() if env is None else env
    # LLAMA_ARG_* variables would silently override our flags.
    proc_env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    servers: list[LlamaServer] = []
    with tempfile.TemporaryDirectory(prefix="llama-fleet-") as tmp, contextlib.ExitStack() as stack:
        try:
            for i in range(n):
                port = free_port()
                log_path = Path(tmp) / f"llama-server-{i}-{port}.log"
                args = [
                    paths["LLAMA_SERVER"],
                    "--host", "127.0.0.1",
                    "--port", str(port),
                    "-m", paths["TINY_MODEL"],
                    "-c", str(ctx_size),
                    "-np", str(parallel),
                    "-t", str(threads),
                    "--alias", alias,
                    "--metrics",
                    "--slots",
                    *extra_args,
                ]  # fmt: skip
                log = stack.enter_context(open(log_path, "wb"))
                proc = subprocess.Popen(
                    args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=proc_env
                )
                servers.append(LlamaServer(f"http://127.0.0.1:{port}", port, proc, log_path, args))
            deadline = time.monotonic() + ready_timeout
            for s in servers:
                s.wait_ready("llama-server", deadline, poll_s=0.1)  # 503 while the model loads
            yield servers
        finally:
            for s in servers:
                _stop(s.proc)


@pytest.fixture
def llama_fleet_factory() -> Iterator:
    """A fixture returning ``start(n, **kw) -> list[LlamaServer]``; all stopped at teardown."""
    with contextlib.ExitStack() as stack:

        def start(n: int = 2, **kw) -> list[LlamaServer]:
            return stack.enter_context(llama_fleet(n, **kw))

        yield start
