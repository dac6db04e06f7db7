"""SpeculativeConfig: `--speculative-config` as vLLM spells it (JSON), n-gram only for now."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SUPPORTED_METHODS = ("ngram",)
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3  # k: drafts proposed per request and step
    prompt_lookup_max: int = 4  # longest n-gram matched
    prompt_lookup_min: int = 1  # shortest n-gram matched

    def __post_init__(self) -> None:
        if self.method not in SUPPORTED_METHODS:
            raise ValueError(
                f"speculative_config: method {self.method!r} is not supported yet (supported: "
                f"{', '.join(SUPPORTED_METHODS)}; draft models and EAGLE are not implemented)"
            )
        for name in _KEYS[1:]:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"speculative_config: {name} must be a positive integer, got {value!r}"
                )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must not "
                f"exceed prompt_lookup_max ({self.prompt_lookup_max})"
            )


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
            '{"method": "ngram", "num_speculative_tokens": 3}, got ' + repr(value)
        )
    method = value.get("method")
    if method is None:
        if "model" in value:
            raise ValueError(
                "speculative_config: draft models are not supported yet; use "
                '{"method": "ngram", ...}'
            )
        raise ValueError('speculative_config: "method" is required (supported: "ngram")')
    if method not in SUPPORTED_METHODS:
        raise ValueError(
            f"speculative_config: method {method!r} is not supported yet (supported: "
            f"{', '.join(SUPPORTED_METHODS)}; draft models and EAGLE are not implemented)"
        )
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(
            f"speculative_config: unknown or unsupported key(s) {', '.join(unknown)} for "
            f"method 'ngram' (known: {', '.join(_KEYS)})"
        )
    return SpeculativeConfig(**value)
