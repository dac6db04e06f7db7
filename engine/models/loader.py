"""Find a model folder and load its weights into our model classes.

resolve_model: a local HF folder as is; the default model name or a .gguf file converted once
into the user cache. load_model: the model class from config.json, weights from safetensors
through each parameter's weight_loader (tensor-parallel sharding; a fused checkpoint tensor such
as Phi-3's qkv_proj split into its shards first), or random ("dummy"); a
converted GGUF's linear weights, left in the file, from the file (engine.gguf.convert.linked_tensors).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from engine.config import DEFAULT_MODEL
from engine.distributed import get_pp_size
from engine.gguf.convert import CONVERTER_VERSION, convert_gguf, linked_tensors
from engine.gguf.source import default_gguf_path
from engine.layers.ops import bind_custom_ops
from engine.layers.quantization.kv_scales import kv_scale_name, load_kv_scale
from engine.models.hf_config import HFModelConfig, load_hf_config, max_model_len_for
from engine.models.registry import get_model_class
from engine.paths import default_cache_dir

__all__ = [
    "HFModelConfig",
    "default_cache_dir",
    "load_hf_config",
    "load_model",
    "max_model_len_for",
    "resolve_dtype",
    "resolve_model",
]

logger = logging.getLogger("tessera.engine")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def _cached_folder(gguf: Path, name: str, cache_dir: Path) -> Path:
    # the paths too: the folder links the files it was converted from (a split model's all)
    from engine.gguf.tensors import shard_paths

    parts = []
    for f in shard_paths(gguf):
        st = f.stat()
        parts.append(f"{f.resolve()}-{st.st_size}-{st.st_mtime_ns}")
    key = "-".join([*parts, str(CONVERTER_VERSION)]).encode()
    return cache_dir / "models" / f"{name}-{hashlib.sha256(key).hexdigest()[:12]}"


def resolve_model(
    name_or_path: str | Path, cache_dir: str | Path | None = None, load_format: str = "auto"
) -> Path:
    """A HF-style folder for a local folder, a .gguf file or the default model name.

    With load_format "dummy" a folder needs only config.json (and a tokenizer to serve)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    text = str(name_or_path)
    if text == DEFAULT_MODEL:
        gguf, name = default_gguf_path(), DEFAULT_MODEL
    else:
        path = Path(text).expanduser()
        if path.is_dir():
            _check_folder(path, weights=load_format != "dummy")
            return path
        if not (path.is_file() and path.suffix == ".gguf"):
            raise ValueError(
                f"model {text!r} not found: give a local Hugging Face folder (config.json + "
                f"*.safetensors + tokenizer), a .gguf file, or {DEFAULT_MODEL!r}"
            )
        gguf, name = path, path.stem.lower()
    folder = _cached_folder(gguf, name, cache)
    if (folder / "config.json").is_file():
        return folder
    return convert_gguf(gguf, folder)


def _check_folder(path: Path, weights: bool = True) -> None:
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a model folder: config.json is missing")
    if weights and not any(path.glob("*.safetensors")):
        raise ValueError(
            f"{path} has no *.safetensors weights (only safetensors are loaded; "
            "load_format 'dummy' (--load-format dummy) draws random weights instead)"
        )


