"""A stand-in tokenizer for `--load-format dummy` when the model folder holds only
config.json (a benchmark of a real model's shape where no tokenizer files exist).

Byte-level: the 256 byte symbols first (any text encodes, one token per byte), then filler
tokens up to the model's vocabulary size so every id the random weights sample decodes; the
config's first end-of-sequence id is a special `<|endoftext|>`. No chat template: chat
requests get a 400 naming /v1/completions. Only ever used with random weights.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.tokenizer import Tokenizer

log = logging.getLogger("tessera.engine")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
EOS = "<|endoftext|>"


def has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def byte_level_tokenizer(vocab_size: int, eos_token_id: int | None) -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    for ch in alphabet[: max(vocab_size, 1)]:
        vocab[ch] = len(vocab)
    for i in range(len(vocab), vocab_size):
        vocab[EOS if i == eos_token_id else f"<|dummy_{i}|>"] = i
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    eos = EOS if EOS in vocab else None
    if eos is not None:
        rust.add_special_tokens([eos])
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rust, eos_token=eos))


def load_tokenizer(
    tokenizer: str | None, model_dir: Path, load_format: str, vocab_size: int, eos: int | None
) -> Tokenizer:
    """The model's tokenizer; with dummy weights and no tokenizer anywhere, the stand-in."""
    if tokenizer is None and load_format == "dummy" and not has_tokenizer(model_dir):
        log.warning(
            "%s has no tokenizer files: using a byte-level stand-in (dummy weights only; "
            "pass --tokenizer to use a real one)",
            model_dir,
        )
        return byte_level_tokenizer(vocab_size, eos)
    return Tokenizer.from_pretrained(tokenizer or model_dir)
