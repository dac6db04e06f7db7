"""Integer weight-only checkpoints (GPTQ, AWQ, compressed-tensors' pack-quantized) on the CPU.

`IntWeightOnlyMethod` is what their formats share: each format names its checkpoint tensors
and says how one converts into the loading layout (engine.layers.quantization.packed); after
loading, the layer gets the fastest CPU kernel its scheme maps onto (finish_int_layer), on the
checkpoint's own values (nothing is requantized):
- 4-bit, groups a multiple of 32 (per-channel included), K a multiple of 64, a bfloat16
  model: the w4 tiles of `--quantization w4a8` and GGUF Q4 (engine.kernels.cpu.w4): each
  group of 32 keeps the codes, its scale s and minimum -zero * s in float16 (w = s * q + m,
  the same values up to the float16 rounding of an asymmetric minimum) and runs where a GGUF
  Q4_1 layer runs: the w4 kernel up to 12 rows, AMX-bf16 tiles or the batch kernel above,
  the one-call decode plan (PackedW4LinearMethod); with act-order (g_idx) the rows sorted by
  group into the same tiles and x's columns gathered in that order per call
  (PermutedW4LinearMethod, not the decode plan's);
- 8-bit symmetric, per-channel scales: int8 rows with float32 row scales on the C GEMM
  (`--quantization int8`'s kernel; with int8 activations from a few rows where the checkpoint
  quantizes them too: W8A8, `--quantization w8a8`'s);
- other 8-bit groups (asymmetric, grouped, act-order), same shape conditions: the Q8 tiles of
  a GGUF Q8_0 LM head with the groups' scales and minimums, x as int8 per 32
  (PackedQ8LinearMethod);
- anything else on the CPU (act-order over a row-parallel shard, groups not a multiple of 32,
  K not of 64, a float32 or float16 model, no kernel on this CPU): the codes by group, one
  byte a weight, multiplied group by group in torch (GroupedDequantLinearMethod): correct, slow,
  and named in the start-up log; off the CPU (until the GPU kernels take them) the canonical
  packed.PackedWeight, dequantized per call (DequantLinearMethod).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu import gemm as cpu_gemm
from engine.kernels.cpu import w4 as cpu_w4
from engine.kernels.cpu import w8a8 as cpu_w8a8
from engine.layers.quantization.base import LinearMethodBase, triton_linear, wants_triton
from engine.layers.quantization.gguf import GGUFW4LinearMethod, w4_large_batch_linear
from engine.layers.quantization.int8 import Int8LinearMethod
from engine.layers.quantization.packed import (
    GIdxLoader,
    PackedWeight,
    ShardLoader,
    dequantize,
    from_loading_layout,
    ignored_loader,
)
from engine.layers.quantization.w8a8 import W8A8LinearMethod


def register(layer: nn.Module, name: str, tensor: torch.Tensor, loader) -> None:
    param = nn.Parameter(tensor, requires_grad=False)
    param.weight_loader = loader
    setattr(layer, name, param)


def register_bias(layer: nn.Module, output_size: int, bias: bool) -> None:
    if bias:
        register(layer, "bias", torch.empty(output_size), layer.weight_loader)
    else:
        layer.register_parameter("bias", None)


class PackedW4LinearMethod(GGUFW4LinearMethod):
    """A checkpoint's 4-bit groups as w4 tiles (layer.w4; layer.weight is their bytes): every
    path of a GGUF Q4 layer, the decode plan's included."""


