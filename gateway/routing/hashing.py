"""Chained block hashes of a routing text: the keys of the prefix index.

The text is cut into blocks of `block_chars` characters and block i is hashed with xxh3 seeded by the hash of
block i-1, so one 64-bit value names a block *and everything before it*. Two prompts share their first k hashes
exactly when they share their first k blocks, which lets the index look a prefix up one dict probe per block.

Default block size 64 characters: about 16 tokens at ~4 characters per token, the block size of vLLM's prefix
cache and the granularity llm-d hashes at. Smaller blocks predict partial matches more finely but cost more
hashes and index nodes per prompt (a 32k-character prompt is 500 blocks at 64); only full blocks are hashed,
as engines only reuse full blocks.
"""

from __future__ import annotations

import xxhash

DEFAULT_BLOCK_CHARS = 64
_ROOT_SEED = 0x5EED
# ASCII text is encoded this many characters at a time: a huge prompt costs one piece's copy, not its own size.
_ENCODE_CHARS = 1 << 20


def block_hashes(text: str, block_chars: int = DEFAULT_BLOCK_CHARS) -> list[int]:
    """Chained xxh3-64 hashes of the full `block_chars`-character blocks of `text`, in order."""
    hashes: list[int] = []
    seed = _ROOT_SEED
    digest = xxhash.xxh3_64_intdigest
    if text.isascii() and len(text) <= _ENCODE_CHARS:  # one character per byte: encode once and hash views of
        data = memoryview(text.encode("ascii"))         # it (the common case, ~3x faster)
        for start in range(0, len(data) - block_chars + 1, block_chars):
            seed = digest(data[start:start + block_chars], seed)
            hashes.append(seed)
        return hashes
    if text.isascii():
        return _long_ascii_hashes(text, block_chars)
    for start in range(0, len(text) - block_chars + 1, block_chars):
        seed = digest(text[start:start + block_chars].encode("utf-8", "surrogatepass"), seed)
        hashes.append(seed)
    return hashes


def _long_ascii_hashes(text: str, block_chars: int) -> list[int]:
    """`block_hashes` of an ASCII text longer than `_ENCODE_CHARS`, encoded a piece at a time: a 30 MB prompt
    costs a 1 MB copy, not a second 30 MB."""
    hashes: list[int] = []
    seed = _ROOT_SEED
    digest = xxhash.xxh3_64_intdigest
    piece_chars = block_chars * max(1, _ENCODE_CHARS // block_chars)  # whole blocks: pieces end where blocks do
    for offset in range(0, len(text), piece_chars):
        data = memoryview(text[offset:offset + piece_chars].encode("ascii"))
        for start in range(0, len(data) - block_chars + 1, block_chars):
            seed = digest(data[start:start + block_chars], seed)
            hashes.append(seed)
    return hashes
