"""Small steps leave threads to the serving front end; large steps and offline use take all."""

from __future__ import annotations

import pytest
import torch

from engine.worker.step_threads import SMALL_STEP_TOKENS, StepThreads


@pytest.fixture
def four_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


def test_small_steps_leave_reserved_threads(four_threads):
    st = StepThreads(reserved=1)
    assert st.for_step(1) == 3 and st.for_step(SMALL_STEP_TOKENS) == 3
    assert st.for_step(SMALL_STEP_TOKENS + 1) == 4
    st.apply(1)
    assert torch.get_num_threads() == 3
    st.apply(512)
    assert torch.get_num_threads() == 4


def test_no_reservation_and_never_below_one(four_threads):
    assert StepThreads(reserved=0).for_step(1) == 4
    assert StepThreads(reserved=9).for_step(1) == 1


def test_engine_config_and_serve_flag():
    from api.settings import Settings, to_engine_config
    from engine.config import EngineConfig

    assert EngineConfig.from_options().parallel.frontend_threads == 0  # offline: all threads
    assert to_engine_config(Settings()).parallel.frontend_threads == 1  # serving: one left
    with pytest.raises(ValueError, match="frontend_threads"):
        EngineConfig.from_options(frontend_threads=-1)
