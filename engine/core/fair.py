"""Virtual token counters: each tenant's weighted service, for the "fair" policy.

VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024). Every tenant has
a counter of the service it received: PROMPT_WEIGHT per prompt token computed plus
OUTPUT_WEIGHT per output token generated (the paper's w_p = 1, w_q = 2), divided by the
tenant's weight, so a tenant of weight 2 is charged half as much and gets twice the tokens.
The scheduler admits from the backlogged tenant (one with waiting requests) whose counter is
smallest, and preempts from the tenant whose counter is largest; when every seat is taken, a
tenant below its weighted share of seats takes one from a tenant above it
(Scheduler._seat_victim), so a light tenant does not wait for a heavy one's request to end.

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
