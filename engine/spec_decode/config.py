"""SpeculativeConfig: `--speculative-config` as vLLM spells it (JSON).

Methods: "ngram" (prompt lookup in the scheduler, no model), "draft_model" (a small model
sharing the target's tokenizer, run by the model runner; {"model": PATH} alone means it, as
in vLLM), "eagle" (an EAGLE-1 head over the target's hidden states, on the runner) and
"eagle3" (an EAGLE-3 head over three of the target's layers). A model-based proposer runs
whole on the driver under tensor parallelism (vLLM's "draft_tensor_parallel_size" 1, the
default), or a draft model with draft_tensor_parallel_size the target's tensor_parallel_size
is split over the ranks like the target (engine.worker.model_runner).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SUPPORTED_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# The keys each method reads; "method", "num_speculative_tokens", "disable_by_batch_size"
# (vLLM's) and Tessera's own "draft_backoff" and "adaptive" are common.
_COMMON = ("method", "num_speculative_tokens", "draft_backoff", "adaptive", "disable_by_batch_size")
_METHOD_KEYS = {
    "ngram": (*_COMMON, "prompt_lookup_max", "prompt_lookup_min"),
    "draft_model": (*_COMMON, "model", "draft_tensor_parallel_size"),
    "eagle": (*_COMMON, "model", "draft_tensor_parallel_size"),
    "eagle3": (*_COMMON, "model", "draft_tensor_parallel_size"),
}
_INT_KEYS = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
_LATER = ("mtp", "medusa")


def _unsupported(method: object) -> ValueError:
    extra = " (MTP and Medusa heads are not implemented yet)" if method in _LATER else ""
    return ValueError(
        f"speculative_config: method {method!r} is not supported yet (supported: "
        f"{', '.join(SUPPORTED_METHODS)}){extra}"
    )


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3  # k: drafts proposed per request and step
    prompt_lookup_max: int = 4  # longest n-gram matched (ngram)
    prompt_lookup_min: int = 1  # shortest n-gram matched (ngram)
    model: str | None = None  # the draft model's or head's folder
    # ranks the draft is split over: 1 (None), the draft whole on the driver; a draft model's
    # may be the target's tensor_parallel_size (engine.config checks), split like the target
    draft_tensor_parallel_size: int | None = None
    # a request whose drafts keep being rejected stops drafting a while (spec_decode.backoff)
    draft_backoff: bool = True
    # each step drafts only where drafting is measured to emit more tokens per second
    # (spec_decode.controller); false: every step drafts (up to disable_by_batch_size)
    adaptive: bool = True
    # no drafts in a step whose running requests number this many or more (vLLM's key):
    # large batches are compute bound, where verifying rejected drafts costs more than it saves
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SUPPORTED_METHODS:
            raise _unsupported(self.method)
        for name in _INT_KEYS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"speculative_config: {name} must be a positive integer, got {value!r}"
                )
        cutoff = self.disable_by_batch_size
        if cutoff is not None and (
            isinstance(cutoff, bool) or not isinstance(cutoff, int) or cutoff < 1
        ):
            raise ValueError(
                f"speculative_config: disable_by_batch_size must be a positive integer, got "
                f"{cutoff!r}"
            )
        tp = self.draft_tensor_parallel_size
        if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
            raise ValueError(
                f"speculative_config: draft_tensor_parallel_size must be a positive integer "
                f"(1, or the target's tensor_parallel_size), got {tp!r}"
            )
        for name in ("draft_backoff", "adaptive"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"speculative_config: {name} must be true or false, got {getattr(self, name)!r}"
                )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must not "
                f"exceed prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.method != "ngram" and (not isinstance(self.model, str) or not self.model):
            raise ValueError(
                f'speculative_config: method "{self.method}" needs "model": the draft '
                "model's (or EAGLE head's) folder"
            )
        if self.method == "ngram" and self.model is not None:
            raise ValueError('speculative_config: method "ngram" takes no "model"')

    @property
    def uses_model(self) -> bool:
        """Drafts come from a model the runner holds (not from the scheduler's n-gram)."""
        return self.method != "ngram"


def parse_speculative_config(
    value: str | dict[str, Any] | SpeculativeConfig | None,
) -> SpeculativeConfig | None:
    """A JSON object (text, as the flag gives it, or a dict, as LLM(...) may), a config, or
    None / "" / "none" (off). ValueError names the field and what is wrong."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        if value.strip().lower() in ("", "none", "null"):
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not valid JSON ({e.msg}): {value!r}") from None
    if not isinstance(value, dict):
        raise ValueError(
            "speculative_config must be a JSON object such as "
            '{"method": "ngram", "num_speculative_tokens": 3} or '
            '{"model": "/path/to/draft", "num_speculative_tokens": 3}, got ' + repr(value)
        )
    method = value.get("method")
    if method is None:
        if "model" not in value:
            raise ValueError(
                'speculative_config: "method" is required (supported: "ngram"; or give '
                '"model": a draft model)'
            )
        method = "draft_model"  # vLLM's reading of a bare "model"
        value = {**value, "method": method}
    if method not in SUPPORTED_METHODS:
        raise _unsupported(method)
    keys = _METHOD_KEYS[method]
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ValueError(
            f"speculative_config: unknown or unsupported key(s) {', '.join(unknown)} for "
            f"method {method!r} (known: {', '.join(keys)})"
        )
    return SpeculativeConfig(**value)
