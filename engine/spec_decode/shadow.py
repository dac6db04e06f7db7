"""ShadowDrafts: the acceptance drafts would have had, measured in steps that verify none.

While the draft controller keeps drafting off, the only acceptance it would see is its
probes' (one step in 16, a few draft rows each at small batches): too few to notice quickly
that the text turned to copying. So in a step without drafts the scheduler still asks the
proposer (n-gram lookups are cheap; a draft model's drafts exist anyway) and keeps one
proposal per request here, unscheduled; the tokens the request then emits settle it: the
drafts kept are the longest prefix the request emits, which is what verification keeps (for
greedy decoding exactly; sampled, a deterministic draft is kept with the probability the
model gives it, which is also the probability of sampling it). No torch.
"""

from __future__ import annotations


class ShadowDrafts:
    def __init__(self) -> None:
        self._pending: dict[str, tuple[list[int], int]] = {}  # drafts, how many matched so far
        self.num_settled = 0

    def wants(self, request_id: str) -> bool:
        """Whether the request has no proposal waiting to be settled."""
        return request_id not in self._pending

    def start(self, request_id: str, drafts: list[int]) -> None:
        """Drafts proposed after the request's last known token, not verified."""
        if drafts:
            self._pending[request_id] = (list(drafts), 0)

    def observe(self, request_id: str, tokens: list[int]) -> tuple[int, int] | None:
        """The request emitted these tokens: (drafts, kept) once its proposal is settled (a
        token differs from its draft, or every draft matched), else None."""
        pending = self._pending.get(request_id)
        if pending is None:
            return None
        drafts, matched = pending
        for token in tokens:
            if token != drafts[matched]:
                break
            matched += 1
            if matched == len(drafts):
                break
        else:
            self._pending[request_id] = (drafts, matched)
            return None
        del self._pending[request_id]
        self.num_settled += 1
        return len(drafts), matched

    def drop(self, request_id: str) -> None:
        """The request finished or was preempted."""
        self._pending.pop(request_id, None)

    def __len__(self) -> int:
        """Proposals waiting (none once every request has finished)."""
        return len(self._pending)
