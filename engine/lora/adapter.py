"""A PEFT LoRA folder read and checked against the base model, then sharded for a TP rank.

    adapter = read_adapter(path, hf_config, max_lora_rank)         # ValueError names the field
    shard = adapter.shard(hf_config, tp_rank, tp_size, dtype)      # this rank's A/B per slice

The folder holds adapter_config.json and adapter_model.safetensors (PEFT's
`save_pretrained`). Supported targets are the decoder's projections, q/k/v/o and
gate/up/down; Tessera's merged qkv_proj and gate_up_proj take each projection's A/B as a
slice of the merged output (SLICES). The scaling lora_alpha / r (lora_alpha / sqrt(r) with
use_rslora) is folded into B once, here, so a step computes y += (x A^T) B^T.

The token embedding and the LM head (VOCAB_TARGETS) may be targeted too, keyed by layer
index -1. PEFT stores the embedding's A as lora_embedding_A [r, vocab] and B as
lora_embedding_B [hidden, r] (a token's delta: B A[:, id]); the LM head's as a linear's.
With a tied base (tie_word_embeddings) each keeps its own delta over the shared weight, as
PEFT's (unmerged) model does. PEFT also saves the base layers' weights beside them
(save_embedding_layers): those must have the base vocabulary (an adapter trained with added
tokens is refused) and are otherwise taken to be the base model's.

Nothing is kept until the whole folder is read and checked: an adapter that fails leaves no
state anywhere (the caller inserts the returned object, or gets the ValueError).
`check=True` reads only the tensors' shapes (the engine's front checks a folder so; the
runner loads the values when a step first needs the adapter).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine.models.hf_config import HFModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# Tessera's layer -> its slices, in output order: each a PEFT target module.
SLICES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
# PEFT target module -> (Tessera layer, slice index)
TARGETS: dict[str, tuple[str, int]] = {
    module: (layer, i) for layer, modules in SLICES.items() for i, module in enumerate(modules)
}
# Tessera layer -> whether it is row-parallel (input split across ranks) or column-parallel
ROW_PARALLEL = {"o_proj", "down_proj"}
# model-level targets, split by vocabulary across TP ranks (engine.layers.embedding)
VOCAB_TARGETS = ("embed_tokens", "lm_head")
MODEL_LAYER = -1  # their "layer index" in LoRAAdapter.weights
SUPPORTED = (*TARGETS, *VOCAB_TARGETS)
_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$"
)
_EMBED_KEY = re.compile(r"(?:^|\.)embed_tokens\.lora_embedding_([AB])(?:\.\w+)?$")
_HEAD_KEY = re.compile(r"(?:^|\.)lm_head\.lora_([AB])(?:\.\w+)?\.weight$")
_BASE_COPY = re.compile(r"(?:^|\.)(embed_tokens|lm_head)\.base_layer\.weight$")


def vocab_shard(vocab: int, tp_rank: int, tp_size: int) -> tuple[int, int, int]:
    """(first id, ids held, padded shard size) of a rank's vocabulary shard, as
    engine.layers.embedding.VocabParallelEmbedding splits it."""
    size = -(-vocab // tp_size)
    start = min(tp_rank * size, vocab)
    return start, min(start + size, vocab) - start, size


def _vocab_rows(t: torch.Tensor, dim: int, vocab: int, tp_rank: int, tp_size: int):
    """t's rank shard along its vocabulary dim, zero-padded to the shard size."""
    import torch

    start, n, size = vocab_shard(vocab, tp_rank, tp_size)
    part = t.narrow(dim, start, n)
    if n == size:
        return part
    pad = list(t.shape)
    pad[dim] = size - n
    return torch.cat([part, t.new_zeros(pad)], dim=dim)


def projection_shapes(cfg: HFModelConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each target module in the base model (unsharded)."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    return {
        "q_proj": (cfg.num_attention_heads * d, h),
        "k_proj": (cfg.num_key_value_heads * d, h),
        "v_proj": (cfg.num_key_value_heads * d, h),
        "o_proj": (h, cfg.num_attention_heads * d),
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "down_proj": (h, i),
    }


