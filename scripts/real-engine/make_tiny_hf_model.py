#!/usr/bin/env python3
"""Write a tiny, random-weight Llama model in Hugging Face format, with a tokenizer trained here.

The vLLM counterpart of make_tiny_model.py (which writes GGUF for llama.cpp): the same corpus, special
tokens and ChatML template, so both engines chat alike. vLLM loads a model directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, chat_template.jinja), so this writes one with
`transformers` and `tokenizers`, touching no model hub. The model says nothing sensible; it only has to
tokenize any text, render chats, fill a KV cache and reuse cached prompt prefixes as a real model would.

Tokenizer: byte-level BPE (GPT-2 style), so any text, newlines and non-ASCII included, tokenizes; its
merges are learned from make_tiny_model.py's corpus (which runs out of merges at about 800 tokens).

Deterministic: the same script and library versions write the same bytes.

Needs: torch, transformers and tokenizers (setup-vllm.sh runs it with vLLM's own venv, which has all three).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from make_tiny_model import CHAT_TEMPLATE, CORPUS, SPECIAL

# Bump when the output changes (setup-vllm.sh also keys its cache on this file's hash).
MODEL_VERSION = 1

BOS, EOS, IM_END = "<s>", "</s>", "<|im_end|>"


def train_tokenizer(vocab_size: int):  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    # A prompt starts with <s>, as in Llama models; chat prompts rendered by the template then start <s><|im_start|>.
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=IM_END, unk_token=SPECIAL[0], pad_token=EOS,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_model(out: Path, *, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
                max_positions: int, vocab_size: int, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = train_tokenizer(vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,  # <|im_end|> ends an assistant turn, as in ChatML models
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "prefix-gateway.json").write_text(json.dumps({"make_tiny_hf_model": MODEL_VERSION, "seed": seed}))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out}: {len(tokenizer)} tokens, {layers} layers, hidden {hidden}, {size / 1e6:.1f} MB")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("output", type=Path, help="directory to write the model into (replaced if it exists)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    # head_dim 64: a size every vLLM attention backend supports
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--max-positions", type=int, default=4096)
    ap.add_argument("--vocab-size", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args(argv)
    write_model(a.output, hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads, ffn=a.ffn,
                max_positions=a.max_positions, vocab_size=a.vocab_size, seed=a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
