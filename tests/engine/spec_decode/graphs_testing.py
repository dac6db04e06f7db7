"""CUDA graphs' logic on the CPU: with TESSERA_STEP_GRAPH=replay (set it before the engine
starts) the model runner builds engine.worker.cuda_graph.ReplayGraphRunner, the CUDA graph
runner over EagerReplay, as its step graph and its draft model's; step_graphs reads them."""

from __future__ import annotations

from engine.worker.cuda_graph import ReplayGraphRunner

REPLAY = ("TESSERA_STEP_GRAPH", "replay")  # monkeypatch.setenv(*REPLAY)


def step_graphs(llm) -> tuple[ReplayGraphRunner, ReplayGraphRunner | None]:
    """The target's graph runner and the draft model's (None without one, or an EAGLE
    head's: its forwards run eager)."""
    runner = llm.engine.executor.runner
    target = runner._step_graph
    assert isinstance(target, ReplayGraphRunner), "TESSERA_STEP_GRAPH=replay was not set"
    drafter = runner.drafter
    return target, (drafter.graph if drafter is not None else None)
