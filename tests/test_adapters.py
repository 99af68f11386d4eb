"""Backends serving several models: a base model and the LoRA adapters its /v1/models lists, and prompts under an
adapter indexed apart from the base model's and from every other adapter's."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.errors import ModelNotFound
from gateway.fleet.backends import BackendSpec
from gateway.fleet.engines import ModelInfo, discover_model
from gateway.fleet.pool import Pool
from gateway.observe.metrics import GatewayMetrics
from gateway.routing.hashing import ROOT_SEED, block_hashes, namespace_seed
from gateway.routing.router import Router, RoutingConfig
from tests.policy_fixtures import text
from tests.test_engines import URL, FakeFetcher, fixture

PROMPT = text("You are a SQL assistant.", 640)


def card(name: str, parent: str | None = None) -> dict[str, object]:
    return {"id": name, "object": "model", "parent": parent}


def listing(base: str, *adapters: str) -> ModelInfo:
    return ModelInfo(base, card(base), {name: card(name, base) for name in adapters})


def fleet(*listings: ModelInfo) -> Pool:
    """A pool of healthy backends that discovered `listings`, one each, as the health checker does."""
    pool = Pool([BackendSpec(f"http://b{i}") for i in range(len(listings))], 10_000, retry_after_s=5)
    for backend, found in zip(pool.backends, listings, strict=True):
        if backend.discovered_model(found):
            pool.models_learned()
        backend.health_check_passed(success_threshold=1)
    return pool


def test_vllm_lists_its_lora_modules_as_adapters_of_the_base_model() -> None:
    found = asyncio.run(discover_model(FakeFetcher({"/v1/models": fixture("vllm", "v1_models_lora.json")}), URL, 1.0))
    assert found is not None and found.model == "tiny-llama" and found.card["max_model_len"] == 2048
    assert {name: entry["parent"] for name, entry in found.others.items()} == {"sql-lora": "tiny-llama",
                                                                                 "chat-lora": "tiny-llama"}
    assert found.others["sql-lora"]["root"] == "/adapters/sql-lora"


def test_sglang_lists_its_lora_paths_as_adapters_of_the_served_model() -> None:
    found = asyncio.run(discover_model(FakeFetcher({"/v1/models": fixture("sglang", "v1_models_lora.json")}), URL,
                                       1.0))
    assert found is not None and found.model == "tiny-llama"
    assert list(found.others) == ["sql-lora"] and found.others["sql-lora"]["parent"] == "tiny-llama"


def test_the_base_model_is_the_first_entry_that_is_not_an_adapter() -> None:
    data = [card("sql-lora", "llama"), card("llama"), card("llama-alias")]
    found = asyncio.run(discover_model(FakeFetcher({"/v1/models": json.dumps({"data": data})}), URL, 1.0))
    assert found is not None and found.model == "llama"
    assert set(found.others) == {"sql-lora", "llama-alias"}


def test_adapter_requests_go_only_to_backends_that_serve_the_adapter() -> None:
    pool = fleet(listing("llama", "sql"), listing("llama", "chat"), listing("llama"))
    assert [b.url for b in pool.serving("sql")] == ["http://b0"]
    assert [b.url for b in pool.serving("chat")] == ["http://b1"]
    assert len(pool.serving("llama")) == 3
    assert pool.models() == ["chat", "llama", "sql"]
    assert [entry["id"] for entry in pool.model_cards()] == ["chat", "llama", "sql"]
    assert pool.model_cards()[0]["parent"] == "llama"


def test_an_adapter_is_named_the_vllm_way_or_either_sglang_way() -> None:
    pool = fleet(listing("llama", "sql"))
    assert pool.resolve_model("sql", None) == "sql"
    assert pool.resolve_model("llama:sql", None) == "sql"
    assert pool.resolve_model("llama", None, lora_path="sql") == "sql"
    assert pool.resolve_model(None, None, lora_path="sql") == "sql"
    assert pool.resolve_model("llama", None) == "llama"
    with pytest.raises(ModelNotFound):
        pool.resolve_model("llama:nope", None)


def test_ready_waits_for_every_adapter_to_have_a_healthy_backend() -> None:
    pool = fleet(listing("llama", "sql"), listing("llama"))
    assert pool.ready()
    pool.backends[0].health_check_failed("down", failure_threshold=1)
    assert not pool.ready()  # sql has no healthy backend left, though llama does


def test_adapters_that_come_and_go_keep_the_base_models_cache() -> None:
    pool = fleet(listing("llama", "sql"))
    backend = pool.backends[0]
    backend.index.insert(block_hashes(PROMPT))
    assert backend.discovered_model(listing("llama", "sql", "chat"))
    assert not backend.discovered_model(listing("llama", "sql", "chat"))
    assert set(backend.other_models) == {"sql", "chat"} and backend.index.size_blocks > 0


def test_the_same_prompt_under_two_adapters_shares_no_block_hash() -> None:
    under_sql, under_chat = block_hashes(PROMPT, seed=namespace_seed("sql")), block_hashes(PROMPT,
                                                                                         seed=namespace_seed("chat"))
    base = block_hashes(PROMPT)
    assert len(under_sql) == len(under_chat) == len(base) == len(PROMPT) // 64
    assert not set(under_sql) & set(under_chat) and not set(under_sql) & set(base)
    assert block_hashes(PROMPT, seed=ROOT_SEED) == base


def test_a_server_of_several_models_has_each_indexed_apart() -> None:
    pool = fleet(ModelInfo("llama", card("llama"), {"qwen": card("qwen")}))  # one server, two models
    router = Router(pool, RoutingConfig())
    router.place("llama", router.routing_request(PROMPT, "llama")).finish()
    assert pool.backends[0].index.match(router.routing_request(PROMPT, "qwen").hashes) == 0


def test_the_router_hashes_each_models_prompt_from_the_models_own_seed() -> None:
    pool = fleet(listing("llama", "sql", "chat"))
    router = Router(pool, RoutingConfig())
    # Every model is seeded by its name, the base model too; only a request naming no model hashes from the root.
    assert router.routing_request(PROMPT, "llama").hashes == block_hashes(PROMPT, seed=namespace_seed("llama"))
    assert router.routing_request(PROMPT).hashes == block_hashes(PROMPT)
    assert router.routing_request(PROMPT, "sql").hashes == block_hashes(PROMPT, seed=namespace_seed("sql"))
    router.place("sql", router.routing_request(PROMPT, "sql")).finish()
    # Cached under sql on the backend: a hit for sql, none for chat or the base model.
    index = pool.backends[0].index
    assert index.match(router.routing_request(PROMPT, "sql").hashes) == len(PROMPT) // 64
    assert index.match(router.routing_request(PROMPT, "chat").hashes) == 0
    assert index.match(router.routing_request(PROMPT, "llama").hashes) == 0


def test_a_backend_listing_a_base_model_as_another_name_changes_no_models_hashes() -> None:
    pool = fleet(listing("llama", "sql"))
    router = Router(pool, RoutingConfig())
    before = {model: router.routing_request(PROMPT, model).hashes for model in ("llama", "sql")}
    joined = pool.add(BackendSpec("http://b9"))
    joined.discovered_model(ModelInfo("qwen", card("qwen"), {"llama": card("llama")}))  # llama as a second name
    pool.models_learned()
    assert {model: Router(pool, RoutingConfig()).routing_request(PROMPT, model).hashes
            for model in ("llama", "sql")} == before


def test_an_adapter_named_the_sglang_way_resolves_only_against_the_extra_models() -> None:
    pool = fleet(listing("llama", "sql"))
    assert pool.extra_models == {"sql"}
    assert pool.resolve_model("llama:sql", None) == "sql"
    with pytest.raises(ModelNotFound):
        pool.resolve_model("sql:llama", None)  # llama is a base model, not an adapter


def test_resolving_an_adapter_lists_no_models_per_request() -> None:
    pool = fleet(listing("llama", "sql"), listing("llama", "chat"))
    listed: list[bool] = []
    models = pool.models
    pool.models = lambda healthy_only=True: listed.append(healthy_only) or models(healthy_only)  # type: ignore
    assert [pool.resolve_model(name, None, lora_path=path) for name, path in
            (("sql", None), ("llama:chat", None), ("llama", "sql"))] == ["sql", "chat", "sql"]
    assert listed == []
    pool.remove(pool.backends[1])  # the pool changed: the names are learned again, once
    assert len(listed) == 1
    with pytest.raises(ModelNotFound):
        pool.resolve_model("chat", None)


def test_an_adapter_no_backend_serves_any_more_leaves_no_metric_series() -> None:
    pool = fleet(listing("llama", "sql"), listing("llama", "sql"))
    metrics = GatewayMetrics(pool)
    pool.models_gone = metrics.forget_models
    for model in ("llama", "sql"):
        metrics.request_done("chat", model, "http://b0", "prefix", "200", 0.1, 0.05, 0.5)
        for counter in metrics.token_counters(model, "http://b0"):
            counter.inc(10)
        metrics.prefix_turn(model, "http://b0", found=True)
    for backend in pool.backends:  # sql unloaded, one backend after the other
        backend.discovered_model(listing("llama"))
        pool.models_learned()
        assert ('model="sql"' in metrics.render().decode()) == (backend is pool.backends[0])
    assert 'model="llama"' in metrics.render().decode()
    metrics.request_done("chat", "llama", "http://b0", "prefix", "200", 0.1, 0.05, 0.5)  # still bound
