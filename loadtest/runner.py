"""Side-by-side runs: the same seeded request sequence through each policy, each on a fresh fleet.

A fresh fleet per run means every policy starts with cold caches and idle replicas, so no run inherits the
previous run's cache. The peer routers (sglang-router, smg; both with their cache_aware policy) get the same kind
of fleet. `run_target` drives any running OpenAI-compatible endpoint instead (a real deployment), where cached
tokens come from its responses.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import httpx2

from loadtest.client import DriveOptions, DriveResult, drive
from loadtest.oracle import chat_request, oracle_hit_rate
from loadtest.progress import Progress
from loadtest.scenarios import FleetSpec, Kind, Scenario
from loadtest.sharing import sharing_figures
from loadtest.stats import RunSummary, summarise
from loadtest.workload import Conversation, RequestKind, generate, request_count
from simulator.fleet import Fleet, running_fleet

logger = logging.getLogger(__name__)

SGLANG_ROUTER = "sglang-router"
SMG = "smg"
PEERS = (SGLANG_ROUTER, SMG)


@dataclass(frozen=True)
class Traffic:
    """How requests arrive; rates are simulated requests/s (wall rate = rate / time_scale)."""

    request_rate: float | None
    max_concurrency: int | None
    stream: bool = True


@dataclass(frozen=True)
class Instances:
    """How many gateway instances front the fleet, and whether they share state through one Redis."""

    count: int = 1
    shared: bool = False

    def label(self, policy: str) -> str:
        if self.count == 1 and not self.shared:
            return policy
        return f"{policy} x{self.count} {'shared' if self.shared else 'alone'}"


@dataclass(frozen=True)
class RunOutcome:
    summary: RunSummary
    drive: DriveResult


def sglang_router_installed() -> bool:
    try:
        import sglang_router  # noqa: F401  (only whether it imports)
    except ImportError:
        return False
    return True


def smg_installed() -> bool:
    """The Shepherd Model Gateway package (`pip install smg`). sglang-router 0.3.2 also installs an `smg`
    command, which is sglang-router itself, so the check is for the `smg` module, run as `-m smg.cli`."""
    return importlib.util.find_spec("smg") is not None


def peer_missing(peer: str) -> str | None:
    """Why peer router `peer` cannot run here, or None when it can."""
    if peer == SGLANG_ROUTER and not sglang_router_installed():
        return "sglang-router is not installed (pip install 'prefix-gateway[bench]')"
    if peer == SMG and not smg_installed():
        return "smg is not installed (pip install smg)"
    return None


def replica_args(scenario: Scenario, *, embedding: bool = False) -> list[str]:
    fleet, workload = scenario.fleet, scenario.workload
    args = ["--model", workload.embedding_model if embedding else workload.model,
            "--kv-capacity-tokens", _capacity_arg(fleet, embedding), "--time-scale", str(fleet.time_scale)]
    if fleet.max_running_requests is not None:
        args += ["--max-running-requests", str(fleet.max_running_requests)]
    return [*args, "--embedding"] if embedding else args


def _capacity_arg(fleet: FleetSpec, embedding: bool) -> str:
    if embedding or not fleet.replica_kv_capacity_tokens:
        return str(fleet.kv_capacity_tokens)
    return ",".join(map(str, fleet.replica_kv_capacity_tokens))  # one per replica of the process


def drive_options(scenario: Scenario, traffic: Traffic, time_scale: float) -> DriveOptions:
    rate = traffic.request_rate / time_scale if traffic.request_rate else None
    return DriveOptions(rate_per_s=rate, max_concurrency=traffic.max_concurrency, stream=traffic.stream,
                        seed=scenario.workload.seed, time_scale=time_scale)


def run_policies(scenario: Scenario, policies: Sequence[str], traffic: Traffic, *, peers: Sequence[str] = (),
                 gateway_args: Sequence[str] = (), instances: Instances = Instances()) -> list[RunOutcome]:
    """One run per policy (and one per peer router), in that order; the oracle is computed once, from run one."""
    conversations = generate(scenario.workload)
    labels: list[str] = list(policies)
    for peer in peers:
        if peer not in PEERS:
            raise ValueError(f"unknown peer {peer!r}; known: {', '.join(PEERS)}")
        reason = peer_missing(peer)
        if reason is None:
            labels.append(peer)
        else:
            logger.warning("--peer %s skipped: %s", peer, reason)
    outcomes: list[RunOutcome] = []
    oracle: float | None = None
    for label in labels:
        result, counts = _fleet_run(scenario, label, conversations, traffic, gateway_args, instances)
        if oracle is None:
            oracle = scenario_oracle(scenario, result)
        shown = label if label in PEERS else instances.label(label)
        outcomes.append(RunOutcome(summarise(shown, result, time_scale=scenario.fleet.time_scale,
                                             slo=scenario.slo, oracle_hit_rate=oracle, replica_counts=counts),
                                   result))
    return outcomes


def _fleet_run(scenario: Scenario, label: str, conversations: tuple[Conversation, ...], traffic: Traffic,
               gateway_args: Sequence[str], instances: Instances) -> tuple[DriveResult, dict[str, int] | None]:
    with running_fleet() as fleet:
        llm = fleet.start_replicas(scenario.fleet.replicas, args=replica_args(scenario))
        backends = list(llm.urls)
        if scenario.workload.kind is Kind.MIXED_MODELS and scenario.fleet.embedding_replicas:
            embed = fleet.start_replicas(scenario.fleet.embedding_replicas,
                                         args=replica_args(scenario, embedding=True), name="embedding-replicas")
            backends += embed.urls
        state = fleet.start_redis().url if instances.shared and label not in PEERS else None
        front = _start_front(fleet, label, backends, gateway_args, instances.count, state)
        before = asyncio.run(replica_request_counts(llm.urls))
        progress = Progress(request_count(conversations), f"{scenario.name}/{label}")
        result = asyncio.run(drive(front, conversations, drive_options(scenario, traffic, scenario.fleet.time_scale),
                                   on_done=lambda r: progress.advance(error=r.error is not None)))
        progress.close()
        if state is not None:
            print(sharing_figures(front, state, len(result.results)).describe(), file=sys.stderr)
        keyed = sum(r.route == "session" for r in result.results)
        if keyed:
            print(f"{label}: {keyed} of {len(result.results)} requests went to a backend their session key vouched "
                  "for beyond its prefix index (route session)", file=sys.stderr)
        # From the replicas' own counters: the peers do not relay x-replica-id, and a replica that served nothing
        # sends no header at all (cache_aware with every request on one replica showed max/mean 1.00).
        after = asyncio.run(replica_request_counts(llm.urls))
        counts = {url: after.get(url, 0) - before.get(url, 0) for url in llm.urls} if after else None
    return result, counts


def _start_front(fleet: Fleet, label: str, backends: list[str], gateway_args: Sequence[str], count: int,
                 state: str | None) -> list[str]:
    if label == SGLANG_ROUTER:
        return [fleet.start_sglang_router(backends, policy="cache_aware").url]
    if label == SMG:
        return [fleet.start_smg(backends, policy="cache_aware").url]
    gateways = fleet.start_gateways(count, backends, args=["--policy", label, *gateway_args], state=state)
    return [gateway.url for gateway in gateways]


_REQUESTS_METRIC = re.compile(r"^sglang:num_requests_total(?:\{[^}]*\})?\s+([0-9.eE+]+)", re.MULTILINE)


async def replica_request_counts(urls: Sequence[str]) -> dict[str, int]:
    """Requests served so far per replica URL, from `sglang:num_requests_total`; {} when not exported."""
    counts: dict[str, int] = {}
    async with httpx2.AsyncClient(trust_env=False, timeout=5.0) as client:
        for url in urls:
            try:
                text = (await client.get(f"{url}/metrics")).text
            except httpx2.HTTPError:
                return {}
            found = _REQUESTS_METRIC.findall(text)
            if not found:
                return {}
            counts[url] = int(sum(float(value) for value in found))
    return counts


def scenario_oracle(scenario: Scenario, result: DriveResult) -> float:
    capacity = scenario.fleet.total_kv_capacity_tokens
    chats = [chat_request(sent.messages, sent.answer) for sent in result.sent if sent.kind is RequestKind.CHAT]
    return oracle_hit_rate(chats, capacity).hit_rate


def run_target(scenario: Scenario, url: str, traffic: Traffic, *, model: str | None = None,
               oracle_capacity_tokens: int | None = None) -> RunOutcome:
    """Drive a running endpoint; times are real seconds (time_scale 1)."""
    workload = scenario.workload
    chosen = model or asyncio.run(first_model(url)) or workload.model
    conversations = tuple(c if c.kind is RequestKind.EMBEDDING else _retarget(c, chosen)
                          for c in generate(workload))
    progress = Progress(request_count(conversations), f"{scenario.name}/target")
    result = asyncio.run(drive(url.rstrip("/"), conversations, drive_options(scenario, traffic, 1.0),
                               on_done=lambda r: progress.advance(error=r.error is not None)))
    progress.close()
    oracle = None
    if oracle_capacity_tokens:
        chats = [chat_request(s.messages, s.answer) for s in result.sent if s.kind is RequestKind.CHAT]
        oracle = oracle_hit_rate(chats, oracle_capacity_tokens).hit_rate
    return RunOutcome(summarise("target", result, time_scale=1.0, slo=scenario.slo, oracle_hit_rate=oracle), result)


def _retarget(conversation: Conversation, model: str) -> Conversation:
    return Conversation(conversation.index, conversation.kind, model, conversation.group,
                        conversation.system_text, conversation.turns)


async def first_model(url: str) -> str | None:
    async with httpx2.AsyncClient(trust_env=False, timeout=10.0) as client:
        try:
            data = (await client.get(f"{url.rstrip('/')}/v1/models")).json().get("data") or []
        except (httpx2.HTTPError, ValueError):
            return None
    return str(data[0]["id"]) if data else None
