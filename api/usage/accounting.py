"""What one generation request costs its API key: the quota lease taken before admission and
the usage row written when it ends.

    accountant = Accountant(quotas, recorder, metrics)       # quotas/recorder None: no database
    ticket = await accountant.admit(principal, request_id, model, reserved_tokens)  # 429 / 503
    ...                                                      # response carries ticket.headers
    accountant.settle(ticket, outputs, prompts)              # sync: ledger row + release task
    await accountant.released(ticket)                        # before the response completes
    await accountant.aclose()                                # shutdown: wait for releases

settle() does no I/O on the caller's task: it queues the usage row (the recorder writes in
batches) and starts the quota release as a task of its own, which a cancelled caller cannot
cut short and which aclose() waits for at shutdown. The response paths still await
released() before their last byte (shielded), so a client that sends its next request as
soon as the previous one completed never trips over its own parallel slot or reservation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from api.db.models import utcnow
from api.quotas.service import Lease, QuotaRefused
from api.server.errors import APIError
from api.server.request_context import bind_tenant, current_request_id
from api.usage.service import UsageRecord

if TYPE_CHECKING:
    from api.keys.auth import Principal
    from api.quotas.service import QuotaService
    from api.server.metrics import Metrics
    from api.usage.service import UsageRecorder
    from engine.outputs import RequestOutput

log = logging.getLogger(__name__)

# Status recorded for a request whose client left before the response was complete.
CLIENT_CLOSED = 499
# Statuses that mean "refused" when the engine produced nothing for the request.
_REFUSALS = frozenset({400, 403, 404, 409, 413, 415, 422, 429, 503})


@dataclass(slots=True)
class Ticket:
    """One admitted request, from its quota lease to its ledger row."""

    request_id: str
    key_id: str | None
    model: str
    lease: Lease
    arrived: float  # time.monotonic() when the handler started
    arrived_at: datetime  # the same moment, UTC, for the ledger
    submitted: float | None = None  # handed to the engine
    first_output: float | None = None  # the engine's first output for every prompt
    status_code: int | None = None  # set by the response path; None: derived from outputs
    tenant_id: str | None = None
    x_request_id: str | None = (
        None  # the HTTP request's X-Request-Id (api/server/request_context.py)
    )
    end_user: str | None = None  # the body's `user` (OpenAI's end-user id)
    lora_adapter: str | None = None  # the LoRA adapter it runs (api/lora/), None: the base
    settled: bool = False
    release: asyncio.Future[None] | None = None

    @property
    def headers(self) -> dict[str, str]:
        """x-ratelimit-* for the response (empty for keys without rate limits)."""
        return self.lease.headers


@dataclass(slots=True)
class Accountant:
    quotas: QuotaService | None
    recorder: UsageRecorder | None
    metrics: Metrics | None = None
    _releases: set[asyncio.Future[None]] = field(default_factory=set)

    async def admit(
        self,
        principal: Principal,
        request_id: str,
        model: str,
        reserved_tokens: int,
        arrived: float | None = None,
    ) -> Ticket:
        """Reserve the request's worst case against the key's limits; 429/503 otherwise."""
        arrived = time.monotonic() if arrived is None else arrived
        arrived_at = utcnow()
        bind_tenant(principal.tenant_name)  # this request's log lines and spans name it
        if self.quotas is None:
            lease = Lease(principal.key_id, reserved_tokens)
        else:
            try:
                lease = await self.quotas.acquire(principal, reserved_tokens=reserved_tokens)
            except APIError as exc:  # 429 over a limit, 503 with the database down
                if isinstance(exc, QuotaRefused) and self.metrics is not None:
                    self.metrics.rejected("quota", exc.reason)
                self.refused(principal, request_id, model, exc.status_code, arrived)
                raise
        ticket = Ticket(request_id, principal.key_id, model, lease, arrived, arrived_at)
        ticket.tenant_id = principal.tenant_id
        ticket.x_request_id = current_request_id()
        return ticket

    def settle(
        self,
        ticket: Ticket,
        outputs: list[RequestOutput | None] | None,
        prompts: list[list[int]],
    ) -> None:
        """The request is over: write its ledger row and give back what it did not use.

        Idempotent and synchronous, so it can run in a `finally` of a cancelled task."""
        if ticket.settled:
            return
        ticket.settled = True
        outputs = outputs or [None] * len(prompts)
        done = [o for o in outputs if o is not None]
        # A prompt counts once the engine produced its first output (its prefill ran).
        prompt_tokens = sum(len(p) for p, o in zip(prompts, outputs, strict=True) if o is not None)
        completion = sum(len(c.token_ids) for o in done for c in o.outputs)
        status = ticket.status_code or _status_of(outputs)
        if self.recorder is not None:
            now = time.monotonic()
            # The engine's own figure (arrival to first scheduled) when it gave one.
            queue = max((o.queue_time for o in done if o.queue_time is not None), default=None)
            if queue is None and ticket.submitted is not None and ticket.first_output is not None:
                queue = ticket.first_output - ticket.submitted
            self.recorder.record(
                UsageRecord(
                    request_id=ticket.request_id,
                    key_id=ticket.key_id,
                    model=ticket.model,
                    prompt_tokens=prompt_tokens,
                    completion_tokens=completion,
                    cached_tokens=sum(o.num_cached_tokens for o in done),
                    finish_reason=_finish_reason(outputs, status),
                    status_code=status,
                    queue_time=queue,
                    latency=now - ticket.arrived,
                    created_at=ticket.arrived_at,
                    tenant_id=ticket.tenant_id,
                    x_request_id=ticket.x_request_id,
                    end_user=ticket.end_user,
                    lora_adapter=ticket.lora_adapter,
                )
            )
        log.debug(
            "request %s finished: status %s, %d prompt + %d completion tokens",
            ticket.request_id, status, prompt_tokens, completion,
        )  # fmt: skip
        self._release(ticket, prompt_tokens + completion)

    def refused(
        self,
        principal: Principal | None,
        request_id: str,
        model: str,
        status: int,
        arrived: float | None = None,
    ) -> None:
        """The ledger row of a request refused before the engine ran it (400, 403, 404, 429,
        503): no tokens, no finish reason, the status the client got."""
        key_id = getattr(principal, "key_id", None)
        if self.recorder is None or key_id is None:
            return
        now = time.monotonic()
        self.recorder.record(
            UsageRecord(
                request_id=request_id,
                key_id=key_id,
                model=model,
                prompt_tokens=0,
                completion_tokens=0,
                cached_tokens=0,
                finish_reason=None,
                status_code=status,
                queue_time=None,
                latency=now - (now if arrived is None else arrived),
                created_at=utcnow(),
                tenant_id=getattr(principal, "tenant_id", None),
                x_request_id=current_request_id(),
            )
        )

    def _release(self, ticket: Ticket, used_tokens: int) -> None:
        if self.quotas is None or ticket.lease.released:
            return
        task = asyncio.ensure_future(self.quotas.release(ticket.lease, used_tokens=used_tokens))
        ticket.release = task
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def released(self, ticket: Ticket) -> None:
        """Wait until the ticket's lease is back (never raises; the wait may be cancelled,
        the release is not)."""
        if ticket.release is not None and not ticket.release.done():
            await asyncio.shield(ticket.release)

    async def aclose(self) -> None:
        """Wait for the releases still running (shutdown, before the database closes)."""
        while self._releases:
            await asyncio.gather(*list(self._releases), return_exceptions=True)
        if self.quotas is not None:
            await self.quotas.aclose()


def _status_of(outputs: list[RequestOutput | None]) -> int:
    if any(o is not None and o.error for o in outputs):
        return 500
    if all(o is not None and o.finished for o in outputs):
        reasons = {c.finish_reason for o in outputs if o is not None for c in o.outputs}
        if "abort" in reasons or "error" in reasons:
            return 503 if "abort" in reasons else 500
        return 504 if "timeout" in reasons else 200  # api.server.errors.TIMEOUT_STATUS
    return 503  # ended before the engine finished it, and not by the client: aborted


def _finish_reason(outputs: list[RequestOutput | None], status: int) -> str | None:
    """One reason per request, the most severe of its samples' (error > timeout > abort >
    length > stop); a prompt the engine did not finish counts as aborted (or failed, on a 5xx).
    None for a request refused before the engine produced anything (a 4xx other than the
    client leaving, a 503 at admission): it never ran."""
    if status != CLIENT_CLOSED and status in _REFUSALS and all(o is None for o in outputs):
        return None
    reasons = {c.finish_reason for o in outputs if o is not None for c in o.outputs}
    if any(o is None or not o.finished for o in outputs):
        reasons.add("error" if status in (500, 502) else "abort")
    for reason in ("error", "timeout", "abort", "length", "stop"):
        if reason in reasons:
            return reason
    return "abort"


__all__ = ["CLIENT_CLOSED", "Accountant", "Ticket"]
