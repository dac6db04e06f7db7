"""RunnerDrafts: the scheduler's side of a model-based proposer (draft model).

The n-gram proposer runs in the scheduler from token ids. A draft model runs on the model
runner, after each step, from the tokens that step emitted: its drafts come back in
ModelRunnerOutput.draft_token_ids and wait here for the request's next plain decode step.
The runner writes the draft model's K/V past the step's tokens (the bonus token and the
drafts before the last), so a step that samples reserves `lookahead` more slots when blocks
allow (vLLM's num_lookahead_tokens); the runner proposes no further than its table reaches.
No torch.
"""

from __future__ import annotations

from collections.abc import Iterable


class RunnerDrafts:
    def __init__(self, num_speculative_tokens: int) -> None:
        self.lookahead = num_speculative_tokens
        self._drafts: dict[str, list[int]] = {}

    def propose(self, request_id: str, k: int) -> list[int]:
        """The drafts the runner proposed after this request's last step (at most k)."""
        drafts = self._drafts.get(request_id)
        return drafts[:k] if drafts else []

    def update(self, sampled: Iterable[str], drafts: dict[str, list[int]]) -> None:
        """After a step: each request that got tokens now has the drafts proposed after them
        (none: the old ones no longer follow its tokens)."""
        for rid in sampled:
            new = drafts.get(rid)
            if new:
                self._drafts[rid] = new
            else:
                self._drafts.pop(rid, None)

    def __len__(self) -> int:
        """Requests holding drafts (none once every request has finished)."""
        return len(self._drafts)

    def drop(self, request_id: str) -> None:
        """The request finished or was preempted (a recompute proposes afresh)."""
        self._drafts.pop(request_id, None)
