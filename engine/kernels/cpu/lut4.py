"""bitsandbytes' 4-bit weights (NF4, FP4) on the CPU kernels (engine/kernels/cpu/lut4.c): each
4-bit code indexes the checkpoint's 16-entry float32 table (its quant_map), one float32 absmax
scales each block of 64 weights, and weight = table[code] * absmax in float32, as bnb's
dequantize makes it. The levels are not integers, so no int8 kernel holds them exactly: the
dot kernel looks every code up in the table scaled by its block's absmax and accumulates in
float32 (scalar, AVX2 or AVX-512: `lut4_isa`).

Up to DOT_MAX_ROWS rows of x run the dot kernel; bf16 x of up to tiles_max_rows() rows (CPUs
with AVX512-BF16) the decoded tiles (32 weight rows at a time decoded to bf16 in cache for
gemm.c's AVX512-BF16 dot kernel: the dense path's bytes without the whole weight written out);
larger batches dequantize the weight to x's dtype in bounded slices for cpu_gemm.dense_linear
(cpu_gemm.dense_by_slices).

The kernel's layout (`pack` makes it from bnb's, `pack_codes` from one code a byte): codes uint8 [N, K/2], per chunk of 32
weights along K 16 bytes, byte j's low nibble weight j of the chunk and its high nibble
weight j + 16; scales float32 [N, K/64]. K must be a multiple of 64.
"""

from __future__ import annotations

import functools

import torch

from engine.kernels.cpu import gemm as cpu_gemm
from engine.kernels.cpu import ops

BLOCK = 64  # weights per absmax (bnb's blocksize the kernel reads)
ISAS = {"scalar": 0, "avx2": 1, "avx512": 2}  # lut4_isa's values (LUT4_ISA_* in the header)
# Rows up to which the dot kernel runs. Measured on a 2-core AVX-512 machine (one thread, bf16
# x; 576 x 1536, 1536 x 576, 2048 x 2048): the dot kernel's time grows with the rows (every 4
# rows of x redo the lookups), the dequantize + dense GEMM path's slowly; they cross at ~8 rows
# (8: 200 vs 220 us on 576 x 1536; 12: 295 vs 176). float32 x, whose dense path is slower,
# would gain up to ~16; bf16 is the serving dtype.
DOT_MAX_ROWS = ops.CONSTANTS["LUT4_DOT_MAX_ROWS"]  # 8 (the header's, which the decode plan reads)
# A large batch dequantizes the weight at most this many bytes at a time (gguf's bound).
DEQUANT_SLICE_BYTES = 128 << 20


def available() -> bool:
    """The library has the kernels (built, and not disabled)."""
    return ops.function("lut4_linear") is not None


def isa_names() -> list[str]:
    """The variants this build has, slowest first."""
    return ops.variant_names("lut4_isa_max", ISAS)


def forced_isa(name: str):
    """Run the `name` variant inside the block (the tests' way to reach them all)."""
    return ops.forced_variable("lut4_isa", ISAS[name])


def _check_k(k: int) -> None:
    if k <= 0 or k % BLOCK:
        raise ValueError(f"lut4: K={k} is not a positive multiple of {BLOCK}")


