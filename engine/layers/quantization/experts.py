"""A quantized checkpoint's mixture-of-experts weights (engine.layers.moe.FusedMoE).

Each expert's checkpoint tensors (`...experts.E.gate_proj.weight_packed`, `.weight_scale`, ...)
load into stacked parameters named after the float ones (`w13_weight_packed` [E, 2I, ...],
`w2_weight_scale` [E, H, ...]), this rank's slice of I as FusedMoE's weight_loader takes it.
Two formats:
- FP8 e4m3 weights with per-tensor or per-channel scales (compressed-tensors' float-quantized,
  the `fp8` checkpoint format): on the CPU, as the dense FP8 method does it, each expert's
  e4m3 bytes and row scales on the CPU's FP8 kernels (CpuFp8Experts; where those do not take
  them, the e4m3 values exact in the model dtype with the row scales applied after each
  expert's GEMM); on CUDA the float8 bytes and float32 row scales go to the fused Triton MoE
  kernel, which widens the weights in its inner loop and scales in its epilogue. Block-wise
  scales (`weight_block_size`, compressed-tensors' block strategy: Fp8BlockExpertsMethod): on
  the CPU's FP8 kernels too (else dequantized at load); on CUDA the same kernel, the block
  scales in its inner loop.
- integer weights, 4 or 8 bits, group or channel scales, symmetric or not (compressed-tensors'
  pack-quantized: W4A16 / W8A16; GPTQ; AWQ), act-order included (GPTQ desc_act, compressed-
  tensors' actorder "group": each expert's own g_idx), and int8 weights with int8 activations
  (compressed-tensors' int-quantized: W8A8): on the CPU each expert's two projections become
  small layers given the dense checkpoints' kernels by finish_int_layer (w4 tiles for int4 —
  act-order's rows sorted by group, x's columns gathered per call —, int8 rows for symmetric
  channel int8 — W8A8's int8 activations from a few rows —, Q8 tiles, or the grouped
  fallback), run by FusedMoE.expert_linear over the tokens routed to that expert; on CUDA the
  codes (two 4-bit codes a byte), float32 scales and zero points go to the fused Triton
  kernel, which dequantizes them in its inner loop (act-order: rows sorted by group at load,
  x's / the activation's columns read through each expert's permutation; W8A8: weight-only
  there, the activations stay in the model dtype).
No float copy of a quantized expert is kept (but FP8 on the CPU where its kernels do not take
the experts: exact e4m3 values for per-channel scales, the dequantized weights for blocks).
The router stays float: FusedMoE's router is a ReplicatedGate, never quantized.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.kernels.cpu import fp8 as cpu_fp8
from engine.layers.moe import DOWN, GATE, UP, GemmChoice
from engine.layers.quantization.fp8_block import cpu_fp8_path, cpu_fp8_weight
from engine.layers.quantization.packed import ignored_loader
from engine.layers.quantization.unquantized import linear_by_rows

# checkpoint tensors read and dropped (compressed-tensors' weight_shape; static activation
# scales: activations stay in the model dtype, as the dense layers keep them)
IGNORED = ("weight_shape", "input_scale")


class ExpertLoader:
    """weight_loader(param, loaded, (expert, GATE | UP | DOWN)) of a stacked expert tensor:
    `convert` turns the checkpoint tensor into output-major [N, ...] (a one-element tensor is a
    per-tensor value, repeated over the rows); gate / up take this rank's rows of I, down its
    columns of I (codes, or groups of them) where the loaded tensor has more than the rank's;
    under expert parallelism (whole experts, moe.inter_slices 1) another rank's expert is
    skipped."""

    def __init__(self, moe: nn.Module, convert: Callable[[torch.Tensor], torch.Tensor], name: str):
        self.moe, self.convert, self.name = moe, convert, name

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        expert, which = shard_id
        moe = self.moe
        if moe.local_expert(expert) is None:
            return  # another rank's expert
        full = self.convert(loaded)
        i, rank, tp = moe.inter, moe.slice_rank, moe.inter_slices
        dst = param.data[moe.local_expert(expert)]
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


def _register_ignored(moe: nn.Module, extra: tuple[str, ...] = ()) -> None:
    for side in ("w13", "w2"):
        for t in (*IGNORED, *extra):
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
        e = moe.num_local_experts
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
        cpu = CpuFp8Experts.prepare(q13, q2, s13, s2, None, dtype)
        if cpu is not None:
            return cpu.install(moe, "float8 e4m3 experts")
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


class CpuFp8Experts:
    """FusedMoE.expert_linear of FP8 experts on the CPU's FP8 kernels (engine.kernels.cpu.fp8):
    each expert's e4m3 codes and scales as they loaded (views of the stacked tensors), one byte
    a weight; weights[0] gate_up's, weights[1] down's, one per local expert."""

    def __init__(self, weights: tuple[list, list]):
        self.weights = weights

    @classmethod
    def prepare(cls, q13, q2, s13, s2, group: int | None, dtype) -> CpuFp8Experts | None:
        """None where the kernels do not take every expert (fp8_block.cpu_fp8_weight)."""
        sides = []
        for q, s in ((q13, s13), (q2, s2)):
            side = [cpu_fp8_weight(q[e], s[e], group, dtype) for e in range(q.shape[0])]
            if any(w is None for w in side):
                return None
            sides.append(side)
        return cls((sides[0], sides[1]))

    def install(self, moe: nn.Module, what: str) -> str:
        """Hand the experts to moe (no float stacks kept); the start-up log's line."""
        for side in ("w13", "w2"):
            moe.register_parameter(f"{side}_weight", None)
        moe.expert_linear = self
        return f"{what}: {cpu_fp8_path()}, per expert over the tokens routed to it"

    def __call__(self, expert: int, which: int, x: torch.Tensor) -> torch.Tensor:
        return cpu_fp8.linear(x, self.weights[1 if which == DOWN else 0][expert])


