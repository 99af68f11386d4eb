"""A simulated SGLang-compatible engine replica: the HTTP surface of `sglang serve`, backed by `simulator.engine`.

It answers what gateways and sglang-router touch: the OpenAI endpoints (Responses with its store included),
Anthropic's Messages, tokenize and rerank (`simulator/replica_apis.py`), SGLang's native `/generate`, the
probes and info endpoints a router reads at registration (`/health`, `/server_info`, `/model_info`),
`/get_load`, `/flush_cache` and Prometheus `/metrics`, plus `/control/faults` for fault injection. Every
response carries `x-replica-id` (host:port) so a test can tell which replica served it.

Run one replica with `python -m simulator.replica --port 30001`, a fleet from one process with
`--ports 30001,30002,...` (one uvicorn server per port in one event loop, so a fleet costs one core).

Why the defaults:
- `--kv-capacity-tokens 400000`: an 80 GB H100 at `--mem-fraction-static 0.85` gives 68 GB to weights and
  KV; Llama-3.1-8B's bf16 weights take 16.1 GB, leaving ~52 GB, and at 128 KiB of KV per token that is
  ~400k tokens once activations and CUDA graphs have their share.
- `--max-running-requests 256`: the batch size up to which SGLang captures CUDA graphs on an H100; beyond
  it decode gains little throughput for much latency.
- Output length is the request's max tokens exactly (16 when unspecified): benchmarks need fixed lengths.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import logging
import signal
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from simulator.engine import Engine, EngineConfig, Generation, RequestTooLarge, embedding_vector
from simulator.faults import DroppingEventStream, Faults, FaultSettings
from simulator.replica_apis import AgentApis
from simulator.replica_requests import (
    ApiError,
    Prompt,
    ReplicaIdHeader,
    adapter_named,
    body_field,
    check_n,
    json_body,
    max_tokens,
    read_prompts,
    sse,
    usage_of,
)
from simulator.tokenizer import render_chat, tokenize

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class ReplicaConfig:
    port: int
    host: str = "127.0.0.1"
    model: str = "sim-llama-8b"
    engine: EngineConfig = field(default_factory=EngineConfig)
    embedding: bool = False         # embedding-model mode: /v1/embeddings only
    lora_adapters: tuple[str, ...] = ()  # LoRA adapters served beside `model`, each with its own prefix cache
    embedding_dim: int = 1024
    faults: FaultSettings = field(default_factory=FaultSettings)
    seed: int = 0                   # seeds the fault injector's random choices

    @property
    def replica_id(self) -> str:
        return f"{self.host}:{self.port}"


class _EngineCollector(Collector):
    """SGLang's metric names, read from the engine at scrape time (nothing to keep in sync)."""

    def __init__(self, engine: Engine, model: str, started_at_s: float) -> None:
        self.engine, self.model, self.started_at_s = engine, model, started_at_s

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        for name, kind, value, help_text in (
            ("sglang:num_running_reqs", GaugeMetricFamily, stats.running, "Running requests"),
            ("sglang:num_queue_reqs", GaugeMetricFamily, stats.queued, "Requests waiting to be scheduled"),
            ("sglang:token_usage", GaugeMetricFamily, stats.token_usage, "Fraction of the KV pool in use"),
            ("sglang:cache_hit_rate", GaugeMetricFamily, stats.cache_hit_rate, "Prefix cache hit rate"),
            ("sglang:prompt_tokens", CounterMetricFamily, stats.prompt_tokens_total, "Prompt tokens"),
            ("sglang:generation_tokens", CounterMetricFamily, stats.generation_tokens_total, "Generated tokens"),
            ("sglang:cached_tokens", CounterMetricFamily, stats.cached_tokens_total, "Prompt tokens from cache"),
            # Requests per replica behind a router that does not relay x-replica-id (loadtest/runner.py).
            ("sglang:num_requests", CounterMetricFamily, stats.requests_total, "Requests admitted"),
            # The simulator's own (tests read it): requests aborted because their client went away.
            ("replica:aborted_requests", CounterMetricFamily, stats.aborted_total, "Requests aborted"),
        ):
            family = kind(name, help_text, labels=["model_name"])
            family.add_metric([self.model], value)
            yield family
        # The standard process metric vLLM's Prometheus client exports: a restart moves it.
        yield GaugeMetricFamily("process_start_time_seconds", "Start time of the process since unix epoch in "
                                "seconds", value=self.started_at_s)


