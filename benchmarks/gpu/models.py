"""Model folders of dummy weights (config + placeholder + a word-level tokenizer), the byte
and FLOP counts of a model's step, and token-id prompts."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np


def write_model_folder(folder: Path, config: dict, tokenizer: bool = True) -> Path:
    """config.json, a header-only safetensors placeholder (the loader wants a weights file in
    the folder; load_format="dummy" never reads it) and a word-level fast tokenizer with one
    token per id (the engine detokenizes; prompts are token ids)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    header = json.dumps({"__metadata__": {"tessera": "placeholder: dummy weights"}}).encode()
    header += b" " * (-len(header) % 8)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    if tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {"<unk>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, config["vocab_size"])}}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
        fast.save_pretrained(str(folder))
    return folder


def layer_params(cfg: dict) -> int:
    """Weights of one decoder layer's GEMMs (q, k, v, o, gate, up, down)."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    return h * q + 2 * h * kv + q * h + 3 * h * i


def decode_weight_bytes(cfg: dict, elem: int = 2) -> int:
    """Weight bytes a decode step reads: every layer's GEMMs and the LM head (the embedding
    gives only B rows, the norms are noise)."""
    return (
        cfg["num_hidden_layers"] * layer_params(cfg) + cfg["vocab_size"] * cfg["hidden_size"]
    ) * elem


def kv_bytes_per_token(cfg: dict, elem: int = 2) -> int:
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * elem


def prefill_flops(cfg: dict, prefix: int, n: int) -> float:
    """GEMMs of n tokens plus attention (QK^T and PV) over the prefix and, causally, the chunk."""
    attn = 4 * cfg["num_hidden_layers"] * cfg["num_attention_heads"] * cfg["head_dim"]
    return 2 * cfg["num_hidden_layers"] * layer_params(cfg) * n + attn * n * (prefix + (n + 1) / 2)


def token_prompts(rng: np.random.Generator, lengths, vocab_size: int) -> list[list[int]]:
    # ordinary ids, no special ones (0 and 1 are the tokenizer's)
    lo, hi = min(1000, vocab_size // 4), max(min(vocab_size, 30000), 3)
    return [rng.integers(lo, hi, size=int(n)).tolist() for n in lengths]
