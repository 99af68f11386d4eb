"""What differs between engines, in one place: how each says who it is, how large its KV cache is, and which
of its metrics mean queue, running and KV usage.

Everything else (the OpenAI endpoints, `/health`, SSE framing) is the same across SGLang, vLLM and llama.cpp's
server, so the rest of the gateway never asks which engine it talks to. Token usage is read by
`gateway/api/usage.py` whatever the engine: every answer carries its own shape (`usage`, `meta_info`, `timings`).

One adapter per engine, each with `detect` (is this that engine, and how many tokens does its KV cache hold?),
`served_model` (the model, for servers whose `/v1/models` says nothing) and `load` (its load metric names).
Discovery tries the adapters in `ADAPTERS` order; the generic one, last, matches any server. Adding an engine
is an `Engine` member, an adapter below, its place in `ADAPTERS`, and its fixtures under
`tests/fixtures/engines/` with a contract test.

Servers with several data-parallel engines (vLLM `--data-parallel-size`, SGLang `--dp-size`) report each
engine's cache separately and spread requests between them, so a prefix is reused only on the engine that
holds it: the capacity discovered is one engine's (the smallest), and the queue and running counts are summed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple, Protocol, TypeGuard

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)


class Engine(str, Enum):
    SGLANG = "sglang"
    VLLM = "vllm"
    LLAMA_CPP = "llama.cpp"
    OPENAI_COMPATIBLE = "openai-compatible"  # answers the OpenAI API, reports nothing we can read


class Fetcher(Protocol):
    """What discovery needs of the HTTP client (`upstream.UpstreamClient`): a GET's body, None on any miss."""

    async def get_bytes(self, url: str, timeout_s: float) -> bytes | None: ...


@dataclass(frozen=True)
class ModelInfo:
    model: str
    card: dict[str, Any]  # the backend's own /v1/models entry, relayed by the gateway's /v1/models
    # The listing's other entries by id: LoRA adapters (entries with a `parent`, as vLLM lists `--lora-modules`
    # and SGLang `--lora-paths`), other names of the model (vLLM's `--served-model-name a b`), other models.
    others: dict[str, dict[str, Any]] = field(default_factory=dict)


def is_lora_adapter(card: dict[str, Any]) -> bool:
    """A /v1/models entry for a LoRA adapter: it names the model it adapts as its `parent`."""
    return isinstance(card.get("parent"), str) and bool(card["parent"])


@dataclass(frozen=True)
class EngineInfo:
    engine: Engine
    capacity_tokens: int | None
    embedding: bool | None = None  # an embedding model (serves no text generation); None: the engine does not say


@dataclass(frozen=True)
class LoadMetricNames:
    """Metric names as the text exposition spells them (the parser strips `_total` from counters only)."""

    queued: tuple[str, ...] = ()
    running: tuple[str, ...] = ()
    kv_usage: tuple[str, ...] = ()  # a share of the pool, 0..1


class Load(NamedTuple):
    queued: float
    running: float
    kv_usage: float


class EngineAdapter(Protocol):
    engine: Engine
    load: LoadMetricNames

    async def detect(self, client: Fetcher, url: str, timeout_s: float) -> EngineInfo | None:
        """This engine and its KV capacity in tokens, or None when `url` is not this engine."""
        ...

    async def served_model(self, client: Fetcher, url: str, timeout_s: float) -> str | None:
        """The served model from the engine's own endpoints, when `/v1/models` named none."""
        ...


class SGLang:
    """`/server_info` (older releases: `/get_server_info`) merges the server arguments with the scheduler's
    `max_total_num_tokens`, the KV pool of one data-parallel rank."""

    engine = Engine.SGLANG
    load = LoadMetricNames(queued=("sglang:num_queue_reqs",), running=("sglang:num_running_reqs",),
                           kv_usage=("sglang:token_usage",))

    async def detect(self, client: Fetcher, url: str, timeout_s: float) -> EngineInfo | None:
        info = await self.server_info(client, url, timeout_s)
        if info is None or not _positive_int(info.get("max_total_num_tokens")):
            return None
        embedding = info.get("is_embedding")
        return EngineInfo(self.engine, info["max_total_num_tokens"], embedding if isinstance(embedding, bool) else None)

    async def served_model(self, client: Fetcher, url: str, timeout_s: float) -> str | None:
        info = await self.server_info(client, url, timeout_s)
        name = (info.get("served_model_name") or info.get("model_path")) if info else None
        return name if isinstance(name, str) else None

    @staticmethod
    async def server_info(client: Fetcher, url: str, timeout_s: float) -> dict[str, Any] | None:
        for path in ("/server_info", "/get_server_info"):
            info = await get_json(client, url + path, timeout_s)
            if isinstance(info, dict):
                return info
        return None


class LlamaCpp:
    """`/props` gives one slot's context (`default_generation_settings.n_ctx`). With a unified KV cache (the
    server's default) that is the whole pool; with one cache per slot a prefix is reused only in its slot.
    Either way one slot's `n_ctx` is what a prefix can count on. Current servers export no KV-usage gauge."""

    engine = Engine.LLAMA_CPP
    load = LoadMetricNames(queued=("llamacpp:requests_deferred",), running=("llamacpp:requests_processing",),
                           kv_usage=("llamacpp:kv_cache_usage_ratio",))  # older servers only

    async def detect(self, client: Fetcher, url: str, timeout_s: float) -> EngineInfo | None:
        props = await get_json(client, url + "/props", timeout_s)
        if not isinstance(props, dict) or not isinstance(props.get("default_generation_settings"), dict):
            return None
        n_ctx = props["default_generation_settings"].get("n_ctx")
        return EngineInfo(self.engine, n_ctx if _positive_int(n_ctx) else None)

    async def served_model(self, client: Fetcher, url: str, timeout_s: float) -> str | None:
        props = await get_json(client, url + "/props", timeout_s)
        alias = props.get("model_alias") if isinstance(props, dict) else None
        return alias if isinstance(alias, str) and alias else None


