"""CUDA graphs' logic for speculative decoding on the CPU: an engine's step graph and its
draft model's swapped for the CUDA graph runner over EagerReplay (each "replay" runs the step
again over the graph's static buffers, padded as a captured graph's would be)."""

from __future__ import annotations

import dataclasses

import torch

from engine.worker.cuda_graph import CudaGraphRunner, EagerReplay


def replay_graphs_on_cpu(llm) -> tuple[CudaGraphRunner, CudaGraphRunner | None]:
    """The target's graph runner and the draft model's (None without one), built from the
    configurations the engine would capture on CUDA. The engine needs an attention backend
    with static metadata (attention_backend="torch")."""
    runner = llm.engine.executor.runner
    config = dataclasses.replace(runner.step_graph_config(), device=torch.device("cpu"))
    target = CudaGraphRunner.from_config(runner.model, config, EagerReplay())
    runner._step_graph = target
    draft = None
    drafter = runner.drafter
    if drafter is not None and drafter.graphs:
        draft_config = drafter.step_graph_config(config)
        draft = CudaGraphRunner.from_config(drafter.model, draft_config, EagerReplay())
        drafter.graph = draft
    return target, draft
