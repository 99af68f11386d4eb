"""Engine adapters against what vLLM, SGLang and llama.cpp's server really answer (tests/fixtures/engines/)."""

import asyncio
from collections.abc import Mapping
from pathlib import Path

import pytest

from gateway.fleet.engines import (
    ADAPTERS,
    Engine,
    EngineInfo,
    Load,
    discover_engine,
    discover_model,
    read_load,
    read_start_time,
    scrape_metrics,
)

FIXTURES = Path(__file__).parent / "fixtures" / "engines"
URL = "http://engine:8000"


class FakeFetcher:
    """Serves fixture files by path; any other path misses, as a 404 does for the real client."""

    def __init__(self, files: Mapping[str, str | bytes]) -> None:
        self.files = {path: body.encode() if isinstance(body, str) else body for path, body in files.items()}
        self.requested: list[str] = []

    async def get_bytes(self, url: str, timeout_s: float) -> bytes | None:
        path = url.removeprefix(URL)
        self.requested.append(path)
        return self.files.get(path)


def fixture(engine: str, name: str) -> str:
    return (FIXTURES / engine / name).read_text()


def vllm(metrics: str = "metrics.txt") -> FakeFetcher:
    return FakeFetcher({"/v1/models": fixture("vllm", "v1_models.json"), "/metrics": fixture("vllm", metrics)})


def sglang(info_path: str = "/server_info", metrics: str = "metrics.txt") -> FakeFetcher:
    return FakeFetcher({"/v1/models": fixture("sglang", "v1_models.json"),
                        info_path: fixture("sglang", "server_info.json"), "/metrics": fixture("sglang", metrics)})


def llama_cpp() -> FakeFetcher:
    return FakeFetcher({"/v1/models": fixture("llama_cpp", "v1_models.json"),
                        "/props": fixture("llama_cpp", "props.json"), "/metrics": fixture("llama_cpp", "metrics.txt")})


def engine_of(client: FakeFetcher) -> EngineInfo:
    return asyncio.run(discover_engine(client, URL, 1.0))


def load_of(client: FakeFetcher) -> Load | None:
    families = asyncio.run(scrape_metrics(client, URL, 1.0))
    assert families is not None
    return read_load(families)


def model_of(client: FakeFetcher) -> str | None:
    found = asyncio.run(discover_model(client, URL, 1.0))
    return None if found is None else found.model


def test_vllm_capacity_is_one_engines_kv_cache_size_tokens() -> None:
    assert engine_of(vllm()) == EngineInfo(Engine.VLLM, 32768)
    assert engine_of(vllm("metrics_dp2.txt")) == EngineInfo(Engine.VLLM, 32768)


def test_vllm_capacity_falls_back_to_blocks_times_block_size() -> None:
    older = fixture("vllm", "metrics.txt").replace('kv_cache_size_tokens="32768"', 'kv_cache_size_tokens="None"')
    assert engine_of(FakeFetcher({"/metrics": older})) == EngineInfo(Engine.VLLM, 2048 * 16)


def test_vllm_model_card_is_relayed_whole() -> None:
    found = asyncio.run(discover_model(vllm(), URL, 1.0))
    assert found is not None and found.model == "tiny-llama"
    assert found.card["owned_by"] == "vllm" and found.card["max_model_len"] == 2048


def test_vllm_load_sums_queues_over_data_parallel_engines_and_averages_kv_usage() -> None:
    assert load_of(vllm()) == Load(queued=2.0, running=3.0, kv_usage=0.25)
    assert load_of(vllm("metrics_dp2.txt")) == Load(queued=7.0, running=7.0, kv_usage=0.5)


@pytest.mark.parametrize("info_path", ["/server_info", "/get_server_info"])
def test_sglang_capacity_comes_from_server_info_old_path_or_new(info_path: str) -> None:
    assert engine_of(sglang(info_path)) == EngineInfo(Engine.SGLANG, 60000, embedding=False)


def test_sglang_says_when_it_serves_an_embedding_model() -> None:
    info = fixture("sglang", "server_info.json").replace('"is_embedding": false', '"is_embedding": true')
    assert engine_of(FakeFetcher({"/server_info": info})).embedding is True
    assert engine_of(vllm()).embedding is None  # vLLM does not say


def test_sglang_model_falls_back_to_server_info_without_v1_models() -> None:
    assert model_of(sglang()) == "tiny-llama"
    assert model_of(FakeFetcher({"/server_info": fixture("sglang", "server_info.json")})) == "tiny-llama"


def test_sglang_load_reads_queue_running_and_token_usage() -> None:
    assert load_of(sglang()) == Load(queued=2.0, running=3.0, kv_usage=0.2)
    assert load_of(sglang(metrics="metrics_dp2.txt")) == Load(queued=7.0, running=7.0, kv_usage=pytest.approx(0.4))


def test_llama_cpp_capacity_is_one_slots_context() -> None:
    assert engine_of(llama_cpp()) == EngineInfo(Engine.LLAMA_CPP, 4096)
    assert model_of(llama_cpp()) == "tiny-llama"
    assert model_of(FakeFetcher({"/props": fixture("llama_cpp", "props.json")})) == "tiny-llama"  # its alias


def test_llama_cpp_load_has_queue_and_running_but_no_kv_gauge() -> None:
    assert load_of(llama_cpp()) == Load(queued=2.0, running=3.0, kv_usage=0.0)


def test_a_plain_openai_server_is_generic_with_unknown_capacity_and_no_load() -> None:
    plain = FakeFetcher({"/v1/models": fixture("openai_compatible", "v1_models.json")})
    assert engine_of(plain) == EngineInfo(Engine.OPENAI_COMPATIBLE, None)
    assert model_of(plain) == "some-hosted-model"
    assert asyncio.run(scrape_metrics(plain, URL, 1.0)) is None


def test_other_engines_metrics_are_not_load() -> None:
    unrelated = FakeFetcher({"/metrics": "# TYPE process_open_fds gauge\nprocess_open_fds 12.0\n"})
    assert load_of(unrelated) is None


def test_each_adapter_claims_only_its_own_engine() -> None:
    servers = {Engine.VLLM: vllm(), Engine.SGLANG: sglang(), Engine.LLAMA_CPP: llama_cpp()}
    for adapter in ADAPTERS[:-1]:
        for engine, server in servers.items():
            found = asyncio.run(adapter.detect(server, URL, 1.0))
            assert (found is not None) == (engine is adapter.engine), (adapter.engine, engine)


def test_error_bodies_and_junk_are_misses_not_crashes() -> None:
    errors = FakeFetcher({"/server_info": fixture("sglang", "error_bad_request.json"),
                          "/props": fixture("llama_cpp", "error_exceed_context.json"),
                          "/v1/models": fixture("vllm", "error_model_not_found.json"), "/metrics": b"\xff{not metrics"})
    assert engine_of(errors) == EngineInfo(Engine.OPENAI_COMPATIBLE, None)
    assert model_of(errors) is None


def test_vllm_reports_its_process_start_time_and_sglangs_fixture_none() -> None:
    families = asyncio.run(scrape_metrics(vllm(), URL, 1.0))
    assert families is not None and read_start_time(families) == pytest.approx(1.79646857892e9)
    sglang_families = asyncio.run(scrape_metrics(sglang(), URL, 1.0))
    assert sglang_families is not None and read_start_time(sglang_families) is None
