"""Why a group of worker ranks died, once: the state both executors' groups share
(multiproc.WorkerGroup, ray_executor.RayWorkerGroup).

The first cause wins; the group's own clean-up (killing the ranks left) runs once, under the
lock, as the cause is set; every listener hears of the death once, outside the lock, from
the thread that noticed it, and one added later hears at once. The lock is the group's: it
also guards what the group's clean-up touches (its processes, its actors).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from engine.errors import EngineDeadError

logger = logging.getLogger("tessera.engine")

Listener = Callable[[EngineDeadError], None]


class GroupFailure:
    def __init__(self, group: str) -> None:
        self.group = group  # for the log line: "The tensor-parallel group", ...
        self.lock = threading.Lock()
        self._cause: str | None = None
        self._listeners: list[Listener] = []

    @property
    def cause(self) -> str | None:
        """Why the group is dead, or None while it is alive."""
        return self._cause

    def add_listener(self, listener: Listener) -> None:
        """Call listener(error) once when the group dies (at once if it already has)."""
        with self.lock:
            self._listeners.append(listener)
            cause = self._cause
        if cause is not None:
            listener(EngineDeadError(cause))

    def raise_if_dead(self) -> None:
        if self._cause is not None:
            raise EngineDeadError(self._cause)

    def fail(self, describe: Callable[[], str], clean_up: Callable[[], None]) -> EngineDeadError:
        """Mark the group dead: on the first call, describe() says why (it may look at what
        the group holds, under the lock) and clean_up() kills what is left; returns the error
        to raise, with the first cause, on every call."""
        with self.lock:
            first = self._cause is None
            if first:
                self._cause = describe()
                clean_up()
            listeners = list(self._listeners) if first else []
            cause = self._cause
        if first:
            logger.error("%s is dead: %s", self.group, cause)
        for listener in listeners:
            try:
                listener(EngineDeadError(cause))
            except Exception:  # noqa: BLE001 - one bad listener must not hide the death
                logger.exception("An engine-dead callback failed")
        return EngineDeadError(cause)
