"""The seam between a server and the engine: what a server may ask (`EngineClient`) and the
one request object it hands over (`EngineRequest`), as vLLM's `EngineClient`.

    request = EngineRequest("chatcmpl-1", prompt_ids, params, Tenancy(tenant="t1"))
    async for output in engine.generate(request):   # cumulative RequestOutput
        ...

An EngineRequest is built once, at the front, and carried unchanged through the engine's
thread into the scheduler's `Request` (engine/llm_engine.py `add`). Its own invariants are
checked when it is made; what depends on the engine (the prompt against max_model_len and
the vocabulary, the sampling parameters, the queue's room, a duplicate id) is checked once,
by the engine that admits it. `AsyncEngine` implements EngineClient; the server
(api/) types its engine as EngineClient and reaches past it for nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from engine.lora.request import LoRARequest
from engine.pooling_params import PoolerConfig, PoolingParams
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.errors import EngineDeadError
    from engine.outputs import RequestOutput
    from engine.sampling_params import StructuredOutputsParams
    from engine.stats import EngineStats, RequestInfo


@dataclass(slots=True, frozen=True)
class Tenancy:
    """Whose request it is, for the scheduler: the fair policy's unit and its weight (the
    tenant's latest weight wins), the prefix-cache salt that isolates it, its priority class
    (lower runs first) and its deadline (time.monotonic(); past it the request ends with
    finish_reason "timeout", its blocks freed)."""

    tenant: str | None = None
    weight: float = 1.0
    cache_salt: str | None = None
    priority: int = 0
    deadline: float | None = None

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"tenant_weight must be positive, got {self.weight}")


@dataclass(slots=True)
class EngineRequest:
    """One engine request: its id, the prompt's token ids, how to sample, and whose it is.
    `prompt_text` (the prompt as given, when it was text) is echoed in outputs; `adapter`
    is the LoRA adapter it runs with (engine.lora.LoRARequest; None: the base model).
    `pooling`: an embedding request (a pooling runner's only kind): its prompt is pooled,
    never sampled (`params` unused), and its one output carries the vector (`pooled`).
    `streamed` False: nobody reads its output as it grows (a whole HTTP answer): the engine
    sends its first output (the time to first token) and its final one, none between."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    tenancy: Tenancy = field(default_factory=Tenancy)
    prompt_text: str | None = None
    adapter: LoRARequest | None = None
    arrival_time: float | None = None
    pooling: PoolingParams | None = None
    streamed: bool = True

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must not be empty")


@runtime_checkable
class EngineClient(Protocol):
    """Everything a server asks of an engine."""

    model_name: str
    max_model_len: int
    tokenizer: Any  # engine.tokenizer.Tokenizer
    # SamplingParams fields a request falls back to (--generation-config), e.g. temperature
    sampling_defaults: dict[str, Any]
    # "generate" or "pooling" (--runner): a pooling engine takes only requests with
    # `pooling` set, a generating one only requests without
    runner: str
    pooler: PoolerConfig | None  # how a pooling engine pools (None: a generating engine)

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """The request's cumulative output after each step that changed it; stopping the
        iteration aborts the request. Raises QueueFullError, EngineDeadError, ValueError.
        A pooling request yields once: finished, its vector in `pooled`."""
        ...

    async def abort(self, request_id: str, wait: bool = False) -> RequestOutput | None:
        """Abort a request (a no-op for one the engine no longer has). wait: until the engine
        has, then its final output where its stream had ended before it (the tokens it made,
        which a closing Generation bills), else None; without wait, None at once."""
        ...

    async def compile_grammar(self, so: StructuredOutputsParams) -> None:
        """Compile (or find cached) a structured-output spec; GrammarError if invalid."""
        ...

    def stats(self) -> EngineStats: ...

    async def request_infos(self) -> list[RequestInfo]: ...

    async def block_states(self) -> bytes: ...

    def is_healthy(self) -> bool: ...

    @property
    def dead_error(self) -> EngineDeadError | None: ...

    def on_dead(self, listener: Callable[[EngineDeadError], None]) -> None: ...

    async def shutdown(self) -> None: ...
