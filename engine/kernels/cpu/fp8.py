"""FP8 e4m3 weights on the CPU at one byte a weight (engine/kernels/cpu/fp8.c): float8_e4m3fn
checkpoints (per-tensor, per-channel and block-wise scales) and `--quantization fp8` keep the
checkpoint's codes, and every call widens them itself: weight = e4m3 * scale in float32, the
scale one per group of `group` inputs of a row (group = K: one a row).

Why: these CPUs have no fp8 arithmetic, so the layers used to hold the e4m3 values in bf16
(two bytes a weight); decode reads every weight once a step and is bound by memory, so half the
bytes is up to half the step. `tessera bench quant --random-llama 2048 5632 16 --formats fp8
fp8-block` (BENCHMARKS.md; a 0.8 B model, two Xeon cores): a one-stream decode step 0.66x
bf16's; 0.88x at 4-64 streams with one scale a row, 1.01-1.09x with blocks; half the memory.

Which kernel takes a call, by its rows of x:
  - up to dot_max_rows(): the dot kernel (the codes widened through float16 bits and FMA'd
    with x in float32: scalar, AVX2 + F16C or AVX-512, `isa_names`; bf16 x with AVX512-BF16:
    the codes as exact bf16 values, built with integer ops, on vdpbf16ps);
  - above, bf16 x, on a CPU with AMX: AMX-bf16 tiles on 16 rows at a time decoded to bf16 in
    cache (cpu_amx's plan: up to its rows; one scale a row: the next rows decoded inside the
    current ones' tile loop);
  - above, bf16 x, AVX512-BF16 without AMX: up to tiles_max_rows(), 32 rows at a time decoded
    to bf16 in cache for gemm.c's AVX512-BF16 dot kernel;
  - larger batches (prefill): the weight dequantized to x's dtype in bounded slices for
    cpu_gemm.dense_linear.
With one scale a row the dot kernel and the decoded rows multiply the exact e4m3 values and
apply the scale to each float32 sum; with blocks the dot kernel does so per block, and the
decoded rows (and every format's dequantized slices) round each weight, e4m3 times its scale,
once to bf16, as a bf16 checkpoint holds it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.kernels.cpu import amx_bf16 as cpu_amx
from engine.kernels.cpu import gemm as cpu_gemm
from engine.kernels.cpu import isa as cpu_isa
from engine.kernels.cpu import ops

ISAS = {"scalar": 0, "avx2": 1, "avx512": 2}  # fp8_isa's values (FP8_ISA_* in the header)
# A large batch dequantizes the weight at most this many bytes at a time (gguf's bound).
DEQUANT_SLICE_BYTES = 128 << 20
K_MULTIPLE = 32  # the kernels read K in chunks of 32


def available() -> bool:
    """The library has the kernels (built, and not disabled)."""
    return ops.function("fp8_linear") is not None


def isa_names() -> list[str]:
    """The variants this build has, slowest first."""
    return ops.variant_names("fp8_isa_max", ISAS)


def forced_isa(name: str):
    """Run the `name` variant inside the block (the tests' way to reach them all)."""
    return ops.forced_variable("fp8_isa", ISAS[name])


@functools.cache
def dot_max_rows() -> int:
    """Rows of x up to which the dot kernel runs. Its cost grows with the rows (every row adds
    its products to the widening each chunk costs once), the decoded paths' hardly at all
    until the GEMM itself counts. Measured on one Xeon core with AMX (40 layers of 2048 x 5632,
    past L3; 2026-12-07): the dot kernel 34 / 37 / 46 / 54 ms at 1 / 2 / 3 / 4 rows, AMX on
    decoded rows 42-45 ms at 1-8; with TESSERA_AMX=0 the decoded tiles 63 / 64 / 114 ms at 1 /
    2 / 8 rows against the dot kernel's 35 / 38 / 106. So 2 with AMX, else 8 (lut4's choice
    for the dense slices too)."""
    return 2 if cpu_amx.available() else 8


@functools.cache
def tiles_max_rows() -> int:
    """Rows of bf16 x up to which, above dot_max_rows(), the decoded tiles run (AVX512-BF16
    builds; 0 elsewhere)."""
    fn = ops.function("fp8_tiles_max_rows")
    return 0 if fn is None else fn()


def fits(n: int, k: int, group: int) -> bool:
    """Whether the kernels take an [n, k] weight with a scale per `group` inputs."""
    return k > 0 and k % K_MULTIPLE == 0 and group > 0 and (group % K_MULTIPLE == 0 or group >= k)


@dataclass
class Fp8Weight:
    """codes uint8 [N, K] (float8_e4m3fn's bytes), scales float32 [N, ceil(K / group)]."""

    codes: torch.Tensor
    scales: torch.Tensor
    group: int

    @classmethod
    def prepare(cls, q: torch.Tensor, scales: torch.Tensor, group: int | None = None) -> Fp8Weight:
        """q float8_e4m3fn [N, K]; scales float32, one a row ([N] or [N, 1]: group None) or
        one per `group` inputs of a row ([N, ceil(K / group)])."""
        n, k = q.shape
        group = k if group is None or group >= k else group
        if not fits(n, k, group):
            raise ValueError(f"fp8: a [{n}, {k}] weight with a scale per {group} inputs")
        scales = scales.to(torch.float32).reshape(n, -1).contiguous()
        if scales.shape[1] != -(-k // group):
            raise ValueError(f"fp8: {scales.shape[1]} scales a row for K={k}, group {group}")
        return cls(q.contiguous().view(torch.uint8), scales, group)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def dequantize(
        self, dtype: torch.dtype, rows: slice = slice(None), out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows of the weight in dtype (float32 or bf16: e4m3 * scale in float32, rounded
        once), into out (contiguous, that shape and dtype) where given."""
        assert dtype in (torch.float32, torch.bfloat16)
        codes, scales = self.codes[rows], self.scales[rows]
        n, k = codes.shape
        if out is None:
            out = torch.empty(n, k, dtype=dtype)
        assert out.is_contiguous() and out.shape == (n, k) and out.dtype == dtype
        rc = ops.function("fp8_dequantize")(
            codes.data_ptr(), scales.data_ptr(), self.group, n, k, out.data_ptr(),
            int(dtype == torch.bfloat16), torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"fp8_dequantize refused [{n}, {k}], group {self.group}")
        return out


def linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (float32 or bf16, CPU) @ W^T (+ bias) in x's dtype, on the kernel the rows
    pick (module docstring)."""
    k, n = w.in_features, w.out_features
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"fp8: x must be float32 or bf16, not {x.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"fp8: x has {x.shape[-1]} features, the weight K={k}")
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    if rows == 0:
        return x.new_empty(*x.shape[:-1], n)
    if rows > dot_max_rows():
        y = _decoded(x2, w, bias) if x.dtype == torch.bfloat16 else None
        if y is not None:
            return y.view(*x.shape[:-1], n)
        return cpu_gemm.dense_by_slices(
            x, n, lambda r0, r1, out: w.dequantize(x.dtype, slice(r0, r1), out), bias,
            DEQUANT_SLICE_BYTES,
        )  # fmt: skip
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    y = torch.empty(rows, n, dtype=x.dtype)
    rc = ops.function("fp8_linear")(
        x2.data_ptr(), x2.stride(0), rows, k, w.codes.data_ptr(), w.scales.data_ptr(), w.group,
        n, None if bias is None else bias.data_ptr(), y.data_ptr(), n,
        int(x.dtype == torch.bfloat16), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"fp8_linear refused [{n}, {k}], group {w.group}")
    return y.view(*x.shape[:-1], n)


def describe() -> str:
    """The kernel each batch size takes here, for the start-up log."""
    dot = f"the FP8 dot kernel up to {dot_max_rows()} rows"
    if cpu_amx.available():
        return (f"{dot}, AMX-bf16 on rows decoded in cache up to {cpu_isa.plan().amx_max_rows}, "
                "dequantized slices above")  # fmt: skip
    if tiles_max_rows():
        return (f"{dot}, rows decoded in cache for the AVX512-BF16 dot kernel up to "
                f"{tiles_max_rows()}, dequantized slices above")  # fmt: skip
    return f"{dot}, dequantized slices above"


def _decoded(x2: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x2 [M, K] bf16 on rows decoded to bf16 in cache (AMX tiles, else the AVX512-BF16 dot
    kernel), or None where neither takes M rows here (the dense slices then)."""
    rows = x2.shape[0]
    amx = cpu_amx.available() and cpu_isa.plan().amx_rows(rows)
    if not amx and rows > tiles_max_rows():
        return None
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    n, k = w.out_features, w.in_features
    y = torch.empty(rows, n, dtype=torch.bfloat16)
    args = (x2.data_ptr(), x2.stride(0), rows, k, w.codes.data_ptr(), w.scales.data_ptr(),
            w.group, n, None if bias is None else bias.data_ptr(), y.data_ptr(), n)  # fmt: skip
    if amx:
        rc = ops.function("amx_bf16_linear_fp8")(*args, 0, torch.get_num_threads())
    else:
        rc = ops.function("fp8_linear_bf16_tiles")(*args, torch.get_num_threads())
    return y if rc == 0 else None
