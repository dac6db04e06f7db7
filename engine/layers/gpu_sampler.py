"""The GPU's sampler: logits [S, V] -> sampled token ids, with no host sync until the ids are
read back.

The CPU sampler (engine.layers.sampler) picks rows by their parameters, draws from torch
generators and reads results with .tolist() at several points: each a device -> host sync on
a GPU, where the host should be preparing the next step. Here every step runs the same ops
on all S rows, whatever their parameters: the per-request parameters come from persistent
device tables (engine.worker.input_batch.SamplingTensors) gathered by the step's columns;
which optional stages run at all (min-p, top-k/top-p, penalties, bias) is decided on the host
from the host's own copy of the parameters, never from device values. No .item(), .tolist(),
nonzero or shape that depends on device data (tested with a dispatch mode). The sampled ids
reach the host through one asynchronous copy into a pinned buffer, read once after an event
(PendingTokens.tolist).

Order and semantics as in the CPU sampler: logit_bias and the min_tokens mask, penalties,
the grammar's token bitmask on structured-output rows, greedy rows' argmax, random rows' temperature -> min_p -> top_k -> top_p (renormalised after
top_k) -> an inverse-CDF draw with one float64 uniform per sample. The uniforms come from a
counter-based hash (splitmix64) of (seed, number of output tokens, sample index) for seeded
requests, of (sampler seed, step, row) otherwise: a seeded request's tokens depend on its seed
and its logits only, whatever else is in the batch, as on the CPU, but the stream is not the
CPU generator's (same seed -> same text on the same device). Logprobs, where a request asks
for them, come from the CPU sampler's code over the raw logits once the ids are back (that
code reads results on the host: the one place with more syncs, only for such steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.layers.sampler import (
    _GREEDY_BELOW,
    Sampler,
    SamplingRequest,
    _is_greedy,
    _needs_changes,
    bias_and_mask_entries,
)
from engine.outputs import TokenLogprobs
from engine.structured_output.bitmask import RowMask, apply_token_bitmask

if TYPE_CHECKING:
    from engine.worker.input_batch import SamplingTensors

_M64 = (1 << 64) - 1


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _srl(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's >> is arithmetic)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def splitmix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic, as in C)."""
    z = (z ^ _srl(z, 30)) * _MIX1
    z = (z ^ _srl(z, 27)) * _MIX2
    return z ^ _srl(z, 31)


def hash_uniforms(key: torch.Tensor, counter: torch.Tensor, num: int) -> torch.Tensor:
    """[S, num] float64 uniforms in [0, 1): a pure function of (key[i], counter[i], j)."""
    base = splitmix64(key * _GOLDEN + counter)  # [S]
    j = torch.arange(1, num + 1, dtype=torch.int64, device=key.device)
    z = splitmix64(base[:, None] + j[None, :] * _GOLDEN)
    return _srl(z, 11).double() * (1.0 / (1 << 53))


@dataclass(slots=True)
class PendingTokens:
    """A step's sampled ids on their way to the host: [S, m] in a pinned buffer, valid once
    the event has passed."""

    host: torch.Tensor
    event: torch.cuda.Event | None
    num_samples: list[int]

    def tolist(self) -> list[list[int]]:
        if self.event is not None:
            self.event.synchronize()  # the step's one wait on the device
        rows = self.host.tolist()
        return [row[:n] for row, n in zip(rows, self.num_samples, strict=True)]


@dataclass(slots=True)
class StepRows:
    """The step's index vectors on the device: which hidden row each sampling request's last
    token is, its parameter column, its output count (seeded draws, the min_tokens mask)."""

    hidden_rows: torch.Tensor  # int64 [S]
    columns: torch.Tensor  # int64 [S]
    num_outputs: torch.Tensor  # int64 [S]


