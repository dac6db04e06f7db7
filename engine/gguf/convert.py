"""Convert a GGUF file (llama.cpp's llama, qwen2, qwen3, qwen2moe, qwen3moe, gemma3, phi3 or
gpt-oss architecture: engine.gguf.arch_config) into a Hugging Face folder, once.

The output (config.json, tokenizer files with the chat template, generation_config.json, the
float32 tensors: norms and biases, and gguf_source.json: the file itself) is written to a
temporary folder next to the destination and renamed into place, so a crash never leaves a
half-written model behind. Every other tensor stays in the file: the GGUF path serves the
linear layers' blocks as they are, and the loader dequantizes what it needs as floats (the
embedding; every weight for `--quantization none`) from there, one tensor at a time
(linked_tensors; the C dequantizer where it reads the type). Written out in float32 they
were 4 bytes a weight on disk (32 GB for an 8B Q4_K file) and most of the conversion's
time. What is written goes one shard at a time (model.safetensors, or
model-0000i-of-0000n.safetensors and their index past SHARD_BYTES; an F32 file's weights
can be large), each tensor dequantized as its shard is written. A split model (llama.cpp's
gguf-split: NAME-00001-of-0000n.gguf and the rest beside it) converts from its first file:
the metadata is there, the tensors are read from every file, and the link names them all.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.gguf import arch_config
from engine.kernels.cpu import gguf as cpu_gguf
from engine.layers.rotary import llama3_inv_freq

logger = logging.getLogger("tessera.engine")

# Bump when the output format changes: old caches are then converted again.
# (New architectures need no bump: no older converter wrote a folder for them.)
CONVERTER_VERSION = 3  # 2: Llama 3 rope scaling, Qwen2; 3: linear blocks left in the file
LINK = "gguf_source.json"  # in a converted folder: the GGUF its linear weights stay in

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",  # Qwen2's
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3's
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# where a model type names a layer tensor otherwise (llama.cpp's tensor_mapping.py)
_TYPE_LAYER_NAMES = {
    "gemma3_text": {  # four norms a layer: ffn_norm is the one before the MLP
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    "phi3": {  # fused as in Phi-3's checkpoints: [q; k; v] rows, and [gate; up] in ffn_up
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",
    },
    "qwen3_moe": {"ffn_gate_inp.weight": "mlp.gate.weight"},  # the router
    "gpt_oss": {  # biases everywhere, sinks, the router's bias; experts stacked apart with
        # their biases [E, I] / [E, H] (engine.models.gpt_oss takes these names)
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "attn_output.bias": "self_attn.o_proj.bias",
        "attn_sinks.weight": "self_attn.sinks",
        "ffn_gate_inp.weight": "mlp.router.weight",
        "ffn_gate_inp.bias": "mlp.router.bias",
        "ffn_gate_exps.bias": "mlp.experts.gate_proj_bias",
        "ffn_up_exps.bias": "mlp.experts.up_proj_bias",
        "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
    },
    "qwen2_moe": {  # the router, and the shared expert with its sigmoid gate
        "ffn_gate_inp.weight": "mlp.gate.weight",
        "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
        "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
        "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
        "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    },
}
# stacked experts [E, rows, cols]: each expert's slice is the checkpoint's per-expert tensor
_EXPERT_NAMES = {
    "ffn_gate_exps.weight": "gate_proj",
    "ffn_up_exps.weight": "up_proj",
    "ffn_down_exps.weight": "down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _hf_name(name: str, model_type: str = "llama") -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    if name.startswith("blk."):
        _, layer, rest = name.split(".", 2)
        names = _TYPE_LAYER_NAMES.get(model_type, {})
        if rest in names:
            return f"model.layers.{layer}.{names[rest]}"
        if rest in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[rest]}"
    return None


@dataclass(frozen=True)
class _ExpertSlice:
    """One expert's rows of a stacked expert tensor, read like a 2-D GGUF tensor."""

    name: str  # the HF checkpoint's: model.layers.N.mlp.experts.E.gate_proj.weight
    type_id: int
    shape: tuple[int, ...]  # as the file stores it: (in_features, out_features)
    data: np.ndarray  # [out_features, bytes per row] (float rows for a float tensor)


