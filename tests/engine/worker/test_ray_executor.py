"""--distributed-executor-backend ray on a local Ray cluster of two nodes (a head and a worker
node, two CPUs each, both on this machine: ray.cluster_utils.Cluster), CPU bundles and gloo.

PP=2 through Ray gives the single-process engine's greedy tokens, its two one-rank stages
packed on one node (a node that holds both stages gets both); TP=2 x PP=2 too, each stage's two
TP ranks on one node and the two stages on the two nodes (Ray's actor table says where each
actor runs). A stage that no node can hold fails, saying what the nodes hold. Removing the
worker node makes the engine dead (the watcher notices while it is idle, every later step
fails); shutdown leaves no actor and no placement group, and the cluster's teardown no Ray
process. Skipped without Ray (the `ray` extra)."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import torch

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'tessera[ray]')")

pytestmark = pytest.mark.slow

_CPUS_PER_NODE = 2
_DEATH_WAIT_S = 60  # an upper bound for a liveness wait, not a speed claim


@pytest.fixture(scope="module")
def two_nodes():
    """A head node and a worker node, and this process joined to them as a driver."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # another module's local cluster
        ray.shutdown()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": _CPUS_PER_NODE, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=_CPUS_PER_NODE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def one_process_tokens(tiny_llama_dir):
    from tests.engine.worker.test_pipeline_parallel import _generate

    torch.set_num_threads(1)
    return _generate(tiny_llama_dir)[0]


def _rank_actors() -> list[dict]:
    """The live rank actors, from Ray's actor table (the GCS, not the executor's word)."""
    from ray._private.state import actors

    return [
        a
        for a in actors().values()
        if a["State"] != "DEAD" and a["ActorClassName"].endswith("RankActor")
    ]


def _node_of_rank(actors: list[dict]) -> dict[int, str]:
    """rank -> node id, read from the actor names (tessera-rank{r}-...)."""
    return {int(a["Name"].split("-")[1][4:]): a["Address"]["NodeID"] for a in actors}


def _live_placement_groups() -> list:
    table = ray.util.placement_group_table()
    return [pg for pg in table.values() if pg["state"] != "REMOVED"]


def _cluster_pids(cluster) -> set[int]:
    """Every process of the cluster: each node's GCS, raylet, monitors, and the raylets'
    worker processes (the actors among them)."""
    pids = set()
    for node in [cluster.head_node, *cluster.worker_nodes]:
        for infos in node.all_processes.values():
            for info in infos:
                pids.add(info.process.pid)
                with_children = psutil.Process(info.process.pid).children(recursive=True)
                pids.update(c.pid for c in with_children)
    return pids


