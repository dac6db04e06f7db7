"""NgramProposer: prompt-lookup drafts (vLLM's "ngram" method), no model and no torch.

For a request whose tokens so far (prompt + output) end in the n-gram g, with n from
prompt_lookup_max down to prompt_lookup_min, find an earlier occurrence of g (the latest one
that k known tokens follow, else the earliest) and propose the (up to k) tokens that
followed it. Copy-heavy generation (quoting, editing,
code, summaries with names) hits often; open-ended text rarely does.

The search is vectorised (numpy): one comparison over the last `lookback` tokens finds
where the last token occurred before, and each n then extends only those candidates
backwards, so a step costs O(lookback + candidates * n) machine work, never a Python loop
per token; lookback bounds it for long contexts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.spec_decode.config import SpeculativeConfig

DEFAULT_LOOKBACK = 4096  # tokens searched back from the end of a request's history


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, lookback: int = DEFAULT_LOOKBACK) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.lookback = lookback

    def propose(self, token_ids: Sequence[int], k: int | None = None) -> list[int]:
        """Up to k (default: num_speculative_tokens) draft tokens to follow token_ids; []
        when no n-gram of the allowed lengths recurs."""
        k = self.k if k is None else min(k, self.k)
        total = len(token_ids)
        if k <= 0 or total <= self.min_n:
            return []
        start = max(0, total - self.lookback)
        tokens = np.asarray(token_ids[start:], dtype=np.int64)
        length = len(tokens)
        # Every match of any length ends with the last token: find those ends once (each
        # followed by at least one token), then extend the candidates backwards.
        ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
        if not len(ends):
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            cand = ends[ends >= n - 1]
            ok = np.ones(len(cand), dtype=bool)
            for j in range(1, n):
                ok &= tokens[cand - j] == tokens[length - 1 - j]
            hits = cand[ok] - (n - 1)  # start of each earlier occurrence
            if len(hits):
                # the latest occurrence followed by k known tokens, else the earliest (the
                # longest continuation: a run like "a a a" is followed by k tokens only there)
                full = hits[hits + n + k <= length]
                follow = int(full[-1] if len(full) else hits[0]) + n
                return tokens[follow : follow + k].tolist()
        return []
