"""What differs between engines, in one place: how each reports its model, KV capacity and load.

Everything else (the OpenAI endpoints, `/health`, SSE framing) is the same across SGLang, vLLM and llama.cpp's
server, so the rest of the gateway never asks which engine it talks to. Each adapter answers two questions:
"are you this engine, and how many tokens does your KV cache hold?" and "which of your metrics mean queue,
running and KV usage?".
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, TypeGuard

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


@dataclass(frozen=True)
class EngineInfo:
    engine: Engine
    capacity_tokens: int | None


@dataclass(frozen=True)
class LoadMetricNames:
    queued: tuple[str, ...]
    running: tuple[str, ...]
    kv_usage: tuple[str, ...]


# Metric names as the text exposition spells them (the parser strips `_total` from counters only).
LOAD_METRICS = LoadMetricNames(
    queued=("sglang:num_queue_reqs", "vllm:num_requests_waiting", "llamacpp:requests_deferred"),
    running=("sglang:num_running_reqs", "vllm:num_requests_running", "llamacpp:requests_processing"),
    kv_usage=("sglang:token_usage", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
              "llamacpp:kv_cache_usage_ratio"),
)


async def get_json(client: Fetcher, url: str, timeout_s: float) -> Any:
    """The JSON a GET returns, or None for any failure (discovery probes are allowed to miss)."""
    body = await client.get_bytes(url, timeout_s)
    try:
        return None if body is None else json.loads(body)
    except ValueError:
        return None


async def discover_model(client: Fetcher, url: str, timeout_s: float) -> ModelInfo | None:
    """The model a backend serves: OpenAI's /v1/models first, SGLang's server info as the fallback."""
    listing = await get_json(client, url + "/v1/models", timeout_s)
    if isinstance(listing, dict) and isinstance(listing.get("data"), list) and listing["data"]:
        card = listing["data"][0]
        if isinstance(card, dict) and isinstance(card.get("id"), str):
            return ModelInfo(card["id"], card)
    info = await _sglang_server_info(client, url, timeout_s)
    name = info.get("served_model_name") or info.get("model_path") if info else None
    return ModelInfo(name, {}) if isinstance(name, str) else None


async def _sglang_server_info(client: Fetcher, url: str, timeout_s: float) -> dict[str, Any] | None:
    for path in ("/server_info", "/get_server_info"):  # newer SGLang, then older
        info = await get_json(client, url + path, timeout_s)
        if isinstance(info, dict):
            return info
    return None


async def discover_engine(client: Fetcher, url: str, timeout_s: float) -> EngineInfo:
    info = await _sglang_server_info(client, url, timeout_s)
    if info is not None and _positive_int(info.get("max_total_num_tokens")):
        return EngineInfo(Engine.SGLANG, info["max_total_num_tokens"])
    props = await get_json(client, url + "/props", timeout_s)
    if isinstance(props, dict) and isinstance(props.get("default_generation_settings"), dict):
        return EngineInfo(Engine.LLAMA_CPP, _llama_cpp_capacity(props))
    return await _vllm_engine(client, url, timeout_s)


def _llama_cpp_capacity(props: dict[str, Any]) -> int | None:
    """llama-server's KV cache holds n_ctx tokens in all, shared by its slots."""
    n_ctx = props["default_generation_settings"].get("n_ctx")
    slots = props.get("total_slots")
    if _positive_int(n_ctx):
        return int(n_ctx) * (int(slots) if _positive_int(slots) and props.get("kv_unified") is False else 1)
    return None


async def _vllm_engine(client: Fetcher, url: str, timeout_s: float) -> EngineInfo:
    """vLLM publishes its cache size only as labels of `vllm:cache_config_info`."""
    families = await scrape_metrics(client, url, timeout_s)
    for family in families or []:
        if family.name == "vllm:cache_config_info":
            for sample in family.samples:
                blocks, size = sample.labels.get("num_gpu_blocks"), sample.labels.get("block_size")
                if blocks and size and blocks.isdigit() and size.isdigit():
                    return EngineInfo(Engine.VLLM, int(blocks) * int(size))
            return EngineInfo(Engine.VLLM, None)
    return EngineInfo(Engine.OPENAI_COMPATIBLE, None)


async def scrape_metrics(client: Fetcher, url: str, timeout_s: float) -> list[Any] | None:
    body = await client.get_bytes(url + "/metrics", timeout_s)
    try:
        return None if body is None else list(text_string_to_metric_families(body.decode("utf-8", "replace")))
    except ValueError:
        return None


def read_load(families: list[Any]) -> tuple[float, float, float] | None:
    """(queued, running, kv_usage) summed over the samples of the first known name of each, or None."""
    values: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    found = [next((values[name] for name in names if name in values), None)
             for names in (LOAD_METRICS.queued, LOAD_METRICS.running, LOAD_METRICS.kv_usage)]
    if found[0] is None and found[1] is None:
        return None
    return found[0] or 0.0, found[1] or 0.0, found[2] or 0.0


def _positive_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
