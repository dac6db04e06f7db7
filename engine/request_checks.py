"""What a request is checked against before the engine admits it: its prompt's ids against
the vocabulary, its length against max_model_len, its sampling (or pooling) parameters, and a
LoRA adapter's folder against the base model. Pure functions of the engine's facts, so a
server checks a request on its own thread (AsyncEngine) or in its own process (the engine
core in another, engine.core_process) before the first await, as the engine would.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.config import EngineConfig
from engine.lora.request import LoRARequest
from engine.pooling_params import PoolingParams
from engine.protocol import EngineRequest
from engine.sampling_params import SamplingParams

# What the scheduler reads of a pooling request's SamplingParams: one sample, never run.
_POOLING_SAMPLING = SamplingParams(max_tokens=1)


class RequestChecks:
    """The checks, over the facts the class that mixes them in holds: runner, vocab_size,
    max_model_len, config, hf_config, base_quantization and _adapters (the LoRA adapters
    checked so far, by lora_int_id)."""

    runner: str
    vocab_size: int
    max_model_len: int
    config: EngineConfig
    hf_config: Any
    base_quantization: str | None
    _adapters: dict[int, LoRARequest]

    def _check_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("The prompt is empty: it must contain at least one token.")
        bad = next((t for t in prompt_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"Token id {bad} in the prompt is out of range: the vocabulary has "
                f"{self.vocab_size} tokens (ids 0..{self.vocab_size - 1})."
            )

    def validate(self, request: EngineRequest) -> None:
        """validate_request or validate_pooling, as the request is; its params resolved in
        place. The runner must match: a pooling engine only pools, a generating one only
        generates. Pure, as validate_request."""
        if (request.pooling is not None) != (self.runner == "pooling"):
            if self.runner == "pooling":
                raise ValueError(
                    "This model is served by the pooling runner (embeddings): it cannot "
                    "generate text; start the engine with --runner generate for that."
                )
            raise ValueError(
                "This model is served by the generate runner: embeddings need an engine "
                "started with --runner pooling (runner='pooling')."
            )
        if request.pooling is not None:
            request.pooling = self.validate_pooling(request.prompt_token_ids, request.pooling)
            request.params = _POOLING_SAMPLING
        else:
            request.params = self.validate_request(request.prompt_token_ids, request.params)

    def validate_pooling(self, prompt_token_ids: list[int], params: PoolingParams) -> PoolingParams:
        """Raise ValueError with a user-facing message; return params with the model's
        pooling filled in (engine.pooling_params.PoolerConfig.resolve)."""
        self._check_prompt(prompt_token_ids)
        limit, n_prompt = self.max_model_len, len(prompt_token_ids)
        if n_prompt > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens; your input has "
                f"{n_prompt} tokens. Shorten the input."
            )
        pooler = self.config.model.pooler
        assert pooler is not None
        return pooler.resolve(params)

    def validate_request(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> SamplingParams:
        """Raise ValueError with a user-facing message; return params with max_tokens resolved.

        Pure: touches no engine state, so AsyncEngine calls it on the caller's thread."""
        self._check_prompt(prompt_token_ids)
        n_prompt = len(prompt_token_ids)
        for name, ids in (
            ("logit_bias", list(params.logit_bias or {})),
            ("stop_token_ids", params.stop_token_ids),
        ):
            bad = next((t for t in ids if not 0 <= int(t) < self.vocab_size), None)
            if bad is not None:
                raise ValueError(
                    f"{name} names token id {bad}, outside the vocabulary (0..{self.vocab_size - 1})."
                )
        limit = self.max_model_len
        if params.max_tokens is None:
            if n_prompt >= limit:
                raise ValueError(
                    f"This model's maximum context length is {limit} tokens; your prompt has "
                    f"{n_prompt} tokens, which leaves no room for a completion. Shorten the prompt."
                )
            return dataclasses.replace(params, max_tokens=limit - n_prompt)
        if n_prompt + params.max_tokens > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens; your prompt has "
                f"{n_prompt} tokens and max_tokens asks for {params.max_tokens} more "
                f"({n_prompt + params.max_tokens} in total). Shorten the prompt or lower max_tokens."
            )
        return params

    def check_adapter(self, lora: LoRARequest) -> None:
        """ValueError unless LoRA is enabled and the adapter's folder fits the base model
        (engine.lora.adapter: its config and tensor shapes, read once per lora_int_id), and
        its lora_int_id names no other adapter."""
        if not self.config.lora.enabled:
            raise ValueError(
                f"LoRA adapter {lora.lora_name!r} requested, but LoRA is not enabled: start the "
                "engine with enable_lora=True (--enable-lora)"
            )
        known = self._adapters.get(lora.lora_int_id)
        if known is not None:
            if known != lora:
                raise ValueError(
                    f"lora_int_id {lora.lora_int_id} is already adapter {known.lora_name!r} "
                    f"({known.lora_path}): give {lora.lora_name!r} another id"
                )
            return
        from engine.lora.adapter import read_adapter

        read_adapter(
            lora.lora_path,
            self.hf_config,
            self.config.lora.max_lora_rank,
            check=True,
            quantization=self.base_quantization,
        )
        self._adapters[lora.lora_int_id] = lora
