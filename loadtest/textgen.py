"""Seeded filler text of a given length in tokens, so workloads need no data download.

The simulated replica tokenises at about 4 characters per token (`simulator/tokenizer.py`), so a text of
`tokens` tokens is written as `4 * tokens` characters of words from a small list. Real engines tokenise
English at roughly the same rate, so the same scenario means about the same against a real deployment.
"""

from __future__ import annotations

import random

CHARS_PER_TOKEN = 4

WORDS = (  # noqa: SIM905 (a word list reads better as text than as 160 quoted words)
    "the of and to in is that for it as with was on be by at this from are or have an they which one you "
    "were all we her she there would their will when who him been has more if no out so said what up its "
    "about than into them can only other new some could time these two may then do first any like now my "
    "such make over our even most me state after also made many did must before back see through way where "
    "get much go well your know should down work year because come people just say each those take day good "
    "how long very still own find here thing give many under name system model cache token prefix request "
    "server replica answer question route memory batch queue latency policy tenant group session prompt "
    "engine kernel vector matrix layer attention decode prefill stream client gateway cluster node shard"
).split()


def words_text(rng: random.Random, tokens: int) -> str:
    """`tokens * CHARS_PER_TOKEN` characters of space-separated words drawn from `rng` (empty for 0)."""
    target = max(0, tokens) * CHARS_PER_TOKEN
    parts: list[str] = []
    size = 0
    while size < target:
        word = rng.choice(WORDS)
        parts.append(word)
        size += len(word) + 1
    return " ".join(parts)[:target]


def draw_length(rng: random.Random, tokens: int, range_ratio: float) -> int:
    """A length in [tokens * range_ratio, tokens], as SGLang's bench draws them (1.0 = always `tokens`)."""
    if tokens <= 0:
        return 0
    low = max(1, int(tokens * range_ratio))
    return rng.randint(low, tokens) if low < tokens else tokens
