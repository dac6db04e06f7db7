"""A PEFT LoRA folder read and checked against the base model, then sharded for a TP rank.

    adapter = read_adapter(path, hf_config, max_lora_rank)         # ValueError names the field
    shard = adapter.shard(hf_config, tp_rank, tp_size, dtype)      # this rank's A/B per slice

The folder holds adapter_config.json and adapter_model.safetensors (PEFT's
`save_pretrained`). Supported targets are the decoder's projections, q/k/v/o and
gate/up/down; Tessera's merged qkv_proj and gate_up_proj take each projection's A/B as a
slice of the merged output (SLICES). A mixture of experts' projections, per expert or
stacked (`target_parameters`), are read by engine.lora.experts into one (A, B) per
projection with every expert stacked, keyed (layer index, "experts"). Each module has its own rank and scaling where the config
has `rank_pattern` / `alpha_pattern` (keys matched against the module's name as peft's
get_pattern_key does: the first key that matches a suffix of the name, as a regex); its
scaling lora_alpha / r (lora_alpha / sqrt(r) with use_rslora) is folded into its B once, here,
so a step computes y += (x A^T) B^T whatever the module's rank (a slot packs each slice to
its own rank, engine.lora.layers).

DoRA (`use_dora`) adds a magnitude m [out] per module (lora_magnitude_vector): peft's output
is m / ||W + s B A||_row * (x W^T + s x A^T B^T) + bias, the norm of each output row over the
input dim. The adapter keeps m; the runner, which holds W as served, turns it into the scale
m / ||W + s B A|| once per load (engine.lora.manager). Not over a quantized base (W is then
not the float weight peft normed) nor on embed_tokens / lm_head.

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
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from engine.lora.experts import (
    LAYER as EXPERTS,
)
from engine.lora.experts import (
    PER_EXPERT,
    STACKED,
    ExpertsReader,
    is_expert_key,
    shard_experts,
)

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
    # a MoE layer's shared expert (Qwen2-MoE), a dense MLP beside the experts
    "shared_expert.gate_up_proj": ("shared_expert.gate_proj", "shared_expert.up_proj"),
    "shared_expert.down_proj": ("shared_expert.down_proj",),
}
SHARED = "shared_expert."
# PEFT target module -> (Tessera layer, slice index)
TARGETS: dict[str, tuple[str, int]] = {
    module: (layer, i) for layer, modules in SLICES.items() for i, module in enumerate(modules)
}
# Tessera layer -> whether it is row-parallel (input split across ranks) or column-parallel
ROW_PARALLEL = {"o_proj", "down_proj", "shared_expert.down_proj"}
# model-level targets, split by vocabulary across TP ranks (engine.layers.embedding)
VOCAB_TARGETS = ("embed_tokens", "lm_head")
MODEL_LAYER = -1  # their "layer index" in LoRAAdapter.weights
SUPPORTED = (*(t for t in TARGETS if not t.startswith(SHARED)), *VOCAB_TARGETS)
# target modules that exist only as a MoE's experts (Mixtral's per-expert names)
EXPERT_ONLY = tuple(m for m in PER_EXPERT if m not in TARGETS)
_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.((?:shared_expert\.)?\w+)\.lora_([AB])"
    r"(?:\.\w+)?\.weight$"
)
_EMBED_KEY = re.compile(r"(?:^|\.)embed_tokens\.lora_embedding_([AB])(?:\.\w+)?$")
_HEAD_KEY = re.compile(r"(?:^|\.)lm_head\.lora_([AB])(?:\.\w+)?\.weight$")
_BASE_COPY = re.compile(r"(?:^|\.)(embed_tokens|lm_head)\.base_layer\.weight$")
_MAGNITUDE_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.((?:shared_expert\.)?\w+)"
    r"\.lora_magnitude_vector(?:\.\w+)?$"
)
_PEFT_PREFIX = "base_model.model."  # save_pretrained's prefix over the base model's names


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
    shared = cfg.shared_expert_intermediate_size
    return {
        "shared_expert.gate_proj": (shared, h),
        "shared_expert.up_proj": (shared, h),
        "shared_expert.down_proj": (h, shared),
        "q_proj": (cfg.num_attention_heads * d, h),
        "k_proj": (cfg.num_key_value_heads * d, h),
        "v_proj": (cfg.num_key_value_heads * d, h),
        "o_proj": (h, cfg.num_attention_heads * d),
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "down_proj": (h, i),
    }


Slices = list["tuple[torch.Tensor, torch.Tensor] | None"]


@dataclass(slots=True)
class AdapterShard:
    """One TP rank's part of an adapter, per (layer index, Tessera layer): weights, one
    (A, B) or None per slice; magnitudes (DoRA), each slice's m over this rank's output rows
    (float32; None where the adapter does not target the slice), empty for a plain LoRA; scales,
    the runner's m / ||W + s B A|| made from them at load (engine.lora.manager)."""

    weights: dict[tuple[int, str], Slices]
    magnitudes: dict[tuple[int, str], list[torch.Tensor | None]] = field(default_factory=dict)
    scales: dict[tuple[int, str], list[torch.Tensor | None]] = field(default_factory=dict)

    def cast(self, dtype: torch.dtype) -> AdapterShard:
        """The A/B in the slots' dtype (magnitudes and scales stay float32)."""
        weights = {
            key: [None if ab is None else (ab[0].to(dtype), ab[1].to(dtype)) for ab in slices]
            for key, slices in self.weights.items()
        }
        return AdapterShard(weights, self.magnitudes, self.scales)


