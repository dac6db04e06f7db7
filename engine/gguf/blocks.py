"""The linear layers' weights of a GGUF file as the file stores them
(`--quantization gguf`): raw blocks per output row, merged the way the model merges its
projections.

q and k rows are reordered as engine.gguf.convert does (llama.cpp interleaves the rotary halves
in its llama files); a row is whole blocks along the input features, so reordering rows moves bytes,
never requantizes. A projection group whose parts differ in type (Q4_K_M files: attn_q/attn_k Q4_K,
attn_v Q6_K) keeps each run of same-typed parts as a row segment of its own type, all in one
buffer; a group with a float part (F16, BF16, F32) is left out, the caller keeps its
dequantized weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.gguf.convert import _unpermute

_FLOATS = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class Segment:
    """Consecutive output rows of one type."""

    type_name: str  # ggml's name: "Q4_K"
    type_id: int  # ggml's id
    data: torch.Tensor  # uint8 [rows, bytes per row]


@dataclass(frozen=True)
class Blocks:
    """One layer's weight [out_features, in_features] as rows of file blocks."""

    type_name: str  # ggml's name: "Q4_1"; a mixed group's, joined: "Q4_K/Q6_K"
    type_id: int  # ggml's id; -1 for a mixed group
    data: torch.Tensor  # uint8 [out_features, bytes per row]; a mixed group's: 1-D, every byte
    in_features: int
    segments: tuple[Segment, ...]  # in row order, views of data (one for a single type)

    @property
    def out_features(self) -> int:
        return sum(s.data.shape[0] for s in self.segments)


def _merge(parts: list[tuple[str, int, np.ndarray]], in_features: int) -> Blocks:
    """[(type name, id, rows [n, bytes])] in row order -> Blocks, runs of a type merged."""
    runs: list[tuple[str, int, list[np.ndarray]]] = []
    for name, type_id, rows in parts:
        if runs and runs[-1][0] == name:
            runs[-1][2].append(rows)
        else:
            runs.append((name, type_id, [rows]))
    if len(runs) == 1:
        name, type_id, rows = runs[0]
        data = torch.from_numpy(np.ascontiguousarray(np.concatenate(rows)))  # own copy
        return Blocks(name, type_id, data, in_features, (Segment(name, type_id, data),))
    arrays = [np.concatenate(rows) for _, _, rows in runs]
    flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays]))  # own copy
    segments, offset = [], 0
    for (name, type_id, _), a in zip(runs, arrays, strict=True):
        view = flat[offset : offset + a.size].view(a.shape[0], a.shape[1])
        segments.append(Segment(name, type_id, view))
        offset += a.size
    return Blocks("/".join(r[0] for r in runs), -1, flat, in_features, tuple(segments))


# model module -> the ways a file stores it: its GGUF tensors in row order, the first way
# the file has all of taken (phi3 files keep q/k/v fused in attn_qkv, and gate and up in
# ffn_up: Phi-3's [q; k; v] and [gate; up] rows, our merged layers' order)
_GROUPS = {
    "self_attn.qkv_proj": (("attn_q", "attn_k", "attn_v"), ("attn_qkv",)),
    "self_attn.o_proj": (("attn_output",),),
    "mlp.gate_up_proj": (("ffn_gate", "ffn_up"), ("ffn_up",)),
    "mlp.down_proj": (("ffn_down",),),
    # qwen2moe's shared expert
    "mlp.shared_expert.gate_up_proj": (("ffn_gate_shexp", "ffn_up_shexp"),),
    "mlp.shared_expert.down_proj": (("ffn_down_shexp",),),
}


