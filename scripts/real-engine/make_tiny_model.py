#!/usr/bin/env python3
"""Write a tiny, random-weight Llama model as GGUF, with a real tokenizer.

The model exists only so that a real inference engine (llama.cpp's
llama-server) can be run on a 2-core CPU in tests: it says nothing sensible,
but it tokenizes any text, renders chats with a ChatML template, fills a KV
cache, and reuses cached prompt prefixes exactly as a real model would.

Everything is deterministic: the same script version writes the same bytes,
so the file's SHA-256 can be used as a cache key.

Tokenizer: SentencePiece-style ("llama" model in GGUF) with byte fallback,
so text that the learned pieces do not cover (newlines, any non-ASCII)
still tokenizes through the 256 <0xNN> byte tokens. The pieces are learned
here by a small BPE run over the built-in corpus below, which gives the
merge paths llama.cpp's SPM tokenizer needs to reach whole words.

Needs: numpy and the `gguf` package (setup.sh installs both into a private
virtual environment).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import numpy as np

# Bump when the output changes, so setup.sh regenerates cached models.
MODEL_VERSION = 1

SPACE = "\u2581"  # SentencePiece's visible space

# A few paragraphs of plain English, enough to learn pieces for common words.
CORPUS = """
The gateway sends each request to the replica that already holds the longest
prefix of the prompt in its cache. When two users share a long system prompt,
the second request can reuse the work done for the first one, and the time to
the first token drops. A replica that is busy or unhealthy is taken out of the
rotation until it answers its health check again. The load balancer keeps a
small tree of prompt prefixes for every replica and updates it after each
request. If the tree grows too large, the oldest entries are evicted first.
This is a test of the system. This is only a test. Hello, world! How are you
today? I am fine, thank you. What is the weather like? It is sunny and warm.
Please write a short story about a cat who lives in a library and reads books
at night. Once upon a time there was a small town by the sea where people
worked in the morning and told stories in the evening. The quick brown fox
jumps over the lazy dog. You are a helpful assistant. Answer the question in
one sentence. Summarize the following text. Translate the sentence into
French. The model runs on the CPU with a tiny random weight file so that the
tests can start a real server in a second. Each server has a number of slots,
and each slot has its own cache of tokens. A user asks a question, and the
assistant gives an answer; then the user asks another question about the same
topic, and the conversation goes on for many turns. Count from one to ten:
one, two, three, four, five, six, seven, eight, nine, ten. Monday, Tuesday,
Wednesday, Thursday, Friday, Saturday, Sunday. January, February, March,
April, May, June, July, August, September, October, November, December.
def main(): return 0 # code, data, json, http, server, client, token, cache
"""

SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
UNK_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(5)

# ChatML. Content may be a string or a list of OpenAI content parts.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


def learn_pieces(corpus: str, n_merges: int) -> tuple[list[str], list[str]]:
    """Return (base characters, merged pieces in merge order) by plain BPE."""
    words = collections.Counter(SPACE + w for w in corpus.split())
    base = sorted({ch for w in words for ch in w} | {chr(c) for c in range(33, 127)} | {SPACE})
    seqs = {w: list(w) for w in words}
    merges: list[str] = []
    known = set(base)
    for _ in range(n_merges):
        pairs: collections.Counter[tuple[str, str]] = collections.Counter()
        for w, freq in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:], strict=False):
                pairs[(a, b)] += freq
        if not pairs:
            break
        # Most frequent pair; ties broken by the pair itself, for determinism.
        (a, b), freq = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        piece = a + b
        for w in words:
            s = seqs[w]
            i, out = 0, []
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(piece)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
        if piece not in known:
            known.add(piece)
            merges.append(piece)
    return base, merges


def build_vocab(n_merges: int) -> tuple[list[str], list[float], list[int]]:
    tokens: list[str] = list(SPECIAL)
    scores: list[float] = [0.0] * len(SPECIAL)
    types: list[int] = [UNKNOWN] + [CONTROL] * (len(SPECIAL) - 1)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        scores.append(0.0)
        types.append(BYTE)
    base, merges = learn_pieces(CORPUS, n_merges)
    for ch in base:
        tokens.append(ch)
        scores.append(-1e6)  # never the target of a merge
        types.append(NORMAL)
    for rank, piece in enumerate(merges):
        tokens.append(piece)
        scores.append(-float(rank))  # earlier merge = higher priority
        types.append(NORMAL)
    assert len(tokens) == len(set(tokens)), "duplicate token"
    return tokens, scores, types


def write_model(path: str, *, n_embd: int, n_layer: int, n_head: int, n_head_kv: int,
                n_ff: int, n_ctx_train: int, n_merges: int, seed: int) -> None:
    import gguf  # imported late so --help works without it

    tokens, scores, types = build_vocab(n_merges)
    n_vocab = len(tokens)
    head_dim = n_embd // n_head
    rng = np.random.default_rng(seed)

    def rand(*shape: int, std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    tmp = path + ".tmp"
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name("prefix-gateway tiny random llama")
    w.add_description(f"random weights, for tests only; make_tiny_model.py v{MODEL_VERSION}")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(UNK_ID)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(IM_END_ID)  # ends an assistant turn, as in ChatML models
    w.add_eot_token_id(IM_END_ID)
    w.add_pad_token_id(EOS_ID)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    w.add_chat_template(CHAT_TEMPLATE)

    w.add_tensor("token_embd.weight", rand(n_vocab, n_embd))
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "attn_q.weight", rand(n_head * head_dim, n_embd))
        w.add_tensor(p + "attn_k.weight", rand(n_head_kv * head_dim, n_embd))
        w.add_tensor(p + "attn_v.weight", rand(n_head_kv * head_dim, n_embd))
        w.add_tensor(p + "attn_output.weight", rand(n_embd, n_head * head_dim))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "ffn_gate.weight", rand(n_ff, n_embd))
        w.add_tensor(p + "ffn_up.weight", rand(n_ff, n_embd))
        w.add_tensor(p + "ffn_down.weight", rand(n_embd, n_ff))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("output.weight", rand(n_vocab, n_embd))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    print(f"wrote {path}: {n_vocab} tokens, {n_layer} layers, n_embd {n_embd}, "
          f"{os.path.getsize(path) / 1e6:.1f} MB")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("output", help="path of the .gguf file to write")
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-head-kv", type=int, default=2)
    ap.add_argument("--n-ff", type=int, default=384)
    ap.add_argument("--n-ctx-train", type=int, default=32768)
    ap.add_argument("--n-merges", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--version", action="store_true", help="print MODEL_VERSION and exit")
    a = ap.parse_args(argv)
    if a.version:
        print(MODEL_VERSION)
        return 0
    write_model(a.output, n_embd=a.n_embd, n_layer=a.n_layer, n_head=a.n_head,
                n_head_kv=a.n_head_kv, n_ff=a.n_ff, n_ctx_train=a.n_ctx_train,
                n_merges=a.n_merges, seed=a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
