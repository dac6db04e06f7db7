"""OutputProcessor: turns the scheduler's per-step RequestUpdates into users' RequestOutputs.

It owns detokenization and stop strings (they need text, the scheduler only knows tokens),
and groups the n samples of one request under the user's request id. With a stream interval
above 1 a request's output goes out with its first token, then once every `interval` new
tokens a sample, and when it finishes: the steps between only add to its state (outputs are
cumulative, so nothing is lost), and a server streams fewer, larger chunks. A request nobody
streams (EngineRequest.streamed False: a whole HTTP answer) gets its first output and its last.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.outputs import CompletionOutput, RequestOutput, RequestUpdate, TokenLogprobs
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.stop_matcher import StopMatcher
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(slots=True)
class _Sample:
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def to_output(self, index: int) -> CompletionOutput:
        return CompletionOutput(
            index=index,
            # Never text held back as a possible stop-string start; copies, because the
            # engine thread goes on appending after the output is handed over.
            text=self.detokenizer.emitted_text,
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            cumulative_logprob=self.cumulative_logprob,
        )


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]
    # Tokens whose text is not output when they end the request (eos, stop_token_ids), as
    # vLLM does; empty with include_stop_str_in_output. Matters with skip_special_tokens
    # off, where the eos text would otherwise end every answer.
    silent_stop_ids: frozenset[int] = frozenset()
    num_cached_tokens: int = 0
    queue_time: float | None = None
    prompt_logprobs: list | None = None
    pooled: Any = None  # a pooling request's vector, once its prompt is computed
    sent_tokens: int = -1  # tokens (all samples) its last output carried; -1: none yet
    interval: int = 1  # the stream interval; for a request not streamed, "never": first and last
    unfinished: int = 0  # samples without a finish reason (a count: read a few times a token)

    def __post_init__(self) -> None:
        self.unfinished = len(self.samples)

    @property
    def finished(self) -> bool:
        return self.unfinished == 0

    def finish(self, sample: _Sample, reason: str, stop_reason: int | str | None = None) -> None:
        sample.finish_reason = reason
        sample.stop_reason = stop_reason
        self.unfinished -= 1

    def due(self, interval: int) -> bool:
        """Whether this step's change goes out: the first output, a finished request, or
        `interval` new tokens a sample since the last one."""
        tokens = sum(len(s.token_ids) for s in self.samples)
        waiting = 0 <= tokens - self.sent_tokens < interval * len(self.samples)
        if self.sent_tokens >= 0 and waiting and not self.finished:
            return False
        self.sent_tokens = tokens
        return True

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.to_output(i) for i, s in enumerate(self.samples)],
            finished=self.unfinished == 0,
            num_cached_tokens=max(self.num_cached_tokens, 0),
            queue_time=self.queue_time,
            prompt_logprobs=self.prompt_logprobs,
            pooled=self.pooled,
        )


_NEVER = 1 << 62  # the interval of a request not streamed: only its first and final outputs


def sample_request_id(request_id: str, index: int) -> str:
    """The scheduler's id for sample `index` of a request (the parent is sample 0)."""
    return request_id if index == 0 else f"{request_id}#{index}"


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.states: dict[str, _RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        streamed: bool = True,
    ) -> None:
        matcher = StopMatcher(params.stop)  # one automaton for the n samples
        samples = [
            _Sample(
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    stop_matcher=matcher,
                ),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            for _ in range(params.n)
        ]
        silent: frozenset[int] = frozenset()
        if not params.include_stop_str_in_output:
            eos = self.tokenizer.eos_token_id
            silent = frozenset([*params.stop_token_ids, *([eos] if eos is not None else [])])
        self.states[request_id] = _RequestState(
            request_id, prompt, prompt_token_ids, samples, silent,
            interval=self.stream_interval if streamed else _NEVER,
        )  # fmt: skip

    def sample_ids(self, request_id: str) -> list[str]:
        state = self.states.get(request_id)
        n = len(state.samples) if state else 1
        return [sample_request_id(request_id, i) for i in range(n)]

    def process(self, updates: list[RequestUpdate]) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's updates. Returns the changed requests' outputs and the scheduler ids
        of samples that a stop string ended (the engine must stop them in the scheduler)."""
        changed: dict[str, _RequestState] = {}
        stopped: list[str] = []
        for update in updates:
            state = self.states.get(update.parent_id or update.request_id)
            if state is None:  # aborted by the user after this step was scheduled
                continue
            sample = state.samples[update.sample_index]
            if sample.finish_reason is not None:
                continue
            if update.num_cached_tokens > state.num_cached_tokens:
                state.num_cached_tokens = update.num_cached_tokens
            if state.queue_time is None:
                state.queue_time = update.queue_time
            if update.prompt_logprobs is not None and state.prompt_logprobs is None:
                state.prompt_logprobs = update.prompt_logprobs
            if update.pooled is not None:
                state.pooled = update.pooled
            detok = sample.detokenizer
            new_ids, new_lps = update.new_token_ids, update.new_logprobs
            text_ids = new_ids
            if update.finish_reason == "stop" and new_ids and new_ids[-1] in state.silent_stop_ids:
                text_ids = new_ids[:-1]
            if len(new_ids) > 1:  # (speculative decoding) a stop string ends it mid-update
                for i, token in enumerate(text_ids):
                    detok.update((token,))
                    if detok.stopped:
                        new_ids = new_ids[: i + 1]
                        new_lps = new_lps[: i + 1] if new_lps else new_lps
                        break
            else:
                detok.update(text_ids)
            sample.token_ids.extend(new_ids)
            if new_lps and sample.logprobs is not None:
                sample.logprobs.extend(new_lps)
                sample.cumulative_logprob += sum(lp.logprob for lp in new_lps)
            if detok.stopped:
                state.finish(sample, FinishReason.STOP.value, detok.stop_reason)
                if update.finish_reason is None:
                    stopped.append(update.request_id)
            elif update.finish_reason is not None:
                detok.finish()
                state.finish(sample, update.finish_reason, update.stop_reason)
            changed[state.request_id] = state
        outputs = []
        for state in changed.values():
            if state.interval == 1 or state.due(state.interval):
                outputs.append(state.to_output())
            if state.finished:
                del self.states[state.request_id]
        return outputs, stopped

    def abort(
        self, request_id: str, reason: FinishReason = FinishReason.ABORT
    ) -> RequestOutput | None:
        """Finish every unfinished sample of a request; returns its final output."""
        state = self.states.pop(request_id, None)
        if state is None:
            return None
        for sample in state.samples:
            if sample.finish_reason is None:
                sample.detokenizer.finish()
                state.finish(sample, reason.value)
        return state.to_output()

    def has_unfinished(self) -> bool:
        return bool(self.states)
