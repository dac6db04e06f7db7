"""Scheduler: continuous batching over a token budget, vLLM v1 style.

No prefill and decode phases: every step spends max_num_batched_tokens on the running
requests first (one token for a decode, the next chunk for a partial prefill), preempting
the newest (FCFS) or lowest-priority running request by recompute when blocks run out, then
admits waiting requests (after a prefix-cache lookup) while seats, budget and blocks allow.
num_computed_tokens advances when a request is scheduled, so update_from_output only appends
the sampled tokens and checks the stop conditions.

n > 1 (see forking.py): update_from_output forks the samples of a parent whose prompt is
computed; each child shares the prompt's full blocks, and a partially filled last block is
copied: the pair goes into the next SchedulerOutput.blocks_to_copy, which the runner applies
before that step's forward.

Tenants: under the "fair" policy the waiting queue admits by VTC (engine/core/fair.py) and the
preemption victim is the newest request of the tenant most over its share (and a tenant
below its share of seats may take one from a tenant above it: fair.seat_victim); each step's
computed prompt tokens and sampled tokens are charged to the tenants' counters. Whatever the
policy, each tenant's prompt and prefix-hit tokens are counted (stats().tenants), and a
request with a deadline that passes is handed back by expired_requests() for the engine to
end as "timeout" (a heap by deadline, so the per-step check is a peek).

Speculative decoding (engine.spec_decode, scheduler_config.speculative_config): a running
request whose next step is a plain decode gets drafts from the n-gram proposer and is
scheduled with 1 + len(drafts) tokens (the budget and its KV slots count them all; where
the slots are short, the drafts are dropped rather than anyone preempted). The
runner returns the drafts it kept plus one token; update_from_output rolls the rejected
positions back (num_computed_tokens drops by their count) before registering full blocks in
the prefix cache, so only blocks of real, computed tokens are ever cached. The blocks the
rejected positions used stay with the request (the next steps fill them) and go back when it
finishes or is preempted, like any other. With a draft model the drafts come from the
runner (ModelRunnerOutput.draft_token_ids, kept in RunnerDrafts until the request's next
decode), and a step that samples reserves lookahead slots for the draft's K/V where blocks
are free. A request whose drafts keep being rejected stops drafting for a while
(engine.spec_decode.backoff: 2, 4, ... 32 decode steps; a kept draft resets it). Whether a
step drafts at all is the draft controller's call (engine.spec_decode.controller): schedule()
asks it once per step and reads the clock, update_from_output() times the step and, for a
pure decode step, reports its requests, draft rows and kept drafts; in a step it declined,
each request's proposal is kept unverified (engine.spec_decode.shadow) and the tokens the
request then emits give the controller the acceptance it would have had. No drafts for
n > 1 samples or seeded requests (their per-step generator); a grammar-constrained request's
drafts are cut to what its grammar allows (RequestGrammar.valid_drafts), and the step's
bitmask holds a row per verified position. The engine runs spec decoding with async
scheduling off.

Pooling requests (Request.pooling_params, a pooling engine's only kind) are prefilled like
any prompt, chunked or not, never sampled: the chunk that ends the prompt comes back with the
request's vector (ModelRunnerOutput.pooled), and update_from_output finishes it there ("stop",
no token, its blocks freed). Mean and CLS pooling get no prefix-cache hit (kv_cache_manager).

Step inputs are incremental (vLLM v1's NewRequestData / CachedRequestData): a request's
prompt, sampling params and eos id go to the runner once (NewRequestData, when it is first
scheduled, again after a preemption, and for each forked sample); each step then carries only
its position, token count and the block ids appended since the runner last saw it. The runner
keeps the rest (engine.worker.input_batch) and appends the tokens it samples itself.

Async scheduling (engine.async_scheduling): schedule() runs while the previous step still
computes, so each request that step samples counts one placeholder token
(num_output_placeholders): it is scheduled as if the token were known, and the runner feeds it
from the device. update_from_output turns a placeholder into the real token; a request that
finished on it had one more token computed, which is dropped with the request. A request sure
to end on its placeholder (max_tokens, max_model_len) is not scheduled again.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from collections.abc import Callable, Iterable

from engine.config import CacheConfig, SchedulerConfig
from engine.core.fair import TenantCounters, fair_victim, seat_victim, tenant_of
from engine.core.forking import child_id, fork_samples, seats
from engine.core.kv_cache_manager import KVCacheManager, NoFreeBlocksError, blocks_per_request
from engine.core.request_queue import RequestQueue, create_request_queue, priority_key
from engine.core.stop import check_stop, reaches_length
from engine.outputs import (
    ModelRunnerOutput,
    NewRequestData,
    RequestUpdate,
    ScheduledRequest,
    SchedulerOutput,
)
from engine.request import Request, RequestStatus
from engine.sampling_params import MAX_N
from engine.spec_decode.backoff import DraftBackoff
from engine.spec_decode.controller import DraftController
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.runner_drafts import RunnerDrafts
from engine.spec_decode.shadow import ShadowDrafts

_RUNNING = RequestStatus.RUNNING


@dataclasses.dataclass(slots=True)
class TenantStats:
    """Cumulative token counts of one tenant's requests (those that named a tenant)."""

    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    generation_tokens: int = 0  # tokens sampled


