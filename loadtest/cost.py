"""Where a relayed request's CPU goes (`python -m loadtest cost`): the gateway's steps added one at a time to a
bare aiohttp relay, in one process that also holds the client and a zero-cost backend.

Each step runs the gateway's own methods up to that step (parse, rewrite, hashes, choose, forward) and then
relays the backend's answer as the bare relay does; `full` is the gateway's handler as served. Per step: the
process's CPU time per request, median of interleaved rounds, the gateway's garbage-collector settings applied
after a warm-up. The client's and the backend's share is in every row alike, so the differences between rows
are the steps'. With `--instructions` each step runs once more under valgrind's callgrind, which counts the
instructions of the measured requests: the same count on every run whatever else the machine does, so a change
of a few per cent shows without a long, noisy benchmark. The bodies are `python -m loadtest overhead`'s.
"""

from __future__ import annotations

import asyncio
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

from gateway.api.prompts import routing_text
from gateway.app import GATEWAY, RELAYED_PATHS, Gateway, Handler, create_app, skip_the_router_for_relays
from gateway.config import build_config
from gateway.server import tune_gc
from loadtest.nginx import COMPLETION, MODELS
from loadtest.wrk import CHAT_PATH, MESSAGES, SYSTEM_TOKENS, chat_bodies
from simulator.fleet import LOOPBACK, free_port

# Each step adds one part of the gateway's request path to the one before it.
STEPS = {
    "relay": "a bare aiohttp relay (server and client, nothing else)",
    "app": "+ the gateway's app: error middleware, shutdown guard, admission, its upstream client",
    "parse": "+ parse: the body, its JSON, the model, the session key",
    "rewrite": "+ rewrite",
    "hashes": "+ routing text and block hashes",
    "choose": "+ choose: the policy, reserve and release (index, load, backlog)",
    "forward": "+ forward: the client's headers, the retry loop, timeouts",
    "full": "+ relay and record: the answer's headers and usage, metrics, the access line",
}
CONCURRENCY = 8  # clients, each with one request in flight: enough to interleave them, as under load
WARMUP_REQUESTS = 400
_JSON = aiohttp.hdrs.CONTENT_TYPE, "application/json"


@dataclass(frozen=True)
class CostConfig:
    requests: int = 4000
    rounds: int = 5
    policy: str = "prefix_aware"
    steps: tuple[str, ...] = tuple(STEPS)
    system_tokens: int = SYSTEM_TOKENS  # of the prompt every request shares; each adds ~100 tokens of its own
    # Each request's own message new to the gateway, as a conversation's next turn is: its blocks are recorded
    # as new ones. By default the overhead benchmark's 300 messages repeat, and after the warm-up all are known.
    new_prompts: bool = False

    def bodies(self) -> list[bytes]:
        count = WARMUP_REQUESTS + self.requests + 1 if self.new_prompts else MESSAGES
        return [body.encode() for body in chat_bodies(stream=False, count=count, system_tokens=self.system_tokens)]

    def prompts(self) -> str:
        """The prompts, as the printed table's heading names them."""
        return f"a {self.system_tokens}-token shared system prompt" + (
            ", each request's message new" if self.new_prompts else "")

    def child_arguments(self) -> list[str]:
        """This configuration on a `python -m loadtest cost` command line."""
        return ["--requests", str(self.requests), "--policy", self.policy, "--system-tokens",
                str(self.system_tokens), *(["--new-prompts"] if self.new_prompts else [])]


def cut_after(gateway: Gateway, step: str) -> Handler:
    """`gateway.admitted` cut after `step`: the steps up to it run, then the answer is relayed bare."""
    depth = list(STEPS).index(step)
    reaches = {name: depth >= index for index, name in enumerate(STEPS)}

    async def admitted(request: web.Request) -> web.StreamResponse:
        await gateway.admission.enter()
        try:
            placement = None
            if not reaches["parse"]:
                url, raw = gateway.pool.backends[0].url + request.path, await request.read()
                upstream = await gateway.client.open(request.method, url, raw, [_JSON])
            else:
                exchange = await gateway.parse(request, RELAYED_PATHS[request.path])
                if reaches["rewrite"]:
                    exchange = gateway.rewrite(exchange, opted_out=False)
                routing = gateway.router.routing_request(routing_text(exchange.endpoint, exchange.body),
                                                         exchange.model, exchange.session) \
                    if reaches["hashes"] else gateway.router.routing_request("")
                if reaches["forward"]:
                    placement, upstream = await gateway.forward(exchange, routing, request)
                else:
                    placement = gateway.choose(exchange, routing, []) if reaches["choose"] else None
                    url = gateway.pool.backends[0].url + request.path
                    upstream = await gateway.client.open(request.method, url, exchange.raw, [_JSON])
            body = await upstream.read_whole(1 << 20)
            upstream.close()
            if placement is not None:
                placement.finish()
            return web.Response(body=body, status=upstream.status, content_type="application/json")
        finally:
            gateway.admission.leave()

    return admitted