def _running(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_pp2_on_ray_equals_one_process_with_both_stages_on_one_node(
    two_nodes, one_process_tokens, tiny_llama_dir
):
    from tests.engine.worker.test_pipeline_parallel import CHOICES, _generate, _structured

    seen = {}

    def on_actors(llm) -> None:
        group = llm.engine.executor.workers
        seen["pids"], seen["nodes"] = group.pids, group.node_ids
        seen["actors"] = _rank_actors()
        seen["groups"] = len(_live_placement_groups())
        seen["texts"] = _structured(llm)  # the bitmask travels to the actor that samples

    got, stats, _ = _generate(
        tiny_llama_dir, pp=2, check=on_actors, distributed_executor_backend="ray"
    )
    assert got == one_process_tokens
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert len(seen["pids"]) == 2 and os.getpid() not in seen["pids"]
    assert len(seen["actors"]) == 2 and seen["groups"] == 1
    assert {a["Pid"] for a in seen["actors"]} == set(seen["pids"])
    # Two one-CPU stages fit one two-CPU node: packed there, no activation on the network.
    nodes = _node_of_rank(seen["actors"])
    assert nodes[0] == nodes[1] and seen["nodes"] == [nodes[0], nodes[1]]
    assert all(t in CHOICES for t in seen["texts"])
    # Torn down: the actors killed, the placement group removed.
    assert _rank_actors() == []
    assert _live_placement_groups() == []


def test_a_stage_no_node_can_hold_fails_saying_what_the_nodes_hold(
    two_nodes, tiny_llama_dir, monkeypatch
):
    """TP=4: one stage's four CPUs must share a node, but each node has two (four in all). The
    placement group never fits; past its wait (shortened here) the engine fails, saying what
    a stage needs and what each node holds, and leaves no actor or placement group."""
    from engine import LLM
    from engine.worker import ray_executor

    monkeypatch.setattr(ray_executor, "_READY_TIMEOUT_S", 5.0)
    want = (
        r"could not place 1 pipeline stage\(s\) of \{'CPU': 4\} each .* must fit on one "
        r"node, and its 2 node\(s\) hold: CPU 2; CPU 2"
    )
    with pytest.raises(RuntimeError, match=want):
        LLM(
            str(tiny_llama_dir),
            dtype="float32",
            num_kv_blocks=24,
            block_size=8,
            max_model_len=128,
            tensor_parallel_size=4,
            device="cpu",
            distributed_executor_backend="ray",
        )
    assert _rank_actors() == []
    assert _live_placement_groups() == []


def test_tp2_pp2_across_two_nodes_then_the_worker_node_dies(
    two_nodes, one_process_tokens, tiny_llama_dir
):
    """TP ranks of a stage on one node, the stages on distinct nodes; the worker node removed
    while the engine is idle: the engine is dead (the watcher, the on_dead listeners), later
    steps fail at once, nothing is left of the group, and the cluster's teardown leaves no
    Ray process."""
    from engine import LLM, SamplingParams
    from engine.errors import EngineDeadError
    from tests.engine.worker.test_pipeline_parallel import PROMPTS, _params

    cluster = two_nodes
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=24,
        block_size=8,
        max_model_len=128,
        max_num_batched_tokens=32,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        device="cpu",
        distributed_executor_backend="ray",
        collective_timeout=30,
    )
    try:
        first = llm.generate(PROMPTS[:1], _params()[:1], use_tqdm=False)
        outs = first + llm.generate(PROMPTS[1:], _params()[1:], use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outs] == one_process_tokens

        nodes = _node_of_rank(_rank_actors())
        assert sorted(nodes) == [0, 1, 2, 3]
        assert nodes[0] == nodes[1] and nodes[2] == nodes[3]  # a TP group on one node
        assert nodes[0] != nodes[2]  # the stages on the two nodes
        head, (worker,) = cluster.head_node, cluster.worker_nodes
        assert {nodes[0], nodes[2]} == {head.node_id, worker.node_id}
        assert llm.engine.executor.workers.node_ids == [nodes[r] for r in range(4)]

        pids = _cluster_pids(cluster)
        assert set(llm.engine.executor.workers.pids) <= pids
        deaths: list = []
        llm.engine.executor.on_dead(deaths.append)
        cluster.remove_node(worker)
        deadline = time.monotonic() + _DEATH_WAIT_S
        while not deaths and time.monotonic() < deadline:  # idle: the watcher notices
            time.sleep(0.2)
        assert len(deaths) == 1 and "Ray worker died" in str(deaths[0])
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        with pytest.raises(EngineDeadError, match="Ray worker died"):
            llm.generate([[8, 9, 10]], params, use_tqdm=False)
        with pytest.raises(EngineDeadError):  # dead for good
            llm.generate([[11, 12]], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert _rank_actors() == []
    assert _live_placement_groups() == []

    # The cluster torn down: no GCS, raylet, monitor or worker process of it is left.
    ray.shutdown()
    cluster.shutdown()
    deadline = time.monotonic() + _DEATH_WAIT_S
    while _running(pids) and time.monotonic() < deadline:  # raylets' workers exit after them
        time.sleep(0.2)
    left = [psutil.Process(p).cmdline()[:2] for p in _running(pids)]
    assert left == []