@dataclasses.dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_cache_queries: int  # cumulative, in tokens
    prefix_cache_hits: int
    num_preemptions: int
    # tenant -> (prefix_cache_queries, prefix_cache_hits, generation_tokens), cumulative
    tenants: dict[str, tuple[int, int, int]] = dataclasses.field(default_factory=dict)
    spec_decoding: SpecDecodingStats | None = None  # None: speculative decoding is off


@dataclasses.dataclass(slots=True)
class SpecDecodingStats:
    """Cumulative speculative-decoding counts (vLLM's vllm:spec_decode_* counters)."""

    num_drafts: int = 0  # requests scheduled with at least one draft token, per step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [i]: drafts accepted at position i (0-based) of their proposal
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)
    # the draft controller's decisions (engine.spec_decode.controller; 0 with it off): steps
    # it let draft, steps it kept plain
    controller_draft_steps: int = 0
    controller_plain_steps: int = 0

    def copy(self) -> SpecDecodingStats:
        return dataclasses.replace(self, accepted_per_pos=list(self.accepted_per_pos))


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        sliding_window: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """sliding_window: the model's, where every layer has one (the largest;
        HFModelConfig.kv_sliding_window): each request's blocks behind it are freed.
        clock: seconds, read at schedule() and update_from_output() to time the steps the
        draft controller weighs (tests pass their own)."""
        if scheduler_config.block_size != cache_config.block_size:
            raise ValueError(
                f"scheduler block_size ({scheduler_config.block_size}) must equal cache "
                f"block_size ({cache_config.block_size})"
            )
        bs = cache_config.block_size
        chunk = (
            scheduler_config.max_num_batched_tokens
            if scheduler_config.enable_chunked_prefill
            else None
        )
        need = blocks_per_request(scheduler_config.max_model_len, bs, sliding_window, chunk)
        if num_blocks - 1 < need:
            what = (
                f"one sequence of max_model_len ({scheduler_config.max_model_len}) tokens"
                if need * bs >= scheduler_config.max_model_len
                else f"one sequence's window ({sliding_window} tokens) and chunk ({need} blocks)"
            )
            raise ValueError(
                f"the KV cache ({num_blocks} blocks of {bs} tokens, block 0 reserved) cannot hold "
                f"{what}: give it more blocks or lower max_model_len"
            )
        self.config = scheduler_config
        self.max_model_len = scheduler_config.max_model_len
        self.async_scheduling = bool(scheduler_config.async_scheduling)
        spec = scheduler_config.speculative_config
        # The proposer seam: n-gram drafts come from the scheduler's token ids, a draft
        # model's from the runner (RunnerDrafts holds them between steps).
        self.proposer = NgramProposer(spec) if spec is not None and not spec.uses_model else None
        self.runner_drafts = (
            RunnerDrafts(spec.num_speculative_tokens)
            if spec is not None and spec.uses_model
            else None
        )
        if spec is not None and self.async_scheduling:
            raise ValueError(
                "speculative_config needs async scheduling off (the engine turns it off)"
            )
        # a request whose drafts keep being rejected stops drafting for a while (backoff.py)
        self.draft_backoff = DraftBackoff(enabled=spec.draft_backoff) if spec is not None else None
        self.spec_disable_by_batch_size = spec.disable_by_batch_size if spec is not None else None
        # whether a step drafts at all, from the measured cost of steps with and without
        # drafts (controller.py; speculative_config's "adaptive": false drafts at every step)
        self.draft_controller = DraftController() if spec is not None and spec.adaptive else None
        self.clock = clock  # the controller's step timings
        self.shadow_drafts = ShadowDrafts()  # the acceptance in steps the controller declined
        self._timed: tuple[SchedulerOutput, float] | None = None  # the step being timed
        self.spec_stats = (
            SpecDecodingStats(accepted_per_pos=[0] * spec.num_speculative_tokens)
            if spec is not None
            else None
        )
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            sliding_window=sliding_window,
        )
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        # VTC counters, under the "fair" policy only (None: nothing is charged).
        self.tenant_counters = TenantCounters() if scheduler_config.policy == "fair" else None
        self.waiting: RequestQueue = create_request_queue(
            scheduler_config.policy, self.tenant_counters
        )
        self.tenant_stats: dict[str, TenantStats] = {}
        self._tenant_snapshot: dict[str, tuple[int, int, int]] | None = {}
        self._has_tenants = False  # some request named a tenant: count per tenant
        self._deadlines: list[tuple[float, int, Request]] = []  # a heap
        self._deadline_seq = itertools.count()
        self.running: list[Request] = []  # oldest first
        self.num_preemptions = 0
        self._num_seats = 0  # sum of seats() over running
        self._finished_ids: list[str] = []  # for the next SchedulerOutput
        self._pending_copies: list[tuple[str, int, int]] = []  # (child id, src, dst)
        # Requests the runner holds (sent as new, not finished or preempted since): how many
        # of their block ids it has.
        self._num_sent_blocks: dict[str, int] = {}

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
            self._tenants_snapshot(),
            self._spec_snapshot(),
        )

    def _spec_snapshot(self) -> SpecDecodingStats | None:
        if self.spec_stats is None:
            return None
        snap = self.spec_stats.copy()
        c = self.draft_controller
        if c is not None:
            snap.controller_draft_steps = c.num_drafting
            snap.controller_plain_steps = c.num_decisions - c.num_drafting
        return snap

    def _tenants_snapshot(self) -> dict[str, tuple[int, int, int]]:
        # Rebuilt only after a change: stats() runs after every step.
        snap = self._tenant_snapshot
        if snap is None:
            snap = self._tenant_snapshot = {
                t: (s.prefix_cache_queries, s.prefix_cache_hits, s.generation_tokens)
                for t, s in self.tenant_stats.items()
            }
        return snap

    # -- requests in and out ------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if not request.prompt_token_ids:
            raise ValueError(f"request {rid!r} has an empty prompt")
        if seats(request) > self.config.max_num_seqs:
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
        self.waiting.add_request(request)
        if request.tenant is not None:
            self._has_tenants = True
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, next(self._deadline_seq), request))

    def expired_requests(self, now: float) -> list[str]:
        """Ids of the unfinished requests (a parent or any of its samples) whose deadline
        is at or before `now`; each is returned once. The caller finishes them."""
        heap, expired = self._deadlines, []
        while heap and heap[0][0] <= now:
            request = heapq.heappop(heap)[2]
            rid = request.request_id
            if self.requests.get(rid) is request or any(
                child_id(rid, i) in self.requests for i in range(1, request.sampling_params.n)
            ):
                expired.append(rid)
        return expired

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
            if status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_TIMEOUT):
                ids += [child_id(rid, i) for i in range(1, MAX_N)]
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
                self._num_seats -= seats(req)
            else:
                self.waiting.remove_request(req)
            self._finish(req, status)
        self.running = [r for r in self.running if r.status == _RUNNING]

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished and free; the caller has taken it out of running/waiting."""
        request.status = status
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._num_sent_blocks.pop(request.request_id, None)
        self._finished_ids.append(request.request_id)
        if self.runner_drafts is not None:
            self.runner_drafts.drop(request.request_id)
        if self.draft_backoff is not None:
            self.draft_backoff.drop(request.request_id)
            self.shadow_drafts.drop(request.request_id)

    # -- one step -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        new: dict[str, NewRequestData] = {}
        preempted_ids: list[str] = []
        manager = self.kv_cache_manager
        running = self.running
        max_loras = self.config.max_loras
        step_loras: set[int] = set()  # the adapters of this step's requests (LoRA only)
        # large batches draft nothing (speculative_config's disable_by_batch_size)
        cutoff = self.spec_disable_by_batch_size
        drafting = self.speculating and (cutoff is None or len(running) < cutoff)
        controller = self.draft_controller if drafting else None
        started = self.clock() if controller is not None else 0.0
        draft_step: bool | None = None  # the controller's choice, at the step's first decode
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            if max_loras and request.lora_request is not None:
                lid = request.lora_request.lora_int_id
                if lid not in step_loras:
                    if len(step_loras) >= max_loras:
                        i += 1  # no slot this step: it keeps its blocks and waits a step
                        continue
                    step_loras.add(lid)
            pending = request.num_output_placeholders
            if pending and self._ends_on_placeholder(request):
                i += 1  # its last token is being sampled: nothing more to compute
                continue
            num_new = len(request.all_token_ids) + pending - request.num_computed_tokens
            if num_new > budget:
                num_new = budget
            if num_new <= 0:  # nothing to compute (the runner returned no token for it)
                i += 1
                continue
            drafts: list[int] = []
            if num_new == 1 and drafting and budget > 1:
                if draft_step is None:
                    draft_step = controller is None or controller.decide(len(running))
                drafts = self._propose(request, budget - 1, draft_step)
                num_new += len(drafts)
            while manager.allocate_slots(request, num_new) is None:
                if drafts:  # speculation never preempts anyone: drop the drafts first
                    num_new -= len(drafts)
                    drafts = []
                    continue
                victim_index = self._pick_victim()
                victim = running.pop(victim_index)
                if victim_index < i:
                    i -= 1
                budget += self._unschedule(victim, scheduled, new)
                self._preempt(victim)
                preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = self._schedule_one(request, num_new, new, drafts)
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted: no blocks for anything further

        if not preempted_ids:  # blocks are short: do not admit while preempting
            budget = self._admit_waiting(budget, scheduled, new, preempted_ids)

        # Copies for children forked last step, unless they were preempted or aborted since.
        copies = [
            (src, dst)
            for cid, src, dst in self._pending_copies
            if (child := self.requests.get(cid)) is not None and child.status == _RUNNING
        ]
        out = SchedulerOutput(
            scheduled=list(scheduled.values()),
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            new_requests=list(new.values()),
            blocks_to_copy=copies,
            finished_request_ids=self._finished_ids,
            preempted_request_ids=preempted_ids,
        )
        self._finished_ids = []
        self._pending_copies = []
        self._timed = (out, started) if draft_step is not None and controller is not None else None
        return out

    def _admit_waiting(
        self,
        budget: int,
        scheduled: dict[str, ScheduledRequest],
        new: dict[str, NewRequestData],
        preempted_ids: list[str],
    ) -> int:
        manager = self.kv_cache_manager
        waiting = self.waiting
        # Seat preemptions (the fair policy) are bounded per step, and a request preempted
        # in this step waits for the next one: re-admitting it here would hand back the
        # budget its undone chunk returned, and two tenants could swap a seat forever.
        seat_preemptions_left = len(self.running)
        preempted_now: set[str] = set()
        seated: Request | None = None  # the request a seat is being made for, kept as next
        # LoRA: the adapters of the running requests, at most max_loras; a waiting request
        # of another adapter is set aside (put back in order below) so the others go on.
        max_loras = self.config.max_loras
        loras = _adapters(self.running) if max_loras else set()
        skipped: list[Request] = []
        while waiting and budget > 0:
            request = seated if seated is not None else waiting.peek_request()
            if request.request_id in preempted_now:
                break
            lora = request.lora_request
            if (
                max_loras
                and lora is not None
                and lora.lora_int_id not in loras
                and len(loras) >= max_loras
            ):
                if seated is not None:
                    waiting.remove_request(request)
                    seated = None
                else:
                    waiting.pop_request()
                skipped.append(request)
                continue
            num_seats = seats(request)
            if self._num_seats + num_seats > self.config.max_num_seqs:
                counters = self.tenant_counters
                if counters is None or seat_preemptions_left <= 0:
                    break
                victim_index = seat_victim(
                    self.running, request, counters, self.config.max_num_seqs
                )
                if victim_index is None:
                    break
                seat_preemptions_left -= 1
                victim = self.running.pop(victim_index)
                preempted_now.add(victim.request_id)
                budget += self._unschedule(victim, scheduled, new)
                self._preempt(victim)
                preempted_ids.append(victim.request_id)
                seated = request  # the victim may now head the queue: the seat is this one's
                continue
            hit_blocks, num_hit = manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if manager.allocate_slots(request, num_new, hit_blocks) is None:
                break  # waiting requests never preempt running ones
            if seated is not None:
                waiting.remove_request(request)
                seated = None
            else:
                waiting.pop_request()
            if request.num_cached_tokens < 0:  # first admission, not a recompute
                request.num_cached_tokens = num_hit
                manager.record_prefix_lookup(request.num_tokens, num_hit)
                if request.tenant is not None:
                    stats = self._stats_of(request.tenant)
                    stats.prefix_cache_queries += request.num_tokens
                    stats.prefix_cache_hits += num_hit
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.status = _RUNNING
            request.num_computed_tokens = num_hit
            self.running.append(request)
            self._num_seats += num_seats
            if lora is not None:
                loras.add(lora.lora_int_id)
            scheduled[request.request_id] = self._schedule_one(request, num_new, new)
            budget -= num_new
        for request in reversed(skipped):  # back at the front, in their order
            waiting.prepend_request(request)
        return budget

    def _propose(self, request: Request, limit: int, draft_step: bool = True) -> list[int]:
        """Draft tokens for a decode step of at most `limit` of them: never more than the
        request may still emit after the step's own token (max_tokens, max_model_len).
        draft_step False (the controller declined the step): none, but the back-off runs
        as if the step drafted, and the proposal is kept unverified (ShadowDrafts) for the
        controller's acceptance (settled, it reaches the back-off too)."""
        sp = request.sampling_params
        if sp.n > 1 or request.parent_id is not None or sp.seed is not None:
            return []
        grammar = request.grammar
        if grammar is not None and not grammar.active:
            return []  # (while a reasoning model thinks: none)
        k = min(limit, self.max_model_len - request.num_tokens - 1)
        if sp.max_tokens is not None:
            k = min(k, sp.max_tokens - request.num_output_tokens - 1)
        if k <= 0:
            return []
        assert self.draft_backoff is not None
        rid = request.request_id
        if not self.draft_backoff.should_draft(rid):
            return []  # (nor a shadow proposal: it measures the drafts that would be made)
        if not draft_step and not self.shadow_drafts.wants(rid):
            return []
        if self.runner_drafts is not None:
            drafts = self.runner_drafts.propose(rid, k)
        else:
            drafts = self.proposer.propose(request.all_token_ids, k)
        if grammar is not None:  # only drafts the grammar allows are worth verifying
            drafts = grammar.valid_drafts(drafts)
        if draft_step:
            return drafts
        self.shadow_drafts.start(rid, drafts)
        return []

    @property
    def speculating(self) -> bool:
        return self.proposer is not None or self.runner_drafts is not None

    def _schedule_one(
        self,
        request: Request,
        num_new: int,
        new: dict[str, NewRequestData],
        drafts: list[int] | None = None,
    ) -> ScheduledRequest:
        rid = request.request_id
        start = request.num_computed_tokens
        end = start + num_new
        counters = self.tenant_counters
        if counters is not None and end > request.num_charged_prompt_tokens:
            # Prompt tokens computed for the first time (not hits, not a recompute).
            n_prompt = min(end, request.num_prompt_tokens)
            first = max(start, request.num_charged_prompt_tokens)
            if n_prompt > first:
                counters.charge(tenant_of(request), prompt_tokens=n_prompt - first)
                request.num_charged_prompt_tokens = n_prompt
        num_drafts = len(drafts) if drafts else 0
        sample = end - num_drafts == len(request.all_token_ids) + request.num_output_placeholders
        if sample and self.async_scheduling and request.pooling_params is None:
            request.num_output_placeholders += 1
        if sample and self.runner_drafts is not None:
            # The draft model's K/V past this step's tokens (RunnerDrafts): best effort,
            # never a preemption (None leaves the blocks as they were). Before the step's
            # tokens count as computed: allocate_slots caches the blocks of computed ones.
            lookahead = min(self.runner_drafts.lookahead, self.max_model_len - end)
            if lookahead > 0:
                self.kv_cache_manager.allocate_slots(request, num_new + lookahead)
        request.num_computed_tokens = end
        params = request.sampling_params
        table = self.kv_cache_manager.req_to_block_ids[rid]
        num_sent = self._num_sent_blocks.get(rid)
        if num_sent is None:  # the runner does not hold it: send it whole, once
            new[rid] = NewRequestData(
                rid,
                request.prompt_token_ids,
                params,
                list(request.output_token_ids),
                request.eos_token_id,
                request.lora_request,
                request.pooling_params,
            )
            num_sent = 0
        self._num_sent_blocks[rid] = len(table)
        return ScheduledRequest(
            rid,
            start,
            num_new,
            table[num_sent:],
            sample,
            seats(request) if sample and params.n > 1 else 1,
            drafts if drafts else [],
        )

    def _unschedule(
        self,
        request: Request,
        scheduled: dict[str, ScheduledRequest],
        new: dict[str, NewRequestData],
    ) -> int:
        """Take a request out of the step being built (it is being preempted); the budget
        its chunk returns."""
        undone = scheduled.pop(request.request_id, None)
        if undone is None:
            return 0
        new.pop(request.request_id, None)
        if undone.sample and self.async_scheduling:
            request.num_output_placeholders -= 1  # this step's: it will not be sampled
        return undone.num_tokens

    def _ends_on_placeholder(self, request: Request) -> bool:
        """Whether a request's pending token is its last by length (async scheduling)."""
        return reaches_length(request, self.max_model_len, request.num_output_placeholders)

    def _pick_victim(self) -> int:
        running = self.running
        policy = self.config.policy
        if policy == "priority":
            return max(range(len(running)), key=lambda j: priority_key(running[j]))
        if policy == "fair":
            return fair_victim(running, self.tenant_counters)
        return len(running) - 1

    def _stats_of(self, tenant: str) -> TenantStats:
        self._tenant_snapshot = None
        stats = self.tenant_stats.get(tenant)
        if stats is None:
            stats = self.tenant_stats[tenant] = TenantStats()
        return stats

    def _charge_output(self, request: Request, num_tokens: int) -> None:
        if self.tenant_counters is not None:
            self.tenant_counters.charge(tenant_of(request), output_tokens=num_tokens)
        if request.tenant is not None:
            self._stats_of(request.tenant).generation_tokens += num_tokens

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the blocks, start over later from the waiting front."""
        self._num_seats -= seats(request)
        self.kv_cache_manager.free(request)
        self._num_sent_blocks.pop(request.request_id, None)  # the runner drops it
        if self.runner_drafts is not None:
            self.runner_drafts.drop(request.request_id)
        if self.draft_backoff is not None:
            self.draft_backoff.drop(request.request_id)
            self.shadow_drafts.drop(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)

    # -- results ------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        timed, self._timed = self._timed, None
        elapsed = (
            self.clock() - timed[1] if timed is not None and timed[0] is scheduler_output else None
        )
        draft_rows = accepted = 0  # this step's, for the controller
        shadow_rows = shadow_kept = 0  # the shadow proposals this step settled
        shadows = len(self.shadow_drafts) > 0 if self.draft_controller is not None else False
        sampled = model_runner_output.sampled_token_ids
        logprobs = model_runner_output.logprobs
        prompt_lps = model_runner_output.prompt_logprobs
        pooled = model_runner_output.pooled
        manager = self.kv_cache_manager
        caching, bs = manager.enable_caching, manager.block_size
        requests = self.requests
        max_model_len = self.max_model_len
        updates: list[RequestUpdate] = []
        num_finished = 0
        charging = self._has_tenants or self.tenant_counters is not None
        if self.runner_drafts is not None:  # (not for requests finished since schedule())
            self.runner_drafts.update(
                (
                    sr.request_id
                    for sr in scheduler_output.scheduled
                    if sr.sample and sr.request_id in requests
                ),
                model_runner_output.draft_token_ids,
            )
        for sr in scheduler_output.scheduled:
            rid = sr.request_id
            request = requests.get(rid)
            if request is None:
                continue  # finished or aborted since schedule()
            if prompt_lps and rid in prompt_lps:
                _add_prompt_logprobs(request, *prompt_lps[rid])
            if sr.sample and request.num_output_placeholders:
                request.num_output_placeholders -= 1
                if request.status == RequestStatus.PREEMPTED:  # since this step: keep the token
                    self._apply_to_preempted(request, sampled.get(rid), logprobs, updates)
                    continue
            if request.status != _RUNNING:
                continue
            start = sr.start_pos
            end = start + sr.num_tokens
            tokens = sampled.get(rid)
            spec = sr.spec_token_ids
            if spec:  # roll the rejected drafts' positions back
                num_rejected = len(spec) - (len(tokens) - 1 if tokens else 0)
                request.num_computed_tokens -= num_rejected
                end -= num_rejected
                self._count_spec(len(spec), len(spec) - num_rejected)
                draft_rows += len(spec)
                accepted += len(spec) - num_rejected
                assert self.draft_backoff is not None
                self.draft_backoff.record(rid, len(spec) - num_rejected)
                end = min(end, request.num_tokens)  # the kept drafts are cached below
            if caching and end // bs > start // bs:
                manager.cache_blocks(request, end)  # this step completed a block's K/V
            if request.pooling_params is not None:
                if rid in pooled:  # its prompt is computed: done, never sampled
                    updates.append(self._finish_pooled(request, pooled[rid]))
                    num_finished += 1
                continue
            if not tokens:  # a prefill chunk short of the prompt's end
                continue
            if shadows:
                settled = self.shadow_drafts.observe(rid, tokens)
                if settled is not None:
                    shadow_rows += settled[0]
                    shadow_kept += settled[1]
                    assert self.draft_backoff is not None  # it goes on as if they were drafted
                    self.draft_backoff.record(rid, settled[1])
            lps = logprobs.get(rid) if logprobs else None
            if charging:
                self._charge_output(request, len(tokens))
            if sr.num_samples > 1:
                self._num_seats -= sr.num_samples - 1  # the children take over the seats
                children, child_updates = fork_samples(
                    request, tokens[1:], lps[1:] if lps else None, max_model_len
                )
                for child in children:
                    self._start_child(request, child)
                updates += child_updates
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
                if spec and caching:  # full blocks the kept drafts completed
                    manager.cache_blocks(request)
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
                    _queue_time(request),
                    _take_prompt_logprobs(request),
                )
            )
        if num_finished:
            self.running = [r for r in self.running if r.status == _RUNNING]
        if shadow_rows:
            assert self.draft_controller is not None
            self.draft_controller.record_acceptance(shadow_rows, shadow_kept)
        if elapsed is not None and _pure_decode(scheduler_output):
            assert self.draft_controller is not None
            self.draft_controller.record(
                len(scheduler_output.scheduled), draft_rows, accepted, elapsed
            )
        return updates

    def _finish_pooled(self, request: Request, vector) -> RequestUpdate:
        """A pooling request whose prompt is computed ends with its vector ("stop"); its
        blocks go back now."""
        self._num_seats -= seats(request)
        self._finish(request, RequestStatus.FINISHED_STOPPED)
        return RequestUpdate(
            request.request_id,
            request.parent_id,
            request.sample_index,
            [],
            None,
            request.finish_reason,
            None,
            request.num_cached_tokens,
            _queue_time(request),
            pooled=vector,
        )

    def _count_spec(self, num_draft_tokens: int, num_accepted: int) -> None:
        stats = self.spec_stats
        assert stats is not None
        stats.num_drafts += 1
        stats.num_draft_tokens += num_draft_tokens
        stats.num_accepted_tokens += num_accepted
        per_pos = stats.accepted_per_pos
        for j in range(num_accepted):
            per_pos[j] += 1

    def _apply_to_preempted(
        self,
        request: Request,
        tokens: list[int] | None,
        logprobs: dict,
        updates: list[RequestUpdate],
    ) -> None:
        """Async scheduling: a step sampled a token for a request that the next schedule()
        preempted. The token is valid (its context was computed): keep it, as a synchronous
        step would have before that preemption, so the recompute resumes after it."""
        if not tokens:
            return
        token = tokens[0]  # never a fork: those steps run synchronously
        if self._has_tenants or self.tenant_counters is not None:
            self._charge_output(request, 1)
        request.append_output_token(token)
        if check_stop(request, self.max_model_len):
            self.waiting.remove_request(request)  # its seats went with the preemption
            self._finish(request, request.status)
        lps = logprobs.get(request.request_id) if logprobs else None
        updates.append(
            RequestUpdate(
                request.request_id,
                request.parent_id,
                request.sample_index,
                [token],
                lps[:1] if lps else None,
                request.finish_reason,
                request.stop_reason,
                request.num_cached_tokens,
                _queue_time(request),
                _take_prompt_logprobs(request),
            )
        )

    def _start_child(self, parent: Request, child: Request) -> None:
        """Give a forked sample the parent's blocks (copy-on-write of a partial last one)."""
        self.requests[child.request_id] = child
        try:
            copy = self.kv_cache_manager.fork(parent, child)
        except NoFreeBlocksError:
            child.status = RequestStatus.WAITING  # no block for the copy: recompute it later
            self.waiting.prepend_request(child)
            return
        child.status = _RUNNING
        child.num_computed_tokens = parent.num_computed_tokens
        self.running.append(child)
        self._num_seats += 1
        if copy is not None:
            self._pending_copies.append((child.request_id, *copy))


