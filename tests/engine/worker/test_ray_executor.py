"""--distributed-executor-backend ray: every rank a Ray actor in a placement group, on a
local Ray cluster (CPU bundles, gloo). PP=2 through Ray gives the single-process engine's
greedy tokens; the ranks run on actors (not this process); shutdown leaves no actor alive
and no placement group. Skipped without Ray (the `ray` extra)."""

from __future__ import annotations

import os

import pytest
import torch

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'tessera[ray]')")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _alive_rank_actors() -> list[dict]:
    from ray._private.state import actors

    return [
        a
        for a in actors().values()
        if a["State"] != "DEAD" and a["ActorClassName"].endswith("RankActor")
    ]


def _live_placement_groups() -> list:
    table = ray.util.placement_group_table()
    return [pg for pg in table.values() if pg["state"] != "REMOVED"]


def test_pp2_on_ray_actors_equals_one_process(local_ray, tiny_llama_dir):
    from tests.engine.worker.test_pipeline_parallel import CHOICES, _generate, _structured

    torch.set_num_threads(1)
    want, _, _ = _generate(tiny_llama_dir)
    seen = {}

    def on_actors(llm) -> None:
        group = llm.engine.executor.workers
        seen["pids"] = group.pids
        seen["actors"] = len(_alive_rank_actors())
        seen["groups"] = len(_live_placement_groups())
        seen["texts"] = _structured(llm)  # the bitmask travels to the actor that samples

    got, stats, _ = _generate(
        tiny_llama_dir, pp=2, check=on_actors, distributed_executor_backend="ray"
    )
    assert got == want
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert len(seen["pids"]) == 2 and os.getpid() not in seen["pids"]
    assert seen["actors"] == 2 and seen["groups"] == 1
    assert all(t in CHOICES for t in seen["texts"])
    # Torn down: the actors killed, the placement group removed.
    assert _alive_rank_actors() == []
    assert _live_placement_groups() == []


def test_a_dead_rank_actor_marks_the_engine_dead(local_ray, tiny_llama_dir):
    """An actor killed while the engine is idle: the watcher's ping notices, the on_dead
    listeners hear of it, and every later step fails at once."""
    import signal
    import time

    from engine import LLM, SamplingParams
    from engine.errors import EngineDeadError

    torch.set_num_threads(1)
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=32,
        block_size=8,
        max_model_len=128,
        pipeline_parallel_size=2,
        device="cpu",
        distributed_executor_backend="ray",
        collective_timeout=20,
    )
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
        deaths: list = []
        llm.engine.executor.on_dead(deaths.append)
        os.kill(llm.engine.executor.workers.pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while not deaths and time.monotonic() < deadline:  # idle: the watcher notices
            time.sleep(0.1)
        assert len(deaths) == 1 and "Ray worker died" in str(deaths[0])
        with pytest.raises(EngineDeadError, match="Ray worker"):
            llm.generate([[8, 9, 10]], params, use_tqdm=False)
        with pytest.raises(EngineDeadError):  # dead for good
            llm.generate([[11, 12]], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert _alive_rank_actors() == []
    assert _live_placement_groups() == []


def test_tp2_pp2_on_four_actors(local_ray, tiny_llama_dir):
    """Four actors, two stages of two TP ranks, the collectives from rank 0's address."""
    from tests.engine.worker.test_pipeline_parallel import _generate

    torch.set_num_threads(1)
    want, _, _ = _generate(tiny_llama_dir)
    got, _, _ = _generate(tiny_llama_dir, tp=2, pp=2, distributed_executor_backend="ray")
    assert got == want
    assert _alive_rank_actors() == [] and _live_placement_groups() == []
