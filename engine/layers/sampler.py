"""Batched sampler: logits [S, V] -> sampled token ids (and logprobs) per scheduled request.

Per step, in vLLM v1's order:
  logprobs of the raw model distribution (log_softmax of the logits as given, vLLM's default
  "raw_logprobs": what the model thinks, before any penalty, bias or truncation)
  -> logit_bias, min_tokens mask -> repetition / presence / frequency penalties
  -> the grammar's token bitmask on constrained rows (structured output)
  -> greedy rows: argmax
  -> random rows: temperature -> min_p -> top_k -> top_p (renormalised after top_k) -> draw.

The draw is inverse-CDF with one float64 uniform per sample (a race over Exp(1) noise would
need V random numbers per row, and exponential_ over [256, 49152] costs ~230 ms on 2 cores).
Seeded requests take their uniforms from their own generator, reseeded each step from
(seed, number of output tokens): a request's tokens depend on its seed and its logits only,
not on its neighbours in the batch, on preemption and recompute, or on drop().

CPU costs that shape the code: torch's argmax, topk and sort over whole rows are many times
slower than vectorised reductions, so rows are handled as 64-token blocks (block maxima and
sums, then work on a few blocks); and every fresh [S, V] tensor page-faults its ~50 MB, so
the big intermediates live in buffers kept across steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import index
from typing import Protocol

import torch

from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.structured_output.bitmask import RowMask, apply_token_bitmask

_B = 64  # block width
_CANDIDATE_BLOCKS = (16, 128)  # top-p/top-k rank the tokens of this many best blocks first
_GREEDY_BELOW = 1e-5  # temperatures under this are greedy (as in vLLM)


def validate_token_ids(ids: Iterable[int], vocab_size: int, what: str = "token id") -> None:
    """Raise ValueError unless every id is an int in [0, vocab_size)."""
    for t in ids:
        try:
            ok = not isinstance(t, bool) and 0 <= index(t) < vocab_size
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(
                f"{what} {t!r} is out of range: the vocabulary has {vocab_size} tokens "
                f"(ids 0 to {vocab_size - 1})"
            )


class SamplingRequest(Protocol):
    """What the sampler reads of a request: the runner's per-request state
    (engine.worker.input_batch.CachedRequestState) has these fields."""

    request_id: str
    sampling_params: SamplingParams
    num_samples: int  # tokens to draw from its row
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # so far: penalties, min_tokens, the seeded draw's step
    eos_token_id: int | None


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}  # unseeded requests, per device
        self._seeded: dict[str, torch.Generator] = {}  # seeded requests, by request id
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def num_tracked_requests(self) -> int:
        return len(self._seeded)

    def drop(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._seeded.pop(rid, None)

    @staticmethod
    def plain_greedy(requests: list[SamplingRequest]) -> bool:
        """Whether every row's token is the argmax of its raw logits (temperature 0, one
        sample, no logprobs, penalties, bias, masks or grammar): then the logits need not
        exist. It reads only the requests' parameters, which every tensor-parallel rank
        holds, so all ranks take the same path (and run the same collectives)."""
        return all(_plain_greedy(r) for r in requests)

    # Always in inference mode: the kept buffers are then inference tensors in every call.
    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,
        requests: list[SamplingRequest],
        grammar_mask: RowMask | None = None,
    ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
        """grammar_mask: the token bitmask of the structured-output rows (only those)."""
        assert logits.dim() == 2 and logits.shape[0] == len(requests)
        if logits.dtype != torch.float32 or not logits.is_contiguous():
            logits = logits.float().contiguous()
        if grammar_mask is None and self.plain_greedy(requests):  # one argmax, no copies
            return [[t] for t in _argmax(logits).tolist()], [None] * len(requests)

        s, v = logits.shape
        x = logits
        changes = _needs_changes(requests)
        if changes or grammar_mask is not None:
            x = self._buffer("changed", s, v, logits).copy_(logits)
            if changes:
                _apply_changes(x, requests)
            if grammar_mask is not None:
                rows = _tensor(grammar_mask.rows, x, torch.long)
                apply_token_bitmask(x, rows, grammar_mask.bitmask)
        greedy = [i for i, r in enumerate(requests) if _is_greedy(r)]
        rand = [i for i, r in enumerate(requests) if not _is_greedy(r)]
        tokens: list[list[int]] = [[] for _ in requests]
        if greedy:
            rows = x if len(greedy) == s else x.index_select(0, _tensor(greedy, x, torch.long))
            for i, t in zip(greedy, _argmax(rows).tolist(), strict=True):
                tokens[i] = [t] * requests[i].num_samples
        if rand:
            drawn = self._sample(x, rand, [requests[i] for i in rand], own=x is not logits)
            for i, ts in zip(rand, drawn, strict=True):
                tokens[i] = ts
        return tokens, self._logprobs(logits, requests, tokens)

    def _sample(
        self, x: torch.Tensor, rows: list[int], reqs: list[SamplingRequest], own: bool
    ) -> list[list[int]]:
        """Draw num_samples tokens for each of x's `rows` (x itself is modified if `own`)."""
        r_, v = len(rows), x.shape[1]
        vp = -(-v // _B) * _B  # padded to whole blocks
        if r_ == x.shape[0] and vp == v:  # all rows: read x, write the work buffer (or x)
            src, w = x, x if own else self._buffer("work", r_, v, x)
        else:
            src = w = self._buffer("work", r_, vp, x)
            if vp == v:
                torch.index_select(x, 0, _tensor(rows, x, torch.long), out=w)
            else:  # the padding gets -inf: zero mass, never drawn
                w[:, :v] = x.index_select(0, _tensor(rows, x, torch.long))
                w[:, v:] = float("-inf")
        sp = [r.sampling_params for r in reqs]
        # e = exp((x - max) / T): unnormalised probabilities, each row's max exactly 1.
        # (x - max) / T is one pass: addcmul(-max / T, x, 1 / T).
        inv_t = _tensor([1 / p.temperature for p in sp], w)[:, None]
        e = torch.addcmul(src.amax(-1, keepdim=True).mul_(-inv_t), src, inv_t, out=w).exp_()
        if any(p.min_p > 0 for p in sp):  # vLLM: drop tokens with prob < min_p * max prob
            keep = self._buffer("scratch", r_, e.shape[1], e)  # a float mask: no bool tensor
            e.mul_(torch.ge(e, _tensor([p.min_p for p in sp], e)[:, None], out=keep))
        eb = e.view(r_, -1, _B)
        block_sums = eb.sum(-1)
        u = self._uniforms(reqs, x.device)
        out = torch.empty(u.shape, dtype=torch.long, device=x.device)
        full = [i for i, p in enumerate(sp) if p.top_k == 0 and p.top_p >= 1.0]
        if full:
            idx = _tensor(full, e, torch.long)
            out[idx] = _sample_blocks(eb, block_sums, idx, u[idx])
        trunc = [i for i, p in enumerate(sp) if p.top_k > 0 or p.top_p < 1.0]
        if trunc:
            idx = _tensor(trunc, e, torch.long)
            block_max = eb.amax(-1)
            top_k = _tensor([sp[i].top_k for i in trunc], e, torch.long)
            top_p = _tensor([sp[i].top_p for i in trunc], e, torch.float64)
            done = torch.zeros(len(trunc), dtype=torch.bool, device=e.device)
            # Few blocks first; rows whose kept set may reach further retry with more.
            for size in (*_CANDIDATE_BLOCKS, eb.shape[1]):
                todo = ~done & (top_k <= size) if size < eb.shape[1] else ~done
                sel = todo.nonzero().squeeze(1)
                if len(sel):
                    rows_ = idx[sel]
                    t, ok = _sample_truncated(
                        eb, block_max, block_sums, rows_, u[rows_], top_k[sel], top_p[sel], size
                    )
                    out[rows_[ok]] = t[ok]
                    done[sel[ok]] = True
                if bool(done.all()):
                    break
        out.clamp_(max=v - 1)  # only reachable from NaN logits: keep ids in the vocabulary
        return [row[: r.num_samples] for row, r in zip(out.tolist(), reqs, strict=True)]

    def _uniforms(self, reqs: list[SamplingRequest], device: torch.device) -> torch.Tensor:
        """[R, max num_samples] float64 uniforms; seeded rows from their own generator."""
        if device not in self._shared:
            self._shared[device] = torch.Generator(device).manual_seed(self._seed)
        shape = (len(reqs), max(r.num_samples for r in reqs))
        u = torch.rand(shape, dtype=torch.float64, device=device, generator=self._shared[device])
        for i, r in enumerate(reqs):
            seed = r.sampling_params.seed
            if seed is None:
                continue
            g = self._seeded.get(r.request_id)
            if g is None:
                g = self._seeded[r.request_id] = torch.Generator(device)
            g.manual_seed(_step_seed(seed, len(r.output_token_ids)))
            n = r.num_samples
            u[i, :n] = torch.rand(n, dtype=torch.float64, device=device, generator=g)
        return u

    def _logprobs(
        self, logits: torch.Tensor, requests: list[SamplingRequest], tokens: list[list[int]]
    ) -> list[list[TokenLogprobs] | None]:
        out: list[list[TokenLogprobs] | None] = [None] * len(requests)
        rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if not rows:
            return out
        r_, v = len(rows), logits.shape[1]
        x = logits
        if r_ < logits.shape[0]:
            x = self._buffer("logprob_rows", r_, v, logits)
            torch.index_select(logits, 0, _tensor(rows, logits, torch.long), out=x)
        # log_softmax = x - logsumexp(x); ranks and the top k come from x itself (same order),
        # so no [R, V] log-probability tensor is ever built.
        m = x.amax(-1, keepdim=True)
        tmp = self._buffer("scratch", r_, v, logits)
        lse = torch.sub(x, m, out=tmp).exp_().sum(-1, keepdim=True).log_().add_(m)
        n = max(len(tokens[i]) for i in rows)
        sampled = _tensor([tokens[i] + [0] * (n - len(tokens[i])) for i in rows], x, torch.long)
        chosen = x.gather(1, sampled)
        # rank = 1 + the number of strictly more likely tokens (vLLM's definition).
        # (compared into the float buffer and summed: a bool tensor's sum is 5x slower)
        rank = torch.stack(
            [torch.gt(x, chosen[:, j : j + 1], out=tmp).sum(-1) + 1 for j in range(n)], 1
        ).long()
        chosen -= lse
        k = max(requests[i].sampling_params.logprobs for i in rows)
        top_v, top_i = _topk(x, k) if k else (x[:, :0], x[:, :0].long())
        top_v = top_v - lse
        chosen_l, rank_l, tv, ti = chosen.tolist(), rank.tolist(), top_v.tolist(), top_i.tolist()
        for j, i in enumerate(rows):
            kk = requests[i].sampling_params.logprobs
            top = list(zip(ti[j][:kk], tv[j][:kk], strict=True))
            out[i] = [
                TokenLogprobs(token_id=t, logprob=chosen_l[j][q], rank=rank_l[j][q], top=top[:])
                for q, t in enumerate(tokens[i])
            ]
        return out

    def _buffer(self, name: str, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        """A [rows, cols] float32 view of a buffer kept across steps (grown, never shrunk)."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < rows * cols or buf.device != like.device:
            buf = self._buffers[name] = torch.empty(rows * cols, device=like.device)
        return buf[: rows * cols].view(rows, cols)


def _is_greedy(r: SamplingRequest) -> bool:
    return r.sampling_params.temperature < _GREEDY_BELOW


def _plain_greedy(r: SamplingRequest) -> bool:
    sp = r.sampling_params
    return (
        r.num_samples == 1
        and sp.temperature < _GREEDY_BELOW
        and sp.logprobs is None
        and sp.structured_outputs is None
        and not _needs_changes((r,))
    )


def _masks_stops(r: SamplingRequest) -> bool:
    sp = r.sampling_params
    return sp.min_tokens > 0 and len(r.output_token_ids) < sp.min_tokens


def _needs_changes(requests: Iterable[SamplingRequest]) -> bool:
    return any(
        r.sampling_params.logit_bias or r.sampling_params.needs_penalties or _masks_stops(r)
        for r in requests
    )


def bias_and_mask_entries(
    requests: Sequence[SamplingRequest],
) -> tuple[list[int], list[int], list[float]]:
    """(row, token, value) entries of each row's logit_bias and min_tokens stop mask, for one
    accumulating index_put_ on the logits (bias adds, the mask adds -inf)."""
    rows: list[int] = []
    toks: list[int] = []
    vals: list[float] = []
    for i, r in enumerate(requests):
        sp = r.sampling_params
        if sp.logit_bias:
            rows += [i] * len(sp.logit_bias)
            toks += sp.logit_bias.keys()
            vals += sp.logit_bias.values()
        if _masks_stops(r):  # eos doesn't stop under ignore_eos, so it isn't masked then
            stops = list(sp.stop_token_ids)
            if r.eos_token_id is not None and not sp.ignore_eos:
                stops.append(r.eos_token_id)
            rows += [i] * len(stops)
            toks += stops
            vals += [float("-inf")] * len(stops)
    return rows, toks, vals


def _apply_changes(x: torch.Tensor, requests: list[SamplingRequest]) -> None:
    """logit_bias, the min_tokens mask and penalties, in place on x [S, V]."""
    rows, toks, vals = bias_and_mask_entries(requests)
    if rows:  # bias adds, the mask adds -inf: one accumulate covers both
        where = (_tensor(rows, x, torch.long), _tensor(toks, x, torch.long))
        x.index_put_(where, _tensor(vals, x), accumulate=True)
    pen = [i for i, r in enumerate(requests) if r.sampling_params.needs_penalties]
    if pen:
        sps = [requests[i].sampling_params for i in pen]
        apply_penalties(
            x,
            [requests[i].prompt_token_ids for i in pen],
            [requests[i].output_token_ids for i in pen],
            _tensor([p.repetition_penalty for p in sps], x),
            _tensor([p.presence_penalty for p in sps], x),
            _tensor([p.frequency_penalty for p in sps], x),
            rows=_tensor(pen, x, torch.long),
        )


def apply_penalties(
    x: torch.Tensor,
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> None:
    """Penalise x [R, V] (contiguous) in place; list i applies to row rows[i] (default i).

    Repetition (HF/vLLM): a token seen in prompt or output has its logit divided by the penalty
    if positive, multiplied if not. Then OpenAI's: logit -= frequency * count_in_output
    + presence * (count_in_output > 0). Only the tokens that occur are touched.
    """
    assert x.is_contiguous()
    v = x.shape[1]
    rows = torch.arange(len(output_ids), device=x.device) if rows is None else rows
    flat = x.view(-1)
    lst, tok = _flatten(output_ids, x.device)
    out_keys, counts = torch.unique(rows[lst] * v + tok, return_counts=True)
    if bool((repetition != 1.0).any()):
        lst, tok = _flatten(prompt_ids, x.device)
        seen = torch.unique(torch.cat([out_keys, rows[lst] * v + tok]))
        rep = _per_row(x, rows, repetition, 1.0)[seen // v]
        val = flat[seen]
        flat[seen] = torch.where(val > 0, val / rep, val * rep)
    r = out_keys // v
    freq, pres = _per_row(x, rows, frequency, 0.0)[r], _per_row(x, rows, presence, 0.0)[r]
    flat[out_keys] -= freq * counts + pres


def _per_row(x: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, fill: float):
    return torch.full((x.shape[0],), fill, dtype=x.dtype, device=x.device).index_put_(
        (rows,), values.to(x.dtype)
    )


def _flatten(lists: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(list index, token id) of every element of a ragged list of lists."""
    lengths = torch.tensor([len(t) for t in lists], device=device)
    which = torch.repeat_interleave(torch.arange(len(lists), device=device), lengths)
    toks = [torch.as_tensor(t, dtype=torch.long) for t in lists]
    return which, torch.cat(toks).to(device) if toks else torch.zeros(0, dtype=torch.long)


def _tensor(values, like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=like.device)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax over the last dim (first maximum wins), ~10x faster on CPU for wide rows:
    a vectorised max per 64-token block, then argmax over block maxima and within one block."""
    r_, v = x.shape
    nb = v // _B
    if nb < 2:
        return x.argmax(-1)
    xb = x[:, : nb * _B].view(r_, nb, _B)
    bmax = xb.amax(-1)
    blk = bmax.argmax(-1)
    ar = torch.arange(r_, device=x.device)
    idx = blk * _B + xb[ar, blk].argmax(-1)
    if v % _B:
        tmax, targ = x[:, nb * _B :].max(-1)
        idx = torch.where(tmax > bmax[ar, blk], nb * _B + targ, idx)
    return idx


def _topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk (sorted) over the last dim: the top k tokens lie in the k blocks with the
    largest maxima, so only those k * 64 candidates are ranked."""
    r_, v = x.shape
    nb = v // _B
    if nb < 4 * k:
        return x.topk(k, -1)
    xb = x[:, : nb * _B].view(r_, nb, _B)
    blocks = xb.amax(-1).topk(k, -1).indices
    cand = xb.gather(1, blocks[:, :, None].expand(-1, -1, _B)).reshape(r_, -1)
    ids = (blocks[:, :, None] * _B + torch.arange(_B, device=x.device)).reshape(r_, -1)
    if v % _B:
        cand = torch.cat([cand, x[:, nb * _B :]], 1)
        ids = torch.cat([ids, torch.arange(nb * _B, v, device=x.device).expand(r_, -1)], 1)
    vals, order = cand.topk(k, -1)
    return vals, ids.gather(1, order)


def _sample_blocks(
    eb: torch.Tensor, block_sums: torch.Tensor, rows: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """Inverse-CDF draw from the unnormalised probabilities eb[rows] ([R, nb, B]): the block
    by cumulative block sums, then the token inside it. u [r, m] -> token ids [r, m]."""
    b = eb.shape[2]
    cdf = block_sums.index_select(0, rows).double().cumsum(-1)
    target = u * cdf[:, -1:]
    blk = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)
    base = torch.where(blk > 0, cdf.gather(1, (blk - 1).clamp(min=0)), 0.0)
    vals = _blocks(eb, rows, blk)  # [r, m, B]
    within = torch.searchsorted(
        vals.cumsum(-1, dtype=torch.float64), (target - base)[:, :, None], right=True
    ).squeeze(-1)
    # f32 block sums and f64 in-block cumsums round differently: never step past the block's
    # last token with mass.
    last = b - 1 - (vals > 0).flip(-1).to(torch.uint8).argmax(-1)
    return blk * b + torch.minimum(within, last)


def _sample_truncated(
    eb: torch.Tensor,
    block_max: torch.Tensor,
    block_sums: torch.Tensor,
    rows: torch.Tensor,
    u: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    nblocks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw after top-k (0: off) and top-p (1: off) from eb[rows], ranking only the tokens of
    the `nblocks` blocks with the largest maxima (>= nb: the whole row, sorted).

    Returns (tokens [r, m], ok [r]); ok is False where the kept set may reach outside the
    candidates: those rows must be redone with more blocks.
    """
    r_, nb, b = len(rows), eb.shape[1], eb.shape[2]
    if nblocks >= nb:
        vals, ids = eb.index_select(0, rows).view(r_, -1).sort(-1, descending=True)
        beta = torch.full((r_,), -1.0, device=eb.device)
        n_exact = torch.full((r_,), vals.shape[1], device=eb.device)
    else:
        top = block_max.index_select(0, rows).topk(nblocks + 1, -1)
        blocks = top.indices[:, :nblocks]
        beta = top.values[:, nblocks]  # no token outside the candidates is above beta
        cand = _blocks(eb, rows, blocks).view(r_, -1)
        # Tokens above beta are the row's true top tokens: pack them left, rank only those.
        above = cand > beta[:, None]
        n_exact = above.sum(-1)
        r_idx, c_idx = above.nonzero(as_tuple=True)
        slot = torch.arange(len(r_idx), device=eb.device) - (n_exact.cumsum(0) - n_exact)[r_idx]
        packed = cand.new_zeros(r_, max(int(n_exact.max()), 1))
        packed[r_idx, slot] = cand[above]
        packed_ids = torch.zeros_like(packed, dtype=torch.long)
        packed_ids[r_idx, slot] = blocks[r_idx, c_idx // b] * b + c_idx % b
        vals, order = packed.sort(-1, descending=True)
        ids = packed_ids.gather(1, order)
    n_pos = (vals > 0).sum(-1)
    cum = vals.cumsum(-1, dtype=torch.float64)
    has_k = top_k > 0
    k = torch.where(has_k, torch.minimum(top_k, n_pos), n_pos).clamp(min=1)
    # top_p renormalises over what top_k kept (vLLM), else over the whole row.
    total = block_sums.index_select(0, rows).sum(-1).double()
    norm = torch.where(has_k, cum.gather(1, (k - 1)[:, None]).squeeze(1), total)
    excl = torch.cat([cum.new_zeros(r_, 1), cum[:, :-1]], 1)
    kept_p = (excl < (top_p * norm)[:, None]).sum(-1)
    keep = torch.where(top_p < 1.0, torch.minimum(kept_p, k), k).clamp(min=1)
    mass_exact = cum.gather(1, (n_exact - 1).clamp(min=0)[:, None]).squeeze(1)
    # beta <= 0: every token with mass is a candidate. Otherwise the top-k set, or the
    # nucleus (the exact tokens' mass reaches top_p), must lie within the exact tokens.
    ok = (beta <= 0) | torch.where(
        has_k, top_k <= n_exact, (n_exact > 0) & (mass_exact >= top_p * norm)
    )
    target = u * cum.gather(1, (keep - 1)[:, None])
    pos = torch.searchsorted(cum, target, right=True)
    pos = torch.minimum(pos, (keep - 1)[:, None])
    return ids.gather(1, pos), ok


def _blocks(eb: torch.Tensor, rows: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """eb[rows[i], blocks[i, j], :] as [r, c, B], by index_select (advanced indexing is slow)."""
    nb, b = eb.shape[1], eb.shape[2]
    flat = (rows[:, None] * nb + blocks).view(-1)
    return eb.view(-1, b).index_select(0, flat).view(*blocks.shape, b)


def _step_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): well-spread generator seeds for consecutive steps."""
    m64 = 0xFFFFFFFFFFFFFFFF
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & m64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m64
    return (z ^ (z >> 31)) >> 1  # 63 bits
