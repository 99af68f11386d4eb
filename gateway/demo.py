"""`prefix-gateway demo`: the gateway in front of simulated replicas, on this machine, no GPU needed.

Starts an LLM pool of simulated SGLang-compatible replicas and one embedding replica (`simulator.replica`),
then the gateway in front of all of them, each as its own process on 127.0.0.1; prints what to paste; stops
everything on Ctrl-C or SIGTERM. With `--workers N` the gateway serves the port from N processes that share
their routing state through a private redis-server (gateway/server.py), as `serve --workers N` does.
"""

from __future__ import annotations

import json
import shlex
import signal
import sys
import threading
from types import FrameType

from simulator.fleet import FleetError, check_port_free, redis_installed, running_fleet

LLM_MODEL = "sim-llama-8b"
EMBEDDING_MODEL = "sim-embedding"
SYSTEM_PROMPT = ("You are the assistant of the prefix-gateway demo. Answer briefly. This system prompt is long "
                 "on purpose: the engine caches its KV state, and the gateway sends requests that share it to "
                 "the replica that already holds it, so the second request reports cached tokens. " * 3).strip()


def curl_line(url: str) -> str:
    body = {"model": LLM_MODEL, "max_tokens": 16,
            "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Hello!"}]}
    return (f"curl -s {url}/v1/chat/completions -H 'content-type: application/json' "
            f"-d {shlex.quote(json.dumps(body))}")


def sdk_snippet(url: str) -> str:
    return "\n".join([
        "from openai import OpenAI",
        f'client = OpenAI(base_url="{url}/v1", api_key="unused")',
        'system = {"role": "system", "content": "You are the assistant of the prefix-gateway demo. " * 20}',
        "for question in ['Hello!', 'And again?']:",
        f'    reply = client.chat.completions.create(model="{LLM_MODEL}", max_tokens=16,',
        '        messages=[system, {"role": "user", "content": question}])',
        "    print(reply.usage.prompt_tokens_details.cached_tokens, reply.choices[0].message.content)",
    ])


def run_demo(replicas: int, port: int, time_scale: float, workers: int = 1) -> int:
    if workers > 1 and not redis_installed():
        print("prefix-gateway demo: --workers N shares routing state through a private redis-server, which is "
              "not installed (apt-get install redis-server)", file=sys.stderr)
        return 1
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    replica_args = ["--time-scale", str(time_scale), "--log-level", "warning"]
    try:
        check_port_free(port)  # before starting anything: a busy port must not look like our gateway
        with running_fleet() as fleet:
            print(f"starting {replicas} simulated LLM replicas and 1 embedding replica ...", flush=True)
            llms = fleet.start_replicas(replicas, args=[*replica_args, "--model", LLM_MODEL], name="llm-replicas")
            embedder = fleet.start_replicas(1, args=[*replica_args, "--embedding", "--model", EMBEDDING_MODEL],
                                            name="embedding-replica")
            gateway = fleet.start_gateway(llms.urls + embedder.urls, port=port, args=["--workers", str(workers)])
            gateway.keep_log = True  # the banner points at it, so it outlives the demo
            print_banner(gateway.url, llms.urls + embedder.urls, gateway.log_path, workers)
            while not stop.wait(0.5):
                dead = [process.name for process in fleet.processes if not process.alive()]
                if dead:
                    print(f"{', '.join(dead)} exited; stopping the demo", file=sys.stderr)
                    return 1
            print("stopping ...", flush=True)
    except FleetError as exc:
        print(f"prefix-gateway demo: {exc}", file=sys.stderr)
        return 1
    return 0


def workers_line(workers: int) -> str:
    if workers == 1:
        return "One gateway process (--workers N: N processes on this port, sharing what they learn)."
    return (f"{workers} gateway processes serve this port and share their routing state (placements, load, health) "
            f"through a private redis-server:\na prompt goes to the replica that holds its prefix whichever process "
            f"takes the connection ({workers} instances in {{url}}/ready's state.instance over a few calls).")


def print_banner(url: str, backends: list[str], log_path: str, workers: int = 1) -> None:
    print(f"""
prefix-gateway is ready at {url}  (backends: {', '.join(backends)})
{workers_line(workers).replace("{url}", url)}

Run this twice; the second answer reports cached tokens (usage.prompt_tokens_details.cached_tokens):

  {curl_line(url)}

The same from Python (pip install openai):

{sdk_snippet(url)}

Live dashboard: {url}/dashboard
Also: {url}/v1/models  {url}/backends  {url}/metrics
The gateway's log (one access line per request; kept after the demo stops): {log_path}
Ctrl-C stops the gateway and the replicas.
""", flush=True)
