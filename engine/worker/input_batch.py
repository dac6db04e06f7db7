"""The runner's persistent per-request state, kept in step with the scheduler's incremental
SchedulerOutputs (in the manner of vLLM v1's InputBatch / CachedRequestState).

A request arrives once as NewRequestData (prompt, earlier outputs, sampling params, eos id);
each step then brings its ScheduledRequest (position, token count, new block ids). The tokens
the runner samples are appended by the runner itself (append_sampled): rank 0 right after
sampling, the other tensor-parallel ranks from the next step's payload. So every rank knows,
without the scheduler resending it, each token it must compute and what the sampler reads
(prompt and output ids for penalties, the output count for min_tokens and seeded draws).

On a GPU the batch also keeps each request's sampling parameters as one column of two device
tables (SamplingTensors), written when requests join: the GPU sampler
(engine.layers.gpu_sampler) reads the step's columns, so no parameter crosses per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.lora.request import LoRARequest
from engine.outputs import NewRequestData, ScheduledRequest, SchedulerOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.worker.pooler import PoolingState

_MIN_BLOCK_CAPACITY = 16


@dataclass(slots=True, eq=False)
class CachedRequestState:
    """What the runner holds for one request (the sampler reads the fields it names)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    token_ids: list[int]  # prompt + output, one list: a step's input ids are a slice of it
    block_ids: np.ndarray  # int32, grown by doubling; the table is its first num_blocks
    num_blocks: int = 0
    num_samples: int = 1  # of the step that last scheduled it
    lora_request: LoRARequest | None = None
    # A pooling request's params and its vector so far (engine.worker.pooler)
    pooling_params: PoolingParams | None = None
    pooling: PoolingState | None = None

    @classmethod
    def from_new(cls, new: NewRequestData) -> CachedRequestState:
        outputs = list(new.output_token_ids)
        return cls(
            request_id=new.request_id,
            prompt_token_ids=new.prompt_token_ids,
            output_token_ids=outputs,
            sampling_params=new.sampling_params,
            eos_token_id=new.eos_token_id,
            token_ids=[*new.prompt_token_ids, *outputs],
            block_ids=np.zeros(_MIN_BLOCK_CAPACITY, dtype=np.int32),
            lora_request=new.lora_request,
            pooling_params=new.pooling_params,
            pooling=PoolingState() if new.pooling_params is not None else None,
        )

    @property
    def block_table(self) -> np.ndarray:
        """The block table: an int32 view, valid until the next append_blocks."""
        return self.block_ids[: self.num_blocks]

    def append_blocks(self, ids: list[int]) -> None:
        n, end = self.num_blocks, self.num_blocks + len(ids)
        if end > len(self.block_ids):
            grown = np.zeros(max(end, 2 * len(self.block_ids)), dtype=np.int32)
            grown[:n] = self.block_ids[:n]
            self.block_ids = grown
        self.block_ids[n:end] = ids
        self.num_blocks = end

    def append_tokens(self, tokens: list[int]) -> None:
        self.output_token_ids.extend(tokens)
        self.token_ids.extend(tokens)

    def set_output_token(self, index: int, token: int) -> None:
        """Write output token `index` (async scheduling: the real id over its placeholder)."""
        self.output_token_ids[index] = token
        self.token_ids[len(self.prompt_token_ids) + index] = token


# SamplingTensors' rows: float32 parameters, then the int64 ones (seed -1: unseeded).
FLOAT_PARAMS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
INT_PARAMS = ("top_k", "seed")


class SamplingTensors:
    """Each request's sampling parameters as one column of two device tables, floats
    [len(FLOAT_PARAMS), capacity] and ints [len(INT_PARAMS), capacity]. A request takes a
    column when it joins and frees it when it leaves; a step that changed any column copies
    the host tables once (flush). The capacity doubles when full."""

    def __init__(self, device: torch.device | str, capacity: int = 64):
        self.device = torch.device(device)
        self.column: dict[str, int] = {}
        self._free: list[int] = []
        self._dirty = False
        self.capacity = 0
        self._host_f = np.zeros((len(FLOAT_PARAMS), 0), dtype=np.float32)
        self._host_i = np.zeros((len(INT_PARAMS), 0), dtype=np.int64)
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        host_f = np.zeros((len(FLOAT_PARAMS), capacity), dtype=np.float32)
        host_i = np.full((len(INT_PARAMS), capacity), -1, dtype=np.int64)
        host_f[:, :old], host_i[:, :old] = self._host_f, self._host_i
        self._host_f, self._host_i = host_f, host_i
        self.floats = torch.zeros(host_f.shape, dtype=torch.float32, device=self.device)
        self.ints = torch.zeros(host_i.shape, dtype=torch.int64, device=self.device)
        self._free.extend(range(capacity - 1, old - 1, -1))  # lowest column first
        self.capacity = capacity
        self._dirty = True

    def add(self, request_id: str, sp: SamplingParams) -> None:
        if not self._free:
            self._grow(2 * self.capacity)
        col = self.column[request_id] = self._free.pop()
        f, i = self._host_f, self._host_i
        f[0, col], f[1, col], f[2, col] = sp.temperature, sp.top_p, sp.min_p
        f[3, col], f[4, col] = sp.repetition_penalty, sp.presence_penalty
        f[5, col] = sp.frequency_penalty
        i[0, col] = sp.top_k
        i[1, col] = -1 if sp.seed is None else sp.seed & 0x7FFFFFFFFFFFFFFF
        self._dirty = True

    def remove(self, request_id: str) -> None:
        col = self.column.pop(request_id, None)
        if col is not None:
            self._free.append(col)

    def flush(self) -> None:
        """Copy the host tables to the device if a request joined since the last flush
        (from pageable memory: the host may rewrite them as soon as this returns)."""
        if self._dirty:
            self.floats.copy_(torch.from_numpy(self._host_f), non_blocking=True)
            self.ints.copy_(torch.from_numpy(self._host_i), non_blocking=True)
            self._dirty = False


