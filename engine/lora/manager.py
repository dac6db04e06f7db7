"""The runner's side of multi-LoRA: resident slots, the LRU of loaded adapters, a step's
mapping.

    manager = LoRAManager(model, hf_config, lora_config, dtype, device)   # after quantizing
    active = manager.prepare([(lora_request or None, first_row, rows), ...])  # every step

    last = hidden.index_select(0, manager.head_rows(rows))  # before each LM-head call
    manager.end_forward()                                     # after the step's forward

`prepare` puts every adapter of the step into a slot (a free one, else the least recently
used one that this step does not need), loading it from the CPU cache (max_cpu_loras
adapters, least recently used evicted) or from its folder, then sets the shared LoRABatch.
The scheduler never mixes more than max_loras adapters in a step, so slots always suffice.

A MoE layer's experts get an ExpertsLoRA (engine.lora.experts): per slot, the adapter's
experts' A/B as loaded (no slot is preallocated); its deltas apply in the experts' loop.

The embedding's deltas apply between prepare and end_forward (not to a draft proposer's
ids); the LM head's to the one call after head_rows, on the step rows it names (a call
without it, a proposer's, gets the base head).

A DoRA adapter's scales g = m / ||W + s B A|| (engine.lora.adapter) are made once per load,
here, from the base weights as served (float weights only): a column-parallel layer's rows
are whole on this rank; a row-parallel layer's norm sums the ranks' partial squares (an
all-reduce: every rank loads the same adapters in the same order, as it runs the same steps).
`graph_blockers` names what of the step's adapters a step graph may not hold: "dora" (the
rescaling is the modules'), "embedding" and "experts" (their deltas group rows on the host);
each graph says which it cannot take (the CPU decode plan: DoRA; CUDA graphs: all three), and
such a step runs eagerly.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict

import torch
from torch import nn

from engine.config import LoRAConfig
from engine.distributed import get_ep_rank_size, get_tp_rank, get_tp_size, tp_all_reduce
from engine.kernels.cpu import lora as cpu_lora
from engine.layers.moe import FusedMoE
from engine.layers.quantization.unquantized import UnquantizedLinearMethod
from engine.lora.adapter import (
    MODEL_LAYER,
    ROW_PARALLEL,
    SHARED,
    SLICES,
    AdapterShard,
    read_adapter,
    vocab_shard,
)
from engine.lora.experts import LAYER as EXPERTS
from engine.lora.experts import ExpertsLoRA
from engine.lora.layers import LoRABatch, LoRAEmbedding, LoRALayer
from engine.lora.request import LoRARequest
from engine.models.hf_config import HFModelConfig

logger = logging.getLogger("tessera.engine")
DORA_ROWS = 1024  # output rows per step of DoRA's norms at load


def lora_kernel(device: torch.device) -> str:
    """On the CPU the C kernel (engine.kernels.cpu.lora) where the CPU kernels are built, else
    torch (grouped matmuls); the Triton shrink/expand kernels on CUDA where triton imports.
    TESSERA_LORA_KERNEL=torch forces the reference; =cpu the C kernel; =triton the Triton
    kernels on any device (the tests, on CPU tensors under TRITON_INTERPRET=1)."""
    forced = os.environ.get("TESSERA_LORA_KERNEL")
    if forced in ("torch", "cpu", "triton"):
        return forced
    if device.type != "cuda":
        return "cpu" if cpu_lora.available() else "torch"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "torch"
    return "triton"


def _linear(decoder: nn.Module, name: str) -> nn.Module | None:
    """A decoder layer's linear layer of that name (engine.lora.adapter.SLICES), or None."""
    if name.startswith(SHARED):  # a MoE layer's shared expert (Qwen2-MoE)
        owner = getattr(decoder.mlp, "shared_expert", None)
        name = name.removeprefix(SHARED)
    else:
        owner = decoder.self_attn if name in ("qkv_proj", "o_proj") else decoder.mlp
    return getattr(owner, name, None)


def _slices(layer: nn.Module, name: str) -> list[tuple[int, int]]:
    """(first row, rows) of each slice of a layer's output on this rank."""
    tp = get_tp_size()
    name = name.removeprefix(SHARED)
    if name == "qkv_proj":
        q = layer.num_heads * layer.head_dim
        kv = layer.num_kv_heads * layer.head_dim
        return [(0, q), (q, kv), (q + kv, kv)]
    if name == "gate_up_proj":
        i = layer.output_sizes[0] // tp
        return [(0, i), (i, i)]
    return [(0, layer.output_size)]


