"""The boundary types: plain slots dataclasses that cross component boundaries.

Scheduler --SchedulerOutput--> ModelRunner --ModelRunnerOutput--> Scheduler
LLMEngine --RequestOutput--> users (LLM.generate, AsyncEngine, the HTTP layer)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.lora.request import LoRARequest
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner does not hold yet: sent once, with the step that first schedules
    it. A preempted request is new again when it is readmitted (its outputs so far are part
    of what it recomputes), and so is each forked sample (output_token_ids = its first)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Tokens sampled before this admission (a copy: the runner appends its own samples).
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_id: int | None = None
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)
    pooling_params: PoolingParams | None = None  # a pooling request's (resolved)


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: only what changed since the runner last saw it.

    The runner knows every token it has to compute: the prompt and earlier outputs from the
    request's NewRequestData, and the tokens it sampled itself since (engine.worker.input_batch).
    """

    request_id: str
    # Position of this step's first token (== request.num_computed_tokens before this step).
    start_pos: int
    # Tokens whose K/V this step computes: a prefill chunk, or the one token of a decode step.
    num_tokens: int
    # Block ids appended to the request's block table since the runner last saw it (the
    # whole table for a new request). Token at position p lives in slot
    # table[p // block_size] * block_size + p % block_size.
    new_block_ids: list[int]
    # True when this chunk ends at the last known token: the runner samples from its last position.
    sample: bool
    # How many tokens to sample from the last position: n for a parent's first sample, else 1.
    num_samples: int = 1
    # Speculative decoding: draft tokens fed after the last known token (they are the last
    # len(spec_token_ids) of num_tokens). The runner verifies them: its output for the request
    # is the drafts it kept plus one token of its own (engine.spec_decode.rejection).
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    # In scheduling order (running requests first, then the ones admitted this step).
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    # The scheduled requests the runner does not hold yet (a subset of `scheduled`).
    new_requests: list[NewRequestData] = field(default_factory=list)
    # Copy-on-write for forked samples: copy every layer's K/V of block src into block dst
    # before this step's forward.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Requests that finished, were aborted or preempted since the last step: the runner drops
    # their state (a preempted request comes back later as a new request).
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Structured output: the bitmask of this step's constrained rows, being filled on a thread
    # while the forward runs (engine.structured_output.manager.GrammarBitmask). Read by the
    # sampling rank only; never sent to tensor-parallel workers.
    grammar_bitmask: Any = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def drops_requests(self) -> bool:
        """Whether the runners must forget some requests (even when nothing is scheduled)."""
        return bool(self.finished_request_ids or self.preempted_request_ids)


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs at one generated position: the sampled token's, and the top-k alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # (token_id, logprob), most likely first, len == requested k


@dataclass(slots=True)
class ModelRunnerOutput:
    # Sampled tokens per scheduled request id; an empty list for a prefill chunk that does not
    # reach the end of the prompt; n tokens for a parent's first sample.
    sampled_token_ids: dict[str, list[int]]
    # A request scheduled with drafts gets its kept drafts plus one token (1..k+1 tokens).
    # Only for requests that asked for logprobs: one entry per sampled token.
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Only for requests that asked for prompt_logprobs and computed prompt rows this step:
    # (position of the first entry's token, entries), one entry per prompt token at
    # positions start+1.. that this chunk's rows predict.
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # Pooling requests whose prompt this step finished: the pooled vector (a 1-D float32
    # tensor on the CPU, truncated and normalized as its PoolingParams say).
    pooled: dict[str, Any] = field(default_factory=dict)
    # Speculative decoding with a draft model: the runner's drafts for each request's next
    # step (proposed after this step's tokens); the scheduler schedules them next.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None (running)
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None


# Prompt logprobs, aligned with the prompt: None for the first token (nothing predicts it).
PromptLogprobs = list[TokenLogprobs | None]


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    queue_time: float | None = None  # seconds from arrival until first scheduled
    error: str | None = None
    # SamplingParams.prompt_logprobs: set from the first output after the prompt is computed
    # (and kept in the later ones, which are cumulative); None until then or if not asked.
    prompt_logprobs: PromptLogprobs | None = None
    # A pooling request's vector (a 1-D float32 tensor on the CPU), set when it finished.
    pooled: Any = None


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """LLM.embed's result per prompt, as vLLM's: `out.outputs.embedding`."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @property
    def embedding(self) -> list[float]:
        return self.outputs.embedding


@dataclass(slots=True)
class RequestUpdate:
    """What one step did to one request: Scheduler.update_from_output returns a list of these.

    For n > 1 the user's request id is the parent's; forked samples carry their own
    request_id, parent_id = the user's id and sample_index = 1..n-1.
    """

    request_id: str
    parent_id: str | None
    sample_index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    finish_reason: str | None  # FinishReason value once finished, else None
    stop_reason: int | str | None
    num_cached_tokens: int
    queue_time: float | None = None  # seconds from arrival to first scheduled, once known
    # The whole prompt's logprobs, with the first update after the prompt was computed.
    prompt_logprobs: PromptLogprobs | None = None
    pooled: Any = None  # a pooling request's vector, with its final update
