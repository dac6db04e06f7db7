"""PoolingParams and PoolerConfig: what a pooling (embedding) request asks for, and what the
model's folder says about pooling (engine.pooler_config reads it).

A pooling request runs its prompt through the same model runner as a generation, but is
never sampled: the final-normed hidden states of its prompt are pooled into one vector
(engine.worker.pooler), and the request ends as soon as its prompt is computed.

    LAST  the last prompt token's hidden state (decoder embedders: Qwen3-Embedding, E5-Mistral)
    MEAN  the mean over every prompt token
    CLS   the first token's hidden state
"""

from __future__ import annotations

from dataclasses import dataclass, field

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNER_CHOICES = ("auto", "generate", "pooling")


@dataclass(slots=True, frozen=True)
class PoolingParams:
    """One pooling request's options (vLLM's names). dimensions: keep the first this many
    values (Matryoshka models only; normalized after the cut); normalize, pooling_type:
    None = the model's (the engine fills both in when it admits the request)."""

    dimensions: int | None = None
    normalize: bool | None = None
    pooling_type: str | None = None

    @property
    def needs_every_position(self) -> bool:
        """Whether pooling reads rows other than the last: a prefix-cache hit would skip them."""
        return self.pooling_type not in (None, "LAST")

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}"
            )
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
        ):
            raise ValueError(f"dimensions must be an integer, got {self.dimensions!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")


@dataclass(slots=True, frozen=True)
class PoolerConfig:
    """How this model pools: the type, whether it L2-normalizes, and the Matryoshka
    dimensions it was trained for (config.json's `matryoshka_dimensions`, or any size up to
    hidden_size where it only says `is_matryoshka`; none: `dimensions` is refused)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    hidden_size: int = 0
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = field(default_factory=tuple)
    source: str = "the decoder default (last token, normalized)"

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}"
            )

    def resolve(self, params: PoolingParams) -> PoolingParams:
        """params with the model's defaults filled in; ValueError for a size it cannot cut to."""
        self.check_dimensions(params.dimensions)
        return PoolingParams(
            params.dimensions,
            self.normalize if params.normalize is None else params.normalize,
            params.pooling_type or self.pooling_type,
        )

    def check_dimensions(self, dimensions: int | None) -> None:
        """ValueError (naming `dimensions`) unless the model can be truncated to this size."""
        if dimensions is None:
            return
        if not (self.is_matryoshka or self.matryoshka_dimensions):
            raise ValueError(
                "dimensions: this model does not support Matryoshka representations (its "
                "config.json sets neither is_matryoshka nor matryoshka_dimensions), so its "
                "embeddings cannot be shortened; leave dimensions unset"
            )
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            allowed = ", ".join(map(str, self.matryoshka_dimensions))
            raise ValueError(
                f"dimensions: this model supports the Matryoshka dimensions {allowed}; "
                f"got {dimensions}"
            )
        if not 1 <= dimensions <= self.hidden_size:
            raise ValueError(
                f"dimensions must be between 1 and the model's hidden size {self.hidden_size}, "
                f"got {dimensions}"
            )