def _expert_slices(t) -> list[_ExpertSlice]:
    """A stacked expert tensor (blk.N.ffn_*_exps.weight, stored [E, rows, cols]) as its
    experts' 2-D slices (views: nothing is copied); [] for any other tensor."""
    if not t.name.startswith("blk."):
        return []
    _, layer, rest = t.name.split(".", 2)
    proj = _EXPERT_NAMES.get(rest)
    if proj is None:
        return []
    shape = tuple(int(s) for s in t.shape)  # (cols, rows, E)
    experts = shape[2]
    rows = np.asarray(t.data).reshape(experts, shape[1], -1)  # E, rows, row bytes or floats
    type_id = int(getattr(t, "type_id", getattr(t, "tensor_type", 0)))
    return [
        _ExpertSlice(
            f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight", type_id, shape[:2], rows[e]
        )
        for e in range(experts)
    ]


def _entries(tensors, model_type: str) -> Iterator[tuple[str, object]]:
    """(HF name, a tensor _float_tensor reads) for every tensor a model takes from the file,
    stacked experts as one entry per expert; others (rope_factors_*) are skipped."""
    for t in tensors:
        name = _hf_name(t.name, model_type)
        if name is not None:
            yield name, t
            continue
        for s in _expert_slices(t):
            yield s.name, s


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp interleaves the rotary halves of q/k rows; HF keeps them as two halves.
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _llama3_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict | None:
    """HF's "llama3" rope_scaling for a rope_freqs tensor (what llama.cpp's converter writes for
    Llama 3.1+: per frequency the divisor of its inverse frequency); None for all ones.

    The divisors are 1 below a wavelength threshold, `factor` above a second one, and between
    them a blend linear in 1 / wavelength. They fix the thresholds' ratios to HF's
    original_max_position_embeddings, not its value: that is taken as Llama 3's 8,192, and the
    thresholds come from the blended frequencies (the line through two of them; with fewer,
    any thresholds in the gaps that reproduce them). Anything else raises: served with plain
    rope it would be wrong."""
    f = np.asarray(factors, dtype=np.float64).reshape(-1)
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if len(f) != len(inv_freq):
        raise ValueError(f"the GGUF's rope_freqs has {len(f)} divisors for head_dim {head_dim}")
    factor = float(f.max())
    if factor <= 1 + 1e-6:
        return None
    x = inv_freq / (2 * np.pi)  # 1 / wavelength, falling
    smooth = (1 / f - 1 / factor) / (1 - 1 / factor)  # 1 where f is 1, 0 where it is factor
    blended = np.flatnonzero((f > 1 + 1e-6) & (f < factor * (1 - 1e-6)))
    k = int(np.argmax(f > 1 + 1e-6))  # the first scaled frequency
    below = x[k - 1] if k > 0 else 4 * x[k]  # an unscaled neighbour (or a made-up one)
    if len(blended) >= 2:  # a = 1 / the short threshold, c = 1 / the long one
        i, j = blended[0], blended[-1]
        a_minus_c = (x[i] - x[j]) / (smooth[i] - smooth[j])
        c = x[i] - smooth[i] * a_minus_c
        a = c + a_minus_c
    elif len(blended) == 1:
        a = np.sqrt(below * x[k])
        c = (x[k] - smooth[k] * a) / (1 - smooth[k])
    else:
        a, c = below ** (2 / 3) * x[k] ** (1 / 3), below ** (1 / 3) * x[k] ** (2 / 3)
    original = 8192
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(original * c),
        "high_freq_factor": float(original * a),
        "original_max_position_embeddings": original,
    }
    ours = llama3_inv_freq(torch.from_numpy(inv_freq), scaling).numpy()
    if not np.allclose(ours, inv_freq / f, rtol=1e-4, atol=0):
        raise ValueError(
            "the GGUF's rope_freqs is not supported: its divisors are not Llama 3's blend "
            "(the only rope scaling served)"
        )
    return scaling


