"""StructuredOutputManager: compiles grammars off the engine step and fills bitmasks.

Compiles run on a small thread pool and are cached by (kind, canonical spec): the first
request with a schema pays the compile, later ones find the finished future. A request
whose grammar is still compiling waits outside the scheduler (LLMEngine) without holding up
the others (vLLM v1's WAITING_FOR_FSM).

A step's bitmask depends on the token sampled the step before, so it cannot be filled
earlier than the step itself; it is filled on a thread while that step's forward runs (the
forward releases the GIL), and the runner waits for it only when it samples.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.sampling_params import StructuredOutputsParams
from engine.structured_output.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarLimits,
    Matcher,
    spec_key,
)
from engine.structured_output.schema_refs import check_schema_refs

logger = logging.getLogger("tessera.engine")

_CACHE_SIZE = 256  # compiled grammars kept (LRU)
_COMPILE_THREADS = 2

SUPPORTED_FORMS = ("json_object", "json_schema", "regex", "choice", "grammar")


class TextWatch:
    """Watches a request's output tokens for a closing text (a reasoning model's
    `</think>`, engine.reasoning): `feed` is True once the text has appeared. Tags are
    ASCII, so decoding token by token finds them whatever the tokenizer splits them into."""

    __slots__ = ("text", "token_text", "_tail")

    def __init__(self, text: str, token_text: Callable[[int], str], tail: str = ""):
        self.text = text
        self.token_text = token_text
        self._tail = tail

    def feed(self, token: int) -> bool:
        self._tail = (self._tail + self.token_text(token))[-2 * len(self.text) :]
        return self.text in self._tail

    def copy(self) -> TextWatch:
        return TextWatch(self.text, self.token_text, self._tail)


class RequestGrammar:
    """One request's grammar state: the compile future, then its own matcher. With a
    `waiting` watch (a reasoning model thinking first), tokens pass unconstrained and
    unmatched until the watch sees the reasoning end; the grammar applies from there."""

    __slots__ = ("future", "_matcher", "submitted", "waiting")

    def __init__(
        self,
        future: concurrent.futures.Future,
        matcher: Matcher | None = None,
        waiting: TextWatch | None = None,
    ):
        self.future = future
        self._matcher = matcher
        self.submitted = time.monotonic()
        self.waiting = waiting

    @property
    def active(self) -> bool:
        """Whether the grammar constrains the next token (not while the model reasons)."""
        return self.waiting is None

    def ready(self) -> bool:
        """Whether the grammar is compiled (or failed: see error())."""
        return self._matcher is not None or self.future.done()

    def error(self) -> BaseException | None:
        if self._matcher is not None or not self.future.done():
            return None
        return self.future.exception()

    @property
    def matcher(self) -> Matcher:
        if self._matcher is None:
            compiled: CompiledGrammar = self.future.result()
            self._matcher = compiled.matcher()
        return self._matcher

    def accept_token(self, token: int) -> None:
        if self.waiting is not None:
            if self.waiting.feed(token):
                self.waiting = None  # the reasoning ended with this token: the answer is next
            return
        if not self.matcher.accept_token(token):
            # Only a token outside the mask gets here (the mask was not applied): the matcher
            # is now in its error state, which is_terminated() reports.
            logger.warning("structured output: token %d rejected by the grammar", token)

    def is_terminated(self) -> bool:
        return self.waiting is None and self.matcher.is_terminated()

    def valid_drafts(self, drafts: list[int]) -> list[int]:
        """The longest prefix of speculative drafts the grammar allows from here (cut at the
        first token outside its mask, and after the one that completes it): what speculative
        decoding may propose for verification. The request's own matcher is not moved."""
        if not drafts or self.waiting is not None or self.matcher.is_terminated():
            return []
        m = self.matcher.fork()
        for j, token in enumerate(drafts):
            if not m.accept_token(token):
                return drafts[:j]
            if m.is_terminated():
                return drafts[: j + 1]
        return drafts

    def failed(self) -> bool:
        return self.waiting is None and self.matcher.failed()

    def fork(self) -> RequestGrammar:
        """A copy for a forked sample: same grammar, its own matcher state."""
        waiting = None if self.waiting is None else self.waiting.copy()
        return RequestGrammar(self.future, self.matcher.fork(), waiting)