@dataclass(slots=True)
class LoRAAdapter:
    """One adapter as read: (layer index, target module) -> (A [r, in], B*scale [out, r]),
    full (unsharded) float32 tensors; shapes only (None) when read with check=True."""

    path: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor] | None]

    def shard(
        self, cfg: HFModelConfig, tp_rank: int, tp_size: int, dtype: torch.dtype
    ) -> dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor] | None]]:
        """This rank's weights per (layer index, Tessera layer): one (A, B) or None per slice.
        Column-parallel layers (qkv, gate_up) split each slice's B on its output rows;
        row-parallel ones (o, down) split A on its input columns (the base layer's
        all-reduce then sums the ranks' partial products)."""
        out: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor] | None]] = {}
        for (layer_idx, module), ab in self.weights.items():
            assert ab is not None, "read with check=True: no values"
            a, b = ab
            if module == "embed_tokens":  # A^T [vocab shard, r]: a token's row is a lookup
                a = _vocab_rows(a.T, 0, cfg.vocab_size, tp_rank, tp_size)
                out[(layer_idx, module)] = [(a.to(dtype).contiguous(), b.to(dtype).contiguous())]
                continue
            if module == "lm_head":  # B's rows are this rank's logits (padded as the head's)
                b = _vocab_rows(b, 0, cfg.vocab_size, tp_rank, tp_size)
                out[(layer_idx, module)] = [(a.to(dtype).contiguous(), b.to(dtype).contiguous())]
                continue
            layer, index = TARGETS[module]
            if layer in ROW_PARALLEL:
                size = a.shape[1] // tp_size
                a = a.narrow(1, tp_rank * size, size)
            else:
                size = b.shape[0] // tp_size
                b = b.narrow(0, tp_rank * size, size)
            slices = out.setdefault((layer_idx, layer), [None] * len(SLICES[layer]))
            slices[index] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
        return out


def _bad(path: Path, field: str, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {str(path)!r}: {field}: {why}")


def read_config(path: Path, max_lora_rank: int) -> tuple[int, float, tuple[str, ...] | None]:
    """(rank, scaling, target modules or None for a regex) from adapter_config.json."""
    file = path / CONFIG_FILE
    if not path.is_dir():
        raise _bad(path, "lora_path", "not a folder")
    if not file.is_file():
        raise _bad(path, CONFIG_FILE, "missing (a PEFT LoRA folder has one)")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise _bad(path, CONFIG_FILE, f"unreadable ({e})") from None
    if not isinstance(config, dict):
        raise _bad(path, CONFIG_FILE, "not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _bad(path, "peft_type", f"{peft_type!r} is not supported (only LORA)")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _bad(path, "r", f"must be a positive integer, got {r!r}")
    if r > max_lora_rank:
        raise _bad(path, "r", f"rank {r} is above max_lora_rank ({max_lora_rank})")
    alpha = config.get("lora_alpha", r)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise _bad(path, "lora_alpha", f"must be a number, got {alpha!r}")
    for name, unsupported in (
        ("use_dora", bool(config.get("use_dora"))),
        ("fan_in_fan_out", bool(config.get("fan_in_fan_out"))),
        ("rank_pattern", bool(config.get("rank_pattern"))),
        ("alpha_pattern", bool(config.get("alpha_pattern"))),
        ("modules_to_save", bool(config.get("modules_to_save"))),
        ("bias", config.get("bias", "none") not in (None, "none")),
        ("layers_to_transform", config.get("layers_to_transform") is not None),
        ("trainable_token_indices", bool(config.get("trainable_token_indices"))),
    ):
        if unsupported:
            raise _bad(path, name, f"{config.get(name)!r} is not supported")
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    targets = config.get("target_modules")
    if isinstance(targets, str):  # a regex: the tensors' names say what it matched
        return r, scaling, None
    if not isinstance(targets, list) or not targets:
        raise _bad(path, "target_modules", f"must be a non-empty list, got {targets!r}")
    unknown = sorted(str(t) for t in targets if t not in SUPPORTED)
    if unknown:
        raise _bad(
            path,
            "target_modules",
            f"{', '.join(unknown)} not supported (supported: {', '.join(SUPPORTED)})",
        )
    return r, scaling, tuple(dict.fromkeys(targets))


def read_adapter(
    path: str | Path, cfg: HFModelConfig, max_lora_rank: int, *, check: bool = False
) -> LoRAAdapter:
    """Read and check a PEFT LoRA folder against the base model's config; ValueError names
    the field or tensor at fault. check=True reads the tensors' shapes, not their values."""
    from safetensors import safe_open

    path = Path(path)
    r, scaling, targets = read_config(path, max_lora_rank)
    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise _bad(path, WEIGHTS_FILE, "missing (PEFT's save_pretrained writes one)")
    shapes = projection_shapes(cfg)
    halves: dict[tuple[int, str], dict[str, object]] = {}
    try:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                shape = tuple(f.get_slice(key).get_shape())
                vocab = _vocab_key(path, key, shape, cfg, r, targets)
                if vocab == "base":
                    continue
                if vocab is not None:
                    module, half = vocab
                    halves.setdefault((MODEL_LAYER, module), {})[half] = (
                        None if check else f.get_tensor(key)
                    )
                    continue
                m = _KEY.search(key)
                if m is None:
                    raise _bad(path, key, "not a LoRA weight of a supported target module")
                layer_idx, module, half = int(m.group(1)), m.group(2), m.group(3)
                if module not in TARGETS or (targets is not None and module not in targets):
                    raise _bad(path, key, f"target module {module!r} is not supported here")
                if layer_idx >= cfg.num_hidden_layers:
                    raise _bad(
                        path,
                        key,
                        f"layer {layer_idx} does not exist (the model has {cfg.num_hidden_layers})",
                    )
                if TARGETS[module][0] in ("gate_up_proj", "down_proj") and cfg.is_moe_layer(
                    layer_idx
                ):
                    raise _bad(path, key, "LoRA on a mixture-of-experts MLP is not supported")
                out_f, in_f = shapes[module]
                want = (r, in_f) if half == "A" else (out_f, r)
                if shape != want:
                    raise _bad(
                        path, key, f"shape {shape} does not fit the base model (expected {want})"
                    )
                halves.setdefault((layer_idx, module), {})[half] = (
                    None if check else f.get_tensor(key)
                )
    except ValueError:
        raise
    except Exception as e:  # a truncated or foreign file
        raise _bad(path, WEIGHTS_FILE, f"unreadable ({e})") from None
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor] | None] = {}
    for (layer_idx, module), ab in halves.items():
        for half in "AB":
            if half not in ab:
                where = module if layer_idx == MODEL_LAYER else f"layers.{layer_idx}.{module}"
                raise _bad(path, f"{where}.lora_{half}", "missing")
        if check:
            weights[(layer_idx, module)] = None
        else:
            a, b = ab["A"].float(), ab["B"].float() * scaling  # type: ignore[union-attr]
            weights[(layer_idx, module)] = (a, b)
    found = {module for _, module in weights}
    if not weights:
        raise _bad(path, WEIGHTS_FILE, "holds no LoRA weights")
    if targets is not None:
        missing = [t for t in targets if t not in found]
        if missing:
            raise _bad(
                path, "target_modules", f"{', '.join(missing)} listed but not in {WEIGHTS_FILE}"
            )
    return LoRAAdapter(str(path), r, scaling, tuple(sorted(found)), weights)


