"""The runner's side of async scheduling (engine.async_scheduling): a step returns before its
sampled ids reach the host.

The ids stay on the device and feed the next step: each request the step sampled gets a
placeholder token (PLACEHOLDER) in the input batch, and the next step's input ids take the
values for those rows from the previous step's device tensor (PrevTokens). The host copy of
the ids goes into one of two pinned buffers (TokenCopies: step t+1 copies into the other while
the host still reads step t's), and PendingOutput.result() waits for it only when the engine
applies the step, one step later; it then writes the real ids over the placeholders.

On the CPU the "device" is the host: the same code runs, the copy is the tensor itself, and
the tests exercise the placeholders and the feed there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.layers.gpu_sampler import GpuSampler
from engine.outputs import ModelRunnerOutput, TokenLogprobs
from engine.structured_output.bitmask import RowMask
from engine.worker.input_batch import CachedRequestState, InputBatch

PLACEHOLDER = -1  # a sampled id not on the host yet (never a valid token id)


class AsyncGpuSampler(GpuSampler):
    """The GPU sampler whose ids stay on the device (the runner copies them itself), with two
    staging buffers used in turn: with a step in flight, the last step's staging copy is
    queued behind its forward, and one buffer would make the host wait for that forward."""

    def __init__(self, params, seed: int = 0):
        super().__init__(params, seed)
        self._stagings = [self._staging, torch.zeros(0, dtype=torch.int64)]
        self._stage_events = [self._staged, torch.cuda.Event() if self._pin else None]
        self._turn = 0

    def stage(self, hidden_rows, columns, num_outputs):
        i = self._turn
        self._turn ^= 1
        self._staging, self._staged = self._stagings[i], self._stage_events[i]
        rows = super().stage(hidden_rows, columns, num_outputs)  # waits for i's last copy
        self._stagings[i] = self._staging  # (grown)
        return rows

    @torch.inference_mode()
    def sample_on_device(
        self,
        logits: torch.Tensor | None,
        requests,
        rows,
        greedy: torch.Tensor | None = None,
        grammar_mask: RowMask | None = None,
    ) -> torch.Tensor:
        """int64 [S, max num_samples] on the device (GpuSampler.sample without the copy)."""
        if greedy is not None:
            tokens = greedy[:, None]
        else:
            tokens = self.draw(logits, requests, rows, grammar_mask)
        self._step += 1  # the unseeded draws' counter, as sample() advances it
        return tokens


@dataclass(slots=True)
class HostTokens:
    """Sampled ids [S, m] on their way to the host; valid once the event has passed."""

    host: torch.Tensor
    event: torch.cuda.Event | None

    def tolist(self) -> list[list[int]]:
        if self.event is not None:
            self.event.synchronize()  # the step's one wait, a step later
        return self.host.tolist()


class TokenCopies:
    """Two pinned host buffers used in turn: step t+1 copies into one while the host has not
    yet read step t's from the other (the engine reads t before it launches t+2)."""

    def __init__(self, device: torch.device) -> None:
        self.pin = device.type == "cuda"
        self._buffers = [torch.zeros(0, dtype=torch.int64) for _ in range(2)]
        self._events = [torch.cuda.Event() if self.pin else None for _ in range(2)]
        self._next = 0

    def start(self, tokens: torch.Tensor) -> HostTokens:
        if not self.pin:  # on the host already
            return HostTokens(tokens, None)
        i = self._next
        self._next ^= 1
        event = self._events[i]
        event.synchronize()  # read two steps ago: long done
        n = tokens.numel()
        if self._buffers[i].numel() < n:
            self._buffers[i] = torch.zeros(max(n, 256), dtype=torch.int64, pin_memory=True)
        host = self._buffers[i][:n].view(tokens.shape)
        host.copy_(tokens, non_blocking=True)
        event.record()
        return HostTokens(host, event)


@dataclass(slots=True)
class PrevTokens:
    """The last step's sampled ids on the device (first sample of each row) and each
    sampled request's row: the next step's placeholder inputs read them."""

    ids: torch.Tensor  # int64 [S] on the device
    row: dict[str, int]

    def feed(
        self, ids: Sequence[int], last_row: dict[str, int], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of this step's input ids, their values on the device) for the rows that
        are placeholders; None if there are none. A placeholder is always a chunk's last
        token (the newest one), and always from the step just before."""
        dst, src = [], []
        for rid, r in last_row.items():
            if ids[r] < 0:
                j = self.row.get(rid)
                if j is None:
                    raise RuntimeError(
                        f"request {rid!r}: its input is a placeholder the last step did not sample"
                    )
                dst.append(r)
                src.append(j)
        if not dst:
            return None
        dst_t = torch.tensor(dst, dtype=torch.long).to(device, non_blocking=True)
        src_t = torch.tensor(src, dtype=torch.long).to(device, non_blocking=True)
        return dst_t, self.ids.index_select(0, src_t)


@dataclass(slots=True)
class PendingOutput:
    """A step's ModelRunnerOutput, available once its ids are on the host. result() writes
    them over the step's placeholders in the input batch; call it once per step, in order."""

    batch: InputBatch
    scheduled: list[str]
    to_sample: list[str]
    states: list[CachedRequestState]
    slots: list[int]  # each sampled state's output index holding its placeholder
    tokens: HostTokens | list[list[int]]
    num_samples: list[int]
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    _output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._output is not None:
            return self._output
        rows = self.tokens if isinstance(self.tokens, list) else self.tokens.tolist()
        held = self.batch.requests
        sampled: dict[str, list[int]] = {rid: [] for rid in self.scheduled}
        for rid, state, slot, row, m in zip(
            self.to_sample, self.states, self.slots, rows, self.num_samples, strict=True
        ):
            sampled[rid] = row[:m]
            if held.get(rid) is state:  # not dropped (finished, preempted) since
                state.set_output_token(slot, row[0])
        self._output = ModelRunnerOutput(
            sampled_token_ids=sampled, logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs
        )
        return self._output