def pack(
    codes_bnb: torch.Tensor, absmax: torch.Tensor, n: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """bnb's packed codes (uint8, n * k / 2 bytes over the [n, k] weight flattened row-major;
    byte i = code[2i] << 4 | code[2i + 1]) and absmax (float32, one per 64 weights) -> the
    kernel's (codes uint8 [n, k / 2], scales float32 [n, k / 64])."""
    _check_k(k)
    flat = codes_bnb.reshape(-1)
    if flat.dtype != torch.uint8 or flat.numel() != n * k // 2:
        raise ValueError(f"lut4: codes must be {n * k // 2} uint8 bytes for [{n}, {k}]")
    if absmax.numel() != n * k // BLOCK:
        raise ValueError(f"lut4: absmax must hold {n * k // BLOCK} scales for [{n}, {k}]")
    codes = torch.stack([flat >> 4, flat & 15], dim=-1).view(n, k)
    scales = absmax.reshape(n, k // BLOCK).to(torch.float32).contiguous()
    return pack_codes(codes), scales


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes uint8 [n, k] (0..15, one a weight) -> the kernel's uint8 [n, k / 2]."""
    n, k = codes.shape
    _check_k(k)
    chunks = codes.view(n, k // 32, 2, 16)
    packed = chunks[:, :, 0] | (chunks[:, :, 1] << 4)  # weights j and j + 16 of each chunk
    return packed.reshape(n, k // 2).contiguous()


def _check_weight(codes: torch.Tensor, scales: torch.Tensor, k: int) -> None:
    _check_k(k)
    n = codes.shape[0]
    assert codes.dtype == torch.uint8 and codes.shape == (n, k // 2) and codes.is_contiguous()
    assert scales.dtype == torch.float32 and scales.shape == (n, k // BLOCK)
    assert scales.is_contiguous()


def _table(table: torch.Tensor) -> torch.Tensor:
    t = table.reshape(-1).to(torch.float32).contiguous()
    if t.numel() != 16:
        raise ValueError(f"lut4: the table must hold 16 values, not {t.numel()}")
    return t


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    table: torch.Tensor,
    k: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel's codes [N, K/2] and scales [N, K/64] -> the weight [N, K] in dtype (float32 or
    bf16: table[code] * scale in float32, then rounded), into out (contiguous, that shape and
    dtype) where given."""
    _check_weight(codes, scales, k)
    n = codes.shape[0]
    if out is None:
        out = torch.empty(n, k, dtype=dtype)
    assert out.is_contiguous() and out.shape == (n, k) and out.dtype == dtype
    assert dtype in (torch.float32, torch.bfloat16)
    t = _table(table)
    rc = ops.function("lut4_dequantize")(
        codes.data_ptr(), scales.data_ptr(), t.data_ptr(), n, k, out.data_ptr(),
        int(dtype == torch.bfloat16), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"lut4_dequantize refused K={k}")
    return out


def linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    table: torch.Tensor,
    k: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] (float32 or bf16, CPU) @ W^T (+ bias) in x's dtype, W the kernel's codes
    [N, K/2] and scales [N, K/64] into table (16 float32 values)."""
    _check_weight(codes, scales, k)
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"lut4: x must be float32 or bf16, not {x.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"lut4: x has {x.shape[-1]} features, the weight K={k}")
    n = codes.shape[0]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], n)
    if x2.shape[0] > DOT_MAX_ROWS and x.dtype == torch.bfloat16 and x2.shape[0] <= tiles_max_rows():
        y = _tiles(x2, codes, scales, table, k, bias)
        if y is not None:
            return y.view(*x.shape[:-1], n)
    if x2.shape[0] > DOT_MAX_ROWS:
        return cpu_gemm.dense_by_slices(
            x,
            n,
            lambda r0, r1, out: dequantize(codes[r0:r1], scales[r0:r1], table, k, x.dtype, out),
            bias,
            DEQUANT_SLICE_BYTES,
        )
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    t = _table(table)
    y = torch.empty(x2.shape[0], n, dtype=x.dtype)
    rc = ops.function("lut4_linear")(
        x2.data_ptr(), x2.stride(0), x2.shape[0], k, codes.data_ptr(), scales.data_ptr(),
        t.data_ptr(), n, None if bias is None else bias.data_ptr(), y.data_ptr(), n,
        int(x.dtype == torch.bfloat16), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"lut4_linear refused K={k}")
    return y.view(*x.shape[:-1], n)


@functools.cache
def tiles_max_rows() -> int:
    """Rows of bf16 x up to which, above DOT_MAX_ROWS, the decoded tiles run (lut4.c's
    lut4_linear_bf16_tiles: AVX512-BF16 builds; 0 elsewhere). The build's: asked once."""
    fn = ops.function("lut4_tiles_max_rows")
    return 0 if fn is None else fn()


def _tiles(x2, codes, scales, table, k, bias) -> torch.Tensor | None:
    """x2 [M, K] bf16 on the decoded tiles (None where the kernel declines: the dense path)."""
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    t = _table(table)
    n = codes.shape[0]
    y = torch.empty(x2.shape[0], n, dtype=torch.bfloat16)
    rc = ops.function("lut4_linear_bf16_tiles")(
        x2.data_ptr(), x2.stride(0), x2.shape[0], k, codes.data_ptr(), scales.data_ptr(),
        t.data_ptr(), n, None if bias is None else bias.data_ptr(), y.data_ptr(), n,
        torch.get_num_threads(),
    )  # fmt: skip
    return y if rc == 0 else None