class GpuSampler:
    def __init__(self, params: SamplingTensors, seed: int = 0):
        self.params = params
        self.device = params.device
        self._seed = _signed(seed & _M64)
        self._step = 0
        cuda = self.device.type == "cuda"
        self._pin = cuda
        self._staging = torch.zeros(0, dtype=torch.int64)
        self._staged = torch.cuda.Event() if cuda else None
        self._out = torch.zeros(0, dtype=torch.int64)
        self._read = torch.cuda.Event() if cuda else None
        self._logprob_code = Sampler(seed)  # its logprobs only: same values as on the CPU

    def logprobs(
        self,
        logits: torch.Tensor,
        requests: Sequence[SamplingRequest],
        tokens: list[list[int]],
    ) -> list[list[TokenLogprobs] | None]:
        """The asked-for logprobs of the sampled tokens under the raw logits (sample leaves
        them raw where a request asks for logprobs)."""
        return self._logprob_code._logprobs(logits, list(requests), tokens)

    def _pinned(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        if buf.numel() < n:
            buf = torch.zeros(max(n, 2 * buf.numel(), 256), dtype=torch.int64, pin_memory=self._pin)
        return buf

    def stage(
        self, hidden_rows: Sequence[int], columns: Sequence[int], num_outputs: Sequence[int]
    ) -> StepRows:
        """The step's three index vectors through one pinned buffer and one non_blocking copy."""
        s = len(hidden_rows)
        if self._staged is not None:
            self._staged.synchronize()  # the last copy out of the staging buffer is done
        self._staging = self._pinned(self._staging, 3 * s)
        h = self._staging.numpy()
        h[:s], h[s : 2 * s], h[2 * s : 3 * s] = hidden_rows, columns, num_outputs
        dev = self._staging[: 3 * s].to(self.device, non_blocking=True)
        if self._staged is not None:
            self._staged.record()
        return StepRows(dev[:s], dev[s : 2 * s], dev[2 * s :])

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor | None,
        requests: Sequence[SamplingRequest],
        rows: StepRows,
        greedy: torch.Tensor | None = None,
        grammar_mask: RowMask | None = None,
    ) -> PendingTokens:
        """Tokens for each request (num_samples each), copied towards the host. greedy: the
        step's argmax ids when every request is plain greedy and the LM head gave them
        without logits (then logits may be None). grammar_mask: the structured-output rows'
        token bitmask."""
        if greedy is not None:
            tokens = greedy[:, None]
        else:
            tokens = self.draw(logits, requests, rows, grammar_mask)
        self._step += 1
        s, m = tokens.shape
        if self._read is not None:
            self._read.synchronize()  # the last step's ids were read out of this buffer
        self._out = self._pinned(self._out, s * m)
        host = self._out[: s * m].view(s, m)
        host.copy_(tokens, non_blocking=True)
        if self._read is not None:
            self._read.record()
        return PendingTokens(host, self._read, [r.num_samples for r in requests])

    def draw(
        self,
        logits: torch.Tensor,
        requests: Sequence[SamplingRequest],
        rows: StepRows,
        grammar_mask: RowMask | None = None,
    ) -> torch.Tensor:
        """int64 [S, max num_samples] on the device; every stage sync-free. The logits are
        modified in place unless a request asks for logprobs (then they stay raw)."""
        s, v = logits.shape
        m = max(r.num_samples for r in requests)
        x = logits if logits.dtype == torch.float32 else logits.float()
        sps = [r.sampling_params for r in requests]
        floats = self.params.floats.index_select(1, rows.columns)  # [F, S]
        ints = self.params.ints.index_select(1, rows.columns)  # [I, S]
        changes = _needs_changes(requests)
        if changes or grammar_mask is not None:
            if x is logits and any(p.logprobs is not None for p in sps):
                x = x.clone()  # logprobs are of the raw distribution
            if changes:
                _apply_changes(x, requests, floats)
            if grammar_mask is not None:  # host rows and bits in, no sync
                masked = _on(grammar_mask.rows, torch.int64, x.device)
                apply_token_bitmask(x, masked, grammar_mask.bitmask)
        greedy_tok = x.argmax(-1)
        if all(_is_greedy(r) for r in requests):
            return greedy_tok[:, None].expand(s, m)
        temp = floats[0]
        is_greedy = temp < _GREEDY_BELOW
        inv_t = torch.where(is_greedy, 1.0, temp).reciprocal()[:, None]
        # e = exp((x - max) / T): unnormalised probabilities, each row's max exactly 1
        e = (x - x.amax(-1, keepdim=True)).mul_(inv_t).exp_()
        if any(p.min_p > 0 for p in sps):  # drop tokens under min_p * the max probability
            e.mul_(e >= floats[2][:, None])
        seeds = ints[1]
        seeded = seeds >= 0
        key = torch.where(seeded, seeds, self._seed)
        unseeded_counter = torch.arange(s, device=x.device) + (self._step << 20)
        u = hash_uniforms(key, torch.where(seeded, rows.num_outputs, unseeded_counter), m)
        # Rows without top-k/top-p draw over the vocabulary in id order, whatever the others
        # do: a row's token must not depend on its neighbours' parameters.
        cum = e.cumsum(-1, dtype=torch.float64)
        drawn = torch.searchsorted(cum, u * cum[:, -1:], right=True).clamp_(max=v - 1)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in sps):
            top_k, top_p = ints[0], floats[1]
            truncated = self._draw_truncated(e, u, top_k, top_p)
            drawn = torch.where(((top_k > 0) | (top_p < 1.0))[:, None], truncated, drawn)
        return torch.where(is_greedy[:, None], greedy_tok[:, None], drawn)

    @staticmethod
    def _draw_truncated(
        e: torch.Tensor, u: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
    ) -> torch.Tensor:
        """The inverse-CDF draw over the probabilities e [S, V] sorted (stable: ties keep id
        order) after top_k (0: off), then top_p over what top_k kept (1: off)."""
        v = e.shape[1]
        vals, ids = e.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(v, device=e.device)[None, :]
        k = torch.where(top_k > 0, top_k.clamp(max=v), v)[:, None]
        vals = vals * (rank < k)
        cum = vals.cumsum(-1, dtype=torch.float64)
        # a token stays while the mass before it is under top_p of the total (the first
        # always stays)
        p = top_p.double()[:, None]
        keep = ((cum - vals) < p * cum[:, -1:]) | (rank == 0) | (p >= 1.0)
        vals = vals * keep
        cum = vals.cumsum(-1, dtype=torch.float64)
        pos = torch.searchsorted(cum, u * cum[:, -1:], right=True).clamp_(max=v - 1)
        return ids.gather(1, pos)