def _vocab_key(
    path: Path,
    key: str,
    shape: tuple[int, ...],
    cfg: HFModelConfig,
    r: int,
    targets: tuple[str, ...] | None,
) -> tuple[str, str] | str | None:
    """For a tensor of the embedding or the LM head: (module, "A" | "B") after checking its
    shape, or "base" for PEFT's copy of a base layer (skipped); None for any other key."""
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    base = _BASE_COPY.search(key)
    if base is not None:
        if shape != (vocab, hidden):
            raise _bad(
                path,
                key,
                f"shape {shape}: the adapter's vocabulary differs from the base model's "
                f"({vocab} x {hidden}); adapters with added tokens are not supported",
            )
        return "base"
    m = _EMBED_KEY.search(key)
    if m is not None:
        module, half = "embed_tokens", m.group(1)
        want = (r, vocab) if half == "A" else (hidden, r)
    else:
        m = _HEAD_KEY.search(key)
        if m is None:
            return None
        module, half = "lm_head", m.group(1)
        want = (r, hidden) if half == "A" else (vocab, r)
    if targets is not None and module not in targets:
        raise _bad(path, key, f"target module {module!r} is not in target_modules")
    if module == "embed_tokens" and cfg.model_type.startswith("gemma"):
        # HF's scaled embedding module adds peft's delta after its sqrt(hidden) scale; here
        # the model scales the embedding's output, delta included
        raise _bad(path, key, "LoRA on Gemma's scaled embeddings is not supported")
    if shape != want:
        extra = (
            "; adapters with added tokens are not supported"
            if vocab in want and len(shape) == 2 and shape != want
            else ""
        )
        raise _bad(path, key, f"shape {shape} does not fit the base model (expected {want}){extra}")
    return module, half
