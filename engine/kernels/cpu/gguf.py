"""GGUF block formats on the CPU kernels (engine/kernels/cpu/gguf.c): Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, IQ4_NL, MXFP4 (gpt-oss's experts), NVFP4 (superblocks of 64 weights: K % 64 == 0;
compressed-tensors' NVFP4 checkpoints repacked), and the K-quants Q2_K-Q6_K with IQ4_XS (gguf_k.c: superblocks of 256 weights,
so K % 256 == 0).

The kernel quantizes each row of x per block of 32 to int8 with a float scale, as llama.cpp
does, and takes integer dot products on the file's blocks (VNNI, AVX2 or scalar: `gguf_isa`).
A dot kernel's cost grows with the rows, so above dot_max_rows() rows (engine.kernels.cpu.isa:
the instruction set's) bf16 activations run on AMX-bf16 tiles where the CPU has them, up to
cpu_isa's amx_max_rows, the weight decoded 16 rows at a time into a buffer in cache
(engine.kernels.cpu.amx_bf16.linear_gguf, through gguf_dequant_row: any type it reads). Elsewhere,
for prefill chunks and for float32 activations, one dequantized copy of the weight in x's
dtype feeds cpu_gemm.dense_linear (oneDNN, or the C GEMM where the CPU has no native bf16).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from engine.kernels.cpu import amx_bf16 as cpu_amx
from engine.kernels.cpu import gemm as cpu_gemm
from engine.kernels.cpu import isa as cpu_isa
from engine.kernels.cpu import ops

TYPES = {
    n: ops.CONSTANTS[f"GGUF_{n}"]
    for n in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4", "NVFP4")
}
# superblocks of 256 weights (gguf_k.c): the K-quants, and IQ4_XS
K_TYPES = {
    n: ops.CONSTANTS[f"GGUF_{n}"] for n in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
}
TYPES.update(K_TYPES)
ISAS = {"scalar": 0, "avx2": 1, "vnni": 2}  # gguf_isa's values (GGUF_ISA_* in the header)


def dot_max_rows() -> int:
    """Rows up to which the dot kernels run (this CPU's plan, or forced_dot_rows's)."""
    return _forced_dot_rows[-1] if _forced_dot_rows else cpu_isa.plan().gguf_dot_max_rows


_forced_dot_rows: list[int] = []


@contextlib.contextmanager
def forced_dot_rows(rows: int) -> Iterator[None]:
    """Run the dot kernels up to `rows` rows inside the block (tests reach them at any batch)."""
    _forced_dot_rows.append(rows)
    try:
        yield
    finally:
        _forced_dot_rows.pop()


def available() -> bool:
    return ops.function("gguf_linear") is not None


def isa_names() -> list[str]:
    """The variants this build has, slowest first."""
    return ops.variant_names("gguf_isa_max", ISAS)


def forced_isa(name: str):
    """Run gguf_linear's `name` variant inside the block (the tests' way to reach them all)."""
    return ops.forced_variable("gguf_isa", ISAS[name])


def block_weights(type_id: int) -> int:
    """Weights along K a block of this type holds (a K-quant's superblock: 256; NVFP4's: 64)."""
    if type_id in K_TYPES.values():
        return 256
    return 64 if type_id == TYPES["NVFP4"] else 32


def row_bytes(type_id: int, in_features: int) -> int:
    return ops.function("gguf_block_bytes")(type_id) * (in_features // block_weights(type_id))


def refusal(type_id: int, in_features: int) -> str | None:
    """Why the kernels cannot take this type at this K (the caller keeps floats), or None."""
    if type_id not in TYPES.values():
        return f"ggml type {type_id} has no kernel"
    qk = block_weights(type_id)
    if in_features % qk:
        return f"in_features {in_features} is not a multiple of its blocks' {qk}"
    return None


def dequantize(
    blocks: torch.Tensor, type_id: int, in_features: int, dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """[N, row bytes] uint8 -> the weight [N, in_features] in dtype (bf16 or float32), into
    out (contiguous, that shape and dtype) where given."""
    if out is None:
        out = torch.empty(blocks.shape[0], in_features, dtype=dtype)
    assert (
        out.is_contiguous() and out.shape == (blocks.shape[0], in_features) and out.dtype == dtype
    )
    rc = ops.function("gguf_dequantize")(
        blocks.data_ptr(), type_id, blocks.shape[0], in_features, out.data_ptr(),
        int(dtype == torch.bfloat16), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"gguf type {type_id} with K={in_features} is not supported")
    return out


def gather_rows(
    blocks: torch.Tensor, type_id: int, in_features: int, ids: torch.Tensor, dtype
) -> torch.Tensor:
    """The rows ids [...] (int) of [N, row bytes] uint8 blocks as [..., in_features] in dtype
    (bf16 or float32): an embedding lookup on the file's blocks. ids must be < N."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), in_features, dtype=dtype)
    rc = ops.function("gguf_gather_rows")(
        blocks.data_ptr(), type_id, blocks.shape[0], in_features, flat.data_ptr(), flat.numel(),
        out.data_ptr(), int(dtype == torch.bfloat16),
    )  # fmt: skip
    if rc == -2:
        raise IndexError(f"a token id outside the embedding's {blocks.shape[0]} rows")
    if rc != 0:
        raise ValueError(f"gguf type {type_id} with K={in_features} is not supported")
    return out.view(*ids.shape, in_features)


