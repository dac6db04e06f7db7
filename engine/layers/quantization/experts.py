"""A quantized checkpoint's mixture-of-experts weights (engine.layers.moe.FusedMoE).

Each expert's checkpoint tensors (`...experts.E.gate_proj.weight_packed`, `.weight_scale`, ...)
load into stacked parameters named after the float ones (`w13_weight_packed` [E, 2I, ...],
`w2_weight_scale` [E, H, ...]), this rank's slice of I as FusedMoE's weight_loader takes it.
Two formats:
- FP8 e4m3 weights with per-tensor or per-channel scales (compressed-tensors' float-quantized,
  the `fp8` checkpoint format): on the CPU, as the dense FP8 method does it, the e4m3 values
  exact in the model dtype with the row scales applied after each expert's GEMM (the C GEMM /
  AMX / oneDNN); on CUDA the float8 bytes and float32 row scales go to the fused Triton MoE
  kernel, which widens the weights in its inner loop and scales in its epilogue. Block-wise
  scales (`weight_block_size`, compressed-tensors' block strategy: Fp8BlockExpertsMethod):
  dequantized at load on the CPU; on CUDA the same kernel, the block scales in its inner loop.
- integer weights, 4 or 8 bits, group or channel scales, symmetric or not (compressed-tensors'
  pack-quantized: W4A16 / W8A16): on the CPU each expert's two projections become small layers
  given the dense checkpoints' kernels by finish_int_layer (w4 tiles for int4, int8 rows for
  symmetric channel int8, Q8 tiles, or the grouped fallback), run by FusedMoE.expert_linear over
  the tokens routed to that expert; on CUDA the codes (two 4-bit codes a byte), float32 scales
  and zero points go to the fused Triton kernel, which dequantizes them in its inner loop.
No float copy of a quantized expert is kept (but FP8 on the CPU, whose kernels take no float8:
exact e4m3 values for per-channel scales, the dequantized weights for block scales).
The router stays float: FusedMoE's router is a ReplicatedGate, never quantized.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.layers.moe import DOWN, GATE, UP, GemmChoice
from engine.layers.quantization.packed import ignored_loader
from engine.layers.quantization.unquantized import linear_by_rows

# checkpoint tensors read and dropped (compressed-tensors' weight_shape; static activation
# scales: activations stay in the model dtype, as the dense layers keep them)
IGNORED = ("weight_shape", "input_scale")


class ExpertLoader:
    """weight_loader(param, loaded, (expert, GATE | UP | DOWN)) of a stacked expert tensor:
    `convert` turns the checkpoint tensor into output-major [N, ...] (a one-element tensor is a
    per-tensor value, repeated over the rows); gate / up take this rank's rows of I, down its
    columns of I (codes, or groups of them) where the loaded tensor has more than the rank's."""

    def __init__(self, moe: nn.Module, convert: Callable[[torch.Tensor], torch.Tensor], name: str):
        self.moe, self.convert, self.name = moe, convert, name

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        expert, which = shard_id
        moe, full = self.moe, self.convert(loaded)
        i, rank, tp = moe.inter, moe.tp_rank, moe.tp_size
        dst = param.data[expert]
        if which == DOWN:
            if full.numel() == 1:
                full = full.reshape(1, 1).expand(dst.shape)
            cols = dst.shape[1]
            if tp > 1 and full.dim() == 2 and full.shape[1] == cols * tp:
                full = full.narrow(1, rank * cols, cols)
        else:
            if full.numel() == 1:
                full = full.reshape(1, 1).expand(i * tp, dst.shape[1])
            dst = dst.narrow(0, which * i, i)
            full = full.narrow(0, rank * i, i)
        if dst.shape != full.shape:
            raise ValueError(
                f"{self.name}: expert {expert}'s checkpoint tensor {tuple(loaded.shape)} does not "
                f"fit (loaded as {tuple(full.shape)}, this rank holds {tuple(dst.shape)})"
            )
        dst.copy_(full)


def _register(moe: nn.Module, name: str, tensor: torch.Tensor, loader, optional=False) -> None:
    param = nn.Parameter(tensor, requires_grad=False)
    param.weight_loader = loader
    e = moe.num_experts
    if name.startswith("w13_"):
        param.expected_shards = {(x, s) for x in range(e) for s in (GATE, UP)}
    else:
        param.expected_shards = {(x, DOWN) for x in range(e)}
    param.optional = optional
    setattr(moe, name, param)


def _register_ignored(moe: nn.Module) -> None:
    for side in ("w13", "w2"):
        for t in IGNORED:
            _register(moe, f"{side}_{t}", torch.zeros(0), ignored_loader, optional=True)