class PermutedW4LinearMethod(LinearMethodBase):
    """Act-order's 4-bit groups as w4 tiles over rows sorted by group (layer.w4, layer.act_perm:
    row k of the tiles is the checkpoint's row act_perm[k]): x's columns are gathered in that
    order for each call (exllama's way), then the w4 paths run. Not the decode plan's (it
    reads the tiles with x as it is)."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x.index_select(-1, layer.act_perm)
        y = cpu_w4.linear(x, layer.w4, bias)
        return y if y is not None else w4_large_batch_linear(x, layer.w4, bias)


class PackedQ8LinearMethod(LinearMethodBase):
    """8-bit groups (of 32, or a multiple: each 32 keeps its group's scale) as the Q8 tiles of a
    GGUF Q8_0 LM head (layer.q8, a cpu_w4.Q8Tiles; layer.act_perm as PermutedW4LinearMethod's):
    w = s * u + m with the codes u, scales s and minimums m = -zero * s in float16; x as int8
    per 32, float32 sums (cpu_w4.linear_q8), any number of rows."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if layer.act_perm is not None:
            x = x.index_select(-1, layer.act_perm)
        y = cpu_w4.linear_q8(x.contiguous(), layer.q8)
        if y is None:
            raise RuntimeError(f"the Q8 tile kernel refused a {x.dtype} call of {tuple(x.shape)}")
        y = y.to(x.dtype)
        return y if bias is None else y + bias


def _to_q8(codes, scales, zeros) -> cpu_w4.Q8Tiles | None:
    """Codes [N, K] (0..255), float32 scales and zeros [N, G] -> Q8 tiles standing for (u - z) * s
    (None where a minimum overflows float16)."""
    n, k = codes.shape
    rep = (k // scales.shape[1]) // cpu_w4.GROUP
    s16 = scales.repeat_interleave(rep, dim=1).half()
    z = 128.0 if zeros is None else zeros.float().repeat_interleave(rep, dim=1)
    m16 = (-z * s16.float()).half()
    if not (torch.isfinite(s16).all() and torch.isfinite(m16).all()):
        return None
    return cpu_w4.pack_q8_groups(codes.view(n, k // cpu_w4.GROUP, cpu_w4.GROUP), s16, m16)


def _q8_refusal(group, k, dtype, device) -> str | None:
    if group % cpu_w4.GROUP or k % cpu_w4.K_MULTIPLE:
        return f"groups of {group} over K={k} (Q8 tiles: groups of 32, K a multiple of 64)"
    if dtype != torch.bfloat16:
        return f"a {str(dtype).removeprefix('torch.')} model (the Q8 tile kernel takes bfloat16)"
    if device.type != "cpu":
        return f"{device.type} (the Q8 tiles are the CPU's)"
    if not cpu_w4.q8_available():
        return "no Q8 tile kernel on this CPU (AVX512-VNNI or AVX2)"
    return None


class CheckpointInt8LinearMethod(Int8LinearMethod):
    """int8 rows and float32 row scales from the checkpoint (nothing to requantize)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass


class CheckpointW8A8LinearMethod(W8A8LinearMethod):
    """The same with int8 activations from w8a8_min_rows rows (a W8A8 checkpoint)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.packed_int8 = cpu_w8a8.pack_weight(layer.weight.data)


class GroupedDequantLinearMethod(LinearMethodBase):
    """The CPU's fallback: layer.codes uint8 [G, group, N] (rows sorted by group where
    act-order permuted them: layer.act_perm), layer.group_scales and layer.group_zs (zero *
    scale) [G, 1, N] in the model dtype. A call of at most `group` rows multiplies x by the
    integer codes group by group (one batched GEMM on the codes widened once) and scales the
    [G, rows, N] partial sums; larger calls dequantize the weight once for one GEMM. One
    byte a weight, no float copy between calls."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        codes, s, zs = layer.codes, layer.group_scales, layer.group_zs
        groups, group, n = codes.shape
        k = groups * group
        x2 = x.reshape(-1, k).to(s.dtype)
        if layer.act_perm is not None:
            x2 = x2.index_select(1, layer.act_perm)
        rows = x2.shape[0]
        q = codes.to(s.dtype)
        if rows <= group:
            xg = x2.view(rows, groups, group).transpose(0, 1)  # [G, rows, group]
            partial = torch.bmm(xg, q)  # [G, rows, N]: x . codes per group
            y = (partial * s).sum(0) - (xg.sum(-1, keepdim=True) * zs).sum(0)
        else:
            y = x2 @ torch.addcmul(-zs, q, s).view(k, n)
        y = y.to(x.dtype).view(*x.shape[:-1], n)
        return y if bias is None else y + bias


def _grouped_codes(layer, codes, scales, zeros, g_idx, bits, group, dtype) -> bool:
    """Give layer GroupedDequantLinearMethod's tensors; False where the groups are not
    contiguous blocks of `group` rows even sorted (a row-parallel shard under act-order)."""
    n, k = codes.shape
    groups = scales.shape[1]
    perm = None
    if g_idx is not None:
        perm = _act_order_perm(g_idx, group, groups)
        if perm is None:
            return False
        codes = codes[:, perm]
    elif groups * group != k:
        return False
    z = torch.full_like(scales, float(1 << (bits - 1))) if zeros is None else zeros.float()
    layer.codes = codes.t().contiguous().view(groups, group, n)
    layer.group_scales = scales.t().to(dtype).contiguous().view(groups, 1, n)
    layer.group_zs = (z * scales).t().to(dtype).contiguous().view(groups, 1, n)
    layer.act_perm = perm
    return True


class DequantLinearMethod(LinearMethodBase):
    """layer.packed (a PackedWeight) dequantized for each call, one GEMM in x's dtype: the
    fallback for schemes no kernel takes (no float copy is kept between calls)."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        w = dequantize(layer.packed).to(x.dtype)  # [K, N]
        return F.linear(x, w.t(), None if bias is None else bias.to(x.dtype))


def _w4_refusal(bits, group, k, zeros, g_idx, dtype, device) -> str | None:
    if bits != 4:
        return f"{bits}-bit"
    if g_idx is not None:
        return "act-order (g_idx)"
    if group % cpu_w4.GROUP or k % cpu_w4.K_MULTIPLE:
        return f"groups of {group} over K={k} (w4 tiles: groups of 32, K a multiple of 64)"
    if dtype != torch.bfloat16:
        return f"a {str(dtype).removeprefix('torch.')} model (the w4 kernel takes bfloat16)"
    if device.type != "cpu":
        return f"{device.type} (the w4 tiles are the CPU's)"
    if not cpu_w4.available():
        return "no w4 kernel on this CPU (AVX512-VNNI or AVX2)"
    return None


def _act_order_perm(g_idx: torch.Tensor | None, group: int, groups: int) -> torch.Tensor | None:
    """Act-order's rows sorted by group (int64 [K]) where every group has `group` rows, so the
    sorted rows are contiguous groups the w4 tiles take; else None."""
    if g_idx is None or groups * group != g_idx.numel():
        return None
    counts = torch.bincount(g_idx.long(), minlength=groups)
    if counts.numel() != groups or not bool((counts == group).all()):
        return None
    return torch.argsort(g_idx.long(), stable=True)


def _to_w4(codes, scales, zeros) -> cpu_w4.Q4Weight | None:
    """Codes [N, K], float32 scales and zeros [N, G] -> w4 tiles standing for (q - z) * s
    (None where a minimum overflows float16)."""
    n, k = codes.shape
    per = scales.shape[1]
    rep = (k // per) // cpu_w4.GROUP  # tiles' groups of 32 per checkpoint group
    s = scales.repeat_interleave(rep, dim=1)
    z = torch.full_like(s, 8.0) if zeros is None else zeros.float().repeat_interleave(rep, 1)
    s16 = s.half()
    m16 = (-z * s16.float()).half()
    if not (torch.isfinite(s16).all() and torch.isfinite(m16).all()):
        return None
    return cpu_w4.pack_groups(codes.view(n, k // cpu_w4.GROUP, cpu_w4.GROUP), s16, m16)


class TritonIntLinearMethod(LinearMethodBase):
    """layer.gemm_weight (engine.kernels.triton.quant_gemm's QuantGemmWeight, repacked once at
    load): the W4A16 / W8A16 Triton GEMM, dequantizing in its inner loop (CUDA)."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return triton_linear("quant_gemm", "quant_gemm", x, layer.gemm_weight, bias)


def _triton_int(layer: nn.Module, packed: PackedWeight) -> str | None:
    """Give layer the Triton GEMM's form of packed; None, or why the kernel cannot serve."""
    try:  # imports triton: only a CUDA layer (or a test under its interpreter) gets here
        from engine.kernels.triton.quant_gemm import repack_for_kernel
    except ImportError as e:
        return f"triton is unavailable ({e})"
    try:
        layer.gemm_weight = repack_for_kernel(
            packed.qweight, packed.scales, packed.zeros, packed.g_idx, packed.bits,
            packed.group_size,
        )  # fmt: skip
    except ValueError as e:  # a shape the kernel refuses
        return str(e)
    layer.quant_method = TritonIntLinearMethod()
    return None


def finish_int_layer(
    layer: nn.Module,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    bits: int,
    group: int,
    act_quant: bool = False,
    triton: bool | None = None,
) -> str:
    """Give a loaded layer (codes [N, K], float32 scales and int zeros [N, G], g_idx [K], this
    rank's) its kernel form and method; returns the path taken, for the start-up log.
    triton: the Triton GEMM (None: on CUDA; True: also for CPU tensors, the tests' way under
    TRITON_INTERPRET=1)."""
    n, k = codes.shape
    dtype = layer.bias.dtype if layer.bias is not None else torch.get_default_dtype()
    dtype = getattr(layer, "model_dtype", dtype)
    device = codes.device
    if wants_triton(triton, device):
        layer.register_parameter("weight", None)
        layer.in_features = k
        packed = from_loading_layout(codes, scales, zeros, g_idx, bits, group, dtype)
        why = _triton_int(layer, packed)
        if why is None:
            order = ", act-order rows sorted by group" if packed.g_idx is not None else ""
            return f"Triton W{bits}A16 GEMM (engine/kernels/triton/quant_gemm.py{order})"
        layer.packed = packed
        layer.quant_method = DequantLinearMethod()
        return f"fallback: dequantized per call ({why})"
    if zeros is not None and bool((zeros == (1 << (bits - 1))).all()):
        zeros = None  # symmetric after all (GPTQ stores sym zero points)
    trivial = g_idx is not None and scales.shape[1] * group == k
    if trivial and torch.equal(g_idx.long(), torch.arange(k, device=device) // group):
        g_idx = None  # act-order off: the trivial order
    perm = _act_order_perm(g_idx, group, scales.shape[1]) if bits == 4 else None
    why = _w4_refusal(bits, group, k, zeros, None if perm is not None else g_idx, dtype, device)
    if why is None:
        w4 = _to_w4(codes if perm is None else codes[:, perm], scales, zeros)
        if w4 is not None:
            layer.w4 = w4
            layer.weight = nn.Parameter(w4.data, requires_grad=False)
            if perm is not None:
                layer.act_perm = perm
                layer.quant_method = PermutedW4LinearMethod()
                return "w4 tiles, rows sorted by group (act-order: x's columns gathered per call)"
            layer.quant_method = PackedW4LinearMethod()
            return "w4 tiles (w4 kernel; AMX-bf16 or batch kernel above 12 rows)"
        why = "a group minimum overflows float16"
    elif bits == 8 and zeros is None and g_idx is None and scales.shape[1] == 1:
        if device.type == "cpu" and cpu_gemm.available(dtype, torch.int8):
            layer.weight = nn.Parameter((codes.to(torch.int16) - 128).to(torch.int8),
                                        requires_grad=False)  # fmt: skip
            layer.weight_scale = scales[:, 0].float().contiguous()
            if act_quant:
                layer.quant_method = CheckpointW8A8LinearMethod()
                layer.quant_method.process_weights_after_loading(layer)
                return "int8 rows (w8a8: int8 activations from 13 rows, 8 with AMX)"
            layer.quant_method = CheckpointInt8LinearMethod()
            return "int8 rows (int8 C GEMM)"
        why = "no int8 C GEMM here"
    elif bits == 8:
        perm = _act_order_perm(g_idx, group, scales.shape[1])
        why = _q8_refusal(group, k, dtype, device)
        if why is None and g_idx is not None and perm is None:
            why = "act-order over a row-parallel shard"
        if why is None:
            q8 = _to_q8(codes if perm is None else codes[:, perm], scales, zeros)
            if q8 is not None:
                layer.q8, layer.act_perm = q8, perm
                layer.weight = nn.Parameter(q8.data, requires_grad=False)
                layer.in_features = k
                layer.quant_method = PackedQ8LinearMethod()
                kind = "asymmetric " if zeros is not None else ""
                order = ", rows sorted by group (act-order)" if perm is not None else ""
                return f"Q8 tiles ({kind}8-bit groups of {group}{order}; x as int8 per 32)"
            why = "a group minimum overflows float16"
    layer.register_parameter("weight", None)
    layer.in_features = k
    if device.type == "cpu" and _grouped_codes(layer, codes, scales, zeros, g_idx, bits, group,
                                               dtype):  # fmt: skip
        layer.quant_method = GroupedDequantLinearMethod()
        return f"fallback: codes x per group, or dequantized for large calls ({why})"
    layer.packed = from_loading_layout(codes, scales, zeros, g_idx, bits, group, dtype)
    layer.quant_method = DequantLinearMethod()
    return f"fallback: dequantized per call ({why})"


def _to_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (K even) -> uint8 [N, K / 2]: k even in the low nibble."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def _from_nibbles(b: torch.Tensor) -> torch.Tensor:
    return torch.stack([b & 15, b >> 4], dim=-1).reshape(b.shape[0], -1)


class IntWeightOnlyMethod(LinearMethodBase):
    """A checkpoint's integer weights while they load: subclasses name the tensors (CODES,
    SCALES, ZEROS, G_IDX) and convert each into the loading layout (convert_*); after loading,
    finish_int_layer picks the kernel."""

    CODES = SCALES = ZEROS = G_IDX = ""
    EXTRA: tuple[str, ...] = ()  # read and dropped

    def __init__(self, bits: int, group_size: int, symmetric: bool, act_order: bool,
                 act_quant: bool = False):  # fmt: skip
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric
        self.act_order, self.act_quant = act_order, act_quant

    def convert_codes(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def convert_scales(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def convert_zeros(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def groups(self, k: int) -> int:
        return 1 if self.group_size <= 0 else k // self.group_size

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool):
        name = getattr(layer, "prefix", type(layer).__name__)
        k, n = input_size, output_size
        per_row = self.group_size <= 0  # one scale per output row (channel strategy)
        group = k if per_row else self.group_size
        row_parallel = layer.tp_dim == 1 and layer.tp_size > 1
        # act-order on a row-parallel shard: its rows' groups are anywhere in the full K
        full_groups = self.act_order and row_parallel and not per_row
        if not full_groups and k % group:
            where = " of this tensor-parallel shard" if row_parallel else ""
            raise ValueError(
                f"{name}: quantization_config group_size {self.group_size} does not divide the "
                f"input features{where} ({k})"
            )
        g = (k * layer.tp_size) // group if full_groups else k // group
        layer.quant_group = group
        layer.in_features_loading = k
        # 4-bit codes load two to a byte (the checkpoint's own size), unpacked a layer at a time
        nibbles = self.bits == 4 and k % 2 == 0
        shape, convert = (n, k), self.convert_codes
        if nibbles:
            shape, convert = (n, k // 2), lambda t: _to_nibbles(self.convert_codes(t))
        register(layer, self.CODES, torch.zeros(shape, dtype=torch.uint8),
                 ShardLoader(layer, convert, name=name))  # fmt: skip
        per_row = self.group_size <= 0
        register(layer, self.SCALES, torch.zeros(n, g, dtype=torch.float32),
                 ShardLoader(layer, self.convert_scales, not (full_groups or per_row), name))  # fmt: skip
        if self.ZEROS:
            z = torch.full((n, g), 1 << (self.bits - 1), dtype=torch.int32)
            register(layer, self.ZEROS, z,
                     ShardLoader(layer, self.convert_zeros, not (full_groups or per_row), name))  # fmt: skip
        if self.G_IDX:  # optional: a checkpoint without act-order may leave it out
            first = layer.tp_rank * k if full_groups else 0
            own_groups = row_parallel and not (full_groups or per_row)
            offset = (layer.tp_rank * k) // group if own_groups else 0
            register(layer, self.G_IDX, (torch.arange(k, dtype=torch.int32) + first) // group,
                     GIdxLoader(layer, name, offset))  # fmt: skip
            getattr(layer, self.G_IDX).optional = True
        for extra in self.EXTRA:
            register(layer, extra, torch.zeros(0), ignored_loader)
            getattr(layer, extra).optional = True
        register_bias(layer, n, bias)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        codes = getattr(layer, self.CODES).data
        if codes.shape[1] * 2 == layer.in_features_loading:  # two 4-bit codes a byte
            codes = _from_nibbles(codes)
        del layer.in_features_loading
        scales = getattr(layer, self.SCALES).data
        zeros = getattr(layer, self.ZEROS).data if self.ZEROS else None
        g_idx = getattr(layer, self.G_IDX).data if self.G_IDX else None
        for name in (self.CODES, self.SCALES, self.ZEROS, self.G_IDX, *self.EXTRA):
            if name:
                delattr(layer, name)
        layer.quant_path = finish_int_layer(
            layer, codes, scales, zeros, g_idx, self.bits, layer.quant_group, self.act_quant
        )