def bare_relay(backend_url: str) -> web.Application:
    app = web.Application()
    session: list[aiohttp.ClientSession] = []

    async def relay(request: web.Request) -> web.Response:
        async with session[0].post(backend_url + request.path, data=await request.read(),
                                   headers=[_JSON]) as answer:
            return web.Response(body=await answer.read(), status=answer.status, content_type="application/json")

    async def open_session(app: web.Application) -> None:  # in the running loop
        session.append(aiohttp.ClientSession())

    async def close_session(app: web.Application) -> None:
        await session[0].close()

    app.router.add_post(CHAT_PATH, relay)
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    return app


def front(step: str, backend_url: str, policy: str) -> web.Application:
    if step == "relay":
        return bare_relay(backend_url)
    app = create_app(build_config({"backends": [{"url": backend_url}], "policy": policy}, {}))
    if step != "full":
        gateway = app[GATEWAY]
        gateway.admitted = cut_after(gateway, step)  # type: ignore[method-assign,assignment]
    return app


def zero_cost_backend() -> web.Application:
    """What `loadtest.nginx` answers, from aiohttp in this process."""
    app = web.Application()

    async def complete(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(COMPLETION)

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def models(request: web.Request) -> web.Response:
        return web.json_response(MODELS)

    app.router.add_post(CHAT_PATH, complete)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    return app


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, LOOPBACK, port).start()
    return runner, f"http://{LOOPBACK}:{port}"


async def cpu_per_request(step: str, config: CostConfig, bodies: Sequence[bytes],
                          on_measure: Callable[[bool], None] = lambda measuring: None) -> float:
    """CPU seconds of this process per request through `step`; `on_measure(True/False)` around the measured
    requests (callgrind's instrumentation)."""
    backend, backend_url = await serve(zero_cost_backend())
    runner, url = await serve(front(step, backend_url, config.policy))
    if step != "relay":
        skip_the_router_for_relays(runner)  # as the gateway serves
    try:
        async with aiohttp.ClientSession() as session:
            sent = 0

            async def one() -> None:
                nonlocal sent
                sent += 1
                async with session.post(url + CHAT_PATH, data=bodies[sent % len(bodies)], headers=[_JSON]) as answer:
                    await answer.read()
                    if answer.status != 200:
                        raise RuntimeError(f"{step}: answered {answer.status}: {await answer.text()}")

            async def client(count: int) -> None:
                for _ in range(count):
                    await one()

            async def rolling(count: int) -> None:  # each client sends its next request when the last ends
                await asyncio.gather(*(client(count // CONCURRENCY) for _ in range(CONCURRENCY)))

            await rolling(WARMUP_REQUESTS)
            await tune_gc(runner.app)
            on_measure(True)
            started = time.process_time()
            await rolling(config.requests)
            spent = time.process_time() - started
            on_measure(False)
    finally:
        await runner.cleanup()
        await backend.cleanup()
        gc.unfreeze()
        gc.collect()
    return spent / (config.requests // CONCURRENCY * CONCURRENCY)


def run_cpu(config: CostConfig) -> dict[str, float]:
    """Median CPU microseconds per request of each step, over interleaved rounds."""
    bodies = config.bodies()
    samples: dict[str, list[float]] = {step: [] for step in config.steps}

    async def rounds() -> None:
        for _ in range(config.rounds):
            for step in config.steps:
                samples[step].append(await cpu_per_request(step, config, bodies) * 1e6)

    _run(rounds())
    return {step: statistics.median(values) for step, values in samples.items()}


def run_instructions(config: CostConfig) -> dict[str, float]:
    """Instructions per request of each step, counted by callgrind (one run each: the count does not vary)."""
    counts = {}
    with tempfile.TemporaryDirectory(prefix="loadtest-cost-") as directory:
        for step in config.steps:
            out = Path(directory) / f"{step}.callgrind"
            argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
                    sys.executable, "-m", "loadtest", "cost", "--one-step", step, *config.child_arguments()]
            done = subprocess.run(argv, capture_output=True, text=True, check=False)
            if done.returncode != 0 or not out.exists():
                raise RuntimeError(f"callgrind run of {step} failed: {done.stderr[-2000:]}")
            counts[step] = callgrind_total(out.read_text()) / config.requests
    return counts


def callgrind_total(profile: str) -> int:
    """The instruction count a callgrind profile ends with (its `totals:` line)."""
    for line in reversed(profile.splitlines()):
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    raise ValueError("no totals line in the callgrind profile")


def measure_one_step(step: str, config: CostConfig) -> None:
    """Run `step` inside callgrind, instrumenting only the measured requests (`run_instructions`)."""
    def instrument(on: bool) -> None:
        subprocess.run(["callgrind_control", "--instr=" + ("on" if on else "off"), str(os.getpid())],
                       capture_output=True, check=True)

    _run(cpu_per_request(step, config, config.bodies(), instrument))


def _run(work: Coroutine[None, None, object]) -> None:
    try:  # the gateway's own event loop, as it serves
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(work)


def cost_rows(costs: dict[str, float]) -> list[list[str]]:
    """Each step's cost and what it adds to the step before."""
    rows: list[list[str]] = []
    previous = None
    for step, cost in costs.items():
        added = "" if previous is None else f"{round(cost) - round(previous):+,}"
        rows.append([step, STEPS[step], f"{cost:,.0f}", added])
        previous = cost
    return rows


def cost_columns(unit: str) -> list[str]:
    return ["step", "what it adds", f"{unit} per request", "added"]