@dataclass(slots=True)
class LoRAAdapter:
    """One adapter as read: (layer index, target module) -> (A [r, in], B*scale [out, r]),
    full (unsharded) float32 tensors, r and scale the module's own; shapes only (None) when
    read with check=True. rank: the largest module rank; scaling: the config's (lora_alpha,
    r), which rank_pattern / alpha_pattern may override per module. magnitudes: DoRA's m
    [out] per (layer index, target module), empty unless use_dora."""

    path: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor] | None]
    use_dora: bool = False
    magnitudes: dict[tuple[int, str], torch.Tensor | None] = field(default_factory=dict)

    def shard(
        self,
        cfg: HFModelConfig,
        tp_rank: int,
        tp_size: int,
        dtype: torch.dtype,
        expert_parallel: bool = False,
    ) -> AdapterShard:
        """This rank's weights per (layer index, Tessera layer): one (A, B) or None per slice.
        Column-parallel layers (qkv, gate_up) split each slice's B on its output rows (and
        DoRA's m with them); row-parallel ones (o, down) split A on its input columns (the base
        layer's all-reduce then sums the ranks' partial products; m stays whole: it scales
        the reduced output). Experts as FusedMoE holds them (engine.lora.experts)."""
        out: dict[tuple[int, str], Slices] = {}
        mags: dict[tuple[int, str], list[torch.Tensor | None]] = {}
        for (layer_idx, module), ab in self.weights.items():
            assert ab is not None, "read with check=True: no values"
            if module == EXPERTS:
                parts = shard_experts(ab, cfg, tp_rank, tp_size, expert_parallel)
                out[(layer_idx, module)] = [
                    None
                    if p is None
                    else (p[0].to(dtype).contiguous(), p[1].to(dtype).contiguous())
                    for p in parts
                ]
                continue
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
            m = self.magnitudes.get((layer_idx, module))
            if layer in ROW_PARALLEL:
                size = a.shape[1] // tp_size
                a = a.narrow(1, tp_rank * size, size)
            else:
                size = b.shape[0] // tp_size
                b = b.narrow(0, tp_rank * size, size)
                if m is not None:
                    m = m.narrow(0, tp_rank * size, size)
            slices = out.setdefault((layer_idx, layer), [None] * len(SLICES[layer]))
            slices[index] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
            if m is not None:
                mag = mags.setdefault((layer_idx, layer), [None] * len(SLICES[layer]))
                mag[index] = m.float().contiguous()
        return AdapterShard(out, mags)


