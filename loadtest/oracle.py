"""The hit rate an ideal router could reach: every request through one cache of the fleet's total capacity.

The requests are replayed in the order they were sent, rendered with the replica's own chat template and
tokenizer and cached with the replica's own cache model (`simulator.kvcache`), so the oracle and the fleet
count hits the same way. One big cache is an upper bound for any placement on N caches of 1/N the size:
nothing is duplicated across replicas and no request misses a prefix that another replica holds.

Each prompt is looked up, then inserted together with its answer, as an engine caches a finished request
(the next round of a conversation renders the answer right after this prompt, so it is a cached prefix).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from simulator.kvcache import PrefixKVCache
from simulator.tokenizer import render_chat, tokenize


@dataclass(frozen=True)
class OracleRequest:
    prompt: str          # the rendered prompt text
    answer: str = ""     # generated text, cached after the prompt


@dataclass(frozen=True)
class OracleResult:
    prompt_tokens: int
    cached_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def oracle_hit_rate(requests: Iterable[OracleRequest], capacity_tokens: int, block_tokens: int = 16
                    ) -> OracleResult:
    cache = PrefixKVCache(capacity_tokens, block_tokens)
    prompt_total = cached_total = 0
    for request in requests:
        tokens = tokenize(request.prompt)
        prompt_total += len(tokens)
        cached_total += cache.lookup(tokens)
        cache.insert(tokenize(request.prompt + request.answer) if request.answer else tokens)
    return OracleResult(prompt_total, cached_total)


def chat_request(messages: Iterable[dict[str, str]], answer: str = "") -> OracleRequest:
    return OracleRequest(render_chat(list(messages)), answer)