def resolve_dtype(
    dtype: str, cfg: HFModelConfig, device: str | torch.device = "cpu"
) -> torch.dtype:
    """auto: float32 if the checkpoint is float32, float16 on CUDA for float16 ones, else bf16."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(
                f"dtype must be one of auto, float32, bfloat16, float16; got {dtype!r}"
            )
        return _DTYPES[dtype]
    if cfg.dtype in ("float32", "fp32"):
        return torch.float32
    if cfg.dtype == "float16" and torch.device(device).type == "cuda":
        return torch.float16
    return torch.bfloat16


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    model_dir: str | Path,
    dtype: str = "auto",
    load_format: str = "auto",
    device: str | torch.device = "cpu",
    max_position: int | None = None,
    seed: int = 0,
    prepare: Callable[[nn.Module], set[str]] | None = None,
    runner: str = "generate",
) -> nn.Module:
    """Build the model for model_dir/config.json and fill its weights; returns it in eval mode,
    its fused ops bound to device's kernels (engine.layers.ops).

    max_position: the longest context to serve, if beyond max_position_embeddings (rope cache).
    prepare: called on the built model before its weights load; returns the names of the
    parameters it filled itself (a GGUF's blocks), which the checkpoint then does not fill: their
    float copies are never read (the built parameters are allocated, never written, so they
    cost no resident memory).
    """
    if load_format not in ("auto", "safetensors", "gguf", "dummy"):
        raise ValueError(
            f"load_format must be auto, safetensors, gguf or dummy; got {load_format!r}"
        )
    model_dir = Path(model_dir)
    cfg = load_hf_config(model_dir)
    cls = get_model_class(cfg.architecture, runner)
    torch_dtype = resolve_dtype(dtype, cfg, device)
    with _default_dtype(torch_dtype), torch.device(device):
        model = cls(cfg, max_position=max_position)
    held = prepare(model) if prepare is not None else set()
    if load_format == "dummy":
        _init_dummy(model, seed)
    else:
        _check_folder(model_dir)
        _load_safetensors(model, model_dir, held)
    bind_custom_ops(model, device)  # the fused ops' forward for this device, chosen once
    return model.eval()


def _init_dummy(model: nn.Module, seed: int) -> None:
    """Random weights drawn in place where the parameters live (on a GPU: on the GPU, with
    its own generator; nothing is generated on the host and copied)."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
            continue
        gen = generators.get(p.device)
        if gen is None:
            gen = generators[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        p.data.normal_(0.0, 0.02, generator=gen)


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    return sorted(model_dir.glob("*.safetensors"))


def _load_safetensors(model: nn.Module, model_dir: Path, held: set[str] = frozenset()) -> None:
    """Every parameter from the checkpoint, but those in held (already filled: not read); in
    a converted GGUF's folder those the safetensors lack from the linked file."""
    from safetensors import safe_open

    params = dict(model.named_parameters())  # tied weights appear once, under the embedding
    packed = getattr(model, "packed_modules_mapping", {})
    expected: dict[str, set] = {}  # merged fragment -> the shard ids that fill it
    for dst, shard_id in packed.values():
        expected.setdefault(dst, set()).add(shard_id)
    # name -> (parameter, shard id) or None: a model whose tensors the packed mapping cannot
    # place (engine.models.moe: one checkpoint tensor per expert into stacked parameters)
    remap = getattr(model, "map_checkpoint_name", None)
    # name -> [(parameter, shard id, offset, size)] or None: a checkpoint tensor that fuses
    # several of a merged parameter's shards (Phi-3's qkv_proj, gate_up_proj), split on dim 0
    # into the shards, each then loaded (and split for tensor parallelism) as its own tensor
    fused = getattr(model, "fused_checkpoint_shards", None)
    # name -> the name this pipeline stage loads it as, or None: another stage's tensor
    # (engine.models.pipeline); without pipeline parallelism every name is this rank's
    stage_name = getattr(model, "stage_checkpoint_name", None) if get_pp_size() > 1 else None
    # name -> the model's name for it, or None (not loaded): a pooling model's (no LM head;
    # a base-model checkpoint's names without `model.`), engine.models.pooling
    rename = getattr(model, "rename_checkpoint", None)
    # name -> the name a quantized format's layers take it under (checkpoint.py's hook)
    quant_name = getattr(model, "quant_checkpoint_name", None)
    loaded: dict[str, set] = {}
    seen: set[str] = set()  # checkpoint names read

    def fill(ckpt_name: str, tensor: Callable[[], torch.Tensor], source: str) -> None:
        seen.add(ckpt_name)
        if quant_name is not None:
            ckpt_name = quant_name(ckpt_name)
        if rename is not None:
            ckpt_name = rename(ckpt_name)
            if ckpt_name is None:
                return
        if stage_name is not None:
            ckpt_name = stage_name(ckpt_name)
            if ckpt_name is None:
                return
        if "rotary_emb.inv_freq" in ckpt_name:
            return
        if kv_scale_name(ckpt_name) is not None and load_kv_scale(model, ckpt_name, tensor()):
            return  # an FP8-KV checkpoint's cache scale, set on its attention layer
        parts = fused(ckpt_name) if fused is not None else None
        if parts is not None:
            whole = tensor()
            total = sum(size for *_, size in parts)
            if whole.shape[0] != total:
                raise ValueError(
                    f"{source}: {ckpt_name!r} has {whole.shape[0]} rows; its parts need {total}"
                )
            for target, shard, offset, size in parts:
                place(ckpt_name, target, shard, whole.narrow(0, offset, size), source)
            return
        mapped = remap(ckpt_name) if remap is not None else None
        if mapped is not None:  # the model's own rule first (a MoE's per-expert tensors)
            target, shard = mapped
        else:
            target, shard = ckpt_name, None
            for src, (dst, shard_id) in packed.items():
                if f".{src}." in ckpt_name:
                    target, shard = ckpt_name.replace(f".{src}.", f".{dst}."), shard_id
                    break
        place(ckpt_name, target, shard, tensor, source)

    def place(
        ckpt_name: str,
        target: str,
        shard,
        tensor: torch.Tensor | Callable[[], torch.Tensor],
        source: str,
    ) -> None:
        if target in held:
            return
        param = params.get(target)
        if param is None:
            if ckpt_name == "lm_head.weight":  # tied: the embedding already serves
                return
            raise ValueError(f"{source}: unexpected weight {ckpt_name!r}")
        loader = getattr(param, "weight_loader", _default_loader)
        data = tensor if isinstance(tensor, torch.Tensor) else tensor()
        if shard is None:
            loader(param, data)
        else:
            loader(param, data, shard)
        loaded.setdefault(target, set()).add(shard)

    for file in _weight_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for ckpt_name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                fill(ckpt_name, functools.partial(f.get_tensor, ckpt_name), file.name)

    def unfilled() -> list[str]:
        out = []
        for name in (n for n in params if n not in held):
            if getattr(params[name], "optional", False):  # a quantized format's optional tensor
                continue
            want = getattr(params[name], "expected_shards", None) or next(
                (ids for frag, ids in expected.items() if f".{frag}." in name), {None}
            )
            if loaded.get(name, set()) != want:
                out.append(name)
        return out

    if unfilled():  # the GGUF path's blocks leave nothing here: the file is not even opened
        for ckpt_name, tensor in linked_tensors(model_dir):
            if ckpt_name not in seen:
                fill(ckpt_name, tensor, "the linked GGUF")
    missing = unfilled()
    if missing:
        raise ValueError(f"{model_dir}: weights missing from the checkpoint: {missing[:5]}")


def _default_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"weight shape mismatch: checkpoint {tuple(loaded.shape)}, model {tuple(param.shape)}"
        )
    param.data.copy_(loaded)
