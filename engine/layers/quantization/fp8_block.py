"""Block-wise FP8 checkpoints: `quant_method: "fp8"` with `weight_block_size: [bn, bk]` (Qwen3-
*-FP8, DeepSeek-V3's form: `weight` float8_e4m3fn [N, K], `weight_scale_inv` float32
[ceil(N / bn), ceil(K / bk)]) and compressed-tensors' float-quantized with `strategy: "block"`
(llm-compressor's FP8_BLOCK: the same tensors, the scale named `weight_scale`). Despite its
name, weight_scale_inv multiplies: W[n, k] = weight[n, k] * scale[n // bn, k // bk] (as
transformers' finegrained_fp8 and vLLM's Fp8LinearMethod read it); a last block may be
partial. The checkpoints' dynamic activations (per token group of 128 in FP8_BLOCK) stay in the
model dtype here: more exact than quantizing them.

While loading, each checkpoint's scale blocks are expanded to one row of scales per output row
([N, ceil(K / bk)], engine.kernels.fp8.expand_block_scales): merged layers (q|k|v, gate|up)
whose parts' rows are not block multiples then stack, each part with its own blocks, and a
column-parallel shard may start anywhere. A row-parallel shard must start on a block of K:
with tensor parallelism bk has to divide the shard's inputs, else a start-up error naming
weight_block_size and the size.

After loading:
- CPU: the e4m3 bytes and the row scales stay as they are, 1 byte a weight, on the CPU's FP8
  kernels (engine.kernels.cpu.fp8: the codes widened in the kernel, each block's sum times its
  scale; larger batches on rows decoded to bf16 in cache). Where those do not take the layer
  (a block of K not a multiple of 32, a float16 model, TESSERA_CPU_KERNELS=0) the weight is
  dequantized once into the model dtype (each value times its block's scale in fp32, rounded
  once) for the unquantized layers' GEMMs, at the float weight's bytes.
- CUDA (and the tests' Triton interpreter): the e4m3 bytes and the row scales stay as they
  are, 1 byte a weight, on the block-FP8 Triton GEMM (engine/kernels/triton/fp8_block_gemm.py),
  which dequantizes in its inner loop.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.cpu import fp8 as cpu_fp8
from engine.kernels.fp8 import dequantize_fp8_blocks, expand_block_scales
from engine.layers.quantization.base import (
    LinearMethodBase,
    triton_linear,
    triton_weight,
    wants_triton,
)
from engine.layers.quantization.int_weight import register, register_bias
from engine.layers.quantization.packed import ShardLoader, _out_slice, ignored_loader
from engine.layers.quantization.unquantized import linear_by_rows


def cpu_fp8_weight(q: torch.Tensor, scales: torch.Tensor, group: int | None, dtype: torch.dtype):
    """The CPU's FP8 kernels' form of float8_e4m3fn codes q [N, K] with float32 scales (one a
    row, group None; or [N, ceil(K / group)]), one byte a weight (engine.kernels.cpu.fp8), or
    None where they do not take it: not on the CPU, no kernels (TESSERA_CPU_KERNELS=0), a
    float16 model, K not a multiple of 32 or a block of K not one of 32 (the caller's float
    path then)."""
    n, k = q.shape
    if q.device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return None
    if not cpu_fp8.available() or not cpu_fp8.fits(n, k, k if group is None else group):
        return None
    return cpu_fp8.Fp8Weight.prepare(q, scales, group)


def cpu_fp8_path() -> str:
    """What the CPU's FP8 kernels run here, for a layer's start-up log line."""
    return f"float8 e4m3 codes kept, one byte a weight: {cpu_fp8.describe()}"


def check_row_shard(name: str, field: str, block: tuple[int, int], k: int, tp: int) -> None:
    """A row-parallel shard of k inputs (tp ranks) must start on a block of K."""
    if tp > 1 and k % block[1]:
        raise ValueError(
            f"{name}: quantization_config.{field} = {list(block)}: a block of {block[1]} inputs "
            f"does not tile this layer's tensor-parallel shard ({k} of {k * tp} inputs with "
            f"tensor_parallel_size {tp}); supported: a tensor_parallel_size whose shards are "
            f"multiples of {block[1]}"
        )


class BlockScaleLoader(ShardLoader):
    """weight_loader of the block scales: [ceil(rows / bn), Kb] -> [rows, Kb] (rows: the part's
    full output rows: a merged shard's, all ranks'), then this rank's slice as ShardLoader takes
    it (its rows; a row-parallel rank its blocks of K)."""

    def __init__(self, layer: nn.Module, block_n: int, name: str):
        super().__init__(layer, lambda t: t, name=name)
        self.block_n = block_n

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        layer = self.layer
        _, size = _out_slice(layer, param, shard_id)
        rows = size * layer.tp_size if layer.tp_dim == 0 else size
        try:
            expanded = expand_block_scales(loaded, rows, self.block_n)
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None
        super().__call__(param, expanded, shard_id)


class Fp8BlockLinearMethod(LinearMethodBase):
    """A block-FP8 checkpoint layer (module docstring). scale_name: the checkpoint's scale
    tensor (`weight_scale_inv` or compressed-tensors' `weight_scale`); field: the config field
    start-up errors name. triton: the Triton GEMM (None: on CUDA; True: also for CPU tensors,
    the tests' way under TRITON_INTERPRET=1)."""

    def __init__(self, block: tuple[int, int], scale_name: str, field: str,
                 triton: bool | None = None):  # fmt: skip
        self.block, self.scale_name, self.field, self.triton = block, scale_name, field, triton

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool):
        name = getattr(layer, "prefix", type(layer).__name__)
        n, k = output_size, input_size
        if layer.tp_dim == 1:
            check_row_shard(name, self.field, self.block, k, layer.tp_size)
        register(layer, "weight", torch.zeros(n, k, dtype=torch.float8_e4m3fn),
                 ShardLoader(layer, lambda t: t, name=name))  # fmt: skip
        blocks_k = -(-k // self.block[1])
        register(layer, self.scale_name, torch.zeros(n, blocks_k, dtype=torch.float32),
                 BlockScaleLoader(layer, self.block[0], name))  # fmt: skip
        register(layer, "input_scale", torch.zeros(0), ignored_loader)  # static: unused
        layer.input_scale.optional = True
        register_bias(layer, n, bias)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        dtype = getattr(layer, "model_dtype", torch.get_default_dtype())
        q, scales = layer.weight.data, getattr(layer, self.scale_name).data
        del layer.weight, layer.input_scale
        delattr(layer, self.scale_name)
        bn, bk = self.block
        why = ""
        if wants_triton(self.triton, q.device):
            weight, why = triton_weight("fp8_block_gemm", "Fp8BlockWeight",
                                        lambda cls: cls.prepare(q, scales, bk))  # fmt: skip
            if weight is not None:
                layer.register_parameter("weight", None)
                layer.fp8_block = weight
                layer.quant_path = (
                    f"float8 e4m3 in blocks of [{bn}, {bk}], dequantized in the Triton GEMM's "
                    "inner loop (engine/kernels/triton/fp8_block_gemm.py)"
                )
                return
        cpu = cpu_fp8_weight(q, scales, bk, dtype)
        if cpu is not None:
            layer.register_parameter("weight", None)
            layer.fp8_cpu = cpu
            layer.quant_path = f"FP8 blocks of [{bn}, {bk}]: {cpu_fp8_path()}"
            return
        layer.weight = nn.Parameter(dequantize_fp8_blocks(q, scales, bk, dtype),
                                    requires_grad=False)  # fmt: skip
        layer.quant_path = (
            f"FP8 blocks of [{bn}, {bk}] dequantized at load into "
            f"{str(dtype).removeprefix('torch.')} (the float weight's bytes; C GEMM / AMX-bf16 "
            f"/ oneDNN{why})"
        )

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if layer.weight is not None:
            return linear_by_rows(layer, x, layer.weight, bias)
        if hasattr(layer, "fp8_cpu"):
            return cpu_fp8.linear(x, layer.fp8_cpu, bias)
        # float8 for the Triton GEMM (process_weights_after_loading)
        return triton_linear("fp8_block_gemm", "fp8_block_gemm", x, layer.fp8_block, bias)