class FusedFp8Experts:
    """FusedMoE.fused_quantized of FP8 experts on CUDA: row scales [E, N] (block_k 0), or one
    row of block scales per output row [E, N, ceil(K / block_k)]."""

    def __init__(self, q13, q2, s13, s2, block_k: int = 0):
        self.q13, self.q2, self.block_k = q13, q2, block_k
        self.s13, self.s2 = s13.float().contiguous(), s2.float().contiguous()

    def __call__(self, x, topk_weights, topk_ids, lora=None) -> torch.Tensor:
        from engine.kernels.triton.fused_moe import ExpertWeights, fused_experts_quantized

        w13 = ExpertWeights(self.q13, self.s13, group=self.block_k)
        w2 = ExpertWeights(self.q2, self.s2, group=self.block_k)
        return fused_experts_quantized(x, w13, w2, topk_weights, topk_ids, lora=lora)


class Fp8BlockExpertsMethod(ExpertsMethod):
    """Block-FP8 experts (Qwen3-30B-A3B-FP8's form; engine.layers.quantization.fp8_block):
    float8_e4m3fn `weight` [N, K] with scales [ceil(N / bn), ceil(K / bk)] (`scale_name`),
    expanded to one row of scales per output row as they load (a gate / up shard of I may then
    end anywhere; down's K shard must start on a block). CPU: each expert's bytes and row
    scales on the CPU's FP8 kernels (CpuFp8Experts); where those do not take them, dequantized
    at load into the model dtype, one expert at a time, and run as float experts (the float
    weights' bytes). CUDA: the
    bytes and row scales go to the fused Triton MoE kernel, which scales each weight by its
    block's scale in its inner loop (no float copy)."""

    def __init__(self, block: tuple[int, int], scale_name: str, field: str):
        self.block, self.scale_name, self.field = block, scale_name, field

    def create_weights(self, moe: nn.Module) -> None:
        from engine.kernels.fp8 import expand_block_scales
        from engine.layers.quantization.fp8_block import check_row_shard

        name = getattr(moe, "prefix", "experts")
        e, (bn, bk) = moe.num_local_experts, self.block
        check_row_shard(f"{name} (down)", self.field, self.block, moe.inter, moe.inter_slices)
        full_rows = {
            "w13": moe.inter * moe.inter_slices,
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
        cpu = CpuFp8Experts.prepare(q13, q2, s13, s2, bk, dtype)
        if cpu is not None:
            return cpu.install(moe, f"FP8 experts in blocks of [{bn}, {bk}]")
        for side, q, s in (("w13", q13, s13), ("w2", q2, s2)):
            w = torch.empty(q.shape, dtype=dtype, device=q.device)
            for x in range(q.shape[0]):  # one expert's float32 intermediates at a time
                w[x] = dequantize_fp8_blocks(q[x], s[x], bk, dtype)
            setattr(moe, f"{side}_weight", nn.Parameter(w, requires_grad=False))
        return (
            f"FP8 experts in blocks of [{bn}, {bk}] dequantized at load into "
            f"{str(dtype).removeprefix('torch.')} (the float experts' bytes and kernels)"
        )


class ExpertGIdxLoader:
    """weight_loader of a stacked act-order g_idx [E, K] (each input row's group): gate and up
    share their input, so their orders must agree (as the dense merged layers' must); down
    keeps this rank's rows of I, whose groups index every group's scales (loaded whole)."""

    def __init__(self, moe: nn.Module, name: str):
        self.moe, self.name = moe, name

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        expert, which = shard_id
        moe, full = self.moe, loaded.to(torch.int32).reshape(-1)
        if moe.local_expert(expert) is None:
            return  # another rank's expert
        expert = moe.local_expert(expert)
        k, slices = param.shape[1], moe.inter_slices
        if which == DOWN and slices > 1 and full.numel() == k * slices:
            full = full.narrow(0, moe.slice_rank * k, k)
        if full.numel() != k:
            raise ValueError(
                f"{self.name}: expert {expert}'s g_idx has {loaded.numel()} rows, this rank's "
                f"experts take {k}"
            )
        seen = param.__dict__.setdefault("w13_loaded", set())
        if which != DOWN and expert in seen and not torch.equal(param.data[expert], full):
            raise ValueError(
                f"{self.name}: expert {expert}'s gate and up projections have different g_idx "
                "(act-order over one input gives them one order); they cannot run as one "
                "gate_up"
            )
        if which != DOWN:
            seen.add(expert)
        param.data[expert].copy_(full)


class IntExpertsMethod(ExpertsMethod):
    """Integer experts in a dense format's tensors (`dense`, an IntWeightOnlyMethod: its CODES /
    SCALES / ZEROS / G_IDX names, its convert_* into the output-major loading layout, its
    act_order and act_quant): compressed-tensors' pack-quantized `weight_packed` /
    `weight_scale` / `weight_zero_point` (act-order: `weight_g_idx`) and int-quantized int8
    `weight` / `weight_scale` (W8A8: act_quant), GPTQ's and AWQ's `qweight` / `scales` /
    `qzeros` (GPTQ's `g_idx`: each expert's own order with desc_act, else read and dropped).
    Act-order over a tensor-parallel shard of down keeps every group's scales, as the dense
    row-parallel layers do (its rows' groups lie anywhere in the full I)."""

    def __init__(self, dense):
        self.dense = dense
        self.bits, self.group_size = dense.bits, dense.group_size
        self.act_order = bool(dense.act_order and dense.G_IDX)
        self.act_quant = dense.act_quant
        self.names = {"codes": dense.CODES, "scales": dense.SCALES, "zeros": dense.ZEROS}

    def _codes(self, t: torch.Tensor) -> torch.Tensor:
        return self.dense.convert_codes(t)

    def create_weights(self, moe: nn.Module) -> None:
        name = getattr(moe, "prefix", "experts")
        e, dense, names = moe.num_local_experts, self.dense, self.names
        tp, per_row = moe.inter_slices, self.group_size <= 0
        for side, (n, k) in _shapes(moe).items():
            group = k if per_row else self.group_size
            # act-order on down's shard: its rows' groups lie anywhere in the full I
            full_groups = self.act_order and side == "w2" and tp > 1 and not per_row
            if (k * tp if full_groups else k) % group:
                where = "I of a tensor-parallel shard" if side == "w2" else "the hidden size"
                where = "I" if full_groups else where
                raise ValueError(
                    f"{name}: quantization_config group_size {self.group_size} does not divide "
                    f"the experts' input features ({where}: {k * tp if full_groups else k})"
                )
            g = (k * tp) // group if full_groups else k // group
            # the float weight is replaced by the codes (int-quantized's take its name)
            moe.register_parameter(f"{side}_weight", None)
            _register(moe, f"{side}_{names['codes']}", torch.zeros(e, n, k, dtype=torch.uint8),
                      ExpertLoader(moe, self._codes, name))  # fmt: skip
            _register(moe, f"{side}_{names['scales']}", torch.zeros(e, n, g, dtype=torch.float32),
                      ExpertLoader(moe, dense.convert_scales, name))  # fmt: skip
            if names["zeros"]:
                z = torch.full((e, n, g), 1 << (self.bits - 1), dtype=torch.int32)
                _register(moe, f"{side}_{names['zeros']}", z,
                          ExpertLoader(moe, dense.convert_zeros, name))  # fmt: skip
            if self.act_order:  # each expert's order; absent: the trivial one
                first = moe.slice_rank * k if full_groups else 0
                trivial = (torch.arange(k, dtype=torch.int32) + first) // group
                _register(moe, f"{side}_{dense.G_IDX}", trivial.repeat(e, 1),
                          ExpertGIdxLoader(moe, name), optional=True)  # fmt: skip
            elif dense.G_IDX:  # GPTQ without act-order: the trivial order, dropped
                _register(moe, f"{side}_{dense.G_IDX}", torch.zeros(0), ignored_loader, True)
        _register_ignored(moe, self._extra())

    def _extra(self) -> tuple[str, ...]:
        """The dense format's read-and-dropped tensors not loaded here (int-quantized's zero
        points and input zero points)."""
        used = set(self.names.values())
        return tuple(t for t in self.dense.EXTRA if t not in used and t not in IGNORED)

    def process_weights_after_loading(self, moe: nn.Module) -> str:
        parts, names = {}, self.names
        for side, (_, k) in _shapes(moe).items():
            codes = getattr(moe, f"{side}_{names['codes']}").data
            scales = getattr(moe, f"{side}_{names['scales']}").data
            zeros = getattr(moe, f"{side}_{names['zeros']}").data if names["zeros"] else None
            if zeros is not None and bool((zeros == (1 << (self.bits - 1))).all()):
                zeros = None  # symmetric after all (GPTQ stores symmetric zero points)
            g_idx = getattr(moe, f"{side}_{self.dense.G_IDX}").data if self.act_order else None
            group = k if self.group_size <= 0 else self.group_size
            parts[side] = ExpertParts(codes, scales, zeros, group, g_idx)
            for t in (*names.values(), self.dense.G_IDX, *IGNORED, *self._extra()):
                if t and hasattr(moe, f"{side}_{t}"):
                    delattr(moe, f"{side}_{t}")
            moe.register_parameter(f"{side}_weight", None)  # no float copy
        if parts["w13"].codes.device.type == "cuda":
            moe.fused_quantized = FusedIntExperts(parts, self.bits)
            order = ", act-order rows sorted by group, x read through each expert's order"
            weight_only = ", activations in the model dtype" if self.act_quant else ""
            return (
                f"int{self.bits} experts on the fused Triton MoE kernel (dequantized in its "
                f"inner loop{order if self.act_order else ''}{weight_only})"
            )
        layers = IntExperts(parts, self.bits, moe.model_dtype, self.act_quant)
        moe.expert_layers = layers  # a submodule: the kernels' tensors are the model's
        moe.expert_linear = layers.linear
        return layers.path


@dataclass(slots=True)
class ExpertParts:
    """One projection's loaded integer experts (the loading layout, stacked): codes uint8
    [E, N, K], float32 scales and int32 zeros (None: symmetric) [E, N, G], the inputs a group
    covers, g_idx int32 [E, K] (act-order; None: row k in group k // group)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group: int
    g_idx: torch.Tensor | None = None


class ExpertProjection(nn.Module):
    """One expert's gate_up or down as a small layer that finish_int_layer gives a dense
    checkpoint layer's kernel (its quant_method and tensors)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.model_dtype = dtype
        self.register_parameter("bias", None)


class ExpertLayers(nn.ModuleList):
    """FusedMoE.expert_linear's layers: E gate_up ExpertProjections, then E down ones (this
    rank's experts, in order); `path` says what they run on."""

    num_experts = 0
    path = ""

    def linear(self, expert: int, which: int, x: torch.Tensor) -> torch.Tensor:
        layer = self[expert + (self.num_experts if which == DOWN else 0)]
        return layer.quant_method.apply(layer, x)


class IntExperts(ExpertLayers):
    """FusedMoE.expert_linear of integer experts on the CPU: 2E ExpertProjections, each on the
    kernel its scheme and shape map onto (engine.layers.quantization.int_weight's
    finish_int_layer, as a dense layer of that scheme: act-order's rows sorted by its own
    order, W8A8's int8 activations from a few rows)."""

    def __init__(self, parts: dict[str, ExpertParts], bits: int, dtype: torch.dtype,
                 act_quant: bool = False):  # fmt: skip
        from engine.layers.quantization.int_weight import finish_int_layer

        super().__init__()
        paths = []
        for side in ("w13", "w2"):
            p = parts[side]
            for e in range(p.codes.shape[0]):
                layer = ExpertProjection(dtype)
                z = None if p.zeros is None else p.zeros[e]
                g = None if p.g_idx is None else p.g_idx[e]
                paths.append(finish_int_layer(layer, p.codes[e], p.scales[e], z, g, bits,
                                              p.group, act_quant))  # fmt: skip
                self.append(layer)
        self.num_experts = parts["w13"].codes.shape[0]
        self.path = "; ".join(sorted(set(paths)))


def sort_rows_by_group(p: ExpertParts) -> tuple[torch.Tensor, torch.Tensor | None,
                                                torch.Tensor | None]:  # fmt: skip
    """Act-order experts' rows sorted by group, each expert by its own g_idx (as the dense
    Triton GEMM's repack_for_kernel does): (codes [E, N, K] sorted, perm int32 [E, K]: sorted
    row k multiplies input column perm[e, k], or None where every order is the trivial one;
    the sorted g_idx, or None where it is k // group for every expert — not on a row-parallel
    shard, whose groups are not its own)."""
    if p.g_idx is None:
        return p.codes, None, None
    e, n, k = p.codes.shape
    order = torch.argsort(p.g_idx.long(), dim=1, stable=True)  # [E, K]
    plain = torch.arange(k, device=order.device)
    codes = p.codes
    perm = None
    if not bool((order == plain).all()):
        codes = torch.gather(p.codes, 2, order.unsqueeze(1).expand(e, n, k))
        perm = order.to(torch.int32).contiguous()
    g_sorted = torch.gather(p.g_idx.long(), 1, order)
    if bool((g_sorted == plain // p.group).all()):
        return codes, perm, None
    return codes, perm, g_sorted.to(torch.int32).contiguous()


class FusedIntExperts:
    """FusedMoE.fused_quantized of integer experts on CUDA: codes (4-bit: two a byte, k even in
    the low nibble), float32 scales and zero points [E, N, G] for the fused Triton kernel;
    act-order's rows sorted by group at load, the kernel reading x's (gate_up) or the
    activation's (down) columns through each expert's permutation."""

    def __init__(self, parts: dict[str, ExpertParts], bits: int):
        from engine.kernels.triton.fused_moe import ExpertWeights

        self.weights = []
        for side in ("w13", "w2"):
            p = parts[side]
            codes, perm, g_idx = sort_rows_by_group(p)
            if bits == 4:
                codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
            self.weights.append(
                ExpertWeights(
                    codes.contiguous(),
                    p.scales.float().contiguous(),
                    None if p.zeros is None else p.zeros.to(torch.int32).contiguous(),
                    bits,
                    p.group,
                    perm,
                    g_idx,
                )  # fmt: skip
            )

    def __call__(self, x, topk_weights, topk_ids, lora=None) -> torch.Tensor:
        from engine.kernels.triton.fused_moe import fused_experts_quantized

        return fused_experts_quantized(x, *self.weights, topk_weights, topk_ids, lora=lora)