# A large batch off AMX multiplies the weight dequantized at most this many bytes at a time:
# an 8B model's LM head is 1 GB in bf16, a transient that large every step would cost page
# faults (above the heap's mmap threshold) and the peak memory the blocks save. Smaller
# weights (every layer of an 8B model) go in one piece: slicing them measured ~5% slower.
DEQUANT_SLICE_BYTES = 128 << 20


def _dense_by_slices(
    x: torch.Tensor, blocks: torch.Tensor, type_id: int, k: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ W^T (+ bias) for W in the file's blocks, dequantized DEQUANT_SLICE_BYTES of rows at
    a time for the dense GEMM (cpu_gemm.dense_by_slices), each slice's outputs in place."""
    return cpu_gemm.dense_by_slices(
        x,
        blocks.shape[0],
        lambda r0, r1, out: dequantize(blocks[r0:r1], type_id, k, x.dtype, out=out),
        bias,
        DEQUANT_SLICE_BYTES,
    )


def linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    type_id: int,
    in_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16 or float32, CPU) @ W^T (+ bias) for W in the file's blocks."""
    k, n = in_features, blocks.shape[0]
    x2 = x.reshape(-1, k)
    if x2.shape[0] > dot_max_rows():
        y = None
        if cpu_isa.plan().amx_rows(x2.shape[0]):
            y = cpu_amx.linear_gguf(x, blocks, type_id, k, bias)
        if y is not None:
            return y
        return _dense_by_slices(x, blocks, type_id, k, bias)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    y = torch.empty(x2.shape[0], n, dtype=x.dtype)
    rc = ops.function("gguf_linear")(
        x2.data_ptr(), x2.stride(0), x2.shape[0], k, blocks.data_ptr(), type_id, n,
        None if bias is None else bias.data_ptr(), y.data_ptr(), n,
        int(x.dtype == torch.bfloat16), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"gguf_linear refused type {type_id}, K={k}")
    return y.view(*x.shape[:-1], n)


def linear_segments(
    x: torch.Tensor,
    segments: tuple[tuple[int, torch.Tensor], ...],
    in_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ W^T for W as consecutive row segments of different types ((type id, uint8 [rows,
    row bytes]) each, a merged projection whose parts the file stores in different types):
    one kernel per segment into its columns of one output (the C call's ldy)."""
    k = in_features
    n = sum(b.shape[0] for _, b in segments)
    x2 = x.reshape(-1, k)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    y = torch.empty(x2.shape[0], n, dtype=x.dtype)
    col = 0
    for type_id, blocks in segments:
        rows = blocks.shape[0]
        b = None if bias is None else bias[col : col + rows]
        if x2.shape[0] > dot_max_rows():  # linear()'s large-batch path, a segment at a time
            y[:, col : col + rows] = linear(x2, blocks, type_id, k, b)
        else:
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            rc = ops.function("gguf_linear")(
                x2.data_ptr(), x2.stride(0), x2.shape[0], k, blocks.data_ptr(), type_id, rows,
                None if b is None else b.data_ptr(), y.data_ptr() + col * y.element_size(), n,
                int(x.dtype == torch.bfloat16), torch.get_num_threads(),
            )  # fmt: skip
            if rc != 0:
                raise ValueError(f"gguf_linear refused type {type_id}, K={k}")
        col += rows
    return y.view(*x.shape[:-1], n)