def _shapes(moe: nn.Module) -> dict[str, tuple[int, int]]:
    """{"w13": (N, K), "w2": (N, K)} of one expert on this rank."""
    hidden = moe.hidden_size
    return {"w13": (2 * moe.inter, hidden), "w2": (hidden, moe.inter)}


class ExpertsMethod:
    """How a FusedMoE holds a checkpoint's quantized experts: create_weights before loading
    (the checkpoint's tensors, stacked), process_weights_after_loading after (the kernels'
    form; returns the path, for the start-up log)."""

    def create_weights(self, moe: nn.Module) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, moe: nn.Module) -> str:
        raise NotImplementedError


class Fp8ExpertsMethod(ExpertsMethod):
    """float8_e4m3fn `weight` [N, K] with `weight_scale` per tensor or per output row."""

    def create_weights(self, moe: nn.Module) -> None:
        name = getattr(moe, "prefix", "experts")
        e = moe.num_experts
        for side, (n, k) in _shapes(moe).items():
            _register(moe, f"{side}_weight", torch.zeros(e, n, k, dtype=torch.float8_e4m3fn),
                      ExpertLoader(moe, lambda t: t, name))  # fmt: skip
            _register(moe, f"{side}_weight_scale", torch.zeros(e, n, 1, dtype=torch.float32),
                      ExpertLoader(moe, lambda t: t.float().reshape(-1, 1), name))  # fmt: skip
        _register_ignored(moe)

    def process_weights_after_loading(self, moe: nn.Module) -> str:
        dtype = moe.model_dtype
        q13, q2 = moe.w13_weight.data, moe.w2_weight.data
        s13, s2 = moe.w13_weight_scale.data[..., 0], moe.w2_weight_scale.data[..., 0]
        for side in ("w13", "w2"):
            delattr(moe, f"{side}_weight_scale")
            for t in IGNORED:
                delattr(moe, f"{side}_{t}")
        if q13.device.type == "cuda":
            moe.fused_quantized = FusedFp8Experts(q13, q2, s13, s2)
            return "float8 e4m3 experts on the fused Triton MoE kernel (row scales in its epilogue)"
        moe.w13_weight = nn.Parameter(q13.to(dtype), requires_grad=False)  # exact values
        moe.w2_weight = nn.Parameter(q2.to(dtype), requires_grad=False)
        moe.expert_linear = ScaledExperts(moe.w13_weight.data, moe.w2_weight.data, s13, s2)
        return (
            f"e4m3 experts exact in {str(dtype).removeprefix('torch.')}, row scales after each "
            "expert's GEMM (C GEMM / AMX-bf16 / oneDNN)"
        )


class ScaledExperts:
    """FusedMoE.expert_linear of FP8 experts on the CPU: x @ w[e]^T on the unquantized layers'
    GEMMs, times the float32 row scales s[e]."""

    def __init__(self, w13, w2, s13, s2):
        self.weights, self.scales = (w13, w2), (s13.float(), s2.float())
        self.gemms = (GemmChoice(), GemmChoice())

    def __call__(self, expert: int, which: int, x: torch.Tensor) -> torch.Tensor:
        i = 1 if which == DOWN else 0
        y = linear_by_rows(self.gemms[i], x, self.weights[i][expert], None)
        return (y.float() * self.scales[i][expert]).to(x.dtype)


class FusedFp8Experts:
    """FusedMoE.fused_quantized of FP8 experts on CUDA: row scales [E, N] (block_k 0), or one
    row of block scales per output row [E, N, ceil(K / block_k)]."""

    def __init__(self, q13, q2, s13, s2, block_k: int = 0):
        self.q13, self.q2, self.block_k = q13, q2, block_k
        self.s13, self.s2 = s13.float().contiguous(), s2.float().contiguous()

    def __call__(self, x, topk_weights, topk_ids) -> torch.Tensor:
        from engine.kernels.triton.fused_moe import ExpertWeights, fused_experts_quantized

        w13 = ExpertWeights(self.q13, self.s13, group=self.block_k)
        w2 = ExpertWeights(self.q2, self.s2, group=self.block_k)
        return fused_experts_quantized(x, w13, w2, topk_weights, topk_ids)