def _rope_scaling(reader, arch: str, theta: float, head_dim: int) -> dict | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind == "linear":  # positions divided by the factor (Gemma 3's global layers)
        return {
            "rope_type": "linear",
            "factor": float(_field(reader, f"{arch}.rope.scaling.factor")),
        }
    if kind == "yarn" and arch in _YARN_ARCHS:
        return _yarn_scaling(reader, arch)
    if kind not in (None, "none"):
        raise ValueError(
            f"GGUF rope scaling {kind!r} is not supported in {arch} files (linear and Llama "
            f"3's are; yarn in {', '.join(_YARN_ARCHS)} files)"
        )
    t = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    return None if t is None else _llama3_scaling(np.asarray(t.data), theta, head_dim)


# where yarn is served (static, transformers'): tested against HF's gpt-oss only
_YARN_ARCHS = ("gpt-oss",)


def _yarn_scaling(reader, arch: str) -> dict:
    """HF's "yarn" rope_scaling from llama.cpp's keys: the factor, the original context, the
    betas where the file gives them (else HF's and llama.cpp's 32 / 1). An attention factor
    other than 1 is refused: llama.cpp multiplies yarn's own scale by it, HF replaces it."""
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if factor is None or original is None:
        raise ValueError(
            f"GGUF yarn rope scaling needs {arch}.rope.scaling.factor and "
            f"{arch}.rope.scaling.original_context_length"
        )
    scaling = {
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": int(original),
    }
    for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        value = _field(reader, f"{arch}.rope.scaling.{key}")
        if value is not None:
            scaling[name] = float(value)
    attn = _field(reader, f"{arch}.rope.scaling.yarn_attn_factor")
    if attn is not None and abs(float(attn) - 1.0) > 1e-6:
        raise ValueError(
            f"GGUF {arch}.rope.scaling.yarn_attn_factor {attn} is not supported (only 1)"
        )
    return scaling


# llama.cpp interleaves the rotary halves of q/k rows in "llama" files only (the others
# rotate halves as HF does)
_ARCHS = arch_config.ARCHS


def rows_interleaved(model_type: str) -> bool:
    """Whether a GGUF file of this model type stores q/k rows in llama.cpp's rotary order."""
    return model_type == "llama"


