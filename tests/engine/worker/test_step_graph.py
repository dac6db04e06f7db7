"""The StepGraph protocol (engine.worker.step_graph): both implementations satisfy it, and the
model runner calls any graph one way: the eager forward's tensors built first only for a
graph that reads them, the eager forward where run() gives None."""

from __future__ import annotations

import inspect

import pytest
import torch

from engine.attention.metadata import common_metadata_from_seqs
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.worker.cpu_graph import DecodePlan
from engine.worker.cuda_graph import CudaGraphRunner, EagerReplay
from engine.worker.model_runner import ModelRunner
from engine.worker.step_graph import StepGraph, StepGraphConfig, StepInputs

BLOCK = 8
IMPLEMENTATIONS = (DecodePlan, CudaGraphRunner)


def _members() -> set[str]:
    methods = {n for n, v in vars(StepGraph).items() if not n.startswith("_") and callable(v)}
    methods |= {n for n, v in vars(StepGraph).items() if isinstance(v, classmethod)}
    return methods | set(StepGraph.__annotations__)


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_both_implementations_have_the_protocols_members(cls) -> None:
    assert _members() == {
        "build", "reserve_bytes", "run", "close", "eager_inputs", "graph_bytes", "takes_lora",
        "lora_blockers", "keeps_aux_hidden", "runs_stages",
    }  # fmt: skip
    for name in _members():
        assert hasattr(cls, name), name
    assert list(inspect.signature(cls.run).parameters) == ["self", "inputs"]
    assert len(inspect.signature(cls.build).parameters) == 2  # (the model, a StepGraphConfig)
    assert list(inspect.signature(cls.reserve_bytes).parameters) == ["config"]
    assert isinstance(cls.eager_inputs, bool) and isinstance(cls.graph_bytes, int)
    assert isinstance(cls.takes_lora, bool) and isinstance(cls.keeps_aux_hidden, bool)
    assert isinstance(cls.runs_stages, bool)
    assert cls.lora_blockers <= {"dora", "embedding", "experts"}  # LoRAManager.graph_blockers
    assert isinstance(inspect.getattr_static(cls, "build"), classmethod)
    assert isinstance(inspect.getattr_static(cls, "reserve_bytes"), classmethod)


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    config = EngineConfig(
        model=ModelConfig(
            model=str(tiny_llama_dir),
            dtype="float32",
            max_model_len=128,
            attention_backend="torch",
            device="cpu",
        ),
        cache=CacheConfig(block_size=BLOCK, num_blocks=64),
        scheduler=SchedulerConfig(block_size=BLOCK, max_model_len=128, max_num_seqs=8),
    )
    r = ModelRunner(config, model_dir=tiny_llama_dir)
    r.load_model()
    r.init_kv_cache(64)
    return r


def test_the_graph_runner_is_a_step_graph(runner) -> None:
    graphs = CudaGraphRunner(runner.model, runner.attn_backend, (1, 2), 16, EagerReplay(), "cpu")
    assert isinstance(graphs, StepGraph) and not graphs.eager_inputs
    config = runner.step_graph_config()
    assert isinstance(config, StepGraphConfig)
    assert CudaGraphRunner.build(runner.model, config) is None  # not a CUDA device
    assert CudaGraphRunner.reserve_bytes(config) == 0
    graphs.close()


def test_the_decode_plan_is_a_step_graph(make_tiny_model) -> None:
    from engine import LLM
    from engine.kernels.cpu import w4 as cpu_w4

    if not cpu_w4.available():
        pytest.skip("the plan runs the 4-bit (AVX512-VNNI or AVX2) kernels")
    path = make_tiny_model("tiny-llama-step-graph", arch="llama", seed=3)
    llm = LLM(str(path), dtype="bfloat16", quantization="w4a8", num_kv_blocks=40, max_num_seqs=4)
    runner = llm.engine.executor.runner
    plan = runner._step_graph
    assert isinstance(plan, DecodePlan) and isinstance(plan, StepGraph) and plan.eager_inputs
    assert DecodePlan.reserve_bytes(runner.step_graph_config()) == 0
    assert runner.graph_reserve_bytes() == 0
    plan.close()
    ids, positions = [5], [3]
    step = StepInputs(ids, positions, common_metadata_from_seqs([(3, 1, [1])], 16))
    runner._eager_inputs(step)
    assert plan.run(step) is None  # closed: the eager forward takes every step
    llm.shutdown()


class _Recording:
    """A step graph that records what it was given and returns a fixed answer."""

    graph_bytes = 0
    takes_lora = False
    lora_blockers = frozenset()
    keeps_aux_hidden = False
    runs_stages = False

    def __init__(self, eager_inputs: bool, answer: torch.Tensor | None):
        self.eager_inputs = eager_inputs
        self.answer = answer
        self.seen: list[StepInputs] = []
        self.closed = False

    @classmethod
    def build(cls, model, config):
        return None

    @classmethod
    def reserve_bytes(cls, config):
        return 0

    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        self.seen.append(inputs)
        return self.answer

    def close(self) -> None:
        self.closed = True


def _step():
    seqs = [(2, 1, [1]), (8, 1, [2, 3])]
    return [11, 12], [2, 8], common_metadata_from_seqs(seqs, BLOCK)


@pytest.mark.parametrize("eager_inputs", [True, False])
def test_the_runner_calls_any_graph_one_way(runner, eager_inputs) -> None:
    ids, positions, common = _step()
    with torch.inference_mode():
        eager = runner.model(
            torch.tensor(ids), torch.tensor(positions), runner.attn_backend.build_metadata(common)
        )
        answer = torch.full((2, 4), 7.0)
        graph = _Recording(eager_inputs, answer)
        assert isinstance(graph, StepGraph)
        runner._step_graph = graph
        try:
            assert runner._run_model(ids, positions, common) is answer  # the graph's
            (step,) = graph.seen
            assert (step.ids, step.positions, step.common, step.fed) == (
                ids,
                positions,
                common,
                None,
            )
            # only a graph that reads them gets the eager forward's tensors built first
            assert (step.input_ids is not None) == eager_inputs
            assert (step.attn_metadata is not None) == eager_inputs
            if eager_inputs:
                assert step.input_ids.tolist() == ids and step.position_ids.tolist() == positions
            graph.answer = None  # not taken: the eager forward's output
            torch.testing.assert_close(runner._run_model(ids, positions, common), eager)
            assert len(graph.seen) == 2
        finally:
            runner._step_graph = None


def test_a_rebuilt_graph_closes_the_old_one(runner) -> None:
    old = _Recording(True, None)
    runner._step_graph = old
    try:
        assert runner._build_step_graph() is None  # float32 on the CPU: no decode plan
        assert old.closed
    finally:
        runner._step_graph = None
