"""Typed engine errors the serving layer maps to HTTP statuses.

ValueError (bad input) -> 400; QueueFullError -> 503 with Retry-After; EngineDeadError -> 503.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of the engine's own failures (not the caller's input)."""


class QueueFullError(EngineError):
    """The waiting queue is at max_num_queued_requests: refuse before doing any work."""


class EngineDeadError(EngineError):
    """The step loop stopped (crashed or shut down): nothing more can be served."""
