"""Executor: runs the model runner(s) for the engine.

One rank (tensor_parallel_size * pipeline_parallel_size == 1): the runner lives in this
process. More: rank 0 in this process, ranks 1..N-1 in worker processes (see
engine/worker/multiproc.py); every rank gets the same SchedulerOutput each step, and keeps its
own persistent input batch (engine/worker/input_batch.py). With
--distributed-executor-backend ray every rank is a Ray actor instead (ray_executor.py). A worker that dies
makes every later call raise EngineDeadError; on_dead listeners hear of it at once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.worker.model_runner import ModelRunner


class Executor:
    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        self.config = config
        self.workers = None
        if config.parallel.world_size > 1:
            if config.parallel.distributed_executor_backend == "ray":
                from engine.worker.ray_executor import RayWorkerGroup

                self.workers = RayWorkerGroup(config, model_dir)
            else:
                from engine.worker.multiproc import WorkerGroup

                self.workers = WorkerGroup(config, model_dir)
            self.runner = self.workers.driver  # (None with Ray: every rank is an actor)
        else:
            self.runner = ModelRunner(config, model_dir=model_dir)
            self.runner.load_model()

    def check_alive(self) -> None:
        """Raise EngineDeadError if a tensor-parallel worker died (one process: never)."""
        if self.workers is not None:
            self.workers.check_alive()

    def on_dead(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call callback(error) once, from any thread, when the executor can step no more."""
        if self.workers is not None:
            self.workers.add_failure_callback(callback)

    def determine_num_blocks(self) -> int:
        if self.workers is not None:
            return self.workers.determine_num_blocks()
        return self.runner.determine_num_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        if self.workers is not None:
            self.workers.init_kv_cache(num_blocks)
        else:
            self.runner.init_kv_cache(num_blocks)

    def stage_stats(self) -> list:
        """Every rank's cumulative step time (engine.stats.StageStats), rank 0 first; call it
        between steps, with no batch in flight."""
        if self.workers is not None:
            return self.workers.stage_stats()
        return [self.runner.stage_stats()]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.workers is not None:
            return self.workers.execute_model(scheduler_output)
        return self.runner.execute_model(scheduler_output)

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the engine may submit before collecting the oldest (pipeline parallelism:
        one per stage, so every stage has a batch to work on); 1 otherwise."""
        return self.workers.max_concurrent_batches if self.workers is not None else 1

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Start a step (max_concurrent_batches > 1 only); collect() returns its output."""
        self.workers.submit(scheduler_output)

    def collect(self) -> ModelRunnerOutput:
        """The oldest submitted step's output (steps are collected in submission order)."""
        return self.workers.collect()

    def shutdown(self) -> None:
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
