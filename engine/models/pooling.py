"""A generation model's class as a pooling model: the same layers, no LM head.

The runner pools the final-normed hidden states (engine.worker.pooler), so the vocabulary
projection is never built into the step and its checkpoint tensor is not loaded. Checkpoints
of a base-model class (`Qwen3Model`, saved by `AutoModel`) name their tensors without the
`model.` prefix: rename_checkpoint adds it (the loader applies it first).
"""

from __future__ import annotations

import functools

from torch import nn


@functools.cache
def as_pooling_model(cls: type[nn.Module]) -> type[nn.Module]:
    class PoolingModel(cls):  # type: ignore[misc, valid-type]
        def __init__(self, cfg, max_position: int | None = None):
            super().__init__(cfg, max_position=max_position)
            self.lm_head = None  # pooled hidden states are the output

        def rename_checkpoint(self, name: str) -> str | None:
            """The model's name for a checkpoint tensor; None: not loaded (the LM head)."""
            if name.startswith("lm_head."):
                return None
            return name if name.startswith("model.") else "model." + name

    PoolingModel.__name__ = PoolingModel.__qualname__ = (
        cls.__name__.removesuffix("ForCausalLM") + "ForEmbedding"
    )
    return PoolingModel
