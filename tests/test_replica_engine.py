"""The replica's timing model, measured on its own virtual clock so results do not depend on machine speed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from simulator.engine import Engine, EngineConfig, Generation, RequestTooLarge
from simulator.tokenizer import tokenize

T = TypeVar("T")


def run(test: Callable[[Engine], Awaitable[T]], **overrides: object) -> T:
    """Run `test` against a started engine with time_scale 0: the loop never sleeps, the clock still counts."""
    async def main() -> T:
        engine = Engine(EngineConfig(time_scale=0.0, **overrides))  # type: ignore[arg-type]
        engine.start()
        try:
            return await asyncio.wait_for(test(engine), timeout=20)
        finally:
            await engine.stop()
    return asyncio.run(main())


async def finish(gen: Generation) -> str:
    return "".join([piece async for piece in gen.pieces()])


def prompt(tokens: int, salt: int = 0) -> list[int]:
    return [(salt * 1_000_003 + i) % 50_000 for i in range(tokens)]


def test_cached_prompt_has_a_much_shorter_ttft() -> None:
    async def scenario(engine: Engine) -> tuple[Generation, Generation]:
        cold = engine.submit(prompt(4000), 8)
        await finish(cold)
        warm = engine.submit(prompt(4000), 8)
        await finish(warm)
        return cold, warm

    cold, warm = run(scenario)
    assert cold.cached_tokens == 0 and warm.cached_tokens >= 3984
    assert cold.ttft_s is not None and warm.ttft_s is not None
    assert warm.ttft_s * 10 < cold.ttft_s
    # ~4000 tokens at 25k tokens/s, plus attention and overhead: the order of a real H100.
    assert 0.1 < cold.ttft_s < 0.5


def test_output_is_exactly_max_tokens_and_deterministic() -> None:
    async def scenario(engine: Engine) -> list[str]:
        return [await finish(engine.submit(prompt(100, salt), 7)) for salt in (1, 1, 2)]

    first, again, other = run(scenario)
    assert len(first.split()) == 7
    assert first == again and first != other


def test_requests_beyond_max_running_wait_in_the_queue() -> None:
    async def scenario(engine: Engine) -> tuple[list[Generation], int, int]:
        gens = [engine.submit(prompt(200, salt), 20) for salt in range(4)]
        await asyncio.wait_for(gens[0].scheduled.wait(), 5)
        await asyncio.sleep(0)
        stats = engine.stats()
        await asyncio.gather(*(finish(gen) for gen in gens))
        return gens, stats.running, stats.queued

    gens, running, queued = run(scenario, max_running_requests=2)
    assert (running, queued) == (2, 2)
    first, _, third, _ = gens
    assert first.finish_clock_s is not None and third.ttft_s is not None and first.ttft_s is not None
    # The third starts only when one of the first two has decoded all 20 tokens.
    assert third.first_token_clock_s is not None and third.first_token_clock_s > first.finish_clock_s
    assert third.ttft_s > 5 * first.ttft_s


def test_full_kv_pool_queues_requests_that_do_not_fit() -> None:
    async def scenario(engine: Engine) -> tuple[Generation, Generation]:
        big = engine.submit(prompt(700), 100)
        second = engine.submit(prompt(300, 1), 100)
        await asyncio.gather(finish(big), finish(second))
        return big, second

    big, second = run(scenario, kv_capacity_tokens=1000)
    assert big.finish_clock_s is not None and second.first_token_clock_s is not None
    assert second.first_token_clock_s >= big.finish_clock_s


def test_decode_slows_as_the_batch_grows() -> None:
    async def one_step_s(engine: Engine, batch: int) -> float:
        gens = [engine.submit(prompt(64, salt), 2) for salt in range(batch)]
        await asyncio.gather(*(finish(gen) for gen in gens))
        return max(gen.finish_clock_s - gen.first_token_clock_s for gen in gens)  # type: ignore[operator]

    async def scenario(engine: Engine) -> tuple[float, float]:
        return await one_step_s(engine, 1), await one_step_s(engine, 200)

    single, batched = run(scenario)
    assert batched > single * 1.5


def test_long_prompt_is_prefilled_in_chunks_without_blocking_admission() -> None:
    async def scenario(engine: Engine) -> Generation:
        gen = engine.submit(prompt(20_000), 1)
        await finish(gen)
        return gen

    gen = run(scenario, chunked_prefill_tokens=4096)
    assert gen.ttft_s is not None and gen.ttft_s > 20_000 / 25_000


def test_counters_track_prompt_cached_and_generated_tokens() -> None:
    async def scenario(engine: Engine) -> Engine:
        for _ in range(2):
            await finish(engine.submit(prompt(160), 5))
        return engine

    stats = run(scenario).stats()
    assert stats.prompt_tokens_total == 320
    assert stats.cached_tokens_total == 159          # the last prompt token is always recomputed
    assert stats.generation_tokens_total == 10
    assert stats.cache_hit_rate == pytest.approx(159 / 320)
    assert (stats.running, stats.queued, stats.token_usage) == (0, 0, 0.0)


def test_next_turn_hits_the_previous_answer() -> None:
    async def scenario(engine: Engine) -> tuple[Generation, str]:
        text = "System prompt. " * 40 + "Question?"
        answer = await finish(engine.submit(tokenize(text), 30, text))
        follow = text + answer + " And a follow-up question."
        return engine.submit(tokenize(follow), 4, follow), answer

    async def both(engine: Engine) -> tuple[Generation, str]:
        gen, answer = await scenario(engine)
        await finish(gen)
        return gen, answer

    gen, answer = run(both)
    assert gen.cached_tokens >= (len("System prompt. " * 40 + "Question?") + len(answer)) // 4 - 16


def test_abort_frees_the_slot_for_the_next_request() -> None:
    async def scenario(engine: Engine) -> Generation:
        stuck = engine.submit(prompt(100), 100_000)
        await stuck.scheduled.wait()
        engine.abort(stuck)
        after = engine.submit(prompt(100, 3), 2)
        await finish(after)
        return after

    assert run(scenario, max_running_requests=1).finished


def test_request_larger_than_the_context_is_refused() -> None:
    async def scenario(engine: Engine) -> None:
        with pytest.raises(RequestTooLarge, match="maximum context length"):
            engine.submit(prompt(1000), 100)

    run(scenario, max_context_tokens=1024)


def test_time_scale_turns_model_seconds_into_real_sleep() -> None:
    async def scenario(engine: Engine) -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await finish(engine.submit(prompt(8000), 1))
        return loop.time() - start, engine.clock_s

    async def main() -> tuple[float, float]:
        engine = Engine(EngineConfig(time_scale=0.1))
        engine.start()
        try:
            return await scenario(engine)
        finally:
            await engine.stop()

    wall_s, model_s = asyncio.run(main())
    assert wall_s >= model_s * 0.1 * 0.9


def test_locked_and_reserved_tokens_never_exceed_the_pool_under_random_load() -> None:
    import random

    capacity = 3000

    async def scenario(engine: Engine) -> int:
        rng = random.Random(11)
        shared = prompt(600, 99)
        gens: list[Generation] = []
        worst = 0
        for i in range(120):
            tokens = shared[:rng.randrange(0, 600)] + prompt(rng.randrange(1, 900), i)
            gens.append(engine.submit(tokens, rng.randrange(1, 60)))
            if rng.random() < 0.1:
                engine.abort(rng.choice(gens))
            for _ in range(rng.randrange(0, 4)):
                await asyncio.sleep(0)
                worst = max(worst, engine.cache.locked_tokens + engine._reserved_tokens)
                assert engine.cache.used_tokens <= capacity
        await asyncio.gather(*(finish(gen) for gen in gens))
        assert engine.cache.locked_tokens == 0 and engine._reserved_tokens == 0
        return worst

    worst = run(scenario, kv_capacity_tokens=capacity, max_running_requests=8)
    assert 0 < worst <= capacity


def test_a_prompt_cached_under_one_adapter_is_cached_under_no_other() -> None:
    async def scenario(engine: Engine) -> list[int]:
        cached = []
        for adapter in ("sql", "sql", "chat", None):
            gen = engine.submit(prompt(512), 1, adapter=adapter)
            await finish(gen)
            cached.append(gen.cached_tokens)
        return cached

    assert run(scenario) == [0, 511, 0, 0]  # a fully cached prompt still computes its last token