def _row_squares(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each row's sum of squares of W + B A in float32, DORA_ROWS rows at a time (a large
    layer's float32 copy is never whole: 14336 x 4096 would be 235 MB)."""
    a, b = a.to(w.device, torch.float32), b.to(w.device, torch.float32)
    out = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for i in range(0, w.shape[0], DORA_ROWS):
        part = w[i : i + DORA_ROWS].float() + b[i : i + DORA_ROWS] @ a
        out[i : i + DORA_ROWS] = part.square().sum(dim=1)
    return out


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        hf_config: HFModelConfig,
        config: LoRAConfig,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config
        self.hf_config = hf_config
        self.batch = LoRABatch(device, lora_kernel(device))
        # the slots' dtype: the model's on CUDA; on the CPU the C kernel's (bf16 for a bf16
        # model), float32 for the torch path (engine.lora.layers)
        if self.batch.kernel == "triton":
            self.dtype = dtype
        elif self.batch.kernel == "cpu":
            self.dtype = cpu_lora.slot_dtype(dtype)
        else:
            self.dtype = torch.float32
        self.layers: dict[tuple[int, str], LoRALayer] = {}
        self._linears: dict[tuple[int, str], nn.Module] = {}  # the base layers (DoRA's W)
        self._experts: list[ExpertsLoRA] = []  # the MoE layers' slots
        for i, decoder in enumerate(model.model.layers):
            experts = getattr(decoder.mlp, "experts", None)
            if isinstance(experts, FusedMoE):
                experts.lora = ExpertsLoRA(
                    self.batch, config.max_loras, self.dtype, device, experts.num_local_experts
                )
                self.layers[(i, EXPERTS)] = experts.lora  # type: ignore[assignment]
                self._experts.append(experts.lora)
            for name in SLICES:
                layer = _linear(decoder, name)
                if layer is None or not hasattr(layer, "lora_active"):
                    continue  # a mixture of experts: no dense gate_up / down
                state = LoRALayer(
                    self.batch,
                    _slices(layer, name),
                    layer.input_size,
                    config.max_loras,
                    config.max_lora_rank,
                    self.dtype,
                    device,
                )
                layer.lora = state
                self.layers[(i, name)] = state
                self._linears[(i, name)] = layer
        self._attach_vocab_layers(model, hf_config, device)
        self._row_slot: list[int] = []  # the step's rows -> slot (-1: the base model)
        self.slots: list[int | None] = [None] * config.max_loras  # lora_int_id per slot
        self._slot_use: OrderedDict[int, None] = OrderedDict(
            (s, None) for s in range(config.max_loras)
        )
        self._cpu: OrderedDict[int, AdapterShard] = OrderedDict()  # lora_int_id -> its shard
        self._slot_dora = [False] * config.max_loras  # whether a slot holds a DoRA adapter
        self.graph_blockers: set[str] = set()  # what of this step a step graph may not hold
        self.num_loads = 0  # adapters read from their folders (tests, logs)
        self.num_swaps = 0  # adapters copied into a slot

    def _attach_vocab_layers(
        self, model: nn.Module, cfg: HFModelConfig, device: torch.device
    ) -> None:
        """Slots on the embedding (a first pipeline stage's) and on the LM head (a last
        stage's), each over this rank's vocabulary shard."""
        from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding

        config, rank = self.config, get_tp_rank()
        start, _, shard = vocab_shard(cfg.vocab_size, rank, get_tp_size())
        self.embedding: LoRAEmbedding | None = None
        self.head: LoRALayer | None = None
        embed = getattr(model.model, "embed_tokens", None)
        if isinstance(embed, VocabParallelEmbedding):
            self.embedding = LoRAEmbedding(
                self.batch, start, shard, cfg.hidden_size,
                config.max_loras, config.max_lora_rank, self.dtype, device,
            )  # fmt: skip
            embed.lora = self.embedding
            self.layers[(MODEL_LAYER, "embed_tokens")] = self.embedding  # type: ignore[assignment]
        head = getattr(model, "lm_head", None)
        if isinstance(head, ParallelLMHead):
            self.head_batch = LoRABatch(device, self.batch.kernel)
            self.head = LoRALayer(
                self.head_batch, [(0, shard)], cfg.hidden_size,
                config.max_loras, config.max_lora_rank, self.dtype, device,
            )  # fmt: skip
            head.lora = self.head
            self.layers[(MODEL_LAYER, "lm_head")] = self.head

    # -- adapters -----------------------------------------------------------------------

    def _load(self, request: LoRARequest) -> AdapterShard:
        """This rank's weights of an adapter: from the CPU cache, else read from its folder."""
        cached = self._cpu.get(request.lora_int_id)
        if cached is not None:
            self._cpu.move_to_end(request.lora_int_id)
            return cached
        adapter = read_adapter(request.lora_path, self.hf_config, self.config.max_lora_rank)
        # float32 until DoRA's norms are taken, then the slots' dtype
        shard = adapter.shard(
            self.hf_config, get_tp_rank(), get_tp_size(), torch.float32,
            expert_parallel=get_ep_rank_size()[1] > 1,
        )  # fmt: skip
        self._dora_scales(shard, request.lora_path)
        shard = shard.cast(self.dtype)
        self.num_loads += 1
        while len(self._cpu) >= self.config.max_cpu_loras:
            evicted, _ = self._cpu.popitem(last=False)
            logger.debug("LoRA adapter %d evicted from the CPU cache", evicted)
        self._cpu[request.lora_int_id] = shard
        return shard

    def remove(self, lora_int_id: int) -> None:
        """Forget an adapter: its CPU copy and its slot."""
        self._cpu.pop(lora_int_id, None)
        for slot, held in enumerate(self.slots):
            if held == lora_int_id:
                self._fill(slot, None, None)

    def _dora_scales(self, shard: AdapterShard, path: str) -> None:
        """shard.scales from its magnitudes: g = m / ||W + s B A|| per output row, the norm
        over the whole input (a row-parallel layer's partial sums of squares all-reduced)."""
        for key, mags in shard.magnitudes.items():
            linear, state = self._linears[key], self.layers[key]
            weight = getattr(linear, "weight", None)
            if not isinstance(linear.quant_method, UnquantizedLinearMethod) or weight is None:
                raise ValueError(
                    f"LoRA adapter {path!r}: use_dora: DoRA over quantized base weights "
                    f"({type(linear.quant_method).__name__}) is not supported"
                )
            scales: list[torch.Tensor | None] = []
            for (row, size), ab, m in zip(state.slices, shard.weights[key], mags, strict=True):
                if m is None or ab is None:
                    scales.append(None)
                    continue
                squares = _row_squares(weight[row : row + size], *ab)
                if key[1] in ROW_PARALLEL:
                    squares = tp_all_reduce(squares)
                scales.append(m.to(weight.device) / squares.sqrt())
            shard.scales[key] = scales

    def _fill(self, slot: int, lora_int_id: int | None, shard: AdapterShard | None) -> None:
        for key, layer in self.layers.items():
            if shard is None:
                layer.set_slot(slot, None)
            elif isinstance(layer, LoRALayer):
                layer.set_slot(slot, shard.weights.get(key), shard.scales.get(key))
            else:
                layer.set_slot(slot, shard.weights.get(key))
        self.slots[slot] = lora_int_id
        self._slot_dora[slot] = shard is not None and bool(shard.scales)

    def _slot_for(self, request: LoRARequest, needed: set[int]) -> int:
        lid = request.lora_int_id
        if lid in self.slots:
            slot = self.slots.index(lid)
        else:
            # a free slot first, else the least recently used one this step does not need
            free = [s for s in self._slot_use if self.slots[s] is None]
            victims = free or [s for s in self._slot_use if self.slots[s] not in needed]
            if not victims:
                raise RuntimeError(
                    f"a step needs more than max_loras ({self.config.max_loras}) adapters"
                )
            slot = victims[0]
            self._fill(slot, lid, self._load(request))
            self.num_swaps += 1
        self._slot_use.move_to_end(slot)
        return slot

    # -- a step -------------------------------------------------------------------------

    def prepare(self, rows: list[tuple[LoRARequest | None, int, int]]) -> bool:
        """Make the step's adapters resident and set the token mapping; whether any row of
        the step has an adapter (then it runs eagerly)."""
        needed = {req.lora_int_id for req, _, _ in rows if req is not None}
        self._row_slot = []
        self.graph_blockers = set()
        if self.head is not None:
            self.head_batch.clear()
        if not needed:
            self.batch.clear()
            return False
        slot_of: dict[int, int] = {}
        ranges = []
        self._row_slot = [-1] * max(start + n for _, start, n in rows)
        for req, start, n in rows:
            if req is None:
                continue
            slot = slot_of.get(req.lora_int_id)
            if slot is None:
                slot = slot_of[req.lora_int_id] = self._slot_for(req, needed)
            ranges.append((slot, start, n))
            self._row_slot[start : start + n] = [slot] * n
        self.batch.set(ranges)
        slots = list(slot_of.values())
        self.batch.dora = any(self._slot_dora[slot] for slot in slots)
        if self.embedding is not None:
            self.embedding.armed = True
        if self.batch.dora:
            self.graph_blockers.add("dora")
        if self.embedding is not None and any(self.embedding.rank[s] for s in slots):
            self.graph_blockers.add("embedding")
        if any(e.weights[s] is not None for e in self._experts for s in slots):
            self.graph_blockers.add("experts")
        return True

    def end_forward(self) -> None:
        """The step's forward is done: later embedding calls (a proposer's) get no delta."""
        if self.embedding is not None:
            self.embedding.armed = False

    def head_rows(self, rows: list[int]) -> list[int]:
        """Set the LM head's next call to these rows of the step's hidden states, in order
        (each with its request's adapter); returns rows, for the caller's index_select."""
        if self.head is None:
            return rows
        width, row_slot = self.head.width, self._row_slot
        ranges = []
        for i, row in enumerate(rows):
            slot = row_slot[row] if row < len(row_slot) else -1
            if slot >= 0 and width[slot]:
                ranges.append((slot, i, 1))
        self.head_batch.set(ranges)
        return rows
