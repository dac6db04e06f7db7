"""Verification of a step's drafts: which proposed tokens the target model keeps.

A request scheduled with drafts d_1..d_k computes logits at k+1 positions: row j is the
target's distribution for the token after d_1..d_j (row 0: after the last known token).

Greedy rows (temperature 0): d_j is kept while it equals the argmax of row j-1, and the
first mismatch emits that argmax instead; if all k are kept the argmax of row k is the
bonus token. So the emitted tokens are exactly the ones non-speculative greedy decoding
would emit, one by one.

Random rows: the n-gram draft is a point mass q = delta(d), so the standard rejection
sampler (Leviathan et al., Chen et al.) reduces to: keep d_j with probability p_j(d_j), where
p_j is the target distribution after everything the sampler applies (logit bias, min_tokens,
penalties over the outputs including the kept drafts, temperature, min_p, top_k, top_p);
on rejection draw from max(0, p_j - q) normalised, i.e. p_j without d_j, renormalised. The
emitted token then has distribution p_j exactly (P(t) = p(d) [t=d] + (1 - p(d)) p(t)/(1 - p(d))
[t != d] = p(t)), and so does every later one.

Logprobs are the raw model's (vLLM's default, as engine.layers.sampler computes them) at
the emitted positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.layers.sampler import _apply_changes, _argmax, _is_greedy, _needs_changes
from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.structured_output.bitmask import RowMask, apply_token_bitmask

if TYPE_CHECKING:
    from collections.abc import Sequence

    from engine.layers.sampler import Sampler, SamplingRequest


@dataclass(slots=True)
class _Position:
    """A request as the sampler sees it at one draft position: its outputs so far plus the
    drafts before that position (what penalties and min_tokens count)."""

    request_id: str
    sampling_params: SamplingParams
    num_samples: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_id: int | None


def positions(request: SamplingRequest, drafts: list[int]) -> list[_Position]:
    outputs = list(request.output_token_ids)
    return [
        _Position(
            request.request_id,
            request.sampling_params,
            1,
            request.prompt_token_ids,
            outputs + drafts[:j],
            request.eos_token_id,
        )
        for j in range(len(drafts) + 1)
    ]


def target_probs(x: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """The sampler's distribution for rows x [m, V] (logits after bias, masks, penalties):
    temperature, then min_p, top_k, top_p (renormalised over what top_k kept), as
    engine.layers.sampler draws from. float64 [m, V], rows summing to 1."""
    x = x.double()
    e = ((x - x.amax(-1, keepdim=True)) / sp.temperature).exp_()
    if sp.min_p > 0:  # the max is exactly 1: prob >= min_p * max prob
        e = e * (e >= sp.min_p)
    if sp.top_k > 0 or sp.top_p < 1.0:
        vals, ids = e.sort(-1, descending=True)
        n_pos = (vals > 0).sum(-1)
        cum = vals.cumsum(-1)
        if sp.top_k > 0:
            k = torch.minimum(torch.full_like(n_pos, sp.top_k), n_pos).clamp(min=1)
            norm = cum.gather(1, (k - 1)[:, None]).squeeze(1)
        else:
            k = n_pos.clamp(min=1)
            norm = cum[:, -1]
        keep = k
        if sp.top_p < 1.0:
            kept_p = ((cum - vals) < (sp.top_p * norm)[:, None]).sum(-1)
            keep = torch.minimum(kept_p, k).clamp(min=1)
        rank = torch.arange(e.shape[1], device=e.device)[None, :]
        vals = torch.where(rank < keep[:, None], vals, 0.0)
        e = torch.zeros_like(e).scatter_(1, ids, vals)
    return e / e.sum(-1, keepdim=True)


def verify(
    logits: torch.Tensor,
    requests: list[SamplingRequest],
    drafts: list[list[int]],
    sampler: Sampler,
    generator: torch.Generator,
    grammar_mask: RowMask | None = None,
) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
    """logits [sum(len(d) + 1), V]: each request's rows in order. Returns each request's
    emitted tokens (the kept drafts, then the target's own token: 1..k+1 of them) and their
    logprobs (None unless the request asked). grammar_mask: the structured-output rows'
    bitmasks (rows: indices into logits; each position's mask is its grammar state after the
    drafts before it), applied after the other changes as the sampler applies them; the
    logprobs are the raw logits', as the sampler's."""
    if logits.dtype != torch.float32 or not logits.is_contiguous():
        logits = logits.float().contiguous()
    rows = [p for r, d in zip(requests, drafts, strict=True) for p in positions(r, d)]
    assert logits.shape[0] == len(rows)
    x = logits
    changes = _needs_changes(rows)
    if changes or grammar_mask is not None:
        x = logits.clone()
        if changes:
            _apply_changes(x, rows)
        if grammar_mask is not None:
            index = torch.tensor(grammar_mask.rows, dtype=torch.long, device=x.device)
            apply_token_bitmask(x, index, grammar_mask.bitmask)
    argmax = _argmax(x).tolist() if any(_is_greedy(r) for r in requests) else None
    emitted: list[list[int]] = []
    base = 0
    for request, draft in zip(requests, drafts, strict=True):
        k = len(draft)
        if _is_greedy(request):
            assert argmax is not None
            out = []
            for j in range(k + 1):
                target = argmax[base + j]
                out.append(target)
                if j == k or draft[j] != target:
                    break
        else:
            out = _verify_random(x[base : base + k + 1], request.sampling_params, draft, generator)
        emitted.append(out)
        base += k + 1
    return emitted, _logprobs(logits, rows, requests, drafts, emitted, sampler)


def _verify_random(
    x: torch.Tensor, sp: SamplingParams, draft: list[int], generator: torch.Generator
) -> list[int]:
    p = target_probs(x, sp)
    k = len(draft)
    u = torch.rand(k + 1, dtype=torch.float64, device=x.device, generator=generator)
    accept = (p[torch.arange(k, device=x.device), torch.tensor(draft, device=x.device)]).tolist()
    uu = u.tolist()
    out: list[int] = []
    for j in range(k):
        if uu[j] < accept[j]:
            out.append(draft[j])
            continue
        residual = p[j].clone()
        residual[draft[j]] = 0.0
        out.append(_draw(residual, generator))
        return out
    out.append(_draw(p[k], generator))
    return out


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One token from unnormalised non-negative weights [V] (inverse CDF, float64)."""
    cdf = weights.cumsum(0)
    u = torch.rand(1, dtype=torch.float64, device=weights.device, generator=generator)
    idx = torch.searchsorted(cdf, u * cdf[-1], right=True)
    last = int((weights > 0).nonzero()[-1])  # never past the last token with mass
    return min(int(idx), last)


def _logprobs(
    logits: torch.Tensor,
    rows: list[_Position],
    requests: list[SamplingRequest],
    drafts: list[list[int]],
    emitted: list[list[int]],
    sampler: Sampler,
) -> list[list[TokenLogprobs] | None]:
    out: list[list[TokenLogprobs] | None] = [None] * len(requests)
    want = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    if not want:
        return out
    index, pos, toks = [], [], []
    base = [0]
    for d in drafts:
        base.append(base[-1] + len(d) + 1)
    for i in want:
        for j, t in enumerate(emitted[i]):
            index.append(base[i] + j)
            pos.append(rows[base[i] + j])
            toks.append([t])
    sel = logits.index_select(0, torch.tensor(index, device=logits.device))
    lps = sampler._logprobs(sel, pos, toks)
    q = 0
    for i in want:
        n = len(emitted[i])
        out[i] = [lp[0] for lp in lps[q : q + n]]
        q += n
    return out
