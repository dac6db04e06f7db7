"""DraftBackoff: stop drafting for a request while its drafts keep being rejected.

A step that verifies k drafts computes k + 1 rows for the request instead of one; on text
that does not repeat itself (open-ended answers) n-gram drafts are rarely kept, and those
rows are pure cost (measured on the default model: one stream 1.19x, eight streams 1.5x the
plain TPOT). So after a verification that kept no draft, the request skips its next 2, then
4, 8, ... (at most MAX_SKIP) chances to draft; one kept draft resets it. Where the text copies
itself the drafts keep being accepted and nothing is skipped. Skipping never changes outputs:
drafts only ever decide how many tokens a step may emit. No torch.
"""

from __future__ import annotations

MAX_SKIP = 32  # decode steps a request may go without a draft before it tries again


class DraftBackoff:
    def __init__(self, max_skip: int = MAX_SKIP, enabled: bool = True) -> None:
        """enabled False (speculative_config's "draft_backoff": false): draft at every chance."""
        self.max_skip = max_skip
        self.enabled = enabled
        self._skip: dict[str, int] = {}  # chances to draft left to skip
        self._next: dict[str, int] = {}  # the skip after the next rejected verification

    def should_draft(self, request_id: str) -> bool:
        """Whether to propose for this request now (each False uses up one skipped chance)."""
        left = self._skip.get(request_id, 0)
        if left:
            self._skip[request_id] = left - 1
            return False
        return True

    def record(self, request_id: str, num_accepted: int) -> None:
        """A verification of this request's drafts kept num_accepted of them."""
        if not self.enabled:
            return
        if num_accepted:
            self._next.pop(request_id, None)
            self._skip.pop(request_id, None)
            return
        skip = self._next.get(request_id, 2)
        self._skip[request_id] = skip
        self._next[request_id] = min(2 * skip, self.max_skip)

    def drop(self, request_id: str) -> None:
        self._skip.pop(request_id, None)
        self._next.pop(request_id, None)

    def __len__(self) -> int:
        """Requests with a back-off in progress (none once every request has finished)."""
        return len(self._next)
