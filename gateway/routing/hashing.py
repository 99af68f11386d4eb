"""Chained block hashes of a routing text: the keys of the prefix index.

The text is cut into blocks of `block_chars` characters and block i is hashed with xxh3 seeded by the hash of
block i-1, so one 64-bit value names a block *and everything before it*. Two prompts share their first k hashes
exactly when they share their first k blocks, which lets the index look a prefix up one dict probe per block.

Default block size 64 characters: about 16 tokens at ~4 characters per token, the block size of vLLM's prefix
cache and the granularity llm-d hashes at. Smaller blocks predict partial matches more finely but cost more
hashes and index nodes per prompt (a 32k-character prompt is 500 blocks at 64); only full blocks are hashed,
as engines only reuse full blocks.

A prompt under a LoRA adapter is cached apart by the engines (vLLM adds the adapter to every block's hash, SGLang
keys its radix tree by it), so its chain starts from the adapter's own seed (`namespace_seed`): the same text
under two adapters shares no hash, and a base-model prompt hashes from the root seed as ever. Every model a
backend serves beside its first is seeded so (`Pool.model_seeds`): another model of a multi-model server has a
cache of its own too, and another name of the same model merely predicts a miss where the engine would hit.
"""

from __future__ import annotations

import xxhash

DEFAULT_BLOCK_CHARS = 64
ROOT_SEED = 0x5EED
# ASCII text is encoded this many characters at a time: a huge prompt costs one piece's copy, not its own size.
_ENCODE_CHARS = 1 << 20


def namespace_seed(name: str) -> int:
    """The seed of the chains cached under the model `name` (a LoRA adapter, say), the same in every gateway
    instance."""
    return xxhash.xxh3_64_intdigest(name.encode("utf-8", "surrogatepass"), ROOT_SEED)


def block_hashes(text: str, block_chars: int = DEFAULT_BLOCK_CHARS, seed: int = ROOT_SEED) -> list[int]:
    """Chained xxh3-64 hashes of the full `block_chars`-character blocks of `text`, in order, the first seeded
    with `seed`."""
    digest = xxhash.xxh3_64_intdigest
    if text.isascii() and len(text) <= _ENCODE_CHARS:  # one character per byte: encode once and hash slices of
        data = text.encode("ascii")                     # it (the common case, ~3x faster)
        return [seed := digest(data[start:start + block_chars], seed)
                for start in range(0, len(data) - block_chars + 1, block_chars)]
    if text.isascii():
        return _long_ascii_hashes(text, block_chars, seed)
    return [seed := digest(text[start:start + block_chars].encode("utf-8", "surrogatepass"), seed)
            for start in range(0, len(text) - block_chars + 1, block_chars)]


def _long_ascii_hashes(text: str, block_chars: int, seed: int) -> list[int]:
    """`block_hashes` of an ASCII text longer than `_ENCODE_CHARS`, encoded a piece at a time: a 30 MB prompt
    costs a 1 MB copy, not a second 30 MB."""
    hashes: list[int] = []
    digest = xxhash.xxh3_64_intdigest
    piece_chars = block_chars * max(1, _ENCODE_CHARS // block_chars)  # whole blocks: pieces end where blocks do
    for offset in range(0, len(text), piece_chars):
        data = text[offset:offset + piece_chars].encode("ascii")
        hashes += [seed := digest(data[start:start + block_chars], seed)
                   for start in range(0, len(data) - block_chars + 1, block_chars)]
    return hashes
