"""The waiting queue: which waiting request the scheduler admits next, vLLM v1 style.

"fcfs": arrival order; a preempted request goes back to the front, ahead of new arrivals.
"priority": lowest (priority, arrival_time) first, ties in insertion order; a preempted
request goes back to its place by that key.
"fair": VTC across tenants (engine.core.fair): the lowest priority class first, then, within
that class, the backlogged tenant with the least weighted service, then that tenant's oldest
request (by its own (priority, arrival_time)). Priority classes are on top of fairness: an
operator who grants a key a better class grants it precedence over other tenants' requests.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from engine.core.fair import TenantCounters, tenant_of
from engine.request import Request


def priority_key(request: Request) -> tuple[int, float]:
    """Lower runs first (and is preempted last) under the "priority" policy."""
    return request.priority, request.arrival_time


class RequestQueue(ABC):
    """Iterates in admission order: the first request is the next to admit."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a new request."""

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Queue a request put back to be recomputed (preempted, or a child not forked)."""

    @abstractmethod
    def peek_request(self) -> Request:
        """The next request to admit; IndexError if empty."""

    @abstractmethod
    def pop_request(self) -> Request:
        """Take out the next request to admit; IndexError if empty."""

    @abstractmethod
    def remove_request(self, request: Request) -> None:
        """Take out a request from anywhere in the queue; ValueError if absent."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...


class FCFSRequestQueue(deque[Request], RequestQueue):
    def add_request(self, request: Request) -> None:
        self.append(request)

    def prepend_request(self, request: Request) -> None:
        self.appendleft(request)

    def peek_request(self) -> Request:
        return self[0]

    def pop_request(self) -> Request:
        return self.popleft()

    def remove_request(self, request: Request) -> None:
        self.remove(request)


class PriorityRequestQueue(RequestQueue):
    # A sorted list rather than vLLM's heap: iteration (the console's queue view) stays in
    # admission order, and an insert is a memmove, cheap at waiting-queue sizes.

    def __init__(self) -> None:
        self._requests: list[Request] = []

    def add_request(self, request: Request) -> None:
        bisect.insort(self._requests, request, key=priority_key)  # after equal keys

    prepend_request = add_request  # the key, not the front, decides its place

    def peek_request(self) -> Request:
        return self._requests[0]

    def pop_request(self) -> Request:
        return self._requests.pop(0)

    def remove_request(self, request: Request) -> None:
        self._requests.remove(request)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def __getitem__(self, index: int) -> Request:
        return self._requests[index]


class FairRequestQueue(RequestQueue):
    """One queue per tenant, in (priority, arrival) order; the next request comes from the
    tenant whose head has the lowest (priority, virtual counter, backlog, arrival). A pick is a scan
    over the backlogged tenants, a handful even on a busy server."""

    def __init__(self, counters: TenantCounters) -> None:
        self.counters = counters
        self._queues: dict[str, list[Request]] = {}
        self._len = 0

    def add_request(self, request: Request) -> None:
        tenant = tenant_of(request)
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = []
        bisect.insort(queue, request, key=priority_key)
        self._len += 1
        self.counters.on_waiting(tenant, request.tenant_weight)

    prepend_request = add_request  # back to its tenant's queue, by its own key

    def _pick(self) -> list[Request]:
        counter = self.counters.counter
        best, best_key = None, None
        for tenant, queue in self._queues.items():
            head = queue[0]
            # Counter ties (a tenant just lifted to the floor) go to the shorter backlog.
            key = (head.priority, counter(tenant), len(queue), head.arrival_time)
            if best_key is None or key < best_key:
                best, best_key = queue, key
        if best is None:
            raise IndexError("pop from an empty queue")
        return best

    def peek_request(self) -> Request:
        return self._pick()[0]

    def pop_request(self) -> Request:
        request = self._pick()[0]
        self.remove_request(request)
        return request

    def remove_request(self, request: Request) -> None:
        tenant = tenant_of(request)
        queue = self._queues.get(tenant)
        if queue is None:
            raise ValueError("request not in the queue")
        queue.remove(request)
        if not queue:
            del self._queues[tenant]
        self._len -= 1
        self.counters.on_unwaiting(tenant)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        # Admission order as the counters stand now (it shifts as service is charged).
        counter = self.counters.counter
        everyone = [r for queue in self._queues.values() for r in queue]
        everyone.sort(key=lambda r: (r.priority, counter(tenant_of(r)), r.arrival_time))
        return iter(everyone)


POLICIES = ("fcfs", "priority", "fair")
__all__ = ["POLICIES", "RequestQueue", "create_request_queue", "priority_key", "tenant_of"]


def create_request_queue(policy: str, counters: TenantCounters | None = None) -> RequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    if policy == "fair":
        return FairRequestQueue(counters if counters is not None else TenantCounters())
    raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
