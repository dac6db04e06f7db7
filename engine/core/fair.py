"""Virtual token counters: each tenant's weighted service, for the "fair" policy.

VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024). Every tenant has
a counter of the service it received: PROMPT_WEIGHT per prompt token computed plus
OUTPUT_WEIGHT per output token generated (the paper's w_p = 1, w_q = 2), divided by the
tenant's weight, so a tenant of weight 2 is charged half as much and gets twice the tokens.
The scheduler admits from the backlogged tenant (one with waiting requests) whose counter is
smallest, and preempts from the tenant whose counter is largest; when every seat is taken, a
tenant below its weighted share of seats takes one from a tenant above it
(seat_victim), so a light tenant does not wait for a heavy one's request to end.

Work conservation comes for free: only backlogged tenants compete, so an idle tenant's
share goes to the others. Bounded lag: a tenant that becomes backlogged again (its waiting
queue was empty) has its counter lifted to the smallest counter among the backlogged
tenants (or, when none is, to the counter of the tenant that last stopped being
backlogged), so time spent idle, or asking for less than its share, earns it no credit to
spend later; a tenant above that floor keeps its lead, so it cannot reset a debt by idling.

What is charged: prompt tokens the first time they are computed (prefix-cache hits and the
recompute after a preemption are free: the victim did not choose them) and every sampled
token. Requests with no tenant count under the tenant "" (one shared anonymous tenant).
"""

from __future__ import annotations

from engine.core.forking import seats
from engine.request import Request

PROMPT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


class TenantCounters:
    def __init__(self) -> None:
        self.counters: dict[str, float] = {}  # virtual service received, by tenant
        self.weights: dict[str, float] = {}  # the latest weight each tenant came with
        self._num_waiting: dict[str, int] = {}  # backlogged tenants: waiting requests > 0
        self._last_left: str | None = None  # the tenant that last stopped being backlogged

    # -- the waiting queue tells it who is backlogged --------------------------------------

    def on_waiting(self, tenant: str, weight: float) -> None:
        """A request of `tenant` entered the waiting queue (new, preempted or re-queued)."""
        if weight > 0:
            self.weights[tenant] = weight  # the latest weight wins
        n = self._num_waiting.get(tenant, 0)
        self._num_waiting[tenant] = n + 1
        if n:
            return
        # Becoming backlogged: lift to the floor so that idling earned no credit.
        floor = self._floor(exclude=tenant)
        counter = self.counters.get(tenant, 0.0)
        self.counters[tenant] = counter if floor is None else max(counter, floor)

    def on_unwaiting(self, tenant: str) -> None:
        """A request of `tenant` left the waiting queue (admitted, finished or aborted)."""
        n = self._num_waiting[tenant] - 1
        if n:
            self._num_waiting[tenant] = n
        else:
            del self._num_waiting[tenant]
            self._last_left = tenant

    def _floor(self, exclude: str) -> float | None:
        waiting = [self.counters[t] for t in self._num_waiting if t != exclude]
        if waiting:
            return min(waiting)
        if self._last_left is not None and self._last_left != exclude:
            return self.counters.get(self._last_left)
        return None

    # -- service ----------------------------------------------------------------------------

    def charge(self, tenant: str, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        cost = PROMPT_WEIGHT * prompt_tokens + OUTPUT_WEIGHT * output_tokens
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self.weights.get(
            tenant, 1.0
        )

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def is_backlogged(self, tenant: str) -> bool:
        return tenant in self._num_waiting

    def backlogged(self):
        """The tenants with waiting requests."""
        return self._num_waiting.keys()


def tenant_of(request: Request) -> str:
    return request.tenant or ""


def fair_victim(running: list[Request], counters: TenantCounters) -> int:
    """The preemption victim when blocks run out: the worst priority class, then the tenant
    most over its share, then its newest request (the index into `running`)."""
    counter = counters.counter
    return max(
        range(len(running)),
        key=lambda j: (
            running[j].priority,
            counter(tenant_of(running[j])),
            running[j].arrival_time,
            j,
        ),
    )


def seat_victim(
    running: list[Request], request: Request, counters: TenantCounters, max_num_seqs: int
) -> int | None:
    """When every seat is taken: the running request to preempt so that `request` gets a
    seat, or None. Only a tenant holding fewer seats than its weighted share (of
    max_num_seqs, among the tenants with requests) takes one, only from a tenant holding
    more than its share with no smaller a counter, and never from a better priority class: the
    newest request of the most-served such tenant, whose recompute costs least (its prompt
    blocks are usually still cached). Seat counts only move toward the shares, so two
    tenants never trade seats back and forth."""
    held: dict[str, int] = {}
    for r in running:
        t = tenant_of(r)
        held[t] = held.get(t, 0) + seats(r)
    weights = counters.weights
    tenant = tenant_of(request)
    total = sum(weights.get(t, 1.0) for t in held.keys() | counters.backlogged())

    def share(t: str) -> float:
        return max_num_seqs * weights.get(t, 1.0) / total

    if held.get(tenant, 0) + seats(request) > share(tenant):
        return None
    floor = counters.counter(tenant)
    best, best_key = None, None
    for j, r in enumerate(running):
        t = tenant_of(r)
        if t == tenant or r.priority < request.priority or held[t] <= share(t):
            continue
        if counters.counter(t) < floor:
            continue
        key = (r.priority, counters.counter(t), r.arrival_time, j)
        if best_key is None or key > best_key:
            best, best_key = j, key
    return best
