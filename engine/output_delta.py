"""A step's outputs as what they add to what was sent before: what the engine process's pipe
carries (engine/core_process.py).

RequestOutputs are cumulative: each holds the request's whole output so far and its prompt.
Pickled whole, a step costs O(prompt + output) a request: at 256 requests of 1,000 prompt and
500 output tokens, ~27 ms a step to pickle and unpickle, more than a GPU's decode step. The
encoder (the child's) sends a request's prompt once, with its first output, and then only each
sample's new text, token ids and logprobs; the decoder (the parent's) appends them and hands
on the same cumulative RequestOutputs the engine made. Both drop a request at its finished
output. A sample's text, tokens and logprobs only ever grow (text held back for a possible
stop string is not in an output until it is final), which is what makes their tails enough.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs


@dataclass(slots=True)
class _SampleSent:
    chars: int = 0
    tokens: int = 0
    logprobs: int = 0


@dataclass(slots=True)
class _RequestSent:
    samples: dict[int, _SampleSent] = field(default_factory=dict)
    prompt_logprobs: bool = False  # sent already (they come once, then stay the same)


class DeltaEncoder:
    """The child's side: outputs -> wire tuples (picklable, small)."""

    def __init__(self) -> None:
        self._sent: dict[str, _RequestSent] = {}

    @property
    def num_requests(self) -> int:
        return len(self._sent)

    def encode(self, outputs: list[RequestOutput]) -> list[tuple]:
        wire = []
        for out in outputs:
            sent = self._sent.get(out.request_id)
            head = None
            if sent is None:
                sent = self._sent[out.request_id] = _RequestSent()
                head = (out.prompt, out.prompt_token_ids)
            samples = []
            for c in out.outputs:
                s = sent.samples.get(c.index)
                if s is None:
                    s = sent.samples[c.index] = _SampleSent()
                lps = None
                if c.logprobs is not None:
                    lps = c.logprobs[s.logprobs :]
                    s.logprobs = len(c.logprobs)
                samples.append(
                    (c.index, c.text[s.chars :], c.token_ids[s.tokens :], c.finish_reason,
                     c.stop_reason, lps, c.cumulative_logprob)
                )  # fmt: skip
                s.chars, s.tokens = len(c.text), len(c.token_ids)
            prompt_logprobs = None
            if out.prompt_logprobs is not None and not sent.prompt_logprobs:
                prompt_logprobs, sent.prompt_logprobs = out.prompt_logprobs, True
            wire.append(
                (out.request_id, head, out.finished, out.num_cached_tokens, out.queue_time,
                 out.error, prompt_logprobs, out.pooled, samples)
            )  # fmt: skip
            if out.finished:
                del self._sent[out.request_id]
        return wire


@dataclass(slots=True)
class _Sample:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class _Request:
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: Any = None
    samples: dict[int, _Sample] = field(default_factory=dict)


class DeltaDecoder:
    """The parent's side: wire tuples -> the cumulative RequestOutputs the child's engine made."""

    def __init__(self) -> None:
        self._requests: dict[str, _Request] = {}

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def decode(self, wire: list[tuple]) -> list[RequestOutput]:
        outputs = []
        for rid, head, finished, cached, queue_time, error, prompt_lps, pooled, samples in wire:
            request = self._requests.get(rid)
            if request is None:
                request = self._requests[rid] = _Request(*head)
            if prompt_lps is not None:
                request.prompt_logprobs = prompt_lps
            completions = []
            for index, text, token_ids, finish, stop, lps, cumulative in samples:
                s = request.samples.get(index)
                if s is None:
                    s = request.samples[index] = _Sample()
                s.text += text
                s.token_ids += token_ids
                if lps is not None:
                    s.logprobs = lps if s.logprobs is None else s.logprobs + lps
                # Copies: the next step appends to these lists; a handed-out output stays.
                completions.append(
                    CompletionOutput(index, s.text, list(s.token_ids), finish, stop,
                                     None if s.logprobs is None else list(s.logprobs), cumulative)
                )  # fmt: skip
            outputs.append(
                RequestOutput(rid, request.prompt, request.prompt_token_ids, completions,
                              finished, cached, queue_time, error, request.prompt_logprobs, pooled)
            )  # fmt: skip
            if finished:
                del self._requests[rid]
        return outputs
