"""Pipeline-parallel stages: which contiguous layers a stage holds.

Balanced by layer count (vLLM's rule): each stage gets num_layers // pp_size, and the
remainder goes one each to the stages before the last, from the second-to-last backwards
(the first stage also holds the embedding, the last the final norm and the LM head).
TESSERA_PP_LAYER_PARTITION="2,1" overrides it: one count per stage, summing to the layers.
A stage builds only its own layers; the others are PPMissingLayer (no parameters), so the
checkpoint's layer indices still name the right modules and the loader skips the rest.
"""

from __future__ import annotations

import os

import torch
from torch import nn

PARTITION_ENV = "TESSERA_PP_LAYER_PARTITION"


def layer_partition(num_layers: int, pp_size: int, override: str | None = None) -> list[int]:
    """Layers per stage; override: the env var's "a,b,..." (None: read the environment)."""
    if override is None:
        override = os.environ.get(PARTITION_ENV) or None
    if override is not None:
        try:
            counts = [int(x) for x in override.split(",")]
        except ValueError:
            raise ValueError(
                f"{PARTITION_ENV}={override!r}: not comma-separated integers"
            ) from None
        if len(counts) != pp_size or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(
                f"{PARTITION_ENV}={override!r}: needs {pp_size} counts of at least 1 that sum "
                f"to the model's {num_layers} layers"
            )
        return counts
    if num_layers < pp_size:
        raise ValueError(
            f"pipeline_parallel_size {pp_size} is more than the model's {num_layers} layers"
        )
    counts = [num_layers // pp_size] * pp_size
    for i in range(num_layers % pp_size):
        counts[-2 - i] += 1
    return counts


def layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers stage pp_rank holds."""
    counts = layer_partition(num_layers, pp_size)
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]


class PPMissingLayer(nn.Identity):
    """A module another stage holds: no parameters, never called."""


class IntermediateTensors:
    """What one stage hands the next: the hidden states and the residual, [T, H] each
    (residual None: a stage that reads the hidden states alone, as an EAGLE head reads its
    target's, engine.spec_decode.eagle.HeadStage). Unpacks as (hidden, residual)."""

    __slots__ = ("hidden", "residual")

    def __init__(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        self.hidden, self.residual = hidden, residual

    def __iter__(self):
        return iter((self.hidden, self.residual))
