"""The timing and scheduling model of one simulated engine replica (one GPU, one scheduler loop).

The loop works like SGLang's with its defaults (`--schedule-policy fcfs`, chunked prefill):

- Requests wait in a FIFO queue. The head is admitted when fewer than `max_running_requests` are running and
  the KV pool can hold its uncached prompt plus all its output tokens; admission stops at the first request
  that does not fit (no overtaking), so a full pool shows up as queueing and long time-to-first-token.
- At admission the prompt is matched against the prefix cache; only the uncached tokens are prefilled.
- Each iteration runs either one prefill batch (new tokens up to `chunked_prefill_tokens`; a longer prompt is
  spread over several iterations) or, when nothing waits to be prefilled, one decode step for every running
  request. Prefill has priority and decode stalls meanwhile, as in SGLang without mixed chunking. The last
  prefill chunk yields a request's first output token.
- KV accounting, as in SGLang's pool: a running request locks its cached prefix (locked blocks cannot be
  evicted) and reserves the tokens it still has to compute, prompt and output. Locked plus reserved tokens
  never exceed the pool; unlocked cached prefixes fill the rest and are evicted (LRU leaves) to make room.
  After prefill the prompt's full blocks are cached and locked, so an identical request arriving meanwhile
  hits; at the end the prompt and its output are cached and unlocked, so the next turn of a conversation
  hits its history.

Durations are model seconds; the loop sleeps `duration * time_scale` of real time and adds `duration` to
`clock_s`, a virtual clock that only advances with work. A request's `ttft_s` is measured on that clock, so
tests can compare cached and uncached prompts without depending on the machine's speed.

Defaults model Llama-3.1-8B-Instruct in bf16 on one H100 SXM 80 GB (989 TFLOP/s dense bf16, 3.35 TB/s HBM):

- Weights: 8.03 B parameters x 2 bytes = 16.1 GB. KV per token: 2 (K, V) x 32 layers x 8 KV heads x 128 dims
  x 2 bytes = 128 KiB.
- `prefill_tokens_per_s` 25,000: a token costs 2 x 8.03 B = 16 GFLOP in the dense layers; at ~40 % of peak
  (what large-batch prefill reaches in practice) that is ~25k tokens/s, i.e. ~80 ms for a 2k-token prompt.
- `prefill_attention_s_per_token_pair` 1.3e-9: attention adds 4 x 32 layers x 4096 = 0.52 MFLOP per (new
  token, context token) pair at the same ~400 TFLOP/s; it is why a long cached context is not quite free.
- `prefill_overhead_s` 5 ms: scheduling, tokenizer hand-off and kernel launches per prefill batch.
- `decode_base_s` 6.5 ms: a decode step reads all weights once: 16.1 GB / (3.35 TB/s x ~75 % achieved) =
  6.4 ms, i.e. ~150 tokens/s for a single stream, in line with published single-request numbers.
- `decode_per_request_s` 30 us: per-sequence sampling, detokenisation and the batch's extra matmul rows.
- `decode_per_context_token_s` 52 ns: reading one token's 128 KiB of KV at ~2.5 TB/s; a batch of 64 requests
  with 2k tokens of context adds ~6.7 ms, so a step takes ~15 ms -- decode slows as the batch grows.
- `chunked_prefill_tokens` 8192: SGLang's default chunked-prefill size on 80 GB GPUs.
- `max_running_requests` 256 and `kv_capacity_tokens` 400,000: see `simulator/replica.py`, where they are set.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import math
import random
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from simulator.kvcache import LockedPrefix, PrefixKVCache
from simulator.tokenizer import tokenize

logger = logging.getLogger(__name__)

_WORDS = (
    "the", "model", "cache", "prefix", "token", "answer", "replica", "gateway", "request", "batch", "memory",
    "latency", "is", "a", "of", "and", "to", "in", "for", "with", "fast", "warm", "cold", "shared", "prompt",
    "route", "load", "block", "queue", "decode", "prefill", "result",
)


@dataclass(frozen=True)
class EngineConfig:
    kv_capacity_tokens: int = 400_000
    max_running_requests: int = 256
    max_context_tokens: int = 131_072          # Llama-3.1's context window
    block_tokens: int = 16
    chunked_prefill_tokens: int = 8192
    prefill_tokens_per_s: float = 25_000.0
    prefill_attention_s_per_token_pair: float = 1.3e-9
    prefill_overhead_s: float = 0.005
    decode_base_s: float = 0.0065
    decode_per_request_s: float = 0.00003
    decode_per_context_token_s: float = 5.2e-8
    time_scale: float = 1.0                    # real seconds slept per model second

    def __post_init__(self) -> None:
        for name in ("kv_capacity_tokens", "max_running_requests", "max_context_tokens", "block_tokens",
                     "chunked_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.time_scale < 0:
            raise ValueError(f"time_scale must be >= 0, got {self.time_scale!r}")


@dataclass(frozen=True)
class EngineStats:
    running: int
    queued: int
    running_tokens: int
    token_usage: float          # running requests' KV tokens / capacity, 0..1
    cache_hit_rate: float       # cached prompt tokens / prompt tokens, since start
    prompt_tokens_total: int
    cached_tokens_total: int
    generation_tokens_total: int
    aborted_total: int = 0      # requests dropped before their end because their client went away
    requests_total: int = 0     # requests admitted since start


class RequestTooLarge(ValueError):
    """The prompt plus its output cannot fit the context window or the KV pool."""


def output_piece(seed: int, position: int) -> str:
    """The text of output token `position` for a prompt whose seed is `seed`: a word, space-separated."""
    word = _WORDS[zlib.crc32(position.to_bytes(4, "little"), seed) % len(_WORDS)]
    return word if position == 0 else " " + word


def embedding_vector(tokens: list[int], dim: int) -> list[float]:
    """A deterministic unit vector for `tokens`, the simulated embedding model's output."""
    digest = hashlib.blake2b(repr(tokens).encode(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "little"))
    vector = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


