"""The waiting queue: which waiting request the scheduler admits next, vLLM v1 style.

"fcfs": arrival order; a preempted request goes back to the front, ahead of new arrivals.
"priority": lowest (priority, arrival_time) first, ties in insertion order; a preempted
request goes back to its place by that key.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

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


def create_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"policy must be 'fcfs' or 'priority', got {policy!r}")
