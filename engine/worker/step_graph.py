"""The step graph: a planned or captured step over static buffers that the model runner runs
where it takes the step, the eager forward otherwise; the model never knows.

Two implementations, one per device: the CPU's one-call decode plan (cpu_graph.DecodePlan)
and CUDA's captured decode graphs (cuda_graph.CudaGraphRunner). The runner holds one (or
None), built once the KV cache is bound, and calls it one way for both:

    inputs = StepInputs(ids, positions, common, fed)
    if graph.eager_inputs: the runner builds the eager forward's tensors into inputs first
    hidden = graph.run(inputs)         # None: not this step's graph, the eager forward runs

A graph whose run() reads only the host-side inputs (eager_inputs False: CUDA graphs, which
fill static buffers of their own) costs a step it takes no host-to-device copy and no
metadata build beyond its own. reserve_bytes is what the KV budget keeps for the graph's
device memory before the cache is sized (it is built after), graph_bytes what it took.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from engine.attention.backends.base import AttentionBackend, AttentionMetadata
    from engine.attention.metadata import CommonAttentionMetadata
    from engine.models.pipeline import IntermediateTensors


@dataclass(slots=True)
class StepInputs:
    """One step of the flattened batch (decodes first, sorted by context length).

    Host side, always set: the input ids and positions as lists, the flat attention metadata,
    and fed: (rows, values on the device) that replace those rows' input ids, async
    scheduling's placeholders for the last step's sampled ids. Device side, the eager
    forward's: set by the runner before run() for a graph with eager_inputs, else None until
    the eager forward needs them (fed already applied to input_ids)."""

    ids: list[int]
    positions: list[int]
    common: CommonAttentionMetadata
    fed: tuple[torch.Tensor, torch.Tensor] | None = None
    input_ids: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    attn_metadata: AttentionMetadata | None = None
    # pipeline parallelism: a stage after the first gets the previous stage's tensors
    intermediate: IntermediateTensors | None = None


@dataclass(slots=True, frozen=True)
class StepGraphConfig:
    """What a step graph is built (and its memory reserved) for: the runner's, once loaded."""

    backend: AttentionBackend
    device: torch.device
    dtype: torch.dtype  # the model's activations
    hf_config: Any  # the model's config (its sizes: the graphs' reserve)
    num_kv_heads: int  # this rank's
    max_num_seqs: int
    max_model_len: int
    block_size: int
    enforce_eager: bool
    tp_size: int
    log: bool = True  # log what was built or why not (rank 0)
    # speculative decoding: the most query tokens of a verification step (1 + k; for a
    # draft model's own forwards k + 2), whose steps get graphs of their own; 0: none
    verify_len: int = 0
    # mixed and prefill steps: piecewise graphs for steps of up to this many tokens (0: none)
    piece_tokens: int = 0
    what: str = ""  # which model's, in the log (a draft's); "" for the target
    aux_outputs: int = 0  # hidden-sized outputs a row besides the last (EAGLE-3's layers)
    # pipeline parallelism: this rank's stage starts from the embedding / ends with the norm
    first_stage: bool = True
    last_stage: bool = True
    stage_residual: bool = True  # a later stage is given the residual too (not an EAGLE head)


@runtime_checkable
class StepGraph(Protocol):
    """A step the runner runs instead of the eager forward where the graph takes it."""

    # True: run() reads the eager forward's tensors (input_ids, position_ids, attn_metadata),
    # which the runner builds first; False: only the host-side inputs (static buffers of its own).
    eager_inputs: bool
    graph_bytes: int  # device memory the graph holds, measured (0: none)
    takes_lora: bool  # whether steps with LoRA adapters may run here (else they run eagerly)
    # what of a LoRA step it cannot hold (engine.lora.manager.LoRAManager.graph_blockers)
    lora_blockers: frozenset[str]
    # whether the model's aux_hidden_states (an EAGLE-3 head's features) are the step's after
    # run(), as after the eager forward
    keeps_aux_hidden: bool
    # whether it runs a pipeline stage (StepInputs.intermediate in, IntermediateTensors out
    # before the last stage); else build() is not called under pipeline parallelism
    runs_stages: bool

    @classmethod
    def build(cls, model: torch.nn.Module, config: StepGraphConfig) -> StepGraph | None:
        """The graph for a model whose KV cache is bound, or None where it does not fit the
        model, the device or the options (every step then runs eagerly)."""
        ...

    @classmethod
    def reserve_bytes(cls, config: StepGraphConfig) -> int:
        """Device bytes build() will take, kept out of the KV cache's budget beforehand."""
        ...

    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """The final norm's output [rows, hidden] for this step, or None: not taken here (the
        runner runs the eager forward, whose KV writes land on the same slots)."""
        ...

    def close(self) -> None:
        """Release what build() took; the graph runs no step after."""
        ...


def build_eager_inputs(step: StepInputs, backend: AttentionBackend, device: torch.device) -> None:
    """The eager forward's tensors for the step: ids and positions on the device (fed
    applied), the backend's metadata."""
    import torch

    step.attn_metadata = backend.build_metadata(step.common)
    input_ids = torch.tensor(step.ids, dtype=torch.long)
    pos = torch.tensor(step.positions, dtype=torch.long)
    if device.type != "cpu":  # a blocking host-to-device copy would wait for the device's queue
        input_ids = input_ids.to(device, non_blocking=True)
        pos = pos.to(device, non_blocking=True)
    if step.fed is not None:  # the last step's ids, without a trip through the host
        input_ids.index_copy_(0, *step.fed)
    step.input_ids, step.position_ids = input_ids, pos


def run_step(
    graph: StepGraph | None,
    model: torch.nn.Module,
    step: StepInputs,
    eager_inputs: Callable[[StepInputs], None],
) -> torch.Tensor | IntermediateTensors:
    """The step through the graph where it takes it, else the eager forward: the final norm's
    output, or a stage's IntermediateTensors before the last. eager_inputs fills the step's
    device tensors (input_ids, position_ids, attn_metadata)."""
    if graph is not None:  # a graph without eager_inputs fills static buffers of its own
        if graph.eager_inputs:
            eager_inputs(step)
        hidden = graph.run(step)
        if hidden is not None:
            return hidden
    if step.input_ids is None:
        eager_inputs(step)
    if step.intermediate is not None:
        return model(step.input_ids, step.position_ids, step.attn_metadata, step.intermediate)
    return model(step.input_ids, step.position_ids, step.attn_metadata)
