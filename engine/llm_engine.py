"""LLMEngine: the synchronous engine. step() is schedule -> execute -> update.

With async scheduling (engine.async_scheduling) one step stays in flight: step() schedules
and launches step t+1, then applies step t's output (update), so the device computes while
the host schedules and detokenizes.

It validates requests, owns the scheduler, the executor (model runners), the output
processor and the structured-output manager, and is used directly by LLM (offline) and from
a thread by AsyncEngine.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import time
from pathlib import Path

from engine.async_scheduling import needs_sync, resolve_async_scheduling
from engine.batch_limits import apply_to_config
from engine.config import EngineConfig
from engine.core.scheduler import Scheduler
from engine.dummy_tokenizer import load_tokenizer
from engine.errors import QueueFullError
from engine.lora.request import LoRARequest
from engine.models.hf_config import load_hf_config, max_model_len_for, sampling_defaults
from engine.models.loader import resolve_model
from engine.output_processor import OutputProcessor
from engine.outputs import ModelRunnerOutput, RequestOutput, SchedulerOutput
from engine.pooler_config import read_pooler_config, resolve_runner
from engine.pooling_params import PoolingParams
from engine.protocol import EngineRequest, Tenancy
from engine.reasoning import PROMPT_TAIL_TOKENS, REASONING_FORMATS, StartState
from engine.request import FinishReason, Request, RequestStatus
from engine.request_checks import RequestChecks
from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarError, StructuredOutputManager
from engine.structured_output.manager import TextWatch
from engine.tokenizer import read_chat_template
from engine.worker.async_output import PendingOutput
from engine.worker.executor import Executor
from engine.worker.model_runner import resolve_device

logger = logging.getLogger("tessera.engine")


def engine_tokenizer(config: EngineConfig, model_dir, hf_config):
    """The model's tokenizer (its folder's, --tokenizer's or the GGUF's), with --chat-template."""
    tokenizer = load_tokenizer(
        config.model.tokenizer,
        Path(model_dir),
        config.model.load_format,
        hf_config.vocab_size,
        next(iter(hf_config.eos_token_ids), None),
    )
    if config.model.chat_template is not None:
        tokenizer.hf.chat_template = read_chat_template(config.model.chat_template)
    return tokenizer


class LLMEngine(RequestChecks):
    def __init__(self, config: EngineConfig) -> None:
        started = time.monotonic()
        model_dir = resolve_model(config.model.model, load_format=config.model.load_format)
        hf_config = load_hf_config(model_dir)
        max_model_len = max_model_len_for(hf_config, config.model.max_model_len)
        config.model.max_model_len = max_model_len
        self.runner = self._resolve_runner(config, model_dir, hf_config)
        tp = config.parallel.world_size  # (async scheduling: one rank only)
        self.async_scheduling = resolve_async_scheduling(
            config.scheduler.async_scheduling, resolve_device(config.model.device).type, tp
        )
        if self.runner == "pooling":  # a pooled prompt has no next step to overlap with
            self.async_scheduling = False
        if config.scheduler.speculative_config is not None and self.async_scheduling:
            if config.scheduler.async_scheduling:  # asked for both
                raise ValueError(
                    "speculative_config does not run with async scheduling yet: drop "
                    "--async-scheduling (speculative decoding turns it off)"
                )
            logger.info("Speculative decoding is on: async scheduling is off")
            self.async_scheduling = False
        config.scheduler = dataclasses.replace(
            config.scheduler, max_model_len=max_model_len, async_scheduling=self.async_scheduling
        )
        batch_limits = apply_to_config(config, hf_config, resolve_device(config.model.device))
        self.config = config
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self.vocab_size = hf_config.vocab_size
        self.hf_config = hf_config
        # LoRA adapters whose folders were checked, by lora_int_id (engine.lora.adapter)
        self._adapters: dict[int, LoRARequest] = {}
        self.tokenizer = engine_tokenizer(config, model_dir, hf_config)
        self.eos_token_id = self.tokenizer.eos_token_id
        # Models with several end tokens (Llama 3) stop on all of them.
        self.extra_eos_ids = [t for t in hf_config.eos_token_ids if t != self.eos_token_id]
        self.reasoning = REASONING_FORMATS.get(config.model.reasoning_parser or "")
        self.sampling_defaults = sampling_defaults(model_dir, config.model.generation_config)
        if self.sampling_defaults:
            SamplingParams(**self.sampling_defaults)  # a bad file is a start-up error
            logger.info(
                "Sampling defaults from generation_config.json (for what a request leaves "
                "unset; --generation-config vllm ignores them): %s",
                self.sampling_defaults,
            )

        self.executor = Executor(config, model_dir)
        self.num_blocks = self.executor.determine_num_blocks()
        self.executor.init_kv_cache(self.num_blocks)
        # A model whose every layer has a sliding window frees each request's blocks behind
        # it; a hybrid one (some global layers) keeps them all (engine.core.kv_cache_manager).
        sliding_window = hf_config.kv_sliding_window()
        self.scheduler = Scheduler(
            config.scheduler, config.cache, self.num_blocks, sliding_window=sliding_window
        )
        if sliding_window is not None:
            logger.info(
                "Sliding window of %d tokens on every layer: each request keeps the KV blocks "
                "of its last %d tokens only",
                sliding_window,
                sliding_window,
            )
        elif hf_config.sliding_window is not None:
            logger.info(
                "Sliding window of %d tokens on some layers only: every KV block is kept (the "
                "global layers read them)",
                hf_config.sliding_window,
            )
        self.output_processor = OutputProcessor(self.tokenizer, config.scheduler.stream_interval)
        # Structured output: grammars compile on the manager's threads; a request whose grammar
        # is not ready yet waits here, outside the scheduler, so nothing else waits for it.
        self.structured = StructuredOutputManager(
            self.tokenizer.hf, self.vocab_size, [self.eos_token_id, *self.extra_eos_ids]
        )
        self._awaiting_grammar: dict[str, Request] = {}
        # Async scheduling: the step in flight (its SchedulerOutput and pending output).
        self._in_flight: tuple[SchedulerOutput, PendingOutput | ModelRunnerOutput] | None = None
        # Pipeline parallelism: the steps submitted and not yet collected, oldest first, up
        # to one per stage (vLLM's batch queue; _step_pipelined).
        self.max_concurrent_batches = self.executor.max_concurrent_batches
        self._batches: collections.deque[SchedulerOutput] = collections.deque()
        # Cumulative counters for metrics (read by AsyncEngine's stats snapshot).
        self.num_steps = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        logger.info(
            "Engine ready in %.1f s (model %s; %s)",
            time.monotonic() - started,
            model_dir,
            batch_limits,
        )

    @staticmethod
    def _resolve_runner(config: EngineConfig, model_dir, hf_config) -> str:
        """--runner resolved (engine.pooler_config), written back into the config the ranks
        get, with a pooling model's PoolerConfig; what a pooling engine cannot combine with
        is refused here."""
        runner = resolve_runner(config.model.runner, Path(model_dir), hf_config.architecture)
        config.model.runner = runner
        if runner != "pooling":
            return runner
        config.model.pooler = read_pooler_config(
            Path(model_dir), hf_config.raw, hf_config.hidden_size
        )
        refused = [
            (config.scheduler.speculative_config is not None, "speculative decoding"),
            (config.lora.enabled, "LoRA adapters"),
            (bool(config.scheduler.async_scheduling), "async scheduling"),
        ]
        for on, what in refused:
            if on:
                raise ValueError(f"--runner pooling does not support {what}; turn it off")
        logger.info("Runner: pooling, %s", config.model.pooler.source)
        return runner

    # -- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        tenant_weight: float = 1.0,
        deadline: float | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
        streamed: bool = True,
    ) -> None:
        """Queue a request given as separate fields (the offline API's form): the
        EngineRequest built from them, then admit + add. tenant/tenant_weight: whose share it
        draws on under the "fair" policy (the tenant's latest weight wins); deadline: a
        time.monotonic() value past which the engine ends it with finish_reason "timeout";
        lora_request: the LoRA adapter to run it with (enable_lora); pooling_params: an
        embedding request (a pooling engine's kind; params unused); streamed False: step()
        returns its first output and its final one only (vLLM's FINAL_ONLY), not one a step."""
        if isinstance(prompt, str):
            prompt_text, prompt_token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            prompt_text, prompt_token_ids = None, list(prompt)
        request = EngineRequest(
            request_id,
            prompt_token_ids,
            params or SamplingParams(),
            Tenancy(tenant, tenant_weight, cache_salt, priority, deadline),
            prompt_text=prompt_text,
            adapter=lora_request,
            arrival_time=arrival_time,
            pooling=pooling_params,
            streamed=streamed,
        )
        self.add(self.admit(request))

    def admit(self, request: EngineRequest) -> EngineRequest:
        """What depends on this engine, checked once: the prompt and parameters
        (validate_request), a duplicate id, the waiting queue's room. The request back, its
        params resolved (max_tokens). AsyncEngine checks the same on its loop instead."""
        if request.request_id in self.output_processor.states:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        self.validate(request)
        if request.adapter is not None:
            self.check_adapter(request.adapter)
        limit = self.config.max_num_queued_requests
        if limit is not None and self.num_waiting >= limit:
            raise QueueFullError(f"The waiting queue is full ({limit} requests); retry shortly.")
        return request

    @property
    def base_quantization(self) -> str | None:
        """The base weights' method (None: float weights), which DoRA adapters need: the
        in-process runner's; with Ray (no runner here) the flag's or the checkpoint's."""
        runner = self.executor.runner
        if runner is not None:
            return runner.quantization
        asked = self.config.model.quantization
        if asked not in (None, "none"):
            return asked
        checkpoint = self.hf_config.quantization_config
        return checkpoint.get("quant_method", "quantized") if checkpoint else None

    def add(self, request: EngineRequest) -> None:
        """Queue an admitted request: the scheduler's Request made from it, with the model's
        extra EOS ids and its grammar (a request whose grammar still compiles waits for it)."""
        params = request.params
        if self.extra_eos_ids and not params.ignore_eos and request.pooling is None:
            params = dataclasses.replace(
                params, stop_token_ids=[*params.stop_token_ids, *self.extra_eos_ids]
            )
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.structured.request_grammar(params.structured_outputs)
            error = grammar.error()
            if error is not None:
                raise GrammarError(str(error))
            grammar.waiting = self._reasoning_watch(request.prompt_token_ids)
        tenancy = request.tenancy
        scheduled = Request(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            priority=tenancy.priority,
            cache_salt=tenancy.cache_salt,
            grammar=grammar,
            tenant=tenancy.tenant,
            tenant_weight=tenancy.weight,
            deadline=tenancy.deadline,
            lora_request=request.adapter,
            pooling_params=request.pooling,
        )
        if request.arrival_time is not None:
            scheduled.arrival_time = request.arrival_time
        rid, text, ids = request.request_id, request.prompt_text, request.prompt_token_ids
        if grammar is not None and not grammar.ready():
            self.output_processor.add_request(rid, text, ids, params, request.streamed)
            self._awaiting_grammar[rid] = scheduled
            return
        self.scheduler.add_request(scheduled)  # its checks first: a refusal leaves no state
        self.output_processor.add_request(rid, text, ids, params, request.streamed)

    def _reasoning_watch(self, prompt_token_ids: list[int]) -> TextWatch | None:
        """For a reasoning model whose prompt leaves it thinking: the watch that holds the
        grammar until the think section ends (engine.reasoning). None: the grammar applies
        from the first token (no reasoning format, or the template did not open one)."""
        fmt = self.reasoning
        if fmt is None:
            return None
        tail = self.tokenizer.decode(prompt_token_ids[-PROMPT_TAIL_TOKENS:], False)
        if fmt.start_state(tail) is not StartState.REASONING:
            return None
        return TextWatch(fmt.end, self._token_text)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: in the scheduler's queue or waiting for their grammar."""
        return self.scheduler.num_waiting + len(self._awaiting_grammar)

    @property
    def awaiting_grammar(self) -> list[Request]:
        return list(self._awaiting_grammar.values())

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request and all its samples; returns its final output (None if unknown)."""
        ids = self.output_processor.sample_ids(request_id)
        self._awaiting_grammar.pop(request_id, None)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        return self.output_processor.abort(request_id)

    def fail_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Finish requests with finish_reason "error" (the step that held them failed)."""
        return self._end(request_ids, RequestStatus.FINISHED_ERROR, FinishReason.ERROR)

    def _end(
        self, request_ids: list[str], status: RequestStatus, reason: FinishReason
    ) -> list[RequestOutput]:
        """Finish requests and all their samples now; their final outputs."""
        outputs = []
        for request_id in request_ids:
            ids = self.output_processor.sample_ids(request_id)
            self._awaiting_grammar.pop(request_id, None)
            self.scheduler.finish_requests(ids, status)
            out = self.output_processor.abort(request_id, reason)
            if out is not None:
                outputs.append(out)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or self.output_processor.has_unfinished()
            or self._in_flight is not None  # async scheduling: a step to apply still
            or bool(self._batches)  # pipeline parallelism: steps to collect still
        )

    # -- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        failed = self._admit_compiled() if self._awaiting_grammar else []
        # Deadlines next: an expired request is neither scheduled nor admitted again.
        expired = self.scheduler.expired_requests(time.monotonic())
        if expired:
            failed += self._end(expired, RequestStatus.FINISHED_TIMEOUT, FinishReason.TIMEOUT)
        if self.async_scheduling:
            try:
                return failed + self._step_async()
            except BaseException:
                self._in_flight = None  # its requests are failed or aborted by the caller
                raise
        if self.max_concurrent_batches > 1:
            try:
                return failed + self._step_pipelined()
            except BaseException:
                self._batches.clear()  # the executor is dead: nothing will be collected
                raise
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            if scheduler_output.drops_requests:  # the runners forget them (no forward)
                self.executor.execute_model(scheduler_output)
            elif self._awaiting_grammar and not failed:
                self._wait_for_grammars()  # nothing else to do: don't spin
            return failed
        runner_output = self._launch(scheduler_output)
        return failed + self._apply(scheduler_output, runner_output)

    def _launch(self, so: SchedulerOutput) -> ModelRunnerOutput | PendingOutput:
        """Run a scheduled step (with async scheduling its pending output), its grammar bitmask
        filled while the forward runs."""
        so.grammar_bitmask = self._start_bitmask(so)
        try:
            runner_output = self.executor.execute_model(so)
        finally:
            if so.grammar_bitmask is not None:  # the fill reads the matchers
                concurrent.futures.wait([so.grammar_bitmask.future])
        self._count_prompt_tokens(so)
        return runner_output

    def _apply(self, so: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        """A step's output into the requests: stop checks, detokenization, stop strings."""
        updates = self.scheduler.update_from_output(so, runner_output)
        self.generation_tokens_total += sum(len(u.new_token_ids) for u in updates)
        outputs, stopped = self.output_processor.process(updates)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    def _step_pipelined(self) -> list[RequestOutput]:
        """Pipeline parallelism: submit a step while the earlier ones are still in the later
        stages, up to one per stage; collect and apply the oldest when the queue is full or
        nothing more can be scheduled. A request in flight has nothing to compute until its
        token is back (the scheduler skips it), so consecutive batches hold other requests;
        every stage runs the batches in order, so a block freed by one batch and reused by
        the next is written in that order everywhere."""
        outputs: list[RequestOutput] = []
        if len(self._batches) < self.max_concurrent_batches:
            so = self.scheduler.schedule()
            if not so.is_empty or so.drops_requests:
                if so.preempted_request_ids:
                    # A request preempted now may be in a batch in flight; its token must be
                    # back (and dropped) before it can be scheduled again: collect them all.
                    while self._batches:
                        outputs += self._collect()
                # (the rank that samples gets the bitmask with the step: submit waits for it)
                so.grammar_bitmask = self._start_bitmask(so)
                self.executor.submit(so)
                self._count_prompt_tokens(so)
                self._batches.append(so)
                if len(self._batches) < self.max_concurrent_batches and not so.is_empty:
                    return outputs  # room for another batch: schedule it before waiting
            elif not self._batches:
                if self._awaiting_grammar:
                    self._wait_for_grammars()  # nothing else to do: don't spin
                return outputs
        if self._batches:
            outputs += self._collect()
        return outputs

    def _collect(self) -> list[RequestOutput]:
        so = self._batches.popleft()
        return self._apply(so, self.executor.collect())

    def _step_async(self) -> list[RequestOutput]:
        """Schedule and launch step t+1, then apply step t (engine.async_scheduling)."""
        outputs = []
        if self._in_flight is not None and needs_sync(self._in_flight[0], self.scheduler.requests):
            outputs = self._apply_in_flight()  # the next step needs its tokens on the host
        so = self.scheduler.schedule()
        if so.is_empty:
            if so.drops_requests:  # the runner forgets them (no forward)
                self.executor.execute_model(so)
            if self._in_flight is not None:
                return outputs + self._apply_in_flight()
            if self._awaiting_grammar and not outputs:
                self._wait_for_grammars()  # nothing else to do: don't spin
            return outputs
        pending = self._launch(so)
        if self._in_flight is not None:
            outputs += self._apply_in_flight()
        self._in_flight = (so, pending)
        return outputs

    def _apply_in_flight(self) -> list[RequestOutput]:
        assert self._in_flight is not None
        so, pending = self._in_flight
        self._in_flight = None
        result = pending.result() if isinstance(pending, PendingOutput) else pending
        return self._apply(so, result)

    # -- structured output ------------------------------------------------------------------

    def _start_bitmask(self, so):
        """Start filling the bitmask of the step's constrained rows (on the manager's thread,
        while the forward runs); None when no row is constrained."""
        requests = self.scheduler.requests
        rows = []
        for sr in so.scheduled:
            if sr.sample:
                request = requests.get(sr.request_id)
                grammar = None if request is None else request.grammar
                if grammar is not None and grammar.active:  # not while the model reasons
                    rows.append((sr.request_id, grammar, sr.spec_token_ids))
        return self.structured.start_bitmask(rows)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Move requests whose grammar is ready into the scheduler; fail those whose grammar
        failed or took longer than the compile limit."""
        failed = []
        limit = self.structured.limits.compile_timeout_s
        now = time.monotonic()
        for rid, request in list(self._awaiting_grammar.items()):
            grammar = request.grammar
            assert grammar is not None
            if not grammar.ready():
                if now - grammar.submitted < limit:
                    continue
                logger.warning("request %s: grammar not compiled after %.0f s", rid, limit)
            del self._awaiting_grammar[rid]
            if grammar.ready() and grammar.error() is None:
                self.scheduler.add_request(request)
                continue
            if grammar.error() is not None:
                logger.warning("request %s: grammar failed: %s", rid, grammar.error())
            out = self.output_processor.abort(rid, FinishReason.ERROR)
            if out is not None:
                failed.append(out)
        return failed

    def _wait_for_grammars(self, timeout: float = 0.05) -> None:
        futures = [r.grammar.future for r in self._awaiting_grammar.values() if r.grammar]
        concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)

    def _count_prompt_tokens(self, scheduler_output) -> None:
        """Count a launched step and its prompt tokens (its sampled ones count when applied,
        in _apply: a dropped placeholder never does)."""
        self.num_steps += 1
        prompt = 0
        for sr in scheduler_output.scheduled:
            request = self.scheduler.get_request(sr.request_id)  # (aborts come between steps)
            n_prompt = request.num_prompt_tokens if request is not None else 0
            if sr.start_pos < n_prompt:
                prompt += min(sr.num_tokens, n_prompt - sr.start_pos)
        self.prompt_tokens_total += prompt

    def check_alive(self) -> None:
        """Raise EngineDeadError if the engine can step no more (a tensor-parallel worker died)."""
        self.executor.check_alive()

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()