class VLLM:
    """vLLM publishes its cache size only as labels of `vllm:cache_config_info`, one sample per engine:
    `kv_cache_size_tokens` where known (right for hybrid models too), else `num_gpu_blocks * block_size`."""

    engine = Engine.VLLM
    load = LoadMetricNames(queued=("vllm:num_requests_waiting",), running=("vllm:num_requests_running",),
                           kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"))  # before 0.10

    async def detect(self, client: Fetcher, url: str, timeout_s: float) -> EngineInfo | None:
        families = await scrape_metrics(client, url, timeout_s)
        info = next((family for family in families or [] if family.name == "vllm:cache_config_info"), None)
        if info is None:
            return None
        capacities = [_vllm_capacity(sample.labels) for sample in info.samples]
        known = [tokens for tokens in capacities if tokens is not None]
        return EngineInfo(self.engine, min(known) if known else None)

    async def served_model(self, client: Fetcher, url: str, timeout_s: float) -> str | None:
        return None  # /v1/models always names it


def _vllm_capacity(labels: dict[str, str]) -> int | None:
    tokens = labels.get("kv_cache_size_tokens", "")
    if tokens.isdigit() and int(tokens) > 0:
        return int(tokens)
    blocks, size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
    return int(blocks) * int(size) if blocks.isdigit() and size.isdigit() and int(blocks) > 0 else None


class OpenAICompatible:
    """Any other server that speaks the OpenAI API: nothing to read beyond `/v1/models`."""

    engine = Engine.OPENAI_COMPATIBLE
    load = LoadMetricNames()

    async def detect(self, client: Fetcher, url: str, timeout_s: float) -> EngineInfo | None:
        return EngineInfo(self.engine, None)

    async def served_model(self, client: Fetcher, url: str, timeout_s: float) -> str | None:
        return None


# Detection order: the cheap JSON probes first, vLLM's /metrics scrape after them, the catch-all last.
ADAPTERS: tuple[EngineAdapter, ...] = (SGLang(), LlamaCpp(), VLLM(), OpenAICompatible())


async def get_json(client: Fetcher, url: str, timeout_s: float) -> Any:
    """The JSON a GET returns, or None for any failure (discovery probes are allowed to miss)."""
    body = await client.get_bytes(url, timeout_s)
    try:
        return None if body is None else json.loads(body)
    except ValueError:
        return None


async def discover_model(client: Fetcher, url: str, timeout_s: float) -> ModelInfo | None:
    """The model a backend serves: OpenAI's /v1/models first, then what an engine's own endpoints say."""
    listing = await get_json(client, url + "/v1/models", timeout_s)
    if isinstance(listing, dict) and isinstance(listing.get("data"), list):
        found = read_listing(listing["data"])
        if found is not None:
            return found
    for adapter in ADAPTERS:
        name = await adapter.served_model(client, url, timeout_s)
        if name is not None:
            return ModelInfo(name, {})
    return None


def read_listing(data: list[Any]) -> ModelInfo | None:
    """The model of a /v1/models listing: its first entry that is not a LoRA adapter (engines list the base
    model first), with every other entry beside it."""
    cards = {card["id"]: card for card in data if isinstance(card, dict) and isinstance(card.get("id"), str)}
    if not cards:
        return None
    model = next((name for name, card in cards.items() if not is_lora_adapter(card)), next(iter(cards)))
    card = cards.pop(model)
    return ModelInfo(model, card, cards)


async def discover_engine(client: Fetcher, url: str, timeout_s: float) -> EngineInfo:
    for adapter in ADAPTERS:
        found = await adapter.detect(client, url, timeout_s)
        if found is not None:
            return found
    return EngineInfo(Engine.OPENAI_COMPATIBLE, None)


async def scrape_metrics(client: Fetcher, url: str, timeout_s: float) -> list[Metric] | None:
    body = await client.get_bytes(url + "/metrics", timeout_s)
    try:
        return None if body is None else list(text_string_to_metric_families(body.decode("utf-8", "replace")))
    except ValueError:
        return None


def _names(kind: str) -> tuple[str, ...]:
    return tuple(name for adapter in ADAPTERS for name in getattr(adapter.load, kind))


# Every engine's names at once: they are prefixed by engine, so a scrape matches only its own engine's.
LOAD_METRICS = LoadMetricNames(queued=_names("queued"), running=_names("running"), kv_usage=_names("kv_usage"))


def read_load(families: Iterable[Metric]) -> Load | None:
    """Queued and running requests summed over a server's engines, KV usage averaged over them; None when the
    scrape has neither a queue nor a running count."""
    samples: dict[str, list[float]] = {}
    for family in families:
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(float(sample.value))
    queued, running, kv_usage = (next((samples[name] for name in names if name in samples), None)
                                 for names in (LOAD_METRICS.queued, LOAD_METRICS.running, LOAD_METRICS.kv_usage))
    if queued is None and running is None:
        return None
    return Load(sum(queued or ()), sum(running or ()), sum(kv_usage) / len(kv_usage) if kv_usage else 0.0)


def _positive_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def read_start_time(families: Iterable[Metric]) -> float | None:
    """The engine process's start time in Unix seconds (`process_start_time_seconds`, the standard process metric
    that vLLM's Prometheus client exports; SGLang's multiprocess metrics lack it), None when the scrape has none."""
    for family in families:
        if family.name == "process_start_time_seconds" and family.samples:
            return float(family.samples[0].value)
    return None