def _on(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on the device without a stream sync: torch's blocking host-to-device
    copy waits for the device's queue; a non_blocking one from pageable memory is staged
    before it returns, so the host tensor may go right away."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _padded(lists: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """int64 [len(lists), longest] on the device, short rows filled with pad."""
    out = np.full((len(lists), max((len(t) for t in lists), default=0) or 1), pad, np.int64)
    for i, t in enumerate(lists):
        out[i, : len(t)] = t
    return torch.from_numpy(out).to(device, non_blocking=True)


def _apply_changes(x: torch.Tensor, requests: Sequence[SamplingRequest], floats) -> None:
    """logit_bias, the min_tokens mask and penalties in place on x [S, V], from host lists
    copied over (their sizes are the host's): the CPU sampler's values, no sync."""
    rows, toks, vals = bias_and_mask_entries(requests)
    dev = x.device
    if rows:
        where = (_on(rows, torch.int64, dev), _on(toks, torch.int64, dev))
        x.index_put_(where, _on(vals, x.dtype, dev), accumulate=True)
    pen = [i for i, r in enumerate(requests) if r.sampling_params.needs_penalties]
    if not pen:
        return
    v = x.shape[1]
    idx = _on(pen, torch.int64, dev)
    xr = x.index_select(0, idx)
    f = floats.index_select(1, idx)
    rep, pres, freq = f[3][:, None], f[4][:, None], f[5][:, None]
    out_ids = _padded([requests[i].output_token_ids for i in pen], v, dev)
    counts = torch.zeros(len(pen), v + 1, dtype=x.dtype, device=dev)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=x.dtype))
    counts = counts[:, :v]
    if any(requests[i].sampling_params.repetition_penalty != 1.0 for i in pen):
        prompt_ids = _padded([requests[i].prompt_token_ids for i in pen], v, dev)
        seen = torch.zeros(len(pen), v + 1, dtype=torch.bool, device=dev)
        seen.scatter_(1, prompt_ids, True)
        seen = seen[:, :v] | (counts > 0)
        xr = torch.where(seen, torch.where(xr > 0, xr / rep, xr * rep), xr)
    xr = xr - (freq * counts + pres * (counts > 0))
    x.index_copy_(0, idx, xr)