def read_linear_blocks(
    path: str | Path, num_heads: int, num_kv_heads: int, interleaved: bool = True
) -> tuple[dict[str, Blocks], dict[str, str]]:
    """({"model.layers.0.self_attn.qkv_proj": Blocks, ..., "lm_head": Blocks, "embed_tokens":
    Blocks}, {module: why it was left out}). The LM head's rows are output.weight, or
    token_embd.weight where the model ties them; embed_tokens is token_embd.weight in a block
    type where the file has an output.weight (tied, the head's rows are the embedding's). interleaved: the file's q/k rows are in llama.cpp's rotary order (its
    llama files; convert.rows_interleaved)."""
    from engine.gguf.tensors import tensor_table  # gguf-py: only a GGUF model needs it

    tensors = tensor_table(path)
    n_layers = 1 + max(int(n.split(".")[1]) for n in tensors if n.startswith("blk."))
    heads = {"attn_q": num_heads, "attn_k": num_kv_heads} if interleaved else {}
    found: dict[str, Blocks] = {}
    skipped: dict[str, str] = {}
    for i in range(n_layers):
        for module, ways in _GROUPS.items():
            name = f"model.layers.{i}.{module}"
            for parts in ways:
                ts = [tensors.get(f"blk.{i}.{p}.weight") for p in parts]
                if all(t is not None for t in ts):
                    break
            else:  # (a MoE layer's MLP: its experts are not linear layers)
                skipped[name] = "missing from the file"
                continue
            names = [t.type_name for t in ts]
            if any(n in _FLOATS for n in names):
                why = "/".join(names) if len(set(names)) > 1 else names[0]
                skipped[name] = f"{why} (a float part: not a block type)"
                continue
            rows = []
            for p, t in zip(parts, ts, strict=True):
                data = t.data  # [out, bytes]
                if p in heads:
                    data = _unpermute(data, heads[p])
                rows.append((t.type_name, t.type_id, data))
            found[name] = _merge(rows, int(ts[0].shape[0]))
    head = tensors.get("output.weight", tensors.get("token_embd.weight"))  # tied: the embedding
    if head is None:
        skipped["lm_head"] = "missing from the file"
    elif head.type_name in _FLOATS:
        skipped["lm_head"] = f"{head.type_name} (a float tensor: not a block type)"
    else:
        found["lm_head"] = _merge([(head.type_name, head.type_id, head.data)], head.shape[0])
    embed = tensors.get("token_embd.weight")  # the embedding's own rows: an untied file's only
    if "output.weight" in tensors and embed is not None and embed.type_name not in _FLOATS:
        found["embed_tokens"] = _merge(
            [(embed.type_name, embed.type_id, embed.data)], embed.shape[0]
        )
    return found, skipped


@dataclass(frozen=True)
class ExpertBlocks:
    """A MoE layer's stacked experts as the file's blocks: w13 [E, 2I, row bytes] (each
    expert's gate rows, then its up rows: FusedMoE's w13 order) and w2 [E, H, row bytes]."""

    w13_type: str
    w13_type_id: int
    w13: torch.Tensor  # uint8 [E, 2I, bytes per row of H]
    w2_type: str
    w2_type_id: int
    w2: torch.Tensor  # uint8 [E, H, bytes per row of I]
    hidden_size: int  # H: w13's in_features
    intermediate_size: int  # I: w2's in_features


def read_expert_blocks(path: str | Path) -> tuple[dict[str, ExpertBlocks], dict[str, str]]:
    """({"model.layers.N.mlp.experts": ExpertBlocks} for every layer with stacked experts
    (blk.N.ffn_{gate,up,down}_exps) in block types, {module: why it was left out}): a float
    tensor, or gate and up in different types (one w13 kernel type per expert)."""
    from engine.gguf.tensors import tensor_table

    tensors = tensor_table(path)
    found: dict[str, ExpertBlocks] = {}
    skipped: dict[str, str] = {}
    layers = sorted({int(n.split(".")[1]) for n in tensors if n.endswith("_exps.weight")})
    for i in layers:
        name = f"model.layers.{i}.mlp.experts"
        ts = [tensors.get(f"blk.{i}.ffn_{p}_exps.weight") for p in ("gate", "up", "down")]
        if any(t is None for t in ts):
            skipped[name] = "missing from the file"
            continue
        gate, up, down = ts
        types = [t.type_name for t in ts]
        if any(n in _FLOATS for n in types):
            skipped[name] = f"{'/'.join(types)} (a float part: not a block type)"
            continue
        if gate.type_name != up.type_name:
            skipped[name] = f"gate {gate.type_name} and up {up.type_name} differ"
            continue
        hidden, inter, experts = (int(d) for d in gate.shape)  # the file's (H, I, E)
        g = gate.data.reshape(experts, inter, -1)
        u = up.data.reshape(experts, inter, -1)
        w13 = torch.from_numpy(np.concatenate([g, u], axis=1))  # own copy, [E, 2I, bytes]
        w2 = torch.from_numpy(np.array(down.data.reshape(experts, hidden, -1)))  # own copy
        found[name] = ExpertBlocks(
            gate.type_name, gate.type_id, w13, down.type_name, down.type_id, w2, hidden, inter
        )
    return found, skipped
