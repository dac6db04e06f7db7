"""Linear layers with tensor parallelism inside (nano-vllm style).

Each parameter carries a ``weight_loader(param, loaded_weight[, shard_id])`` that copies this
rank's slice of a full checkpoint tensor. ColumnParallel splits output features (no
communication), RowParallel splits input features and all-reduces its output. How the weights
are stored and multiplied is the layer's `quant_method` (engine.layers.quantization):
unquantized until the loader's quantize_model gives it another.

A layer may carry a LoRA state (`lora`, engine.lora.layers.LoRALayer, attached by the runner
when LoRA is enabled): its per-adapter deltas are added to the layer's own product, before a
row-parallel layer's all-reduce, which then sums the ranks' partial deltas too. A DoRA
adapter's rows are then rescaled (`lora.rescale`: after that all-reduce, the bias apart).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed import get_tp_rank, get_tp_size, tp_all_reduce
from engine.layers.quantization.base import LinearMethodBase
from engine.layers.quantization.unquantized import UnquantizedLinearMethod


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({d})")
    return n // d


class LinearBase(nn.Module):
    """y = x W^T (+ b); tp_dim is the weight dimension split across ranks (None: replicated)."""

    lora = None  # a LoRALayer (engine.lora.layers) when LoRA is enabled

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size  # this rank's
        self.tp_dim = tp_dim
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.quant_method: LinearMethodBase = UnquantizedLinearMethod()
        self.quant_method.create_weights(self, input_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if self.tp_dim is not None and param.dim() > self.tp_dim:
            size = param.size(self.tp_dim)
            loaded = loaded.narrow(self.tp_dim, self.tp_rank * size, size)
        _copy(param, loaded)

    @property
    def lora_active(self) -> bool:
        """Whether this step adds LoRA deltas here (a fused path over it must step aside)."""
        return self.lora is not None and self.lora.active

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias)
        if self.lora is not None:
            y = self.lora.rescale(self.lora.apply(x, y), self.bias)
        return y


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, tp_dim=None)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; the output stays sharded."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        tp = get_tp_size()
        super().__init__(input_size, _divide(output_size, tp, "output size"), bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one matmul (gate_up): shard i loads its slice."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int
    ) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        loaded = loaded.narrow(0, self.tp_rank * size, size)
        _copy(param.narrow(0, offset, size), loaded)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; each rank holds its heads of each."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
    ):
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "num_attention_heads")
        self.num_kv_heads = _divide(num_kv_heads, tp, "num_key_value_heads")
        output_size = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str
    ) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[
            shard_id
        ]
        loaded = loaded.narrow(0, self.tp_rank * size, size)
        _copy(param.narrow(0, offset, size), loaded)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with all_reduce.

    The bias is added once, after the reduction, so it is not counted tp_size times.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        tp = get_tp_size()
        super().__init__(_divide(input_size, tp, "input size"), output_size, bias, tp_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        y = self.quant_method.apply(self, x, None)
        if self.lora is not None:  # A split on the input: the all-reduce sums the deltas too
            y = self.lora.apply(x, y)
        y = tp_all_reduce(y)
        if self.lora is not None:  # DoRA's scale: on the whole (reduced) output, before the bias
            y = self.lora.rescale(y, None)
        return y if self.bias is None else y + self.bias


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"weight shape mismatch: checkpoint {tuple(src.shape)}, model {tuple(dst.shape)}"
        )
    dst.data.copy_(src)