class Generation:
    """One request inside the engine: its accounting, and the output pieces as they are decoded."""

    def __init__(self, prompt_tokens: list[int], max_new_tokens: int, prompt_text: str | None, clock_s: float,
                 namespace: int = 0) -> None:
        self.prompt_tokens = prompt_tokens
        self.namespace = namespace   # the prefix cache's namespace: its LoRA adapter's, 0 for the base model
        self.max_new_tokens = max_new_tokens
        self.prompt_text = prompt_text
        self.seed = zlib.crc32(repr(prompt_tokens[-64:]).encode()) ^ len(prompt_tokens)
        self.cached_tokens = 0
        self.prefilled = 0           # prompt tokens computed or found cached so far
        self.reserved_tokens = 0     # KV tokens held outside the cache: still to compute, or the partial block
        self.locked: LockedPrefix | None = None
        self.output: list[str] = []
        self.arrival_clock_s = clock_s
        self.first_token_clock_s: float | None = None
        self.finish_clock_s: float | None = None
        self.scheduled = asyncio.Event()   # set once the prefix match is known (cached_tokens is final)
        self._pieces: asyncio.Queue[str | None] = asyncio.Queue()

    @property
    def ttft_s(self) -> float | None:
        """Model seconds from arrival to the first output token."""
        return None if self.first_token_clock_s is None else self.first_token_clock_s - self.arrival_clock_s

    @property
    def finished(self) -> bool:
        return self.finish_clock_s is not None

    async def pieces(self) -> AsyncIterator[str]:
        """Output text pieces, one per decoded token, as the engine produces them."""
        while (piece := await self._pieces.get()) is not None:
            yield piece

    def _emit(self, clock_s: float) -> None:
        piece = output_piece(self.seed, len(self.output))
        self.output.append(piece)
        if self.first_token_clock_s is None:
            self.first_token_clock_s = clock_s
        self._pieces.put_nowait(piece)

    def _finish(self, clock_s: float) -> None:
        self.finish_clock_s = clock_s
        self._pieces.put_nowait(None)

    def cache_sequence(self) -> list[int]:
        """Tokens to keep cached when the request ends: the prompt and what it generated."""
        if self.prompt_text is not None:
            # Re-tokenised as one text, the way the next turn's prompt (which contains this answer) will be.
            return tokenize(self.prompt_text + "".join(self.output))
        return self.prompt_tokens + [zlib.crc32(piece.encode()) for piece in self.output]