class _Replica:
    """The handlers of one replica and the parts they share; built once per app by `create_replica_app`."""

    def __init__(self, config: ReplicaConfig) -> None:
        self.config = config
        self.engine = Engine(config.engine)
        self.faults = Faults(config.faults, config.seed)
        self.registry = CollectorRegistry(auto_describe=False)
        started_at_s = time.time()  # per replica, though several share a process: each restarts alone
        self.registry.register(_EngineCollector(self.engine, config.model, started_at_s))
        self.created = int(started_at_s)
        self.apis = AgentApis(self)

    # --- inference ---------------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        body = await json_body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "'messages' must be a non-empty array of message objects", "messages")
        try:
            text = render_chat(messages, body_field(body, "tools", list))
        except TypeError as exc:
            raise ApiError(400, str(exc), "messages") from exc
        check_n(body)
        # sglang-router renames max_tokens to max_completion_tokens; OpenAI's SDK sends either.
        max_new = max_tokens(body, "max_completion_tokens", "max_tokens")
        stream = body_field(body, "stream", bool, False)
        include_usage = bool(body_field(body, "stream_options", dict, {}).get("include_usage"))
        [gen] = await self._generate([Prompt(tokenize(text), text)], max_new, self.adapter_of(body))
        rid = "chatcmpl-" + uuid.uuid4().hex
        if stream:
            return DroppingEventStream(self._openai_events(gen, rid, include_usage, chat=True),
                                       self.faults.settings.drop_after_chunks)
        if not await self._collect([gen], request):
            return Response(status_code=499)  # nobody to answer
        message = {"role": "assistant", "content": "".join(gen.output)}
        return JSONResponse({**self._head(rid, "chat.completion"), "usage": usage_of(gen), "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": "length"}]})

    async def completions(self, request: Request) -> Response:
        body = await json_body(request)
        prompts = read_prompts(body.get("prompt"), "prompt")
        check_n(body)
        stream = body_field(body, "stream", bool, False)
        if stream and len(prompts) > 1:
            raise ApiError(400, "streaming supports a single prompt", "prompt")
        include_usage = bool(body_field(body, "stream_options", dict, {}).get("include_usage"))
        gens = await self._generate(prompts, max_tokens(body, "max_tokens"), self.adapter_of(body))
        rid = "cmpl-" + uuid.uuid4().hex
        if stream:
            return DroppingEventStream(self._openai_events(gens[0], rid, include_usage, chat=False),
                                   self.faults.settings.drop_after_chunks)
        if not await self._collect(gens, request):
            return Response(status_code=499)  # nobody to answer
        usage = {key: sum(usage_of(gen)[key] for gen in gens) for key in ("prompt_tokens", "completion_tokens")}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        usage["prompt_tokens_details"] = {"cached_tokens": sum(gen.cached_tokens for gen in gens)}
        choices = [{"index": i, "text": "".join(gen.output), "logprobs": None, "finish_reason": "length"}
                   for i, gen in enumerate(gens)]
        return JSONResponse({**self._head(rid, "text_completion"), "choices": choices, "usage": usage})

    async def generate(self, request: Request) -> Response:
        body = await json_body(request)
        name = "input_ids" if body.get("input_ids") is not None else "text"
        prompts = read_prompts(body.get(name), name)
        batched = isinstance(body[name], list) and isinstance(body[name][0], (str, list))
        sampling = body_field(body, "sampling_params", dict, {})
        max_new = max_tokens(sampling, "max_new_tokens")
        stream = body_field(body, "stream", bool, False)
        if stream and batched:
            raise ApiError(400, "streaming supports a single prompt", "text")
        started = time.monotonic()
        gens = await self._generate(prompts, max_new, self.adapter_of(body))
        rid = body_field(body, "rid", str) or uuid.uuid4().hex
        if stream:
            return DroppingEventStream(self._generate_events(gens[0], rid, started),
                                       self.faults.settings.drop_after_chunks)
        if not await self._collect(gens, request):
            return Response(status_code=499)  # nobody to answer
        results = [{"text": "".join(gen.output), "meta_info": self._meta(gen, rid, started)} for gen in gens]
        return JSONResponse(results if batched else results[0])

    async def embeddings(self, request: Request) -> Response:
        body = await json_body(request)
        if not self.config.embedding:
            raise ApiError(400, f"{self.config.model} is a generation model and does not serve embeddings", "model")
        prompts = read_prompts(body.get("input"), "input")
        encoding = body_field(body, "encoding_format", str, "float")
        if encoding not in ("float", "base64"):
            raise ApiError(400, f"encoding_format must be 'float' or 'base64', got {encoding!r}", "encoding_format")
        dim = body_field(body, "dimensions", int, self.config.embedding_dim)
        gens = await self._admit(prompts, 0)  # prefill only: an embedding costs one forward pass
        if not await self._collect(gens, request):
            return Response(status_code=499)  # nobody to answer
        data = []
        for index, gen in enumerate(gens):
            vector = embedding_vector(gen.prompt_tokens, dim)
            # The OpenAI SDK asks for base64 by default: little-endian float32, as OpenAI sends it.
            encoded: Any = vector
            if encoding == "base64":
                encoded = base64.b64encode(struct.pack(f"<{dim}f", *vector)).decode()
            data.append({"object": "embedding", "index": index, "embedding": encoded})
        tokens = sum(len(gen.prompt_tokens) for gen in gens)
        return JSONResponse({"object": "list", "data": data, "model": self.config.model,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    def adapter_of(self, body: dict[str, Any]) -> str | None:
        """The LoRA adapter `body` asks for, None for the base model; 404 for a model not served here."""
        return adapter_named(body, self.config.model, self.config.lora_adapters)

    async def _generate(self, prompts: list[Prompt], max_new: int, adapter: str | None = None) -> list[Generation]:
        if self.config.embedding:
            raise ApiError(400, f"{self.config.model} is an embedding model and does not generate text", "model")
        return await self._admit(prompts, max_new, adapter)

    async def _admit(self, prompts: list[Prompt], max_new: int, adapter: str | None = None) -> list[Generation]:
        """Apply the injected faults, then queue every prompt; all or none are queued."""
        if self.faults.should_fail():
            raise ApiError(500, "Injected fault: internal server error", error_type="internal_server_error")
        await self.faults.before_response()
        gens: list[Generation] = []
        try:
            for prompt in prompts:
                gens.append(self.engine.submit(prompt.tokens, max_new, prompt.text, adapter))
        except RequestTooLarge as exc:
            for gen in gens:
                self.engine.abort(gen)
            raise ApiError(400, str(exc)) from exc
        return gens

    async def _collect(self, gens: list[Generation], request: Request) -> bool:
        """Run `gens` to their end; False when the client went away first. Its generations are then aborted, as
        vLLM and SGLang abort a request whose connection closed, and their slots go to the next requests."""
        async def run() -> None:
            for gen in gens:
                async for _ in gen.pieces():
                    pass

        async def client_gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        finished, gone = asyncio.ensure_future(run()), asyncio.ensure_future(client_gone())
        try:
            await asyncio.wait((finished, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (finished, gone):
                task.cancel()
            await asyncio.gather(finished, gone, return_exceptions=True)
            for gen in gens:
                self.engine.abort(gen)  # a no-op once finished
        if finished.cancelled():
            return False
        finished.result()  # raises what the generation raised
        return True

    def _head(self, rid: str, obj: str) -> dict[str, Any]:
        return {"id": rid, "object": obj, "created": int(time.time()), "model": self.config.model}

    def _meta(self, gen: Generation, rid: str, started: float) -> dict[str, Any]:
        done = len(gen.output) >= gen.max_new_tokens
        return {"id": rid, "prompt_tokens": len(gen.prompt_tokens), "completion_tokens": len(gen.output),
                "cached_tokens": gen.cached_tokens, "e2e_latency": round(time.monotonic() - started, 6),
                "finish_reason": {"type": "length", "length": len(gen.output)} if done else None}

    async def _openai_events(self, gen: Generation, rid: str, include_usage: bool, chat: bool
                             ) -> AsyncIterator[str]:
        """OpenAI's stream: a chunk per token (chat deltas, the first with the role), the finish, usage, DONE."""
        head = self._head(rid, "chat.completion.chunk" if chat else "text_completion")

        def chunk(piece: str | None, finish: str | None) -> str:
            if chat:
                delta = {} if piece is None else {"content": piece}
                if piece is not None and len(gen.output) == 1:
                    delta["role"] = "assistant"
                choice: dict[str, Any] = {"index": 0, "delta": delta}
            else:
                choice = {"index": 0, "text": piece or ""}
            return sse({**head, "choices": [{**choice, "logprobs": None, "finish_reason": finish}]})

        try:
            async for piece in gen.pieces():
                yield chunk(piece, None)
            yield chunk(None, "length")
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage_of(gen)})
            yield "data: [DONE]\n\n"
        finally:
            self.engine.abort(gen)

    async def _generate_events(self, gen: Generation, rid: str, started: float) -> AsyncIterator[str]:
        try:
            async for _ in gen.pieces():
                # SGLang's native stream repeats the whole text so far in every chunk.
                yield sse({"text": "".join(gen.output), "meta_info": self._meta(gen, rid, started)})
            yield "data: [DONE]\n\n"
        finally:
            self.engine.abort(gen)

    # --- probes, info, control ---------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if not self.faults.healthy:
            raise ApiError(503, "unhealthy (injected fault)", error_type="service_unavailable")
        return PlainTextResponse("OK")

    async def models(self, request: Request) -> Response:
        card = {"id": self.config.model, "object": "model", "created": self.created, "owned_by": "sglang",
                "root": self.config.model, "parent": None, "max_model_len": self.config.engine.max_context_tokens}
        # Adapters follow the base model, naming it as their parent, as vLLM and SGLang list them.
        adapters = [{"id": name, "object": "model", "created": self.created, "owned_by": "sglang", "root": name,
                     "parent": self.config.model, "max_model_len": None} for name in self.config.lora_adapters]
        return JSONResponse({"object": "list", "data": [card, *adapters]})

    async def server_info(self, request: Request) -> Response:
        cfg = self.config
        return JSONResponse({
            "served_model_name": cfg.model, "model_path": cfg.model, "tokenizer_path": cfg.model,
            "max_total_num_tokens": cfg.engine.kv_capacity_tokens, "tp_size": 1, "dp_size": 1,
            "max_running_requests": cfg.engine.max_running_requests, "is_embedding": cfg.embedding,
            "context_length": cfg.engine.max_context_tokens, "chunked_prefill_size": cfg.engine.chunked_prefill_tokens,
            "page_size": cfg.engine.block_tokens, "host": cfg.host, "port": cfg.port, "version": "simulated"})

    async def model_info(self, request: Request) -> Response:
        return JSONResponse({"model_path": self.config.model, "tokenizer_path": self.config.model,
                             "is_generation": not self.config.embedding})

    async def get_load(self, request: Request) -> Response:
        stats = self.engine.stats()
        return JSONResponse([{"dp_rank": 0, "num_reqs": stats.running + stats.queued,
                              "num_waiting_reqs": stats.queued, "num_tokens": stats.running_tokens}])

    async def flush_cache(self, request: Request) -> Response:
        if not self.engine.flush_cache():
            raise ApiError(400, "Cache not flushed: requests are queued or running")
        return PlainTextResponse("Cache flushed.")

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def control_faults(self, request: Request) -> Response:
        if request.method == "POST":
            try:
                settings = FaultSettings.from_json(await json_body(request), self.faults.settings)
            except ValueError as exc:
                raise ApiError(400, str(exc)) from exc
            self.faults.apply(settings)
            logger.info("%s: faults set to %s", self.config.replica_id, settings)
        return JSONResponse(self.faults.describe())

    def routes(self) -> list[Route]:
        get, post = ["GET"], ["POST"]
        return [
            Route("/v1/chat/completions", self.chat, methods=post),
            Route("/v1/completions", self.completions, methods=post),
            Route("/generate", self.generate, methods=post),
            Route("/v1/embeddings", self.embeddings, methods=post),
            *self.apis.routes(),
            Route("/v1/models", self.models, methods=get),
            *(Route(path, self.health, methods=get) for path in ("/health", "/health_generate", "/ready")),
            Route("/server_info", self.server_info, methods=get),
            Route("/get_server_info", self.server_info, methods=get),
            Route("/model_info", self.model_info, methods=get),
            Route("/get_model_info", self.model_info, methods=get),
            Route("/get_load", self.get_load, methods=get),
            Route("/flush_cache", self.flush_cache, methods=["GET", "POST"]),
            Route("/metrics", self.metrics, methods=get),
            Route("/control/faults", self.control_faults, methods=["GET", "POST"]),
        ]


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response(anthropic=request.url.path.startswith("/v1/messages"))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return ApiError(exc.status_code, str(exc.detail)).response(anthropic=request.url.path.startswith("/v1/messages"))


def create_replica_app(config: ReplicaConfig) -> Starlette:
    """One replica: its engine runs while the app's lifespan does."""
    replica = _Replica(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        replica.engine.start()
        logger.info("replica %s serving %s (KV %s tokens, time scale %s)", config.replica_id, config.model,
                    config.engine.kv_capacity_tokens, config.engine.time_scale)
        yield
        await replica.engine.stop()

    return Starlette(routes=replica.routes(), lifespan=lifespan,
                     middleware=[Middleware(ReplicaIdHeader, replica_id=config.replica_id)],
                     exception_handlers={ApiError: _api_error, HTTPException: _http_error})


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # serve_replicas stops all servers on one signal; uvicorn's per-server handlers would stop only one.
        yield


async def serve_replicas(configs: list[ReplicaConfig]) -> None:
    """Serve every replica from this event loop until SIGINT or SIGTERM, then shut all down cleanly."""
    servers = [_Server(uvicorn.Config(create_replica_app(c), host=c.host, port=c.port, log_config=None,
                                      access_log=False, lifespan="on", timeout_graceful_shutdown=5))
               for c in configs]

    def stop_all() -> None:
        for server in servers:
            server.should_exit = True

    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # not the main thread
            loop.add_signal_handler(signum, stop_all)
            handled.append(signum)
    try:
        await asyncio.gather(*(server.serve() for server in servers))
    finally:
        stop_all()
        for signum in handled:
            loop.remove_signal_handler(signum)


def _ports(text: str) -> list[int]:
    try:
        ports = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ports must be comma-separated integers, got {text!r}") from None
    if not ports:
        raise argparse.ArgumentTypeError("--ports needs at least one port")
    return ports


def _capacities(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()] or [0]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--kv-capacity-tokens must be comma-separated integers, got {text!r}") \
            from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def build_parser() -> argparse.ArgumentParser:
    defaults, faults = EngineConfig(), FaultSettings()
    p = argparse.ArgumentParser(
        prog="python -m simulator.replica", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="A simulated SGLang-compatible engine replica (Llama-3.1-8B on one H100, by default).")
    add = p.add_argument
    add("--host", default="127.0.0.1", help="address to listen on")
    add("--port", type=int, default=30000, help="TCP port of a single replica")
    add("--ports", type=_ports, default=None, help="comma-separated ports: one independent replica per port, "
        "all in this process (overrides --port)")
    add("--model", default="sim-llama-8b", help="model name served and reported")
    add("--kv-capacity-tokens", type=_capacities, default=str(defaults.kv_capacity_tokens),
        help="KV pool size in tokens (max_total_num_tokens); bounds the prefix cache and running requests. "
        "Comma-separated: one per --ports entry, for a fleet of unequal replicas")
    add("--max-running-requests", type=int, default=defaults.max_running_requests,
        help="requests decoded concurrently; more wait in the queue")
    add("--context-length", type=int, default=defaults.max_context_tokens,
        help="longest prompt plus output, in tokens")
    add("--time-scale", type=float, default=defaults.time_scale,
        help="real seconds per simulated second (0.01 runs 100x faster than a real GPU)")
    add("--embedding", action="store_true", help="embedding-model mode: serve /v1/embeddings, refuse generation")
    add("--embedding-dim", type=int, default=1024, help="embedding vector dimension")
    add("--lora-adapters", type=_names, default=(), help="comma-separated LoRA adapter names served beside "
        "--model: listed in /v1/models with the model as parent, named by requests as vLLM (model) or SGLang "
        "(model 'base:adapter', lora_path) name them, each with a prefix cache of its own")
    add("--error-rate", type=float, default=faults.error_rate,
        help="fault: fraction (0..1) of inference requests answered 500")
    add("--latency-ms", type=float, default=faults.latency_ms,
        help="fault: milliseconds of real time added before each inference response starts")
    add("--hang", action="store_true", help="fault: accept inference requests but never answer until cleared "
        "through POST /control/faults")
    add("--drop-after-chunks", type=int, default=faults.drop_after_chunks,
        help="fault: close a streaming response's connection after this many SSE chunks")
    add("--unhealthy-for-s", type=float, default=faults.unhealthy_for_s,
        help="fault: /health, /health_generate and /ready answer 503 for this many seconds after start")
    add("--seed", type=int, default=0, help="seed of the fault injector (replica i uses seed + i)")
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log verbosity")
    return p


def configs_from_args(args: argparse.Namespace) -> list[ReplicaConfig]:
    ports = args.ports or [args.port]
    capacities = args.kv_capacity_tokens
    if len(capacities) == 1:
        capacities = capacities * len(ports)
    elif len(capacities) != len(ports):
        raise ValueError(f"--kv-capacity-tokens gives {len(capacities)} capacities for {len(ports)} ports")
    faults = FaultSettings(error_rate=args.error_rate, latency_ms=args.latency_ms, hang=args.hang,
                           drop_after_chunks=args.drop_after_chunks, unhealthy_for_s=args.unhealthy_for_s)
    return [ReplicaConfig(port=port, host=args.host, model=args.model, engine=_engine_config(args, capacity),
                          embedding=args.embedding, embedding_dim=args.embedding_dim,
                          lora_adapters=args.lora_adapters, faults=faults, seed=args.seed + index)
            for index, (port, capacity) in enumerate(zip(ports, capacities, strict=True))]


def _engine_config(args: argparse.Namespace, kv_capacity_tokens: int) -> EngineConfig:
    return EngineConfig(kv_capacity_tokens=kv_capacity_tokens, max_running_requests=args.max_running_requests,
                        max_context_tokens=args.context_length, time_scale=args.time_scale)


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configs = configs_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve_replicas(configs))


if __name__ == "__main__":
    main()
