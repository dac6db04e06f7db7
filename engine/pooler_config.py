"""Which runner a model folder gets, and how it pools (engine.pooling_params.PoolerConfig).

--runner auto picks pooling for an embedding model: a folder of sentence-transformers
(`modules.json`), or an architecture without an LM head (`LlamaModel`, `Qwen3Model`: a
base-model class, not `...ForCausalLM`); else generate. A pooling model pools as its
sentence-transformers modules say (the Pooling module's `config.json` mode; a Normalize
module or not), else last token + normalize, vLLM's default for decoder models
(Qwen3-Embedding's way). Matryoshka sizes come from config.json (`is_matryoshka`,
`matryoshka_dimensions`). What the engine cannot reproduce (a Dense projection, max or
weighted-mean pooling) is refused at start rather than served as wrong vectors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.pooling_params import RUNNER_CHOICES, PoolerConfig

_ST = "sentence_transformers.models."
# sentence-transformers' Pooling config flags -> our pooling types
_MODE_FLAGS = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
_UNSUPPORTED_FLAGS = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
_MODE_NAMES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}


def is_embedding_architecture(architecture: str) -> bool:
    """A base-model class (`Qwen3Model`): hidden states out, no LM head (`GPT2LMHeadModel`
    also ends in "Model" and has one)."""
    return architecture.endswith("Model") and "LMHead" not in architecture


def resolve_runner(requested: str, model_dir: Path, architecture: str) -> str:
    """`generate` or `pooling` for --runner (auto: as the folder says, see the module doc)."""
    if requested not in RUNNER_CHOICES:
        raise ValueError(f"runner must be one of {', '.join(RUNNER_CHOICES)}, got {requested!r}")
    embedding = is_embedding_architecture(architecture)
    if requested == "auto":
        return "pooling" if embedding or (model_dir / "modules.json").is_file() else "generate"
    if requested == "generate" and embedding:
        raise ValueError(
            f"architecture {architecture} has no LM head, so it cannot generate: serve it "
            "with --runner pooling (runner='pooling')"
        )
    return requested


def read_pooler_config(
    model_dir: Path, raw_config: dict[str, Any], hidden_size: int
) -> PoolerConfig:
    """The folder's pooling (see the module doc); ValueError for what cannot be served."""
    dims = raw_config.get("matryoshka_dimensions") or ()
    matryoshka = dict(
        hidden_size=hidden_size,
        is_matryoshka=bool(raw_config.get("is_matryoshka", False)),
        matryoshka_dimensions=tuple(int(d) for d in dims),
    )
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return PoolerConfig(**matryoshka)
    modules = json.loads(modules_path.read_text())
    pooling_type, normalize = "LAST", False
    for module in modules:
        kind = str(module.get("type", "")).removeprefix(_ST)
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            pooling_type = _pooling_mode(model_dir / module.get("path", ""))
        else:
            raise ValueError(
                f"{modules_path}: the sentence-transformers module {module.get('type')!r} is "
                "not supported (only Transformer, Pooling and Normalize are)"
            )
    source = f"{modules_path.name} ({pooling_type.lower()} pooling"
    source += ", normalized)" if normalize else ", not normalized)"
    return PoolerConfig(pooling_type, normalize, source=source, **matryoshka)


def _pooling_mode(folder: Path) -> str:
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{path} is missing: the Pooling module's mode is unknown")
    cfg = json.loads(path.read_text())
    if isinstance(cfg.get("pooling_mode"), str):  # newer sentence-transformers
        mode = _MODE_NAMES.get(cfg["pooling_mode"])
        if mode is None:
            raise ValueError(f"{path}: pooling_mode {cfg['pooling_mode']!r} is not supported")
        return mode
    unsupported = [f for f in _UNSUPPORTED_FLAGS if cfg.get(f)]
    chosen = [mode for flag, mode in _MODE_FLAGS.items() if cfg.get(flag)]
    if unsupported or len(chosen) != 1:
        raise ValueError(
            f"{path}: exactly one of {', '.join(_MODE_FLAGS)} must be true (the engine pools "
            f"by last token, mean or CLS); it sets {', '.join(unsupported + chosen) or 'none'}"
        )
    return chosen[0]
