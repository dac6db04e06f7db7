"""The linear layers' weights of a llama GGUF file as the file stores them (`--quantization
gguf`): raw blocks per output row, merged the way the model merges its projections.

q and k rows are reordered as gguf_convert does (llama.cpp interleaves the rotary halves); a
row is whole blocks along the input features, so reordering rows moves bytes, never
requantizes. A projection group whose parts differ in type (q_proj Q4_K, v_proj Q6_K...) is
left out: the caller keeps its dequantized weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.config import DEFAULT_MODEL
from engine.models.gguf_convert import _unpermute


@dataclass(frozen=True)
class Blocks:
    """One layer's weight [out_features, in_features] as rows of file blocks."""

    type_name: str  # ggml's name: "Q4_1"
    type_id: int  # ggml's id
    data: torch.Tensor  # uint8 [out_features, bytes per row]
    in_features: int


# model module -> (its GGUF tensors in shard order, the unpermute head-count key or None)
_GROUPS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


def gguf_source(model: str | Path) -> Path | None:
    """The .gguf file a model name serves from (the default model's bundled file), or None."""
    from engine.models.loader import default_gguf_path

    if str(model) == DEFAULT_MODEL:
        return default_gguf_path()
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def read_linear_blocks(
    path: str | Path, num_heads: int, num_kv_heads: int
) -> tuple[dict[str, Blocks], dict[str, str]]:
    """({"model.layers.0.self_attn.qkv_proj": Blocks, ...}, {module: why it was left out})."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    n_layers = 1 + max(int(n.split(".")[1]) for n in tensors if n.startswith("blk."))
    heads = {"attn_q": num_heads, "attn_k": num_kv_heads}
    found: dict[str, Blocks] = {}
    skipped: dict[str, str] = {}
    for i in range(n_layers):
        for module, parts in _GROUPS.items():
            name = f"model.layers.{i}.{module}"
            ts = [tensors.get(f"blk.{i}.{p}.weight") for p in parts]
            if any(t is None for t in ts):
                skipped[name] = "missing from the file"
                continue
            types = {t.tensor_type for t in ts}
            if len(types) != 1:
                skipped[name] = "parts of mixed types " + "/".join(t.tensor_type.name for t in ts)
                continue
            (qtype,) = types
            if qtype.name in ("F32", "F16", "BF16"):
                skipped[name] = f"{qtype.name} (not a block type)"
                continue
            rows = []
            for p, t in zip(parts, ts, strict=True):
                data = np.asarray(t.data).reshape(int(t.shape[1]), -1)  # [out, bytes]
                if p in heads:
                    data = _unpermute(data, heads[p])
                rows.append(data)
            merged = torch.from_numpy(np.ascontiguousarray(np.concatenate(rows)))  # own copy
            found[name] = Blocks(qtype.name, int(qtype), merged, int(ts[0].shape[0]))
    return found, skipped
