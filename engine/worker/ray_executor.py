"""The Ray executor (--distributed-executor-backend ray): every rank in a Ray actor.

Ray is optional (the `ray` extra) and imported only here, only when chosen. The group joins
the cluster at RAY_ADDRESS, or the one this process already joined, or starts a local one;
reserves a placement group of one bundle per pipeline stage, sized for the stage's TP ranks
(tp GPUs on CUDA, tp CPUs on the CPU), and starts each rank's actor in its stage's bundle. A
bundle lives on one node, so a TP group never straddles nodes (its all-reduces stay inside
the node); the stages are packed (PACK: on as few nodes as hold them, one node when it can,
else a stage per node as they fit), so stages cross the network only when a node cannot hold
them, and then only the point-to-point activations do. Rank 0's actor picks the rendezvous
address (its node's IP and a free port there), and every actor joins the torch.distributed
group from it, as the multiprocessing workers do, then loads its shard or stage. Each step
the engine's process sends every actor the same payload as the multiprocessing executor's
(engine.worker.step_payload) and the actors run the same call handler
(multiproc.handle_call); the rank that samples (rank 0, or the last stage's first TP rank
under pipeline parallelism) returns the step's output.

The scheduler stays in the engine's process, which holds no model. An actor that dies (or a
step past the collective timeout) fails the step: the group kills its actors and is dead for
good (EngineDeadError), as the multiprocessing group is. A watcher thread pings the actors
every second on a concurrency group of their own (a ping never waits behind a step), so a
dead actor is noticed while the engine is idle too, and the on_dead listeners hear of it
(group_failure.GroupFailure, shared with the multiprocessing group). shutdown() stops the
actors, kills them, and removes the placement group; a cluster it started stays up until the
process exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.worker.group_failure import GroupFailure
from engine.worker.multiproc import call_message, step_messages

logger = logging.getLogger("tessera.engine")

_READY_TIMEOUT_S = 600.0
_STOP_TIMEOUT_S = 10.0
_WATCH_S = 1.0  # how often the watcher pings the actors
_PING_TIMEOUT_S = 30.0
_HEALTH = "health"  # the actors' concurrency group for pings


def import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError(
            "--distributed-executor-backend ray needs Ray: pip install 'tessera[ray]' "
            "(or use the default, mp)"
        ) from None
    return ray


class RankActor:
    """One rank, in its Ray actor (wrapped with ray.remote by RayWorkerGroup)."""

    def __init__(self, config: EngineConfig, model_dir: str, rank: int, on_cuda: bool) -> None:
        from engine.worker.model_runner import LOCAL_RANK_ENV, LOCAL_WORLD_SIZE_ENV

        if on_cuda:  # Ray made this bundle's GPU the only visible one
            os.environ[LOCAL_RANK_ENV], os.environ[LOCAL_WORLD_SIZE_ENV] = "0", "1"
        self.config, self.model_dir, self.rank = config, Path(model_dir), rank
        self.runner = None
        self.answers = False

    def rendezvous(self) -> str:
        """This node's address and a free port on it: rank 0's, for every rank to join."""
        import ray

        from engine.worker.multiproc import free_port

        return f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"

    def start(self, init_method: str, num_threads: int) -> tuple[int, str]:
        """Join the group, then load this rank's shard; returns the actor's pid and node."""
        import ray
        import torch

        from engine.distributed import backend_for, bind_cuda_device, init_distributed
        from engine.worker.model_runner import ModelRunner, resolve_device

        parallel = self.config.parallel
        torch.set_num_threads(num_threads)
        device = resolve_device(self.config.model.device, self.rank, parallel.world_size)
        bind_cuda_device(device)
        init_distributed(
            self.rank,
            parallel.world_size,
            init_method,
            backend_for(device),
            parallel.collective_timeout_s,
            parallel.pipeline_parallel_size,
        )
        self.runner = ModelRunner(self.config, model_dir=self.model_dir, rank=self.rank)
        self.runner.load_model()
        self.answers = self.runner.samples
        return os.getpid(), ray.get_runtime_context().get_node_id()

    def ping(self) -> bool:
        return True

    def call(self, message: bytes):
        from engine.worker.multiproc import handle_call

        return handle_call(self.runner, message, self.answers)

    def stop(self) -> None:
        from engine.distributed import destroy_distributed

        destroy_distributed()


class RayWorkerGroup:
    """The multiprocessing WorkerGroup's interface over Ray actors (the driver: none)."""

    driver = None  # every rank is an actor: the engine's process only schedules

    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        ray = self.ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from engine.worker.model_runner import resolve_device

        parallel = config.parallel
        world_size = parallel.world_size
        self.timeout_s = parallel.collective_timeout_s
        self.output_rank = (parallel.pipeline_parallel_size - 1) * parallel.tensor_parallel_size
        self._dead = GroupFailure("The Ray worker group")  # why it broke; set once
        self._lock = self._dead.lock  # also guards the actors
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None
        self._sampled: dict[str, list[int]] = {}
        self._in_flight: list[list] = []  # each submitted step's replies, oldest first
        self.parallel = parallel
        self.actors: list = []
        self.placement_group = None
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS") or None
            # A local cluster: a logical CPU per rank at least, whatever the machine has.
            local = {} if address else {"num_cpus": max(os.cpu_count() or 1, world_size)}
            ray.init(address=address, include_dashboard=False, log_to_driver=False, **local)
        on_cuda = resolve_device(config.model.device, 0, 1).type == "cuda"
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        # One bundle per stage: its TP ranks on one node; rank r is stage r // tp.
        stage = {"GPU": tp, "CPU": tp} if on_cuda else {"CPU": tp}
        try:
            self.placement_group = placement_group([stage] * pp, strategy="PACK")
            self._wait_placed(stage, pp)
            # The workers import this checkout's engine (a local cluster shares its disk).
            root = str(Path(__file__).resolve().parents[2])
            path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
            actor_cls = ray.remote(concurrency_groups={_HEALTH: 1})(RankActor)
            for rank in range(world_size):
                strategy = PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank // tp
                )
                self.actors.append(
                    actor_cls.options(
                        num_cpus=1,
                        num_gpus=1 if on_cuda else 0,
                        scheduling_strategy=strategy,
                        runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}},
                        name=f"tessera-rank{rank}-{os.getpid()}-{id(self):x}",
                    ).remote(config, str(model_dir), rank, on_cuda)
                )
            init_method = ray.get(self.actors[0].rendezvous.remote(), timeout=_READY_TIMEOUT_S)
            started = ray.get(
                [a.start.remote(init_method, 1) for a in self.actors], timeout=_READY_TIMEOUT_S
            )
        except BaseException:
            self.shutdown()
            raise
        self.pids = [pid for pid, _ in started]
        self.node_ids = [node for _, node in started]  # each rank's Ray node
        self._watcher = threading.Thread(target=self._watch, name="tessera-ray-watch", daemon=True)
        self._watcher.start()
        logger.info(
            "Ray: %d ranks on actors (tensor parallel %d x pipeline parallel %d) on %d node(s) "
            "(stage: node %s), rendezvous %s",
            world_size,
            tp,
            pp,
            len(set(self.node_ids)),
            ", ".join(f"{s}: {self.node_ids[s * tp][:8]}" for s in range(pp)),
            init_method,
        )

    def _wait_placed(self, stage: dict, stages: int) -> None:
        """Wait for the placement group; a cluster with no room says what it lacks."""
        ray = self.ray
        try:
            ray.get(self.placement_group.ready(), timeout=_READY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
            held = "; ".join(
                ", ".join(f"{k} {v:g}" for k, v in sorted(r.items()) if k in stage) or "none"
                for r in nodes
            )
            raise RuntimeError(
                f"the Ray cluster could not place {stages} pipeline stage(s) of {stage} each "
                f"in {_READY_TIMEOUT_S:.0f} s: a stage's tensor-parallel ranks must fit on one "
                f"node, and its {len(nodes)} node(s) hold: {held}"
            ) from None

    # -- liveness -------------------------------------------------------------------------

    @property
    def failure(self) -> str | None:
        return self._dead.cause

    def add_failure_callback(self, callback: Callable[[EngineDeadError], None]) -> None:
        self._dead.add_listener(callback)

    def check_alive(self) -> None:
        self._dead.raise_if_dead()

    def _watch(self) -> None:
        """Ping every actor each second (on its health group: never behind a step)."""
        ray = self.ray
        while not self._closing.wait(_WATCH_S):
            with self._lock:
                actors = list(self.actors)
            if not actors or self._dead.cause is not None:
                return
            refs = [a.ping.options(concurrency_group=_HEALTH).remote() for a in actors]
            try:
                ray.get(refs, timeout=_PING_TIMEOUT_S)
            except ray.exceptions.RayActorError as exc:
                if not self._closing.is_set():
                    self._fail(f"a Ray worker died: {exc}")
                return
            except Exception:  # noqa: BLE001 - a slow ping: the steps' timeout decides
                continue

    def _fail(self, cause: str) -> EngineDeadError:
        return self._dead.fail(lambda: cause, self._kill_actors)

    # -- calls ----------------------------------------------------------------------------

    def _all(self, message: bytes, timeout: float) -> list:
        self.check_alive()
        return self._wait([a.call.remote(message) for a in self.actors], timeout)

    def _wait(self, refs: list, timeout: float) -> list:
        try:
            return self.ray.get(refs, timeout=timeout)
        except self.ray.exceptions.GetTimeoutError:
            raise self._fail(f"a Ray worker did not answer in {timeout:.0f} s") from None
        except self.ray.exceptions.RayActorError as exc:
            raise self._fail(f"a Ray worker died: {exc}") from None
        except self.ray.exceptions.RayTaskError as exc:
            raise self._fail(f"a Ray worker failed: {exc}") from None

    def _call(self, method: str, *args) -> list:
        import msgspec

        return self._all(call_message(method, msgspec.msgpack.encode(args)), self.timeout_s)

    def stage_stats(self) -> list:
        """Every rank's StageStats, rank 0 first (between steps: none in flight)."""
        return self._call("stage_stats")

    def determine_num_blocks(self) -> int:
        return min(self._call("determine_num_blocks"))

    def init_kv_cache(self, num_blocks: int) -> None:
        self._call("init_kv_cache", num_blocks)

    @property
    def max_concurrent_batches(self) -> int:
        """One step in flight per pipeline stage (multiproc.WorkerGroup's)."""
        return self.parallel.pipeline_parallel_size

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(scheduler_output)
        return self.collect()

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Queue a step on every actor (each runs its calls in order); collect() waits."""
        self.check_alive()
        ranks = range(len(self.actors))
        messages = step_messages(scheduler_output, self._sampled, ranks, self.output_rank)
        self._sampled = {}  # sent: never twice, even if this step fails
        self._in_flight.append(
            [a.call.remote(m) for a, m in zip(self.actors, messages, strict=True)]
        )

    def collect(self) -> ModelRunnerOutput:
        """The oldest submitted step's output (the rank that samples answers with it)."""
        self.check_alive()
        result = self._wait(self._in_flight.pop(0), self.timeout_s)[self.output_rank]
        self._sampled.update((rid, t) for rid, t in result.sampled_token_ids.items() if t)
        return result

    def shutdown(self) -> None:
        ray = self.ray
        self._closing.set()
        if self._watcher is not None:
            self._watcher.join(_PING_TIMEOUT_S)
        if self._dead.cause is None and self.actors:
            with contextlib.suppress(Exception):
                ray.get([a.stop.remote() for a in self.actors], timeout=_STOP_TIMEOUT_S)
        with self._lock:
            self._kill_actors()
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.placement_group)
            self.placement_group = None

    def _kill_actors(self) -> None:
        for actor in self.actors:
            with contextlib.suppress(Exception):
                self.ray.kill(actor)
        self.actors = []