def _read_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_ARCHS)})"
        )

    def key(name: str, default=None):
        return _field(reader, f"{arch}.{name}", default)

    tensors = {t.name: t for t in reader.tensors}
    names = set(tensors)
    hf_class, model_type, extra = _ARCHS[arch]
    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    # Qwen3's heads are wider than hidden / heads: llama.cpp writes their width as key_length
    head_dim = int(key("attention.key_length", key("rope.dimension_count", hidden // heads)))
    theta = float(key("rope.freq_base", 10000.0))
    config = {
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length", key("expert_feed_forward_length"))),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(key("context_length", 2048)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(reader, arch, theta, head_dim),
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        # The original checkpoint's dtype, so dtype="auto" serves in bfloat16; the float
        # tensors are stored dequantized in float32.
        "torch_dtype": "bfloat16",
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    elif arch in ("qwen2", "qwen3"):  # Qwen2: q/k/v biases, Qwen3: none; no sliding window
        config.update(use_sliding_window=False)
        if arch == "qwen3":
            config.update(attention_bias=False)
    if extra is not None:
        config.update(extra(key, tensors, config))
    return config


# Float32 bytes per weight shard: what the conversion holds in memory at once.
SHARD_BYTES = 512 << 20
_CHUNK_ROWS = 4096


def _float_tensor(t, config: dict, name: str | None = None) -> torch.Tensor:
    """One GGUF tensor (gguf-py's ReaderTensor, engine.gguf.tensors.Tensor, or an expert's
    slice) dequantized to float32 as HF's checkpoint holds it under name (an array of its
    own): q/k rows in HF's order, Gemma's norms without the 1 llama.cpp adds."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(int(getattr(t, "type_id", getattr(t, "tensor_type", 0))))
    shape = tuple(int(s) for s in reversed(t.shape))
    if len(shape) == 2 and int(qtype) in cpu_gguf.TYPES.values() and cpu_gguf.available():
        # the C dequantizer (every thread; the same bits as gguf-py's, tests/engine/kernels)
        blocks = torch.from_numpy(np.array(t.data, dtype=np.uint8).reshape(shape[0], -1))
        w = cpu_gguf.dequantize(blocks, int(qtype), shape[1], torch.float32).numpy()
    elif len(shape) == 2 and t.data.ndim == 2 and t.data.shape[0] == shape[0]:
        # row chunks: gguf-py's dequantize holds a few float temporaries of its input's size
        w = np.empty(shape, dtype=np.float32)
        for i in range(0, shape[0], _CHUNK_ROWS):
            w[i : i + _CHUNK_ROWS] = dequantize(t.data[i : i + _CHUNK_ROWS], qtype)
    else:
        w = dequantize(t.data, qtype).reshape(shape)
    model_type = config.get("model_type", "llama")
    name = name or _hf_name(t.name, model_type)
    if model_type == "gemma3_text" and name.endswith("norm.weight"):
        # llama.cpp's converter stores Gemma's (1 + w) scale; HF's checkpoint holds w (and
        # engine.models.gemma3 adds the 1 back at load)
        w = w - np.float32(1.0)
    if name.endswith("shared_expert_gate.weight"):
        w = w.reshape(1, -1)  # llama.cpp's loader takes it as {n_embd}; HF's is [1, H]
    if rows_interleaved(model_type):
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, config["num_key_value_heads"])
    if not (w.flags.writeable and w.flags.c_contiguous and w.dtype == np.float32):
        w = np.array(w, dtype=np.float32)  # a copy: F32 tensors are views of the read-only mmap
    return torch.from_numpy(w)


def _shards(tensors: list, shard_bytes: int) -> list[list]:
    """The tensors in file order, split into runs of at most shard_bytes of float32 (a larger
    tensor alone)."""
    shards: list[list] = [[]]
    size = 0
    for t in tensors:
        nbytes = 4 * int(np.prod([int(s) for s in t.shape]))
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    return shards


def left_in_file(t, model_type: str = "llama") -> bool:
    """Whether a GGUF tensor stays in the file when converting: all but the float32 ones
    (norms, biases: small). The GGUF path keeps the linear layers' blocks as they are; the
    rest (the embedding, stacked experts, float paths' weights) is dequantized from the file
    at load."""
    taken = _hf_name(t.name, model_type) is not None or bool(_expert_slices(t))
    return taken and t.tensor_type.name != "F32"


def _write_weights(
    reader, config: dict, out_dir: Path, shard_bytes: int = SHARD_BYTES, every: bool = True
) -> None:
    """The weights as safetensors shards, each dequantized, written and freed in turn; all of
    them, or (every=False) those not left_in_file."""
    from safetensors.torch import save_file

    model_type = config.get("model_type", "llama")
    tensors = [t for t in reader.tensors if every or not left_in_file(t, model_type)]
    shards = _shards([t for t in tensors if next(_entries([t], model_type), None)], shard_bytes)
    n = len(shards)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        file = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        tensors = {name: _float_tensor(t, config, name) for name, t in _entries(shard, model_type)}
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        if n > 1:
            gib = sum(t.numel() * 4 for t in tensors.values()) / 2**30
            logger.info("Converted weight shard %d/%d (%.2f GiB float32)", i, n, gib)
        del tensors
    if n > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def linked_tensors(folder: Path) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(HF name, a function dequantizing it to float32) for each of the linked GGUF's
    tensors, nothing if the folder has no link (read when called: one tensor at a time)."""
    link = folder / LINK
    if not link.is_file():
        return
    info = json.loads(link.read_text())
    path = Path(info["path"])
    files = info.get("files", [{"path": info["path"], "size": info["size"]}])
    for f in files:
        p = Path(f["path"])
        if not p.is_file() or p.stat().st_size != f["size"]:
            raise ValueError(
                f"{folder} was converted from {p}, which is gone or changed: its linear "
                "weights stay in that file (convert again: serve the .gguf itself)"
            )
    from engine.gguf.tensors import tensor_table

    config = json.loads((folder / "config.json").read_text())
    model_type = config.get("model_type", "llama")
    for name, t in _entries(tensor_table(path).values(), model_type):
        yield name, functools.partial(_float_tensor, t, config, name)


# gpt-oss's turn ends besides the file's one eos (its HF generation_config's list; llama.cpp
# ends generation on them too): <|call|> ends a turn that calls a tool
_HARMONY_STOPS = ("<|return|>", "<|endoftext|>", "<|call|>")


def _stop_ids(reader, config: dict):
    """generation_config's eos_token_id: the file's eos, and for gpt-oss the harmony stops its
    vocabulary has."""
    eos = config["eos_token_id"]
    if config["model_type"] != "gpt_oss":
        return eos
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    ids = [i for i, t in enumerate(tokens) if t in _HARMONY_STOPS]
    return list(dict.fromkeys(([] if eos is None else [eos]) + ids))


def _save_tokenizer(gguf_path: Path, out_dir: Path, model_type: str = "llama") -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # AutoTokenizer reads the file's model config only to pick a class, and transformers'
    # gpt-oss reader of it fails on the yarn keys (float() of a numpy array); gpt-oss has no
    # tokenizer class of its own: the generic one AutoTokenizer would give, built directly
    cls = PreTrainedTokenizerFast if model_type == "gpt_oss" else AutoTokenizer
    tok = cls.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not tok.chat_template:
        logger.warning("%s carries no chat template; chat requests will fail", gguf_path.name)
    tok.save_pretrained(str(out_dir))


class _SplitReader:
    """A split model's GGUFReaders as one: the first file's metadata, every file's tensors."""

    def __init__(self, paths: list[Path]):
        from gguf import GGUFReader

        readers = [GGUFReader(str(p)) for p in paths]
        self.fields = readers[0].fields
        self.tensors = [t for r in readers for t in r.tensors]


def convert_gguf(gguf_path: str | Path, dest: str | Path, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write the HF folder for gguf_path (a file, or a split model's first) at dest
    (atomically); return dest."""
    from engine.gguf.tensors import shard_paths

    gguf_path, dest = Path(gguf_path), Path(dest)
    files = shard_paths(gguf_path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    logger.info("Converting %s once; cached at %s", gguf_path, dest)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{dest.name}-", dir=dest.parent))
    try:
        reader = _SplitReader(files)
        config = _read_config(reader)
        stops = _stop_ids(reader, config)
        _write_weights(reader, config, tmp, shard_bytes, every=False)
        del reader
        link = {"path": str(gguf_path.resolve()), "size": gguf_path.stat().st_size}
        if len(files) > 1:
            link["files"] = [{"path": str(f.resolve()), "size": f.stat().st_size} for f in files]
        (tmp / LINK).write_text(json.dumps(link, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": stops}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        _save_tokenizer(gguf_path, tmp, config["model_type"])
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("Converted %s in %.1f s", gguf_path.name, time.perf_counter() - t0)
    return dest
