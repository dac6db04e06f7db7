"""Scheduler: continuous batching over a token budget, vLLM v1 style.

No prefill and decode phases: every step spends max_num_batched_tokens on the running
requests first (one token for a decode, the next chunk for a partial prefill), preempting
the newest (FCFS) or lowest-priority running request by recompute when blocks run out, then
admits waiting requests (after a prefix-cache lookup) while seats, budget and blocks allow.
num_computed_tokens advances when a request is scheduled, so update_from_output only appends
the sampled tokens and checks the stop conditions.

n > 1: the parent runs alone until its prompt is computed (holding n seats of max_num_seqs);
the runner then samples n tokens from it (ScheduledRequest.num_samples) and
update_from_output forks samples 1..n-1 as requests "<id>#<i>" that share the prompt's full
blocks. A partially filled last block is copied: the pair goes into the next
SchedulerOutput.blocks_to_copy, which the runner applies before that step's forward.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections.abc import Iterable

from engine.config import CacheConfig, SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager, NoFreeBlocksError
from engine.outputs import (
    ModelRunnerOutput,
    RequestUpdate,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from engine.request import Request, RequestStatus
from engine.sampling_params import MAX_N

_RUNNING = RequestStatus.RUNNING


@dataclasses.dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_cache_queries: int  # cumulative, in tokens
    prefix_cache_hits: int
    num_preemptions: int


def _seats(request: Request) -> int:
    """Running slots a request takes: an n > 1 parent reserves its children's until it forks."""
    n = request.sampling_params.n
    return n if n > 1 and request.parent_id is None and not request.output_token_ids else 1


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set a finished status if the last token ends the request. EOS and stop token ids
    win over length; neither counts before min_tokens."""
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    if num_output >= params.min_tokens:
        last = request.output_token_ids[-1]
        if last == request.eos_token_id and not params.ignore_eos:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if params.stop_token_ids and last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    if (params.max_tokens is not None and num_output >= params.max_tokens) or len(
        request.all_token_ids
    ) >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False


def make_child(parent: Request, index: int) -> Request:
    """Sample `index` (1..n-1) of an n > 1 parent: same prompt, n=1, seed + index."""
    params = parent.sampling_params
    child = Request(
        request_id=f"{parent.request_id}#{index}",
        prompt_token_ids=parent.prompt_token_ids,
        sampling_params=dataclasses.replace(
            params, n=1, seed=params.seed + index if params.seed is not None else None
        ),
        eos_token_id=parent.eos_token_id,
        arrival_time=parent.arrival_time,
        priority=parent.priority,
        cache_salt=parent.cache_salt,
        parent_id=parent.request_id,
        sample_index=index,
    )
    child.num_cached_tokens = parent.num_cached_tokens
    child.first_scheduled_time = parent.first_scheduled_time
    return child


class Scheduler:
    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int
    ) -> None:
        if scheduler_config.block_size != cache_config.block_size:
            raise ValueError(
                f"scheduler block_size ({scheduler_config.block_size}) must equal cache "
                f"block_size ({cache_config.block_size})"
            )
        bs = cache_config.block_size
        if (num_blocks - 1) * bs < scheduler_config.max_model_len:
            raise ValueError(
                f"the KV cache ({num_blocks} blocks of {bs} tokens, block 0 reserved) cannot hold "
                f"one sequence of max_model_len ({scheduler_config.max_model_len}) tokens: give "
                f"it more blocks or lower max_model_len"
            )
        self.config = scheduler_config
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: list[Request] = []  # next to admit first
        self.running: list[Request] = []  # oldest first
        self.num_preemptions = 0
        self._num_seats = 0  # sum of _seats() over running
        self._finished_ids: list[str] = []  # for the next SchedulerOutput
        self._pending_copies: list[tuple[str, int, int]] = []  # (child id, src, dst)

    # -- queries ------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def stats(self) -> SchedulerStats:
        m = self.kv_cache_manager
        return SchedulerStats(
            len(self.running),
            len(self.waiting),
            m.usage,
            m.prefix_cache_queries,
            m.prefix_cache_hits,
            self.num_preemptions,
        )

    # -- requests in and out ------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if not request.prompt_token_ids:
            raise ValueError(f"request {rid!r} has an empty prompt")
        if _seats(request) > self.config.max_num_seqs:
            raise ValueError(
                f"request {rid!r}: n={request.sampling_params.n} samples exceed max_num_seqs "
                f"({self.config.max_num_seqs})"
            )
        if request.num_tokens > self.config.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt has {request.num_tokens} tokens, more than "
                f"max_model_len ({self.config.max_model_len})"
            )
        request.status = RequestStatus.WAITING
        self.requests[rid] = request
        self._enqueue(request, front=False)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from any state, freeing their blocks now. Aborting a parent also
        aborts its forked samples. Unknown or already finished ids are ignored."""
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        victims = []
        for rid in request_ids:
            ids = [rid]
            if status == RequestStatus.FINISHED_ABORTED:
                ids += [f"{rid}#{i}" for i in range(1, MAX_N)]
            for vid in ids:
                req = self.requests.get(vid)
                if req is not None and (vid == rid or req.parent_id == rid):
                    victims.append(req)
        if not victims:
            return
        for req in victims:
            if req.request_id not in self.requests:
                continue  # listed twice
            if req.status == _RUNNING:
                self._num_seats -= _seats(req)
            else:
                self.waiting.remove(req)
            self._finish(req, status)
        self.running = [r for r in self.running if r.status == _RUNNING]

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished and free; the caller has taken it out of running/waiting."""
        request.status = status
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    def _enqueue(self, request: Request, front: bool) -> None:
        if self.config.policy == "priority":
            bisect.insort(self.waiting, request, key=lambda r: (r.priority, r.arrival_time))
        elif front:
            self.waiting.insert(0, request)
        else:
            self.waiting.append(request)

    # -- one step -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        preempted_ids: list[str] = []
        manager = self.kv_cache_manager
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_new = len(request.all_token_ids) - request.num_computed_tokens
            if num_new > budget:
                num_new = budget
            if num_new <= 0:  # nothing to compute (the runner returned no token for it)
                i += 1
                continue
            while manager.allocate_slots(request, num_new) is None:
                victim_index = self._pick_victim()
                victim = running.pop(victim_index)
                if victim_index < i:
                    i -= 1
                undone = scheduled.pop(victim.request_id, None)
                if undone is not None:
                    budget += len(undone.token_ids)
                self._preempt(victim)
                preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = self._schedule_one(request, num_new)
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted: no blocks for anything further

        if not preempted_ids:  # blocks are short: do not admit while preempting
            budget = self._admit_waiting(budget, scheduled)

        # Copies for children forked last step, unless they were preempted or aborted since.
        copies = [
            (src, dst)
            for cid, src, dst in self._pending_copies
            if (child := self.requests.get(cid)) is not None and child.status == _RUNNING
        ]
        out = SchedulerOutput(
            scheduled=list(scheduled.values()),
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            blocks_to_copy=copies,
            finished_request_ids=self._finished_ids,
            preempted_request_ids=preempted_ids,
        )
        self._finished_ids = []
        self._pending_copies = []
        return out

    def _admit_waiting(self, budget: int, scheduled: dict[str, ScheduledRequest]) -> int:
        manager = self.kv_cache_manager
        waiting = self.waiting
        while waiting and budget > 0:
            request = waiting[0]
            seats = _seats(request)
            if self._num_seats + seats > self.config.max_num_seqs:
                break
            hit_blocks, num_hit = manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if manager.allocate_slots(request, num_new, hit_blocks) is None:
                break  # waiting requests never preempt running ones
            waiting.pop(0)
            if request.num_cached_tokens < 0:  # first admission, not a recompute
                request.num_cached_tokens = num_hit
                manager.record_prefix_lookup(request.num_tokens, num_hit)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.status = _RUNNING
            request.num_computed_tokens = num_hit
            self.running.append(request)
            self._num_seats += seats
            scheduled[request.request_id] = self._schedule_one(request, num_new)
            budget -= num_new
        return budget

    def _schedule_one(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        request.num_computed_tokens = end
        all_tokens = request.all_token_ids
        sample = end == len(all_tokens)
        params = request.sampling_params
        return ScheduledRequest(
            request.request_id,
            all_tokens[start:end],
            start,
            self.kv_cache_manager.req_to_block_ids[request.request_id],
            sample,
            params,
            _seats(request) if sample and params.n > 1 else 1,
            request.prompt_token_ids,
            request.output_token_ids,
            request.eos_token_id,
        )

    def _pick_victim(self) -> int:
        running = self.running
        if self.config.policy != "priority":
            return len(running) - 1
        return max(
            range(len(running)), key=lambda j: (running[j].priority, running[j].arrival_time)
        )

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the blocks, start over later from the waiting front."""
        self._num_seats -= _seats(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, front=True)

    # -- results ------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        sampled = model_runner_output.sampled_token_ids
        logprobs = model_runner_output.logprobs
        manager = self.kv_cache_manager
        caching, bs = manager.enable_caching, manager.block_size
        requests = self.requests
        max_model_len = self.max_model_len
        updates: list[RequestUpdate] = []
        num_finished = 0
        for sr in scheduler_output.scheduled:
            rid = sr.request_id
            request = requests.get(rid)
            if request is None or request.status != _RUNNING:
                continue  # finished or aborted since schedule()
            start = sr.start_pos
            if caching and (start + len(sr.token_ids)) // bs > start // bs:
                manager.cache_blocks(request)  # this step completed a block's K/V
            tokens = sampled.get(rid)
            if not tokens:  # a prefill chunk short of the prompt's end
                continue
            lps = logprobs.get(rid) if logprobs else None
            if sr.num_samples > 1:
                self._num_seats -= sr.num_samples - 1  # the children take over the seats
                updates += self._fork_children(request, tokens[1:], lps[1:] if lps else None)
                tokens = tokens[:1]
                lps = lps[:1] if lps else lps
            for k, token in enumerate(tokens):  # one, unless a runner samples more per step
                request.append_output_token(token)
                if check_stop(request, max_model_len):
                    tokens = tokens[: k + 1]
                    self._num_seats -= 1
                    self._finish(request, request.status)
                    num_finished += 1
                    finish_reason = request.finish_reason
                    break
            else:
                finish_reason = None
            updates.append(
                RequestUpdate(
                    rid,
                    request.parent_id,
                    request.sample_index,
                    tokens,
                    lps,
                    finish_reason,
                    request.stop_reason,
                    request.num_cached_tokens,
                )
            )
        if num_finished:
            self.running = [r for r in self.running if r.status == _RUNNING]
        return updates

    def _fork_children(
        self, parent: Request, tokens: list[int], lps: list[TokenLogprobs] | None
    ) -> list[RequestUpdate]:
        """Samples 1..n-1 of an n > 1 parent whose prompt is computed: each shares the
        parent's blocks (copy-on-write of a partial last block) and starts decoding."""
        updates = []
        for i, token in enumerate(tokens, start=1):
            child = make_child(parent, i)
            child.append_output_token(token)
            # A child that finishes on its first token never holds blocks.
            if not check_stop(child, self.max_model_len):
                self.requests[child.request_id] = child
                self._start_child(parent, child)
            updates.append(
                RequestUpdate(
                    child.request_id,
                    parent.request_id,
                    i,
                    [token],
                    lps[i - 1 : i] if lps else None,
                    child.finish_reason,
                    child.stop_reason,
                    child.num_cached_tokens,
                )
            )
        return updates

    def _start_child(self, parent: Request, child: Request) -> None:
        try:
            copy = self.kv_cache_manager.fork(parent, child)
        except NoFreeBlocksError:
            child.status = RequestStatus.WAITING  # no block for the copy: recompute it later
            self._enqueue(child, front=True)
            return
        child.status = _RUNNING
        child.num_computed_tokens = parent.num_computed_tokens
        self.running.append(child)
        self._num_seats += 1
        if copy is not None:
            self._pending_copies.append((child.request_id, *copy))
