"""EngineStats: a snapshot of the engine's state, cheap to take after every step.

Read from any thread (the HTTP layer, /metrics, the console): it is replaced whole,
never mutated in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class RequestInfo:
    request_id: str
    status: str  # "running" | "waiting"
    num_prompt_tokens: int
    num_output_tokens: int
    num_blocks: int
    arrival_time: float  # time.monotonic() of arrival
    tenant: str | None = None  # the tenant the request was submitted for, if any


@dataclass(slots=True, frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1, blocks held by requests
    num_blocks: int = 0
    block_size: int = 16
    prefix_cache_queries: int = 0  # tokens looked up, cumulative
    prefix_cache_hits: int = 0  # tokens found, cumulative
    num_preemptions: int = 0
    # tenant -> (prefix-cache queries, prefix-cache hits, generated tokens), cumulative
    # tokens, for the requests that named a tenant. Shared with the engine: never mutate.
    tenants: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    prompt_tokens_total: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    generation_tokens_total: int = 0
    num_steps: int = 0
    # Speculative decoding, cumulative (all 0 / empty while it is off): requests scheduled
    # with drafts (per step), draft tokens, accepted ones, and accepted per draft position.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_pos: tuple[int, ...] = ()
    # the draft controller's decisions, cumulative: steps it let draft, steps it kept plain
    spec_decode_controller_draft_steps: int = 0
    spec_decode_controller_plain_steps: int = 0
    last_step_time: float = 0.0  # time.monotonic() at the end of the last step
    loop_alive: bool = False
    requests: tuple[RequestInfo, ...] = field(default_factory=tuple)


@dataclass(slots=True, frozen=True)
class StageStats:
    """One rank's time in steps, cumulative since it loaded (ModelRunner.stage_stats): what a
    benchmark differences over a run to see how busy each pipeline stage was. busy =
    step_s - input_wait_s; the rest of the wall time the rank waited for its next batch (or,
    the driver, scheduled and collected)."""

    rank: int
    pp_rank: int
    steps: int = 0  # steps that ran a forward on this rank
    step_s: float = 0.0  # seconds inside execute_model
    input_wait_s: float = 0.0  # of those, waiting for the previous stage's activations
    send_s: float = 0.0  # of those, handing activations to the next stage (blocking)
    graph_steps: int = 0  # of the steps, those its step graph took (CUDA graphs' replays)
