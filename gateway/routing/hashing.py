"""Chained block hashes of a routing text: the keys of the prefix index.

The text is cut into blocks of `block_chars` characters and block i is hashed with xxh3 seeded by the hash of
block i-1, so one 64-bit value names a block *and everything before it*. Two prompts share their first k hashes
exactly when they share their first k blocks, which lets the index look a prefix up one dict probe per block.

Default block size 64 characters: about 16 tokens at ~4 characters per token, the block size of vLLM's prefix
cache and the granularity llm-d hashes at. Smaller blocks predict partial matches more finely but cost more
hashes and index nodes per prompt (a 32k-character prompt is 500 blocks at 64); only full blocks are hashed,
as engines only reuse full blocks.

Engines cache a prompt per model: vLLM adds a LoRA adapter to every block's hash, SGLang keys its radix tree by
it, and each model of a multi-model server has a cache of its own. So a request's chain starts from its model's
own seed (`namespace_seed` of the model's name; the router computes it once per name): the same text under two
models or adapters shares no hash. Every model is seeded by its name alone, whatever else the fleet serves, so a
model's hashes never change when a backend joins or lists another name, and every gateway instance sharing state
hashes alike. Another name of the same model merely predicts a miss where the engine would hit. The root seed
starts the chain of a request that names no model.
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


class PrefixHashes:
    """`block_hashes` for prompts that start as earlier ones did, without hashing the shared start again.

    Hashing costs a Python-level call per block (~0.1 us; ~50 us for a 32k-character prompt), and most prompts
    repeat an earlier one's start: a system prompt, a document, a conversation's history. Every
    `CHECKPOINT_BLOCKS` blocks, the chain so far is remembered under a 128-bit xxh3 digest of the text it covers
    (one streaming pass over the prompt at memory speed); a prompt's chain resumes from the furthest checkpoint
    it shares with one seen before. The digest names the text exactly (a collision is a 2^-128 chance), so the
    hashes are always those `block_hashes` gives. Bounded: past `max_checkpoints` everything is forgotten at
    once and rebuilt by the next prompts, which costs them what no memory would."""

    # A 32k-character prompt behind a known 32k-character prefix: ~16 us at 16 blocks (1 KB); at 8, ~24 us (more
    # checkpoints to digest); at 32, up to 31 blocks are hashed again.
    CHECKPOINT_BLOCKS = 16

    def __init__(self, block_chars: int = DEFAULT_BLOCK_CHARS, max_checkpoints: int = 32_768) -> None:
        self.block_chars = block_chars
        self.max_checkpoints = max_checkpoints
        self._chains: dict[int, list[int]] = {}  # digest of a checkpoint's text -> a chain through that checkpoint

    def of(self, text: str, seed: int = ROOT_SEED) -> list[int]:
        step = self.block_chars * self.CHECKPOINT_BLOCKS
        if not step <= len(text) <= _ENCODE_CHARS:  # too short to hold a checkpoint, or a giant kept off memory
            return block_hashes(text, self.block_chars, seed)
        ascii_bytes = memoryview(text.encode("ascii")) if text.isascii() else None  # sliced without copies
        digest = xxhash.xxh3_128(seed=seed)
        known, resumed = 0, None  # characters covered by the furthest checkpoint found, and its chain
        unknown: list[int] = []  # digests of the checkpoints after it
        for end in range(step, len(text) + 1, step):
            digest.update(ascii_bytes[end - step:end] if ascii_bytes is not None
                          else text[end - step:end].encode("utf-8", "surrogatepass"))
            key = digest.intdigest()
            chain = None if unknown else self._chains.get(key)
            if chain is not None:
                known, resumed = end, chain
            else:
                unknown.append(key)
        if resumed is None:
            hashes = block_hashes(text, self.block_chars, seed)
        else:
            blocks = known // self.block_chars
            hashes = resumed[:blocks] + block_hashes(text[known:], self.block_chars, resumed[blocks - 1])
        if len(self._chains) + len(unknown) > self.max_checkpoints:
            self._chains.clear()
        for key in unknown[:self.max_checkpoints]:
            self._chains[key] = hashes
        return hashes
