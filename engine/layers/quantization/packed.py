"""The canonical in-memory form of integer weight-only checkpoints (GPTQ, AWQ, compressed-tensors'
pack-quantized), shared by the CPU path and the GPU kernels, and how a checkpoint's tensors
reach it.

After loading, every integer format is GPTQ-style (`PackedWeight`):
- `qweight` int32 [K // (32 // bits), N], packed along K (the input dimension): code q[k, n]
  sits in word k // (32 // bits) of column n at bit (k % (32 // bits)) * bits (lowest bits =
  lowest k);
- `scales` [K // group, N] in the model dtype;
- `zeros` [K // group, N] unpacked integer zero points (int32), or None for symmetric
  weights, whose zero is 2 ** (bits - 1);
- `g_idx` int32 [K] (the group of each input row: GPTQ's act-order) or None (row k in group
  k // group);
- W[k, n] = (q[k, n] - zero[g(k), n]) * scale[g(k), n] and y = x @ W; `dequantize` is the torch
  reference every kernel is tested against.

While a checkpoint loads, each format's tensors are converted as they are read into one
output-major loading layout (the formats differ in packing, order and orientation, the layers'
tensor-parallel slicing does not): codes uint8 [N, K] (unsigned: 0 .. 2**bits - 1; 4-bit ones
two to a byte, [N, K / 2], so a layer loads in the checkpoint's own size), scales
float32 [N, G] (exact for float16 and bfloat16 checkpoints), zeros int32 [N, G], g_idx [K].
`ShardLoader` slices those for this rank (merged q/k/v and gate/up shards, row-parallel group
boundaries) and `IntWeightOnlyMethod.process_weights_after_loading` (engine.layers.quantization.
int_weight) turns them into the kernel's form.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(slots=True)
class PackedWeight:
    """A linear layer's integer weight in the canonical GPTQ-style form (module docstring)."""

    bits: int
    group_size: int  # rows of K per group (K itself for per-channel scales)
    qweight: torch.Tensor  # int32 [K * bits / 32, N]
    scales: torch.Tensor  # [K // group_size, N], the model dtype
    zeros: torch.Tensor | None  # int32 [K // group_size, N]; None: symmetric (2 ** (bits - 1))
    g_idx: torch.Tensor | None  # int32 [K]; None: row k in group k // group_size

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * (32 // self.bits)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    def group_of_rows(self) -> torch.Tensor:
        """int64 [K]: the group of each input row."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.in_features, device=self.qweight.device) // self.group_size


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [K, N] (0 .. 2**bits - 1) -> int32 [K // (32 // bits), N], packed along K
    with the lowest bits holding the lowest k."""
    per = 32 // bits
    k, n = codes.shape
    if k % per:
        raise ValueError(f"{bits}-bit codes pack {per} rows to a word; K={k} is not a multiple")
    c = codes.to(torch.int64).view(k // per, per, n)
    shifts = (torch.arange(per, device=codes.device) * bits).view(1, per, 1)
    words = (c << shifts).sum(1)  # disjoint bit fields: the sum is their OR
    return (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement of bit 31


def unpack_rows(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """pack_rows' inverse: int32 [K // (32 // bits), N] -> int32 codes [K, N]. Widths that do
    not divide 32 (GPTQ's 3-bit) are a bit stream along K instead: 32 rows in `bits` words."""
    if 32 % bits:
        return _unpack_stream(qweight, bits)
    per = 32 // bits
    words, n = qweight.shape
    shifts = (torch.arange(per, device=qweight.device) * bits).view(1, per, 1)
    codes = (qweight.to(torch.int64).unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(words * per, n).to(torch.int32)


def unpack_cols(packed: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """int32 [R, C] holding 32 // bits codes a word along the last dim (lowest bits first) ->
    int32 [R, C * 32 // bits]. `order[i]`: the column within its word's span that bit field i
    holds (AWQ's interleave); None: field i holds column i. Widths that do not divide 32: a
    bit stream along the last dim, as unpack_rows reads one along K."""
    if 32 % bits:
        if order is not None:
            raise ValueError(f"no field order for {bits}-bit codes (a bit stream)")
        return _unpack_stream(packed.t(), bits).t()
    per = 32 // bits
    r, c = packed.shape
    shifts = torch.arange(per, device=packed.device) * bits
    fields = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C, per]
    if order is not None:
        cols = torch.empty_like(fields)
        cols[..., order] = fields  # field i -> column order[i]
        fields = cols
    return fields.reshape(r, c * per).to(torch.int32)


def _unpack_stream(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [W, N] holding, per column, a little-endian stream of `bits`-wide codes (code k at
    stream bit k * bits; GPTQ's 3-bit layout, so a code may straddle two words) -> int32
    [W * 32 // bits, N]. W must be a multiple of `bits` (32 codes fill `bits` words)."""
    w, n = words.shape
    if w % bits:
        raise ValueError(f"{bits}-bit codes fill {bits} words per 32 rows; {w} words is not a "
                         "multiple")  # fmt: skip
    u = (words.to(torch.int64) & 0xFFFFFFFF).view(w // bits, bits, n)
    start = torch.arange(32, device=words.device) * bits
    word, shift = start // 32, (start % 32).view(1, 32, 1)
    lo = u[:, word] >> shift
    # a code straddling words takes its high bits from the next one (else that term is masked)
    hi = u[:, (word + 1).clamp(max=bits - 1)] << (32 - shift)
    codes = (lo | hi) & ((1 << bits) - 1)
    return codes.reshape(w // bits * 32, n).to(torch.int32)


def dequantize(w: PackedWeight) -> torch.Tensor:
    """The float32 weight W [K, N] the packed codes stand for (the kernels' reference)."""
    q = unpack_rows(w.qweight, w.bits).float()
    g = w.group_of_rows()
    scales = w.scales.float()[g]
    zero = float(1 << (w.bits - 1)) if w.zeros is None else w.zeros.float()[g]
    return (q - zero) * scales


def from_loading_layout(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
) -> PackedWeight:
    """The canonical form of a layer's loaded tensors (output-major: codes [N, K], scales and
    zeros [N, G], g_idx [K])."""
    return PackedWeight(
        bits=bits,
        group_size=group_size,
        qweight=pack_rows(codes.t(), bits).contiguous(),
        scales=scales.t().to(dtype).contiguous(),
        zeros=None if zeros is None else zeros.t().to(torch.int32).contiguous(),
        g_idx=None if g_idx is None else g_idx.to(torch.int32).contiguous(),
    )


# -- loading: a checkpoint tensor -> this rank's slice of the loading layout ------------------


def _out_slice(layer: nn.Module, param: torch.Tensor, shard_id) -> tuple[int, int]:
    """(offset in param's rows, rows) that shard_id fills on this rank."""
    tp = layer.tp_size
    if shard_id is None:
        return 0, param.shape[0]
    if hasattr(layer, "output_sizes"):  # MergedColumnParallelLinear (gate_up)
        return sum(layer.output_sizes[:shard_id]) // tp, layer.output_sizes[shard_id] // tp
    q = layer.num_heads * layer.head_dim  # QKVParallelLinear
    kv = layer.num_kv_heads * layer.head_dim
    return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]


class ShardLoader:
    """A parameter's weight_loader(param, loaded[, shard_id]): `convert` turns the checkpoint
    tensor into the loading layout (output-major [N, ...], or a 1-D per-tensor value that is
    broadcast over the shard's rows); this rank's rows of a column-parallel layer are taken
    (merged shards at their offsets), and with `input_dim` a row-parallel layer's columns
    (codes, or groups: create_weights checked that shards end on group boundaries)."""

    def __init__(self, layer: nn.Module, convert: Callable[[torch.Tensor], torch.Tensor],
                 input_dim: bool = True, name: str = ""):  # fmt: skip
        self.layer, self.convert, self.input_dim, self.name = layer, convert, input_dim, name

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        layer = self.layer
        try:
            full = self.convert(loaded)
        except ValueError as e:  # a tensor whose packing the config misstates (its bits)
            raise ValueError(f"{self.name}: checkpoint tensor {tuple(loaded.shape)}: {e}") from e
        offset, size = _out_slice(layer, param, shard_id)
        column = layer.tp_dim == 0
        if full.numel() == 1:  # a per-tensor value, for each of the shard's rows
            rows = size * (layer.tp_size if column else 1)
            full = full.reshape([1] * param.dim()).expand(rows, *param.shape[1:])
        if column:
            full = full.narrow(0, layer.tp_rank * size, size)
        dst = param.data.narrow(0, offset, size)
        if self.input_dim and layer.tp_dim == 1 and layer.tp_size > 1:
            cols = dst.shape[1]
            full = full.narrow(1, layer.tp_rank * cols, cols)
        if dst.shape != full.shape:
            raise ValueError(
                f"{self.name}: checkpoint tensor {tuple(loaded.shape)} does not fit the layer "
                f"(loaded as {tuple(full.shape)}, the layer holds {tuple(dst.shape)})"
            )
        dst.copy_(full)


class ScaleBytesLoader(ShardLoader):
    """A scale tensor taken as stored, in the one dtype its scheme uses (another dtype is
    another scheme: the error names it, e.g. NVFP4's float8_e4m3fn, MXFP4's uint8 E8M0)."""

    def __init__(self, layer: nn.Module, name: str, dtype: torch.dtype, scheme: str):
        super().__init__(layer, self._bytes, name=name)
        self.dtype, self.scheme = dtype, scheme

    def _bytes(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype != self.dtype:
            got, want = (str(d).removeprefix("torch.") for d in (t.dtype, self.dtype))
            raise ValueError(  # ShardLoader names the layer and the tensor's shape
                f"weight_scale is {got}; {self.scheme} checkpoints supported: {want} scales "
                "(weights.scale_dtype)"
            )
        return t


class GIdxLoader:
    """g_idx [K] (a row's group, act-order): every merged shard must agree (they share their
    input); a row-parallel rank keeps its rows (their groups index the full scales with
    act-order, else the rank's own, from group_offset)."""

    def __init__(self, layer: nn.Module, name: str = "", group_offset: int = 0):
        # group_offset: the first group of a row-parallel rank whose scales are its own groups
        # (no act-order), subtracted so that g_idx indexes them
        self.layer, self.name, self.group_offset = layer, name, group_offset

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        layer = self.layer
        full = loaded.to(torch.int32)
        if layer.tp_dim == 1 and layer.tp_size > 1:
            k = param.shape[0]
            full = full.narrow(0, layer.tp_rank * k, k) - self.group_offset
        if full.shape != param.shape:
            raise ValueError(f"{self.name}: g_idx of {tuple(loaded.shape)}, expected {param.shape}")
        if getattr(param, "g_idx_loaded", False) and not torch.equal(param.data, full):
            raise ValueError(
                f"{self.name}: the merged projections' g_idx differ (act-order over one input "
                "should give them one order); this checkpoint cannot be merged"
            )
        param.data.copy_(full)
        param.g_idx_loaded = True


def ignored_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """A checkpoint tensor read and not needed (compressed-tensors' weight_shape)."""
