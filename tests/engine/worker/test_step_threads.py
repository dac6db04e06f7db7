"""Small steps leave threads to the serving front end; large steps and offline use take all.
Serving's default measures which is faster on the server's own steps, per band of sizes."""

from __future__ import annotations

import pytest
import torch

from engine.worker.step_threads import BANDS, CALIBRATION_STEPS, SMALL_STEP_TOKENS, StepThreads


@pytest.fixture
def four_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


def test_small_steps_leave_reserved_threads(four_threads):
    st = StepThreads(reserved=1)  # a fixed reservation: steps of up to 4 tokens only
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
    from api.server.settings import Settings
    from engine.args import EngineArgs

    assert (
        EngineArgs().create_engine_config().parallel.frontend_threads == 0
    )  # offline: all threads
    assert Settings().create_engine_config().parallel.frontend_threads is None  # serving: measured
    for text, want in (("auto", None), ("0", 0), ("1", 1)):
        settings = Settings.from_argv(["--frontend-threads", text], environ={})
        assert settings.create_engine_config().parallel.frontend_threads == want
    with pytest.raises(ValueError, match="frontend_threads"):
        EngineArgs(frontend_threads=-1).create_engine_config()


@pytest.mark.parametrize("faster", [3, 4])
def test_measuring_alternates_then_keeps_the_faster(four_threads, faster):
    st = StepThreads(reserved=None, calibration_steps=5)
    assert st.measuring and st.for_step(BANDS[-1] + 1) == 4  # large steps: all
    seen = []
    while SMALL_STEP_TOKENS in st._trial:
        threads = st.for_step(1)
        seen.append(threads)
        st.record(1, threads, 0.010 if threads == faster else 0.013)
        st.record(2, 4, 0.001)  # another step size never completes a comparison on its own
    assert seen == [3, 4] * 5  # alternated, each size compared with itself
    assert st.small[SMALL_STEP_TOKENS] == faster
    assert st.for_step(1) == faster and st.for_step(SMALL_STEP_TOKENS) == faster
    # the next band is its own: still measuring, alternating from all but one
    assert st.measuring and st.small[BANDS[1]] is None and st.for_step(SMALL_STEP_TOKENS + 1) == 3


def test_each_band_of_step_sizes_chooses_apart(four_threads):
    st = StepThreads(reserved=None, calibration_steps=3)
    for _ in range(3):
        for threads in (3, 4):  # 1-token steps faster on 3, 8-token steps on 4
            st.record(1, threads, 0.010 if threads == 3 else 0.013)
            st.record(8, threads, 0.020 if threads == 4 else 0.030)
    assert not st.measuring and st.small == {SMALL_STEP_TOKENS: 3, BANDS[1]: 4}
    assert [st.for_step(n) for n in (1, 4, 5, 16, 17)] == [3, 3, 4, 4, 4]


def test_it_measures_again_after_recheck_steps(four_threads):
    st = StepThreads(reserved=None, calibration_steps=2, recheck_steps=6)
    for threads in (3, 4, 3, 4):
        st.record(1, threads, 0.010 if threads == 4 else 0.013)
    for threads in (3, 4, 3, 4):
        st.record(8, threads, 0.010 if threads == 4 else 0.013)
    assert not st.measuring and st.small == {SMALL_STEP_TOKENS: 4, BANDS[1]: 4}
    for _ in range(5):  # a band's steps count towards its next measurement, others' do not
        st.apply(1)
        st.finish()
        st.apply(SMALL_STEP_TOKENS + 1)
        st.finish()
        st.apply(BANDS[-1] + 1)
        st.finish()
    assert not st.measuring
    st.apply(1)
    st.finish()
    assert st.measuring and st.for_step(1) == 3  # alternating again, from all but one
    assert st.for_step(8) == 4  # the other band keeps its choice until its own count
    for threads in (3, 4, 3, 4):  # the load moved: now one thread fewer is faster
        st.record(1, threads, 0.010 if threads == 3 else 0.013)
    assert not st.measuring and st.small[SMALL_STEP_TOKENS] == 3 and st.for_step(1) == 3


def test_one_thread_or_a_fixed_reservation_measures_nothing(four_threads):
    assert not StepThreads(reserved=1).measuring
    torch.set_num_threads(1)
    st = StepThreads(reserved=None)
    assert not st.measuring and st.for_step(1) == 1


def _greedy_tokens(engine, prompt: str, max_tokens: int) -> list[int]:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine.add_request("r", prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out if out.finished else final
    return final.outputs[0].token_ids


def test_the_engine_measures_on_its_own_steps(tiny_llama_dir):
    """The engine's real small steps (two threads) decide; the text is the same."""
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine

    torch.set_num_threads(2)  # the autouse fixture puts the count back
    engines = [
        LLMEngine(
            EngineArgs(model=str(tiny_llama_dir), frontend_threads=reserved).create_engine_config()
        )
        for reserved in (None, 0)
    ]
    threads = engines[0].executor.runner._threads
    assert threads.measuring
    n = 2 * CALIBRATION_STEPS + 8
    measured, fixed = (_greedy_tokens(e, "hello world", n) for e in engines)
    # one sequence: 1-token steps decide their band; the 5-16 band never ran, still undecided
    assert threads.small[SMALL_STEP_TOKENS] in (1, 2) and threads.small[BANDS[1]] is None
    assert measured == fixed and len(measured) == n
    for e in engines:
        e.shutdown()
