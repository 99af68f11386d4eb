"""Requests per second the gateway serves to well-behaved clients with and without hostile company.

`python -m loadtest.hostile`: a gateway in front of three simulated replicas is driven by `clients` well-behaved
clients in a closed loop for `seconds`, twice per round: once alone (baseline), once while `slowloris`
connections trickle header bytes (one a second, reconnecting whenever the gateway closes them) and a fourth
replica that answers half its requests with 500 is in the pool (hostile). Rounds run back to back so that a
noisy, shared machine affects both phases alike.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from simulator.fleet import running_fleet

CHAT = "/v1/chat/completions"
REPLICA = ["--time-scale", "0.01", "--log-level", "warning"]
GATEWAY = ["--log-level", "warning", "--keepalive-timeout-secs", "15"]


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    statuses: Counter[str]
    slowloris_closed: int = 0  # times the gateway closed a slowloris connection

    @property
    def requests_per_s(self) -> float:
        return sum(self.statuses.values()) / self.seconds

    @property
    def ok_per_s(self) -> float:
        return self.statuses["200"] / self.seconds


async def well_behaved(url: str, clients: int, seconds: float) -> Counter[str]:
    statuses: Counter[str] = Counter()
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async def client(index: int) -> None:
            turn = 0
            while time.monotonic() < deadline:
                body = {"messages": [{"role": "user", "content": f"client {index} question {turn}"}],
                        "max_tokens": 8}
                try:
                    async with session.post(url + CHAT, json=body) as response:
                        await response.read()
                        statuses[str(response.status)] += 1
                except (aiohttp.ClientError, TimeoutError) as exc:
                    statuses[type(exc).__name__] += 1
                turn += 1
        await asyncio.gather(*(client(index) for index in range(clients)))
    return statuses


async def slowloris(url: str, connections: int, stop: asyncio.Event) -> int:
    """Hold `connections` connections that send one header byte a second; how many the gateway closed."""
    host, port = url.removeprefix("http://").split(":")
    head = f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nX-Slow: ".encode()
    closed = 0

    async def one() -> None:
        nonlocal closed
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(host, int(port))
            except OSError:
                await asyncio.sleep(1)
                continue
            try:
                writer.write(head)
                while not stop.is_set():
                    writer.write(b"a")
                    try:
                        if await asyncio.wait_for(reader.read(1024), timeout=1.0) == b"":
                            break
                    except TimeoutError:
                        continue
                    break
                closed += not stop.is_set()
            except ConnectionError:
                closed += 1
            finally:
                writer.close()

    await asyncio.gather(*(one() for _ in range(connections)))
    return closed


async def hostile_phase(url: str, clients: int, seconds: float, connections: int) -> tuple[Counter[str], int]:
    stop = asyncio.Event()
    attack = asyncio.ensure_future(slowloris(url, connections, stop))
    await asyncio.sleep(2.0)  # every slow connection open before the measurement starts
    statuses = await well_behaved(url, clients, seconds)
    stop.set()
    return statuses, await attack


def run(rounds: int, clients: int, seconds: float, connections: int) -> list[Phase]:
    phases = []
    with running_fleet() as fleet:
        healthy = fleet.start_replicas(3, args=REPLICA)
        failing = fleet.start_replica(args=[*REPLICA, "--error-rate", "0.5"], name="failing-replica")
        calm = fleet.start_gateway(healthy.urls, args=GATEWAY, name="gateway-calm")
        stormy = fleet.start_gateway([*healthy.urls, failing.url], args=GATEWAY, name="gateway-hostile")
        for url in (calm.url, stormy.url):  # warm both up (connection pools, code paths) before measuring
            asyncio.run(well_behaved(url, clients, 3.0))
        for _ in range(rounds):
            phases.append(Phase("baseline", seconds, asyncio.run(well_behaved(calm.url, clients, seconds))))
            statuses, closed = asyncio.run(hostile_phase(stormy.url, clients, seconds, connections))
            phases.append(Phase("hostile", seconds, statuses, closed))
    return phases


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.hostile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="baseline + hostile pairs, back to back")
    parser.add_argument("--clients", type=int, default=16, help="well-behaved clients, each one request at a time")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--slowloris", type=int, default=300, help="slow connections in the hostile phase")
    args = parser.parse_args(argv)
    for phase in run(args.rounds, args.clients, args.seconds, args.slowloris):
        print(f"{phase.name:9} {phase.requests_per_s:7.1f} answers/s {phase.ok_per_s:7.1f} ok/s  "
              f"statuses {dict(phase.statuses)}  slowloris closed {phase.slowloris_closed}")


if __name__ == "__main__":
    main()
