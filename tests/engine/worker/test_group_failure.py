"""GroupFailure, the death state both executors' groups share: the first cause wins, the
clean-up runs once, every listener hears once (one added late at once), a listener that
raises hides nothing, and many threads failing together agree on one cause."""

from __future__ import annotations

import threading

import pytest

from engine.errors import EngineDeadError
from engine.worker.group_failure import GroupFailure


def test_first_cause_wins_and_clean_up_runs_once():
    dead = GroupFailure("The test group")
    cleaned: list[int] = []
    heard: list[str] = []
    dead.add_listener(lambda e: heard.append(str(e)))
    assert dead.cause is None
    dead.raise_if_dead()  # alive: nothing raised

    err = dead.fail(lambda: "rank 1 died", lambda: cleaned.append(1))
    again = dead.fail(lambda: "a later cause", lambda: cleaned.append(2))
    assert isinstance(err, EngineDeadError) and str(err) == str(again) == "rank 1 died"
    assert dead.cause == "rank 1 died" and cleaned == [1] and heard == ["rank 1 died"]
    with pytest.raises(EngineDeadError, match="rank 1 died"):
        dead.raise_if_dead()

    late: list[str] = []
    dead.add_listener(lambda e: late.append(str(e)))  # already dead: told at once
    assert late == ["rank 1 died"] and heard == ["rank 1 died"]


def test_a_raising_listener_does_not_hide_the_death_from_the_others():
    dead = GroupFailure("The test group")
    heard: list[str] = []

    def broken(_):
        raise RuntimeError("listener bug")

    dead.add_listener(broken)
    dead.add_listener(lambda e: heard.append(str(e)))
    assert str(dead.fail(lambda: "gone", lambda: None)) == "gone"
    assert heard == ["gone"]


def test_describe_and_clean_up_run_under_the_groups_lock():
    dead = GroupFailure("The test group")
    held = []
    dead.fail(lambda: str(held.append(dead.lock.locked())), lambda: held.append(dead.lock.locked()))
    assert held == [True, True]
    assert not dead.lock.locked()


def test_threads_failing_together_agree_on_one_cause():
    dead = GroupFailure("The test group")
    cleaned: list[int] = []
    heard: list[str] = []
    dead.add_listener(lambda e: heard.append(str(e)))
    start = threading.Barrier(8)
    results: list[str] = []

    def fail(i: int) -> None:
        start.wait()
        results.append(str(dead.fail(lambda: f"cause {i}", lambda: cleaned.append(i))))

    threads = [threading.Thread(target=fail, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cleaned) == 1 and len(heard) == 1
    assert set(results) == {dead.cause} == {f"cause {cleaned[0]}"}