def _add_prompt_logprobs(request: Request, first: int, entries: list) -> None:
    """A chunk's prompt logprobs (entries for prompt positions first..): a recomputed chunk
    (after preemption) overwrites what it computed before."""
    if request.prompt_logprobs_sent:
        return
    held = request.prompt_logprobs
    if held is None:
        held = request.prompt_logprobs = [None]
    del held[first:]
    if len(held) < first:  # never: chunks arrive in order from position 0
        held.extend([None] * (first - len(held)))
    held.extend(entries)


def _take_prompt_logprobs(request: Request) -> list | None:
    """The whole prompt's logprobs, once, with the request's first sampled token."""
    if request.prompt_logprobs_sent or request.sampling_params.prompt_logprobs is None:
        return None
    request.prompt_logprobs_sent = True
    held = request.prompt_logprobs or [None]  # a one-token prompt: just the None
    request.prompt_logprobs = None
    return held


def _adapters(requests: list[Request]) -> set[int]:
    return {r.lora_request.lora_int_id for r in requests if r.lora_request is not None}


def _queue_time(request: Request) -> float | None:
    if request.first_scheduled_time is None:
        return None
    return request.first_scheduled_time - request.arrival_time


def _pure_decode(so: SchedulerOutput) -> bool:
    """Every request of the step decodes (one known token, its drafts): the only steps whose
    time tells what drafting costs (a prompt chunk's would swamp it)."""
    return not so.new_requests and all(
        sr.sample and sr.num_tokens == 1 + len(sr.spec_token_ids) for sr in so.scheduled
    )