class Fp8BlockExpertsMethod(ExpertsMethod):
    """Block-FP8 experts (Qwen3-30B-A3B-FP8's form; engine.layers.quantization.fp8_block):
    float8_e4m3fn `weight` [N, K] with scales [ceil(N / bn), ceil(K / bk)] (`scale_name`),
    expanded to one row of scales per output row as they load (a gate / up shard of I may then
    end anywhere; down's K shard must start on a block). CPU: dequantized at load into the model
    dtype, one expert at a time, and run as float experts (the float weights' bytes). CUDA: the
    bytes and row scales go to the fused Triton MoE kernel, which scales each weight by its
    block's scale in its inner loop (no float copy)."""

    def __init__(self, block: tuple[int, int], scale_name: str, field: str):
        self.block, self.scale_name, self.field = block, scale_name, field

    def create_weights(self, moe: nn.Module) -> None:
        from engine.kernels.fp8 import expand_block_scales
        from engine.layers.quantization.fp8_block import check_row_shard

        name = getattr(moe, "prefix", "experts")
        e, (bn, bk) = moe.num_experts, self.block
        check_row_shard(f"{name} (down)", self.field, self.block, moe.inter, moe.tp_size)
        full_rows = {
            "w13": moe.inter * moe.tp_size,
            "w2": moe.hidden_size,
        }  # one part's, all ranks'

        def expand(rows: int):
            return lambda t: expand_block_scales(t, rows, bn)

        for side, (n, k) in _shapes(moe).items():
            _register(moe, f"{side}_weight", torch.zeros(e, n, k, dtype=torch.float8_e4m3fn),
                      ExpertLoader(moe, lambda t: t, name))  # fmt: skip
            scales = torch.zeros(e, n, -(-k // bk), dtype=torch.float32)
            _register(moe, f"{side}_{self.scale_name}", scales,
                      ExpertLoader(moe, expand(full_rows[side]), name))  # fmt: skip
        _register_ignored(moe)

    def process_weights_after_loading(self, moe: nn.Module) -> str:
        from engine.kernels.fp8 import dequantize_fp8_blocks

        dtype, (bn, bk) = moe.model_dtype, self.block
        q13, q2 = moe.w13_weight.data, moe.w2_weight.data
        s13 = getattr(moe, f"w13_{self.scale_name}").data
        s2 = getattr(moe, f"w2_{self.scale_name}").data
        for side in ("w13", "w2"):
            delattr(moe, f"{side}_{self.scale_name}")
            for t in IGNORED:
                delattr(moe, f"{side}_{t}")
        if q13.device.type == "cuda":
            moe.fused_quantized = FusedFp8Experts(q13, q2, s13, s2, bk)
            return (
                f"float8 e4m3 experts in blocks of [{bn}, {bk}] on the fused Triton MoE kernel "
                "(block scales in its inner loop)"
            )
        for side, q, s in (("w13", q13, s13), ("w2", q2, s2)):
            w = torch.empty(q.shape, dtype=dtype, device=q.device)
            for x in range(q.shape[0]):  # one expert's float32 intermediates at a time
                w[x] = dequantize_fp8_blocks(q[x], s[x], bk, dtype)
            setattr(moe, f"{side}_weight", nn.Parameter(w, requires_grad=False))
        return (
            f"FP8 experts in blocks of [{bn}, {bk}] dequantized at load into "
            f"{str(dtype).removeprefix('torch.')} (the float experts' bytes and kernels)"
        )


class IntExpertsMethod(ExpertsMethod):
    """Integer weight-only experts in a dense format's tensors (`dense`, an IntWeightOnlyMethod:
    its CODES / SCALES / ZEROS names and its convert_* into the output-major loading layout):
    compressed-tensors' pack-quantized `weight_packed` / `weight_scale` / `weight_zero_point`,
    GPTQ's and AWQ's `qweight` / `scales` / `qzeros` (a GPTQ `g_idx` without act-order is read
    and dropped: the trivial order)."""

    def __init__(self, dense):
        self.dense = dense
        self.bits, self.group_size = dense.bits, dense.group_size
        self.names = {"codes": dense.CODES, "scales": dense.SCALES, "zeros": dense.ZEROS}

    def _codes(self, t: torch.Tensor) -> torch.Tensor:
        return self.dense.convert_codes(t)

    def create_weights(self, moe: nn.Module) -> None:
        name = getattr(moe, "prefix", "experts")
        e, dense, names = moe.num_experts, self.dense, self.names
        for side, (n, k) in _shapes(moe).items():
            group = k if self.group_size <= 0 else self.group_size
            if k % group:
                where = "I of a tensor-parallel shard" if side == "w2" else "the hidden size"
                raise ValueError(
                    f"{name}: quantization_config group_size {self.group_size} does not divide "
                    f"the experts' input features ({where}: {k})"
                )
            g = k // group
            _register(moe, f"{side}_{names['codes']}", torch.zeros(e, n, k, dtype=torch.uint8),
                      ExpertLoader(moe, self._codes, name))  # fmt: skip
            _register(moe, f"{side}_{names['scales']}", torch.zeros(e, n, g, dtype=torch.float32),
                      ExpertLoader(moe, dense.convert_scales, name))  # fmt: skip
            if names["zeros"]:
                z = torch.full((e, n, g), 1 << (self.bits - 1), dtype=torch.int32)
                _register(moe, f"{side}_{names['zeros']}", z,
                          ExpertLoader(moe, dense.convert_zeros, name))  # fmt: skip
            if dense.G_IDX:  # GPTQ without act-order: the trivial order, dropped
                _register(moe, f"{side}_{dense.G_IDX}", torch.zeros(0), ignored_loader, True)
            # the float weight is replaced by the codes
            moe.register_parameter(f"{side}_weight", None)
        _register_ignored(moe)

    def process_weights_after_loading(self, moe: nn.Module) -> str:
        parts, names = {}, self.names
        for side, (_, k) in _shapes(moe).items():
            codes = getattr(moe, f"{side}_{names['codes']}").data
            scales = getattr(moe, f"{side}_{names['scales']}").data
            zeros = getattr(moe, f"{side}_{names['zeros']}").data if names["zeros"] else None
            if zeros is not None and bool((zeros == (1 << (self.bits - 1))).all()):
                zeros = None  # symmetric after all (GPTQ stores symmetric zero points)
            group = k if self.group_size <= 0 else self.group_size
            parts[side] = (codes, scales, zeros, group)
            for t in (*names.values(), self.dense.G_IDX, *IGNORED):
                if t and hasattr(moe, f"{side}_{t}"):
                    delattr(moe, f"{side}_{t}")
        if parts["w13"][0].device.type == "cuda":
            moe.fused_quantized = FusedIntExperts(parts, self.bits)
            return (
                f"int{self.bits} experts on the fused Triton MoE kernel (dequantized in its "
                "inner loop)"
            )
        layers = IntExperts(parts, self.bits, moe.model_dtype)
        moe.expert_layers = layers  # a submodule: the kernels' tensors are the model's
        moe.expert_linear = layers.linear
        return layers.path


class ExpertProjection(nn.Module):
    """One expert's gate_up or down as a small layer that finish_int_layer gives a dense
    checkpoint layer's kernel (its quant_method and tensors)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.model_dtype = dtype
        self.register_parameter("bias", None)


class IntExperts(nn.ModuleList):
    """FusedMoE.expert_linear of integer experts on the CPU: 2E ExpertProjections, each on the
    kernel its scheme and shape map onto (engine.layers.quantization.int_weight)."""

    def __init__(self, parts: dict, bits: int, dtype: torch.dtype):
        from engine.layers.quantization.int_weight import finish_int_layer

        super().__init__()
        paths = []
        for side in ("w13", "w2"):
            codes, scales, zeros, group = parts[side]
            for e in range(codes.shape[0]):
                layer = ExpertProjection(dtype)
                z = None if zeros is None else zeros[e]
                paths.append(finish_int_layer(layer, codes[e], scales[e], z, None, bits, group))
                self.append(layer)
        self.num_experts = codes.shape[0]
        self.path = "; ".join(sorted(set(paths)))

    def linear(self, expert: int, which: int, x: torch.Tensor) -> torch.Tensor:
        layer = self[expert + (self.num_experts if which == DOWN else 0)]
        return layer.quant_method.apply(layer, x)


class FusedIntExperts:
    """FusedMoE.fused_quantized of integer experts on CUDA: codes (4-bit: two a byte, k even in
    the low nibble), float32 scales and zero points [E, N, G] for the fused Triton kernel."""

    def __init__(self, parts: dict, bits: int):
        from engine.kernels.triton.fused_moe import ExpertWeights

        self.weights = []
        for side in ("w13", "w2"):
            codes, scales, zeros, group = parts[side]
            if bits == 4:
                codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
            self.weights.append(
                ExpertWeights(
                    codes.contiguous(),
                    scales.float().contiguous(),
                    None if zeros is None else zeros.to(torch.int32).contiguous(),
                    bits,
                    group,
                )  # fmt: skip
            )

    def __call__(self, x, topk_weights, topk_ids) -> torch.Tensor:
        from engine.kernels.triton.fused_moe import fused_experts_quantized

        return fused_experts_quantized(x, *self.weights, topk_weights, topk_ids)