class InputBatch:
    def __init__(self, sampling: SamplingTensors | None = None) -> None:
        self.requests: dict[str, CachedRequestState] = {}
        # The device copies of the sampling parameters (the GPU sampler's), or None.
        self.sampling = sampling

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def __getitem__(self, request_id: str) -> CachedRequestState:
        return self.requests[request_id]

    def update(self, so: SchedulerOutput) -> None:
        """Apply a step's changes: drop, add, then extend each scheduled request."""
        requests = self.requests
        sampling = self.sampling
        for rid in so.finished_request_ids:
            requests.pop(rid, None)  # also ids the runner never held (aborted while waiting)
        for rid in so.preempted_request_ids:
            requests.pop(rid, None)
        if sampling is not None:
            for rid in (*so.finished_request_ids, *so.preempted_request_ids):
                sampling.remove(rid)
        for new in so.new_requests:
            requests[new.request_id] = CachedRequestState.from_new(new)
            if sampling is not None:
                sampling.remove(new.request_id)  # a resent request keeps no stale column
                sampling.add(new.request_id, new.sampling_params)
        if sampling is not None:
            sampling.flush()
        for r in so.scheduled:
            state = requests.get(r.request_id)
            if state is None:
                raise RuntimeError(
                    f"request {r.request_id!r} is scheduled but the runner does not hold it: "
                    "it was never sent as a new request, or was dropped since"
                )
            if r.new_block_ids:
                state.append_blocks(r.new_block_ids)
            state.num_samples = r.num_samples
            if r.start_pos + r.num_tokens - len(r.spec_token_ids) > len(state.token_ids):
                raise RuntimeError(
                    f"request {r.request_id!r}: the step computes tokens up to position "
                    f"{r.start_pos + r.num_tokens - len(r.spec_token_ids) - 1} but the runner knows only "
                    f"{len(state.token_ids)} tokens"
                )

    def append_sampled(self, sampled: dict[str, list[int]]) -> None:
        """Append a step's sampled tokens (ModelRunnerOutput.sampled_token_ids) to the
        requests that step scheduled. A parent's first sample (num_samples > 1) keeps only
        the first: the other samples become forked requests, sent to the runner as new."""
        requests = self.requests
        for rid, tokens in sampled.items():
            if not tokens:
                continue
            state = requests.get(rid)
            if state is None:  # preempted or finished while its batch was in flight (PP)
                continue
            state.append_tokens(tokens[:1] if state.num_samples > 1 else tokens)

    def step_inputs(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[list[int], list[int], list[tuple[int, int, np.ndarray]], dict[str, int]]:
        """The flattened batch: input ids, positions, (start_pos, num_tokens, block table) per
        request for the attention metadata builder (decodes first, by start_pos ascending,
        then the prefill chunks in scheduling order), and each request's last row. A request
        with drafts (speculative decoding) is a chunk: its last known token, then the drafts;
        its rows for verification are the last len(drafts) + 1 up to its last row."""
        requests = self.requests
        decodes = sorted((r for r in scheduled if r.num_tokens == 1), key=_start_pos)
        prefills = [r for r in scheduled if r.num_tokens != 1]
        ids: list[int] = []
        positions: list[int] = []
        seqs: list[tuple[int, int, np.ndarray]] = []
        last_row: dict[str, int] = {}
        for i, r in enumerate(decodes):
            state = requests[r.request_id]
            ids.append(state.token_ids[r.start_pos])
            positions.append(r.start_pos)
            seqs.append((r.start_pos, 1, state.block_table))
            last_row[r.request_id] = i
        for r in prefills:
            state = requests[r.request_id]
            start, end = r.start_pos, r.start_pos + r.num_tokens
            if r.spec_token_ids:
                ids.extend(state.token_ids[start : end - len(r.spec_token_ids)])
                ids.extend(r.spec_token_ids)
            else:
                ids.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            seqs.append((start, r.num_tokens, state.block_table))
            last_row[r.request_id] = len(ids) - 1
        return ids, positions, seqs, last_row


def _start_pos(r: ScheduledRequest) -> int:
    return r.start_pos
