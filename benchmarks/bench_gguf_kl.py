"""Accuracy of each linear-layer path on the bundled model, against its dequantized float32
weights: mean next-token KL(reference || path) and top-1 agreement, teacher-forced (issue 22).

    tessera bench gguf_kl [--quantization gguf none w4a8 w8a8] [--windows 8]

The bundled SmolLM2-135M Q4_1 file dequantized to float32 is the reference: every path is
measured against the same file's values, so the figures are what the kernels add, not the
4-bit quantization of the file itself. Two regimes, because the kernels change with the
rows of a call: windows of 12 tokens (every call 12 rows: the decode-size kernels, e.g. the
w4 tiles' kernel) and whole 96-token prefixes (96 rows: AMX tiles where the CPU has them).
Attention is the torch reference in every path, so only the linear layers differ.
"""

from __future__ import annotations

import argparse
import math

import torch

TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small "
    "can of oil and a cloth for the lens. From the gallery he could see the fishing boats "
    "returning to the harbour, their lamps swaying with the swell, and beyond them the long "
    "dark line of the coast where the cliffs fell into the sea. He had kept the light for "
    "thirty years, through storms that shook the tower and calm nights when the water lay "
    "flat as glass, and in all that time the lamp had never once gone out."
)
SHORT, LONG = 12, 96


def _logits(model, tokens: list[int]) -> torch.Tensor:
    from engine.attention.backends.torch import TorchAttentionBackend
    from engine.attention.metadata import common_metadata_from_seqs

    attn0 = model.model.layers[0].self_attn
    heads, kv_heads, head_dim = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
    dtype = model.model.embed_tokens.weight.dtype
    blocks = math.ceil(len(tokens) / 16)
    backend = TorchAttentionBackend(16, heads, kv_heads, head_dim, dtype)
    for attn in model.attention_layers():
        attn.kv_cache = torch.zeros(2, blocks + 1, 16, kv_heads, head_dim, dtype=dtype)
        attn.backend = backend
    meta = backend.build_metadata(
        common_metadata_from_seqs([(0, len(tokens), list(range(1, blocks + 1)))], 16)
    )
    with torch.inference_mode():
        h = model(torch.tensor(tokens), torch.arange(len(tokens)), meta)
        return model.compute_logits(h).float()


def _compare(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    p = torch.log_softmax(ref_logits, -1)
    q = torch.log_softmax(logits, -1)
    kl = (p.exp() * (p - q)).sum(-1)
    top1 = (ref_logits.argmax(-1) == logits.argmax(-1)).float()
    return float(kl.mean()), float(top1.mean())


def main(argv: list[str] | None = None) -> int:
    from engine.config import DEFAULT_MODEL
    from engine.gguf.source import default_gguf_path
    from engine.layers.quantization.quantize import quantize_model
    from engine.models.loader import load_model, resolve_model
    from engine.tokenizer import Tokenizer

    parser = argparse.ArgumentParser(prog="tessera bench gguf_kl")
    parser.add_argument(
        "--quantization", nargs="+", default=["gguf", "none", "w4a8", "w8a8"],
        choices=["gguf", "none", "int8", "w8a8", "w4a8"],
    )  # fmt: skip
    parser.add_argument("--windows", type=int, default=8, help="12-token windows measured")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    folder, gguf = resolve_model(DEFAULT_MODEL), default_gguf_path()
    tokens = Tokenizer.from_pretrained(folder).encode(TEXT)[: LONG + 1]
    if len(tokens) < LONG:
        raise SystemExit(f"the text has only {len(tokens)} tokens")
    if not 1 <= args.windows <= len(tokens) // SHORT:
        raise SystemExit(
            f"--windows: 1 to {len(tokens) // SHORT} (the text's {SHORT}-token windows)"
        )
    windows = [tokens[i * SHORT : (i + 1) * SHORT] for i in range(args.windows)]

    def measure(model) -> dict[str, tuple[float, float]]:
        short = [_logits(model, w) for w in windows]
        return {"short": torch.cat(short), "long": _logits(model, tokens[:LONG])}

    ref = measure(load_model(folder, dtype="float32"))
    print(
        f"Reference: the bundled Q4_1 file dequantized to float32; {args.windows} windows of "
        f"{SHORT} tokens and one {LONG}-token prefix, teacher-forced.\n"
    )
    print("| path (bf16 activations) | KL, 12-row calls | top-1, 12-row | KL, 96-row calls | top-1, 96-row |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    for method in args.quantization:
        model = load_model(folder, dtype="bfloat16")
        if method != "none":
            quantize_model(model, method, gguf_path=gguf if method == "gguf" else None)
        out = measure(model)
        ks, ts = _compare(ref["short"], out["short"])
        kl, tl = _compare(ref["long"], out["long"])
        print(f"| {method} | {ks:.4f} | {ts:.3f} | {kl:.4f} | {tl:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