class Engine:
    """One replica's scheduler. `start()` runs the loop as a task; `submit()` queues a request."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.cache = PrefixKVCache(config.kv_capacity_tokens, config.block_tokens)
        self.clock_s = 0.0
        self._waiting: collections.deque[Generation] = collections.deque()
        self._prefilling: list[Generation] = []
        self._running: list[Generation] = []
        self._reserved_tokens = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._prompt_tokens_total = 0
        self._cached_tokens_total = 0
        self._generation_tokens_total = 0
        self._aborted_total = 0
        self._requests_total = 0
        self._namespaces: dict[str, int] = {}

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="engine-scheduler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for gen in [*self._waiting, *self._prefilling, *self._running]:
            gen._finish(self.clock_s)

    def submit(self, prompt_tokens: list[int], max_new_tokens: int, prompt_text: str | None = None,
               adapter: str | None = None) -> Generation:
        """Queue a request (under a LoRA `adapter`, if named); raises RequestTooLarge when it could never be
        admitted."""
        total = len(prompt_tokens) + max_new_tokens
        if total > self.config.max_context_tokens:
            raise RequestTooLarge(
                f"This model's maximum context length is {self.config.max_context_tokens} tokens. However, you "
                f"requested {total} tokens ({len(prompt_tokens)} in the messages, {max_new_tokens} in the completion).")
        if total > self.config.kv_capacity_tokens:
            raise RequestTooLarge(
                f"The request needs {total} KV tokens; the pool holds {self.config.kv_capacity_tokens}.")
        gen = Generation(prompt_tokens, max_new_tokens, prompt_text, self.clock_s, self._namespace(adapter))
        self._waiting.append(gen)
        self._wake.set()
        return gen

    def _namespace(self, adapter: str | None) -> int:
        """The prefix-cache namespace of `adapter`: one of its own, as vLLM and SGLang cache per adapter."""
        if adapter is None:
            return 0
        return self._namespaces.setdefault(adapter, -1 - len(self._namespaces))

    def abort(self, gen: Generation) -> None:
        """Drop a request whose client went away; frees its slot and KV reservation."""
        if gen.finished:
            return
        self._aborted_total += 1
        if gen in self._waiting:
            self._waiting.remove(gen)
        for group in (self._prefilling, self._running):
            if gen in group:
                group.remove(gen)
        self._release(gen)
        gen._finish(self.clock_s)

    def flush_cache(self) -> bool:
        """Empty the prefix cache; like SGLang, only when no request is queued or running."""
        if self._waiting or self._prefilling or self._running:
            return False
        self.cache.clear()
        return True

    def stats(self) -> EngineStats:
        active = [*self._prefilling, *self._running]
        running_tokens = sum(gen.prefilled + len(gen.output) for gen in active)
        prompt_total = self._prompt_tokens_total
        return EngineStats(
            running=len(active), queued=len(self._waiting), running_tokens=running_tokens,
            token_usage=min(1.0, running_tokens / self.config.kv_capacity_tokens),
            cache_hit_rate=self._cached_tokens_total / prompt_total if prompt_total else 0.0,
            prompt_tokens_total=prompt_total, cached_tokens_total=self._cached_tokens_total,
            generation_tokens_total=self._generation_tokens_total, aborted_total=self._aborted_total,
            requests_total=self._requests_total)

    async def _loop(self) -> None:
        while True:
            batch = self._next_prefill_batch()
            if batch:
                await self._prefill(batch)
            elif self._running:
                await self._decode_step()
            else:
                # Nothing admissible: sleep until a request arrives (a running one always ends eventually).
                self._wake.clear()
                await self._wake.wait()

    def _next_prefill_batch(self) -> list[tuple[Generation, int]]:
        """(request, new tokens to compute now) pairs within the chunked-prefill budget, FCFS."""
        budget = self.config.chunked_prefill_tokens
        batch: list[tuple[Generation, int]] = []
        for gen in self._prefilling:
            chunk = min(budget, len(gen.prompt_tokens) - gen.prefilled)
            if chunk <= 0:
                break
            batch.append((gen, chunk))
            budget -= chunk
        while budget > 0 and self._waiting and self._admit(self._waiting[0]):
            gen = self._waiting.popleft()
            chunk = min(budget, len(gen.prompt_tokens) - gen.prefilled)
            batch.append((gen, chunk))
            budget -= chunk
        return batch

    def _admit(self, gen: Generation) -> bool:
        if len(self._prefilling) + len(self._running) >= self.config.max_running_requests:
            return False
        locked = self.cache.lock(gen.prompt_tokens, gen.namespace)
        # A fully cached prompt still recomputes its last token, which produces the first output token.
        cached = min(locked.tokens, len(gen.prompt_tokens) - 1) if gen.prompt_tokens else 0
        need = len(gen.prompt_tokens) - cached + gen.max_new_tokens
        if self.cache.locked_tokens + self._reserved_tokens + need > self.config.kv_capacity_tokens:
            self.cache.unlock(locked)
            return False
        gen.locked = locked
        gen.cached_tokens = gen.prefilled = cached
        gen.reserved_tokens = need
        self._reserved_tokens += need
        self._prompt_tokens_total += len(gen.prompt_tokens)
        self._requests_total += 1
        self._cached_tokens_total += cached
        self._prefilling.append(gen)
        self._fit_cache()
        gen.scheduled.set()
        return True

    async def _prefill(self, batch: list[tuple[Generation, int]]) -> None:
        cfg = self.config
        new_tokens = sum(chunk for _, chunk in batch)
        pairs = sum(chunk * (gen.prefilled + chunk / 2) for gen, chunk in batch)
        await self._spend(cfg.prefill_overhead_s + new_tokens / cfg.prefill_tokens_per_s
                          + pairs * cfg.prefill_attention_s_per_token_pair)
        for gen, chunk in batch:
            if gen.finished:
                continue  # aborted while the batch ran
            gen.prefilled += chunk
            if gen.prefilled < len(gen.prompt_tokens):
                continue
            self._prefilling.remove(gen)
            self._cache_prompt(gen)
            if gen.max_new_tokens == 0:
                self._complete(gen)
                continue
            self._running.append(gen)
            self._step_output(gen)
        self._fit_cache()

    async def _decode_step(self) -> None:
        cfg = self.config
        batch = list(self._running)
        context = sum(len(gen.prompt_tokens) + len(gen.output) for gen in batch)
        await self._spend(cfg.decode_base_s + cfg.decode_per_request_s * len(batch)
                          + cfg.decode_per_context_token_s * context)
        for gen in batch:
            if not gen.finished:
                self._step_output(gen)

    def _step_output(self, gen: Generation) -> None:
        gen._emit(self.clock_s)
        self._generation_tokens_total += 1
        if len(gen.output) >= gen.max_new_tokens:
            self._running.remove(gen)
            self._complete(gen)

    def _complete(self, gen: Generation) -> None:
        self._release(gen)  # first, so the finished request's blocks may make room for its own output
        self.cache.insert(gen.cache_sequence(), gen.namespace)
        self._fit_cache()
        gen._finish(self.clock_s)

    async def _spend(self, duration_s: float) -> None:
        await asyncio.sleep(duration_s * self.config.time_scale)
        self.clock_s += duration_s

    def _cache_prompt(self, gen: Generation) -> None:
        """Move the prompt's full blocks from the reservation into the cache, locked while gen runs."""
        self._reserved_tokens -= gen.reserved_tokens
        gen.reserved_tokens = 0
        self.cache.insert(gen.prompt_tokens, gen.namespace)
        old = gen.locked
        gen.locked = self.cache.lock(gen.prompt_tokens, gen.namespace)
        if old is not None:
            self.cache.unlock(old)
        gen.reserved_tokens = len(gen.prompt_tokens) - gen.locked.tokens + gen.max_new_tokens
        self._reserved_tokens += gen.reserved_tokens

    def _release(self, gen: Generation) -> None:
        self._reserved_tokens -= gen.reserved_tokens
        gen.reserved_tokens = 0
        if gen.locked is not None:
            self.cache.unlock(gen.locked)
            gen.locked = None

    def _fit_cache(self) -> None:
        """Evict cached prefixes until the cache and the running requests' reservations fit the pool."""
        excess = self.cache.used_tokens + self._reserved_tokens - self.config.kv_capacity_tokens
        if excess > 0:
            self.cache.evict(excess)