def _bad(path: Path, field: str, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {str(path)!r}: {field}: {why}")


def pattern_key(keys, name: str) -> str | None:
    """The first of keys that matches name as peft's get_pattern_key does (a regex over a
    dot-separated suffix of the module's name), or None."""
    for key in keys:
        if re.match(rf"(.*\.)?({key})$", name):
            return key
    return None


@dataclass(slots=True, frozen=True)
class AdapterConfig:
    """adapter_config.json's fields that shape the weights. targets: None for a regex."""

    r: int
    alpha: float
    use_rslora: bool
    use_dora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    targets: tuple[str, ...] | None
    target_parameters: tuple[str, ...] = ()  # experts' stacked parameters (engine.lora.experts)

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.r) if self.use_rslora else self.alpha / self.r

    def rank_of(self, name: str) -> tuple[int, str]:
        """A module's rank and the field it comes from ("r" or "rank_pattern")."""
        key = pattern_key(self.rank_pattern, name)
        return (self.r, "r") if key is None else (self.rank_pattern[key], "rank_pattern")

    def scaling_of(self, name: str) -> float:
        """A module's lora_alpha / r (/ sqrt(r) with use_rslora), each from its pattern."""
        r, _ = self.rank_of(name)
        key = pattern_key(self.alpha_pattern, name)
        alpha = self.alpha if key is None else self.alpha_pattern[key]
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _number(value: object, integer: bool = False) -> bool:
    kinds = int if integer else int | float
    return isinstance(value, kinds) and not isinstance(value, bool)


def _pattern(path: Path, config: dict, name: str, integer: bool) -> dict:
    """rank_pattern / alpha_pattern: a JSON object of module-name patterns to numbers."""
    pattern = config.get(name) or {}
    if not isinstance(pattern, dict):
        raise _bad(path, name, f"must be an object of module-name patterns, got {pattern!r}")
    for key, value in pattern.items():
        if not _number(value, integer) or value <= 0:
            what = "a positive integer" if integer else "a positive number"
            raise _bad(path, name, f"{key!r}: must be {what}, got {value!r}")
        try:
            re.compile(key)
        except re.error as e:
            raise _bad(path, name, f"{key!r} is not a valid pattern ({e})") from None
    return dict(pattern)


def read_config(path: Path, quantization: str | None = None) -> AdapterConfig:
    """adapter_config.json's fields, checked. quantization: the base model's method (None:
    float weights), which DoRA needs."""
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
    if not _number(r, integer=True) or r < 1:
        raise _bad(path, "r", f"must be a positive integer, got {r!r}")
    alpha = config.get("lora_alpha", r)
    if not _number(alpha):
        raise _bad(path, "lora_alpha", f"must be a number, got {alpha!r}")
    for name, unsupported in (
        ("fan_in_fan_out", bool(config.get("fan_in_fan_out"))),
        ("modules_to_save", bool(config.get("modules_to_save"))),
        ("bias", config.get("bias", "none") not in (None, "none")),
        ("lora_bias", bool(config.get("lora_bias"))),
        ("layers_to_transform", config.get("layers_to_transform") is not None),
        ("trainable_token_indices", bool(config.get("trainable_token_indices"))),
    ):
        if unsupported:
            raise _bad(path, name, f"{config.get(name)!r} is not supported")
    use_dora = bool(config.get("use_dora"))
    if use_dora and quantization is not None:
        raise _bad(
            path,
            "use_dora",
            f"DoRA over a quantized base model (quantization {quantization!r}) is not "
            "supported: its norm is of the float weights (serve them: --quantization none)",
        )
    rank_pattern = _pattern(path, config, "rank_pattern", integer=True)
    alpha_pattern = _pattern(path, config, "alpha_pattern", integer=False)
    parameters = _target_parameters(path, config)
    targets = config.get("target_modules")
    if isinstance(targets, str):  # a regex: the tensors' names say what it matched
        parsed = None
    elif parameters and not targets:
        parsed = ()
    elif not isinstance(targets, list) or not targets:
        raise _bad(path, "target_modules", f"must be a non-empty list, got {targets!r}")
    else:
        unknown = sorted(str(t) for t in targets if t not in SUPPORTED and t not in EXPERT_ONLY)
        if unknown:
            raise _bad(
                path,
                "target_modules",
                f"{', '.join(unknown)} not supported (supported: {', '.join(SUPPORTED)})",
            )
        parsed = tuple(dict.fromkeys(targets))
        if use_dora and any(t in VOCAB_TARGETS for t in parsed):
            raise _bad(path, "use_dora", "DoRA on embed_tokens / lm_head is not supported")
    if use_dora and parameters:
        raise _bad(path, "use_dora", "DoRA on experts (target_parameters) is not supported")
    return AdapterConfig(
        r, alpha, bool(config.get("use_rslora")), use_dora, rank_pattern, alpha_pattern, parsed,
        parameters,
    )  # fmt: skip