@dataclass(slots=True)
class GrammarBitmask:
    """A step's bitmask being filled: row i of the tensor belongs to request_ids[i] (a request
    with speculative drafts has 1 + len(drafts) rows in a row, in order of position)."""

    request_ids: list[str]
    future: concurrent.futures.Future  # -> int32 [len(request_ids), ceil(vocab / 32)]

    def result(self) -> torch.Tensor:
        return self.future.result()


class StructuredOutputManager:
    def __init__(
        self,
        hf_tokenizer,
        vocab_size: int,
        eos_token_ids: list[int],
        limits: GrammarLimits | None = None,
    ) -> None:
        self.limits = limits or GrammarLimits()
        self.vocab_size = vocab_size
        self._tokenizer_args = (hf_tokenizer, vocab_size, eos_token_ids)
        self._backend: GrammarBackend | None = None  # built by the first compile (~1 s)
        self._backend_lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[str, str], concurrent.futures.Future] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            _COMPILE_THREADS, thread_name_prefix="tessera-grammar"
        )
        self._fill = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tessera-mask")
        self.num_compiles = 0
        self.num_cache_hits = 0

    # -- compiling --------------------------------------------------------------------------

    def compile(self, so: StructuredOutputsParams) -> concurrent.futures.Future:
        """The future of the compiled grammar (from the cache when the spec was seen).
        Size limits are checked here and raise GrammarError at once."""
        key = spec_key(so, self.limits)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return future
            future = self._pool.submit(self._compile, key)
            self._cache[key] = future
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            self.num_compiles += 1
            return future

    def request_grammar(self, so: StructuredOutputsParams) -> RequestGrammar:
        return RequestGrammar(self.compile(so))

    def _compile(self, key: tuple[str, str]) -> CompiledGrammar:
        kind, spec = key
        if kind == "json":  # named in the client's terms, before the engine dumps its state
            check_schema_refs(json.loads(spec))
        return self.backend.compile(kind, spec)

    @property
    def backend(self) -> GrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                from engine.structured_output.llguidance_backend import LLGuidanceBackend

                self._backend = LLGuidanceBackend(*self._tokenizer_args)
            return self._backend

    def warm_up(self) -> concurrent.futures.Future:
        """Build the backend's tokenizer tables on the pool now, not on the first request."""
        return self._pool.submit(lambda: self.backend)

    # -- bitmasks ---------------------------------------------------------------------------

    def start_bitmask(
        self, rows: list[tuple[str, RequestGrammar, list[int]]]
    ) -> GrammarBitmask | None:
        """Begin filling the bitmask of the step's constrained rows on the fill thread: per
        (request, grammar, drafts), one row for the request's next token and, with speculative
        drafts, one more for each draft: row j the mask after the first j drafts (the target's
        token at each verified position is drawn under it; the drafts are the grammar's own,
        RequestGrammar.valid_drafts). The matchers must not move until the fill is done."""
        if not rows:
            return None
        ids = [rid for rid, _, drafts in rows for _ in range(1 + len(drafts))]
        walks, row = [], 0  # (matcher, its first row, drafts)
        for _, g, drafts in rows:
            walks.append((g.matcher, row, drafts))
            row += 1 + len(drafts)
        words = -(-self.vocab_size // 32)
        backend = self.backend

        def fill() -> torch.Tensor:
            bitmask = torch.zeros(len(ids), words, dtype=torch.int32)
            pairs = []
            repeats = []  # (rows, the row whose mask they keep)
            for matcher, first, drafts in walks:  # a matcher per position, from the last one's
                m = matcher
                pairs.append((m, first))
                for j, token in enumerate(drafts, 1):
                    m = m.fork()
                    if not m.accept_token(token):  # (not a valid_drafts prefix): the rows past
                        # it keep the mask that rejects this draft, so none is kept
                        repeats.append((slice(first + j, first + 1 + len(drafts)), first + j - 1))
                        break
                    pairs.append((m, first + j))
            backend.fill_bitmasks(pairs, bitmask)  # all rows at once, on the backend's threads
            for rows_, src in repeats:
                bitmask[rows_] = bitmask[src]
            return bitmask

        return GrammarBitmask(ids, self._fill.submit(fill))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._fill.shutdown(wait=False, cancel_futures=True)


__all__ = ["GrammarBitmask", "GrammarError", "RequestGrammar", "StructuredOutputManager"]
