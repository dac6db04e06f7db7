"""Request: one sequence the scheduler moves between waiting, running and finished."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.lora.request import LoRARequest
    from engine.pooling_params import PoolingParams
    from engine.structured_output.manager import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue, its blocks freed, to be recomputed
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6
    FINISHED_TIMEOUT = 7  # past its deadline: ended by the engine

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    TIMEOUT = "timeout"


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    RequestStatus.FINISHED_TIMEOUT: FinishReason.TIMEOUT,
}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first under the "priority" policy
    cache_salt: str | None = None  # mixed into the first block hash: isolates tenants' caches
    tenant: str | None = None  # whose service this is, under the "fair" policy
    tenant_weight: float = 1.0  # the tenant's share relative to others (the latest one wins)
    deadline: float | None = None  # time.monotonic() past which the engine ends it ("timeout")
    # The LoRA adapter it runs with (None: the base model); mixed into its block hashes.
    lora_request: LoRARequest | None = None
    # n > 1: children are forked from the parent once the prompt is computed.
    parent_id: str | None = None
    sample_index: int = 0

    output_token_ids: list[int] = field(default_factory=list)
    # prompt + output, kept as one list so the scheduler never concatenates per step.
    all_token_ids: list[int] = field(init=False)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # Async scheduling: tokens scheduled to be sampled whose values have not come back yet
    # (each one step ahead at most; see engine.async_scheduling).
    num_output_placeholders: int = 0
    num_cached_tokens: int = (
        -1
    )  # prompt tokens served from the prefix cache; -1 = not yet looked up
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    first_scheduled_time: float | None = None
    num_charged_prompt_tokens: int = 0  # prompt tokens its tenant was charged for (fair)
    # Full-block hashes of all_token_ids, extended as blocks fill (see kv_cache_utils).
    block_hashes: list = field(default_factory=list)
    # Structured output: the grammar's state, advanced by every output token. It lives here,
    # not in the runner, so preemption (recompute) and forking keep it.
    grammar: RequestGrammar | None = None
    # SamplingParams.prompt_logprobs: the entries the runner computed so far (index i for
    # prompt token i; the first is None), handed over once, with the first sampled token.
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False
    # A pooling request (resolved PoolingParams): finished, never sampled, once its prompt
    # is computed; the runner returns its vector then (ModelRunnerOutput.pooled).
    pooling_params: PoolingParams | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept_token(token_id)