def _target_parameters(path: Path, config: dict) -> tuple[str, ...]:
    """target_parameters (peft's LoRA on nn.Parameters): only experts' stacked projections."""
    parameters = config.get("target_parameters") or []
    if not isinstance(parameters, list) or not all(isinstance(p, str) for p in parameters):
        raise _bad(path, "target_parameters", f"must be a list of names, got {parameters!r}")
    unsupported = [p for p in parameters if p.rpartition(".")[2] not in STACKED]
    if unsupported:
        raise _bad(
            path,
            "target_parameters",
            f"{', '.join(unsupported)} not supported (supported: the experts' "
            f"{' and '.join(STACKED)}, e.g. mlp.experts.gate_up_proj)",
        )
    return tuple(parameters)


def _module_name(key: str) -> str:
    """The module's name in the base model (what peft's patterns match) from a tensor key."""
    name = key.split(".lora_")[0]
    return name[len(_PEFT_PREFIX) :] if name.startswith(_PEFT_PREFIX) else name


def _module_rank(path: Path, key: str, config: AdapterConfig, max_lora_rank: int) -> int:
    """A module's rank, refused above max_lora_rank naming the field it came from."""
    return _rank_of(path, _module_name(key), config, max_lora_rank)


def _rank_of(path: Path, name: str, config: AdapterConfig, max_lora_rank: int) -> int:
    r, source = config.rank_of(name)
    if r > max_lora_rank:
        if source == "r":
            raise _bad(path, "r", f"rank {r} is above max_lora_rank ({max_lora_rank})")
        raise _bad(
            path,
            "rank_pattern",
            f"{pattern_key(config.rank_pattern, name)!r} gives {name} rank {r}, above "
            f"max_lora_rank ({max_lora_rank})",
        )
    return r


