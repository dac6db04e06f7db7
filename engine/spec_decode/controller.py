"""DraftController: decide per step whether drafting pays for the batch, from its own timings.

What pays is emitted tokens per second of wall time. A decode step without drafts emits one
token per request; a step with drafts emits 1 + accepted per request and costs more (the
draft rows verified, the proposing). Whether that trade wins depends on the machine, the
batch size and the text (measured with n-gram on the default model: copying 2.6x faster at
one stream, open-ended text 0.83x-0.92x at eight), so no fixed cutoff is right everywhere.

The controller keeps running estimates (EWMA), per bucket of batch sizes (1, 2-3, 4-7, 8-15,
...: a decode step's cost grows with its rows, not linearly), of
  plain   - the wall time per request of a step without drafts,
  drafted - the wall time per request of a step with drafts, and its draft rows per request,
and, over all steps, of the acceptance (kept drafts per draft row). A step with drafts is
expected to emit (1 + acceptance * rows) tokens per request in `drafted` seconds, one without
one token in `plain` seconds; it drafts when the first rate is the higher. Only pure decode
steps are measured (a prefill chunk's cost says nothing about drafting). In a step without
drafts the acceptance is still measured, on shadow proposals (spec_decode.shadow). Every
`probe_interval`-th decision takes the other option (a probe), so the losing side's
estimates stay fresh: acceptance rises again when the text turns to copying, and a drafted
step's cost changes with the batch. A bucket with no estimates yet drafts first, then tries
plain. The decision only chooses whether drafts are proposed: verification is unchanged,
so greedy outputs are those of plain decoding either way. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROBE_INTERVAL = 16  # every 16th decision takes the other option
ALPHA = 0.25  # EWMA weight of a new step time
# The acceptance's EWMA weighs a measurement by its draft rows (1 - (1 - ROW_ALPHA) ** rows:
# 0.14 for one request's 3 drafts, 0.71 for 8 requests' 24): a step where one request drafted
# says less than one where eight did.
ROW_ALPHA = 0.05
# A step time counts at most this many times the estimate: a step stalled by a neighbour on
# a shared machine (10x and more) would otherwise sway the side measured only by probes
# for many probes; a real slowdown still shows, growing the estimate step by step.
MAX_STEP_GROWTH = 2.0


def _ewma(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else old + alpha * (new - old)


def _ewma_time(old: float | None, new: float, alpha: float) -> float:
    return _ewma(old, new if old is None else min(new, MAX_STEP_GROWTH * old), alpha)


def bucket_of(num_requests: int) -> int:
    """Batch sizes 1, 2-3, 4-7, 8-15, ... share estimates."""
    return max(num_requests, 1).bit_length()


@dataclass(slots=True)
class _Bucket:
    plain_s: float | None = None  # seconds per request of a plain step
    drafted_s: float | None = None  # seconds per request of a step with drafts
    rows: float | None = None  # draft rows per request in a step with drafts


@dataclass(slots=True)
class DraftController:
    probe_interval: int = PROBE_INTERVAL
    alpha: float = ALPHA
    row_alpha: float = ROW_ALPHA
    acceptance: float | None = None  # kept drafts per draft row
    buckets: dict[int, _Bucket] = field(default_factory=dict)
    num_decisions: int = 0
    num_drafting: int = 0  # decisions to draft (probes included)
    num_probes: int = 0
    _since_probe: int = 0

    def __post_init__(self) -> None:
        if self.probe_interval < 2:
            raise ValueError(f"probe_interval must be at least 2, got {self.probe_interval}")

    def pays(self, num_requests: int) -> bool | None:
        """Whether drafting is expected to emit more tokens per second in a step of this many
        requests; None while the bucket lacks an estimate."""
        b = self.buckets.get(bucket_of(num_requests))
        if b is None or b.plain_s is None or b.drafted_s is None or self.acceptance is None:
            return None
        assert b.rows is not None
        return (1.0 + self.acceptance * b.rows) * b.plain_s > b.drafted_s

    def decide(self, num_requests: int) -> bool:
        """Whether this step drafts (called once per step that has a request to draft for)."""
        self.num_decisions += 1
        pays = self.pays(num_requests)
        if pays is None:  # warm-up: measure a drafted step first, then a plain one
            b = self.buckets.get(bucket_of(num_requests))
            draft = b is None or b.drafted_s is None
        else:
            self._since_probe += 1
            probe = self._since_probe >= self.probe_interval
            if probe:
                self._since_probe = 0
                self.num_probes += 1
            draft = pays != probe
        self.num_drafting += draft
        return draft

    def record(self, num_requests: int, draft_rows: int, accepted: int, seconds: float) -> None:
        """A pure decode step of num_requests requests took `seconds`, with draft_rows draft
        tokens verified (0: a plain step) of which `accepted` were kept."""
        if num_requests <= 0 or seconds <= 0.0:
            return
        b = self.buckets.setdefault(bucket_of(num_requests), _Bucket())
        per_request = seconds / num_requests
        if draft_rows == 0:
            b.plain_s = _ewma_time(b.plain_s, per_request, self.alpha)
            return
        b.drafted_s = _ewma_time(b.drafted_s, per_request, self.alpha)
        b.rows = _ewma(b.rows, draft_rows / num_requests, self.alpha)
        self.record_acceptance(draft_rows, accepted)

    def record_acceptance(self, draft_rows: int, accepted: int) -> None:
        """draft_rows drafts (verified, or shadow ones: spec_decode.shadow) of which
        `accepted` were, or would have been, kept."""
        if draft_rows > 0:
            weight = 1.0 - (1.0 - self.row_alpha) ** draft_rows
            self.acceptance = _ewma(self.acceptance, accepted / draft_rows, weight)
