"""4-bit weights in tiles of 16 rows (`--quantization w4a8`'s small batches, and a GGUF file's
Q4_0/Q4_1 layers).

A one-stream decode step reads every weight once, so its time is weight bytes over memory
bandwidth. Here each group of 32 consecutive weights of a row keeps 4-bit codes q in 0..15,
a scale s and a minimum m (both float16): w ~ s * q + m, like llama.cpp's Q4_1. With the
scales that is 0.625 bytes a weight against int8's 1.0. Groups of 32 follow outliers far
better than one int8 scale per row: on SmolLM2-135M, 4-bit groups on every linear layer
cost a mean next-token KL of 0.002 from bf16 (int8 rows on them and the LM head: 0.006).

With AVX512-VNNI (w4.c) the kernel takes 1-12 rows of x, quantized to int16 with one scale
per row (as cpu_gemm's `rows_i16`); with AVX2 only (w4_avx2.c) it takes any number of rows,
x quantized to int8 per group of 32 (llama.cpp's Q8_1 activations, vpmaddubsw on the same
tiles): max_rows() says which. AVX512-VNNI builds also have a batch kernel for any number of
rows (w4_vnni_batch.c, linear_batch: x as int8 per group of 32 on vpdpbusd), which larger
batches take where the CPU has no AMX. Rows are stored in tiles of 16 so that each float lane of the
kernel accumulates one output row: 32 bytes hold 16 rows x 4 codes, widened to int16 they are the
operands of two vpdpwssd against pairs of x broadcast from memory, and no horizontal sums
are left (a row-wise layout spent a third of its instructions on them: 120 one-row GEMMs of
SmolLM2 on a Zen 4 core, 7.1 -> 3.5-4.0 ms). Each group's sum is scaled in float, and the
minimums meet per-group sums of x:
y = xs * (sum_g s_g * (q_g . xq_g) + sum_g m_g * sum(xq_g)). Needs AVX512-VNNI (or AVX2),
F16C, and K a multiple of 64; other layers and larger batches use the int8 weights the layer
keeps too (w8a8). Built once per machine like the other CPU kernels (engine/kernels/cpu/w4.c).
A GGUF file's Q4_0/Q4_1 layers (engine.gguf.w4) hold nothing but tiles: pack_groups
takes their codes and scales as they are, unpack gives larger batches' GEMMs their weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels.cpu import ops

GROUP = 32
K_MULTIPLE = 64  # in features must be a multiple of this (the x quantizer's step)
TILE = ops.W4_TILE  # output rows per tile, one per float lane of the kernel
GROUP_BYTES = TILE * GROUP // 2 + 2 * TILE * 2  # a tile's group: codes, scales, minimums

_resolved: list[tuple] = []  # (the kernel's function or None, its max rows); resolved once


def _resolve() -> tuple:
    if not _resolved:
        fn = ops.function("linear_q4_bf16")
        _resolved.append((fn, 0 if fn is None else ops.function("w4_max_rows")()))
    return _resolved[0]


def _kernel():
    """linear_q4_bf16 with its signature set, or None (no compiler, neither AVX512-VNNI nor
    AVX2)."""
    return _resolve()[0]


def available() -> bool:
    return _kernel() is not None


def max_rows() -> int:
    """Rows of x the kernel takes in one call (12 with AVX512-VNNI, any with AVX2; 0 without
    a kernel); larger batches go elsewhere (w8a8's int8 weights, or the large-batch paths)."""
    return _resolve()[1]


def x_as_int8() -> bool:
    """Whether the kernel takes x as int8 per group of 32 (the AVX2 build, every batch) rather
    than as int16 per row (AVX512-VNNI): the coarser of the two roundings of x."""
    return available() and max_rows() > ops.W4_MAX_ROWS


@dataclass(frozen=True)
class Q4Weight:
    """A linear layer's weight [out_features, in_features] as 4-bit groups in tiles of 16
    rows (the kernel's layout, see its source); `data` is uint8 [tiles, G * 320]."""

    data: torch.Tensor
    out_features: int
    in_features: int


def quantize_groups(weight: torch.Tensor) -> Q4Weight:
    """weight [N, K] (K a multiple of 64) -> its 4-bit groups of 32 (codes 0..15, a float16
    scale and minimum per group), rows padded to tiles of 16; dequantize() inverts it."""
    n, k = weight.shape
    if k % K_MULTIPLE:
        raise ValueError(f"4-bit groups need K a multiple of {K_MULTIPLE}, got {k}")
    g = weight.float().view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scales, mins = ((hi - lo) / 15).half(), lo.half()
    s, m = scales.float()[..., None], mins.float()[..., None]  # the stored values
    codes = torch.where(s > 0, torch.round((g - m) / s.clamp_min(1e-30)), 0).clamp_(0, 15)
    return pack_groups(codes.to(torch.uint8), scales, mins)


def _tile_chunks(codes: torch.Tensor) -> torch.Tensor:
    """Codes uint8 [N, G, 32] (0..15, N a multiple of 16) -> the tiles' code bytes
    [tile, group, 256]: [tile, row, group, chunk, 4 k] -> [tile, group, chunk, row, 2] with
    k = 4c + j in the low nibble of byte 2r + j, 4c + 2 + j in its high one."""
    n, groups = codes.shape[:2]
    c = codes.view(n // TILE, TILE, groups, 8, 4)
    return (c[..., :2] | (c[..., 2:] << 4)).permute(0, 2, 3, 1, 4).reshape(n // TILE, groups, 256)


def _per_group(v: torch.Tensor) -> torch.Tensor:
    """float16 [N, G] (N a multiple of 16) -> [tile, group, 32 bytes]: a tile's 16 rows."""
    n, groups = v.shape
    return v.view(n // TILE, TILE, groups).transpose(1, 2).contiguous().view(torch.uint8)


def _pad_rows(v: torch.Tensor, pad: int) -> torch.Tensor:
    return torch.nn.functional.pad(v, (0, 0) * (v.dim() - 1) + (0, pad))


def pack_groups(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> Q4Weight:
    """Codes uint8 [N, G, 32] (0..15), float16 scales and minimums [N, G] -> the kernel's
    tiles of 16 rows (padded rows: codes, scales and minimums 0), bytes as they are: the
    weight stands for w = s * q + m of exactly these values."""
    n, groups = scales.shape
    pad = -n % TILE
    codes, scales, mins = (_pad_rows(v, pad) for v in (codes, scales, mins))
    data = torch.cat([_tile_chunks(codes), _per_group(scales), _per_group(mins)], dim=2)
    return Q4Weight(data.reshape(-1, groups * GROUP_BYTES).contiguous(), n, groups * GROUP)


Q8_GROUP_BYTES = 8 * 64 + 2 * TILE * 2  # a Q8 tile's group: 512 code bytes, scales, minimums
Q8_0_BLOCK_BYTES = 34  # ggml's block_q8_0: float16 d, 32 int8 codes
Q8_LAYOUTS = {"planes": "linear_q8w4_f32", "vnni": "linear_q8_vnni_f32"}  # a build has one


@dataclass(frozen=True)
class Q8Tiles:
    """Q8_0 rows in tiles of 16 rows for one of two kernels (the build has one of them):
    - "planes" (w4_avx2.c's linear_q8w4_f32): two nibble planes of w4 tiles, a weight d * q
      being d * (16 * hi + lo) - 128 * d with q + 128 = 16 * hi + lo;
    - "vnni" (w4_vnni_batch.c's linear_q8_vnni_f32): the codes q + 128 as one plane, lane r
      of each 64-byte chunk holding row r's 4 consecutive codes (vpdpbusd's operand).
    Either way a group's scales d and minimums -128 d follow as float16. `data` is uint8
    [tiles, G * Q8_GROUP_BYTES]."""

    data: torch.Tensor
    out_features: int
    in_features: int
    layout: str


def q8_layout() -> str | None:
    """This build's Q8 tile layout ("planes" with AVX2 only, "vnni" with AVX512-VNNI), or None
    (no kernel)."""
    return next((k for k, fn in Q8_LAYOUTS.items() if ops.function(fn) is not None), None)


def q8_available() -> bool:
    """Whether this build has a Q8 tile kernel."""
    return q8_layout() is not None


def _vnni_chunks(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, G, 32] (N a multiple of 16) -> [tile, group, 512]: per chunk of 4 k,
    the 16 rows' 4 codes one after another."""
    n, groups = codes.shape[:2]
    c = codes.view(n // TILE, TILE, groups, 8, 4)
    return c.permute(0, 2, 3, 1, 4).reshape(n // TILE, groups, 512)


def pack_q8_0(blocks: torch.Tensor, in_features: int, layout: str | None = None) -> Q8Tiles:
    """uint8 [N, G * 34] Q8_0 rows (a GGUF file's) -> Q8Tiles in `layout` (default: this
    build's) standing for exactly the file's values. Raises ValueError where K is not a
    multiple of 64 or a -128 * d overflows float16."""
    layout = layout or q8_layout()
    if layout not in Q8_LAYOUTS:
        raise ValueError(f"no Q8 tile layout {layout!r}")
    n = blocks.shape[0]
    if in_features % K_MULTIPLE:
        raise ValueError(f"Q8 tiles need K a multiple of {K_MULTIPLE}, got {in_features}")
    groups = in_features // GROUP
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != (n, groups * Q8_0_BLOCK_BYTES):
        raise ValueError(f"Q8_0 rows of K={in_features} are {groups * Q8_0_BLOCK_BYTES} bytes")
    b = blocks.view(n, groups, Q8_0_BLOCK_BYTES)
    scales = b[..., :2].contiguous().view(torch.float16).view(n, groups)
    mins = (scales.float() * -128).half()
    if not torch.isfinite(mins).all():
        raise ValueError("a Q8_0 scale's -128d overflows float16")
    u = (b[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    return pack_q8_groups(u, scales, mins, layout)


def pack_q8_groups(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, layout: str | None = None
) -> Q8Tiles:
    """uint8 codes [N, G, 32] (0..255), float16 scales and minimums [N, G] -> Q8Tiles in
    `layout` (default: this build's) standing for w = s * u + m of exactly these values (a
    Q8_0 block: u = q + 128, m = -128 s; an 8-bit checkpoint's groups: m = -zero * s)."""
    layout = layout or q8_layout()
    if layout not in Q8_LAYOUTS:
        raise ValueError(f"no Q8 tile layout {layout!r}")
    n, groups = scales.shape
    pad = -n % TILE
    u, scales, mins = (_pad_rows(v, pad) for v in (codes, scales, mins))
    planes = [_vnni_chunks(u)] if layout == "vnni" else [_tile_chunks(u >> 4), _tile_chunks(u & 15)]
    data = torch.cat([*planes, _per_group(scales), _per_group(mins)], dim=2)
    return Q8Tiles(
        data.reshape(-1, groups * Q8_GROUP_BYTES).contiguous(), n, groups * GROUP, layout
    )


def linear_q8(x: torch.Tensor, w: Q8Tiles) -> torch.Tensor | None:
    """x [..., K] bf16 against Q8 tiles -> float32 [..., N] (x as int8 per group of 32, float32
    sums); None where the tiles' kernel is absent or cannot take the call."""
    fn = ops.function(Q8_LAYOUTS[w.layout])
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if fn is None or x.dtype != torch.bfloat16 or x2.stride(-1) != 1 or w.in_features != k:
        return None
    m, n = x2.shape[0], w.out_features
    y = torch.empty(m, n, dtype=torch.float32)
    rc = fn(
        x2.data_ptr(), x2.stride(0), m, k, w.data.data_ptr(), n, y.data_ptr(), n,
        torch.get_num_threads(),
    )  # fmt: skip
    return None if rc != 0 else y.view(*x.shape[:-1], n)


def argmax_q8(x: torch.Tensor, w: Q8Tiles) -> torch.Tensor | None:
    """argmax over the last dim of linear_q8(x, w) as int64 [rows] (the same float32 sums, the
    first maximum winning), without the logits: the VNNI layout's epilogue; None where it is
    absent (the AVX2 planes) or cannot take the call."""
    fn = ops.function("linear_q8_vnni_argmax") if w.layout == "vnni" else None
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if fn is None or x.dtype != torch.bfloat16 or x2.stride(-1) != 1 or w.in_features != k:
        return None
    token = torch.empty(x2.shape[0], dtype=torch.int64)
    rc = fn(
        x2.data_ptr(), x2.stride(0), x2.shape[0], k, w.data.data_ptr(), w.out_features,
        token.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return None if rc != 0 else token


def batch_available() -> bool:
    """Whether this build has the AVX512-VNNI kernel for batches above max_rows()
    (w4_vnni_batch.c; AVX2 builds' linear_q4_bf16 takes every batch itself)."""
    return ops.function("linear_q4_bf16_batch") is not None


def linear_batch(
    x: torch.Tensor, q4: Q4Weight, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """x [..., K] bf16, any number of rows, on the AVX512-VNNI batch kernel (x as int8 per
    group of 32, vpdpbusd on the unpacked tiles); None where it is absent or cannot take the
    call."""
    return _call(ops.function("linear_q4_bf16_batch"), x, q4, bias, top=None)


def dequantize(q4: Q4Weight) -> torch.Tensor:
    """The float32 weight [N, K] the codes stand for (the tests' reference)."""
    t, groups = q4.data.shape[0], q4.in_features // GROUP
    d = q4.data.view(t, groups, GROUP_BYTES)
    b = d[..., :256].reshape(t, groups, 8, TILE, 2)
    codes = torch.cat([b & 15, b >> 4], dim=-1).permute(0, 3, 1, 2, 4)  # [t, row, g, c, 4]
    codes = codes.reshape(t * TILE, groups, GROUP).float()

    def per_row(v: torch.Tensor) -> torch.Tensor:  # [tile, group, 32 bytes] -> [N, G] float
        return v.contiguous().view(torch.float16).transpose(1, 2).reshape(-1, groups).float()

    scales, mins = per_row(d[..., 256:288]), per_row(d[..., 288:])
    w = codes * scales[..., None] + mins[..., None]
    return w.reshape(t * TILE, -1)[: q4.out_features]


def unpack(q4: Q4Weight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight [N, K] in dtype (bf16 or float32) for a GEMM: the C pass where the kernels
    are built (engine/kernels/cpu/w4_tiles.c, any CPU), else dequantize(); the same values."""
    fn = ops.function("w4_dequantize")
    if fn is None or dtype not in (torch.bfloat16, torch.float32):
        return dequantize(q4).to(dtype)
    out = torch.empty(q4.out_features, q4.in_features, dtype=dtype)
    rc = fn(
        q4.data.data_ptr(), q4.out_features, q4.in_features, out.data_ptr(),
        int(dtype == torch.bfloat16), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"w4 tiles of K={q4.in_features} are not groups of {GROUP}")
    return out


def linear(x: torch.Tensor, q4: Q4Weight, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., K] bf16 (at most max_rows() rows) against the 4-bit weight; None where the kernel
    cannot take the call (the caller uses its int8 weights)."""
    fn, top = _resolve()
    return _call(fn, x, q4, bias, top)


def _call(fn, x: torch.Tensor, q4: Q4Weight, bias: torch.Tensor | None, top: int | None):
    """One of the bf16 kernels (linear_q4_bf16's signature) on x, or None where it is absent
    or cannot take the call (more rows than `top`, another dtype or K)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], q4.out_features
    if (
        fn is None
        or x.dtype != torch.bfloat16
        or not 1 <= m <= (m if top is None else top)
        or x2.stride(-1) != 1
        or q4.in_features != k
        or (bias is not None and bias.dtype != x.dtype)
    ):
        return None
    y = torch.empty(m, n, dtype=x.dtype)
    rc = fn(
        x2.data_ptr(), x2.stride(0), m, k, q4.data.data_ptr(), n,
        None if bias is None else bias.data_ptr(), y.data_ptr(), n, torch.get_num_threads(),
    )  # fmt: skip
    return None if rc != 0 else y.view(*x.shape[:-1], n)