def read_adapter(
    path: str | Path,
    cfg: HFModelConfig,
    max_lora_rank: int,
    *,
    check: bool = False,
    quantization: str | None = None,
) -> LoRAAdapter:
    """Read and check a PEFT LoRA folder against the base model's config; ValueError names
    the field or tensor at fault. check=True reads the tensors' shapes, not their values.
    quantization: the base model's method (None: float weights), refused with DoRA."""
    from safetensors import safe_open

    path = Path(path)
    config = read_config(path, quantization)
    targets = config.targets
    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise _bad(path, WEIGHTS_FILE, "missing (PEFT's save_pretrained writes one)")
    shapes = projection_shapes(cfg)
    experts = ExpertsReader(cfg, partial(_bad, path), list(config.target_parameters), check)
    halves: dict[tuple[int, str], dict[str, object]] = {}
    ranks: dict[tuple[int, str], int] = {}
    scales: dict[tuple[int, str], float] = {}
    magnitudes: dict[tuple[int, str], torch.Tensor | None] = {}
    try:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                shape = tuple(f.get_slice(key).get_shape())
                if _BASE_COPY.search(key) is None and ".lora_" in key:
                    r = _module_rank(path, key, config, max_lora_rank)
                else:
                    r = config.r
                vocab = _vocab_key(path, key, shape, cfg, r, targets)
                if vocab == "base":
                    continue
                if vocab is not None:
                    module, half = vocab
                    if config.use_dora:
                        raise _bad(path, "use_dora", f"DoRA on {module} is not supported")
                    where = (MODEL_LAYER, module)
                    ranks[where], scales[where] = r, config.scaling_of(_module_name(key))
                    halves.setdefault(where, {})[half] = None if check else f.get_tensor(key)
                    continue
                if is_expert_key(key):
                    _expert_tensor(path, key, shape, f, experts, config, max_lora_rank)
                    continue
                mag = _MAGNITUDE_KEY.search(key)
                m = mag or _KEY.search(key)
                if m is None:
                    raise _bad(path, key, "not a LoRA weight of a supported target module")
                layer_idx, module = int(m.group(1)), m.group(2)
                short = module.removeprefix(SHARED)  # as target_modules names it
                if module not in TARGETS or (targets is not None and short not in targets):
                    raise _bad(path, key, f"target module {module!r} is not supported here")
                if layer_idx >= cfg.num_hidden_layers:
                    raise _bad(
                        path,
                        key,
                        f"layer {layer_idx} does not exist (the model has {cfg.num_hidden_layers})",
                    )
                moe = cfg.is_moe_layer(layer_idx)
                if TARGETS[module][0] in ("gate_up_proj", "down_proj") and moe:
                    raise _bad(
                        path,
                        key,
                        f"layer {layer_idx}'s MLP is a mixture of experts: no dense {module} "
                        "(its experts take adapters as mlp.experts)",
                    )
                if module.startswith(SHARED) and not (moe and cfg.shared_expert_intermediate_size):
                    raise _bad(path, key, f"layer {layer_idx} has no shared expert")
                out_f, in_f = shapes[module]
                if mag is not None:
                    if not config.use_dora:
                        raise _bad(path, key, "a DoRA magnitude, but use_dora is not set")
                    if shape != (out_f,):
                        raise _bad(
                            path,
                            key,
                            f"shape {shape} does not fit the base model (expected {(out_f,)})",
                        )
                    magnitudes[(layer_idx, module)] = None if check else f.get_tensor(key)
                    continue
                half = m.group(3)
                want = (r, in_f) if half == "A" else (out_f, r)
                if shape != want:
                    raise _bad(
                        path, key, f"shape {shape} does not fit the base model (expected {want})"
                    )
                where = (layer_idx, module)
                ranks[where], scales[where] = r, config.scaling_of(_module_name(key))
                halves.setdefault(where, {})[half] = None if check else f.get_tensor(key)
    except ValueError:
        raise
    except Exception as e:  # a truncated or foreign file
        raise _bad(path, WEIGHTS_FILE, f"unreadable ({e})") from None
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor] | None] = {}
    for (layer_idx, module), ab in halves.items():
        where = module if layer_idx == MODEL_LAYER else f"layers.{layer_idx}.{module}"
        for half in "AB":
            if half not in ab:
                raise _bad(path, f"{where}.lora_{half}", "missing")
        if config.use_dora and (layer_idx, module) not in magnitudes:
            raise _bad(path, f"{where}.lora_magnitude_vector", "missing (use_dora is set)")
        if check:
            weights[(layer_idx, module)] = None
        else:
            scale = scales[(layer_idx, module)]
            a, b = ab["A"].float(), ab["B"].float() * scale  # type: ignore[union-attr]
            weights[(layer_idx, module)] = (a, b)
    expert_weights = experts.assemble()
    weights.update(expert_weights)  # type: ignore[arg-type]
    stray = [key for key in magnitudes if key not in weights]
    if stray:
        layer_idx, module = stray[0]
        raise _bad(path, f"layers.{layer_idx}.{module}.lora_magnitude_vector", "has no lora_A/B")
    if not check:
        magnitudes = {key: m.float() for key, m in magnitudes.items()}  # type: ignore[union-attr]
    found = {module.removeprefix(SHARED) for _, module in weights if module != EXPERTS}
    found |= experts.modules
    if not weights:
        raise _bad(path, WEIGHTS_FILE, "holds no LoRA weights")
    parameters = tuple(p.rpartition(".")[2] for p in config.target_parameters)
    for name, listed in (("target_modules", targets or ()), ("target_parameters", parameters)):
        missing = [t for t in dict.fromkeys(listed) if t not in found]
        if missing:
            raise _bad(path, name, f"{', '.join(missing)} listed but not in {WEIGHTS_FILE}")
    return LoRAAdapter(
        str(path),
        max([*ranks.values(), *(r for r, _ in experts.ranks.values())]),
        config.scaling,
        tuple(sorted(found)),
        weights,
        config.use_dora,
        magnitudes,
    )


def _expert_tensor(
    path: Path,
    key: str,
    shape: tuple[int, ...],
    f,
    experts: ExpertsReader,
    config: AdapterConfig,
    max_lora_rank: int,
) -> None:
    """One tensor of a MoE layer's experts, checked and handed to the experts' reader."""
    if config.use_dora:
        raise _bad(path, key, "DoRA on experts is not supported")
    module = key.split(".lora_")[0].rpartition(".")[2]
    targets = config.targets
    if module in PER_EXPERT and targets is not None and module not in targets:
        raise _bad(path, key, f"target module {module!r} is not in target_modules")

    def rank_scale(name: str) -> tuple[int, float]:
        return _rank_of(path, name, config, max_lora_rank), config.scaling_of(name)

    experts.add(key, shape, rank_scale, lambda: f.get_tensor(key))


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
