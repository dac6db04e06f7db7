"""LLM: the offline Python API.

from engine import LLM, SamplingParams
llm = LLM()
outs = llm.generate(["Hello", "Paris is"], SamplingParams(max_tokens=32, temperature=0))

Embeddings (runner="pooling", or an embedding model's folder with the default auto):
llm = LLM(embedding_model_dir, runner="pooling")
vectors = [o.outputs.embedding for o in llm.embed(["Hello", "Paris is"])]

LoRA adapters (PEFT folders), as vLLM's:
llm = LLM(model_dir, enable_lora=True, max_loras=4)
outs = llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from engine.lora.request import LoRARequest
from engine.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, object]


class LLM:
    def __init__(self, model: str | None = None, **options: Any) -> None:
        """`options`: EngineArgs' fields (engine.args: each with its help), vLLM's names."""
        try:
            args = EngineArgs(model=model, **options)
        except TypeError as e:  # an unknown keyword: say which names exist
            known = ", ".join(f.name for f in dataclasses.fields(EngineArgs))
            raise TypeError(f"{e}; LLM takes: {known}") from None
        config = args.create_engine_config()
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come back in prompt order.
        lora_request: the LoRA adapter of every prompt, or one per prompt (None: the base
        model); the engine needs enable_lora=True."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"Got {len(params_list)} SamplingParams for {len(prompts)} prompts: pass one, "
                    "or one per prompt."
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(
                    f"Got {len(loras)} LoRA requests for {len(prompts)} prompts: pass one, "
                    "or one per prompt."
                )
        return self._run(prompts, params_list, use_tqdm, loras)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (text or token ids), in prompt order, pooled as the
        model's config says (engine.pooler_config); the engine must run runner="pooling".
        pooling_params: dimensions (Matryoshka models), normalize."""
        prompts = _as_prompt_list(prompts)
        params = pooling_params or PoolingParams()
        outs = self._run(prompts, [params] * len(prompts), use_tqdm, [None] * len(prompts))
        return [
            EmbeddingRequestOutput(
                o.request_id, EmbeddingOutput(o.pooled.tolist()), o.prompt_token_ids
            )
            for o in outs
        ]

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's defaults (--generation-config; vLLM's name)."""
        return SamplingParams(**self.engine.sampling_defaults)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.tokenizer.apply_chat_template(conv) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _run(
        self,
        prompts: list[Prompt],
        params_list: list[SamplingParams] | list[PoolingParams],
        use_tqdm: bool,
        loras: list[LoRARequest | None],
    ) -> list[RequestOutput]:
        """params_list: SamplingParams to generate, or PoolingParams to pool."""
        engine = self.engine
        order: dict[str, int] = {}
        # Validate everything first so a bad prompt leaves nothing half-queued.
        try:
            for prompt, params, lora in zip(prompts, params_list, loras, strict=True):
                request_id = str(next(self._ids))
                # Only each request's final output is kept: the engine makes no output a
                # step for it (a cumulative copy of every request's tokens, each step).
                if isinstance(params, PoolingParams):
                    engine.add_request(request_id, prompt, pooling_params=params, streamed=False)
                else:
                    engine.add_request(
                        request_id, prompt, params, lora_request=lora, streamed=False
                    )
                order[request_id] = len(order)
        except Exception:
            for request_id in order:
                engine.abort_request(request_id)
            raise
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm or len(prompts) < 8)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
        except BaseException:
            for request_id in order:
                engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text, or a list of token ids) or several, as a list of prompts."""
    if isinstance(prompts, str) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    return list(prompts)
