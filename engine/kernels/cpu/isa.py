"""Which CPU kernel takes a linear layer's call, by the rows of x: chosen per instruction set.

The dot kernels (cpu_gemm's AVX512-BF16 `_dp`, cpu_gguf's block dot products) read each weight
once per call and do every row's products on the vector units, so their cost grows with the
rows; AMX-bf16 tiles (cpu_amx) do 16 rows' products in the time of one vector instruction's
work per row, after a fixed setup; oneDNN's F.linear has a fixed cost per call that small
matrices do not amortize. Where one takes over from the other depends on the CPU, not the
model, so the rows are keyed by what the CPU has (RowPlan per ISA):

  amx:          AMX-bf16 (Intel Sapphire Rapids and later). Measured on a 2-core Xeon slice
                (SmolLM2-135M's 120 per-layer GEMMs, weights streaming from memory, sum of
                per-GEMM best of 7): AMX / `_dp` time 1.01 at 1 row, 0.90 at 2, 0.83 at 4,
                0.57 at 8, 0.31 at 16, 0.24 at 32; oneDNN takes 1.2-2.2x AMX's time at 1-128
                rows, but from 256 rows (prefill) oneDNN's blocking wins (one core, the model's
                shapes: oneDNN / AMX time 1.2-1.8 at 64-128 rows, 0.85-1.04 at 256, 0.7-0.96
                at 512, 0.36-0.73 at 2,048): AMX up to AMX_MAX_ROWS rows. GGUF: AMX on rows decoded 16 at a time (same 120 GEMMs) against the dot
                kernels: Q4_1 1.27x their time at 1 row, 0.64x at 4, 0.25x at 16; Q8_0 1.48x
                at 1, 0.97x at 4, 0.42x at 16: the dot kernels up to GGUF_AMX_ROWS rows.
                w4 tiles (GGUF Q4_0/Q4_1) keep AMX up to AMX_W4_MAX_ROWS: oneDNN needs them
                dequantized first (a copy of the whole weight per call), which costs more than
                its better blocking saves below ~1,500 rows (SmolLM2-135M's four shapes, sum of
                medians, AMX / dequantize + oneDNN time: 0.26 at 128 rows, 0.62 at 512, 0.75
                at 1,024, 1.20 at 2,048).
  amx_off:      the same CPU with TESSERA_AMX=0: `_dp` up to 8 rows, where oneDNN (which uses
                the tiles itself) gets faster (same measurement: `_dp` 0.59x oneDNN's time at 4
                rows, 0.87x at 8, 1.6x at 16).
  avx512_bf16:  AVX512-BF16 without AMX (AMD Zen 4/5): `_dp` up to 32 rows (measured on a Zen
                5: 1.1-3x faster than oneDNN at 1-32 rows, 0.85-0.95x from 64), oneDNN above.
  other:        no native bf16 (AVX2): cpu_gemm's widening kernel at every batch; torch's bf16
                matmul is slow there (also for GGUF layers' dequantized large batches). The w4
                kernel (Q4_0/Q4_1 tiles) takes every batch there: int8 products on
                vpmaddubsw, 1.4-1.7x the widening kernel's speed at 8-512 rows (Zen 3).
GGUF without AMX (and above AMX_MAX_ROWS): the dot kernels up to 16 rows, then one
dequantized copy and the GEMM; Q4_0/Q4_1 layers (w4 tiles) without AMX: the AVX512-VNNI batch
kernel above the w4 kernel's 12 rows (int8 activations per 32 on vpdpbusd; 1.5-2.2x the
chunked kernel or the dequantized GEMM at 13-512 rows, Zen 5).

A calibration at start was not worth its start-up time: the order of the kernels is the
instruction set's, and the crossovers are flat (a row or two either way costs a few percent).
The plan is logged once, when a layer first asks.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from engine.kernels.cpu import amx_bf16 as cpu_amx
from engine.kernels.cpu import ops
from engine.kernels.cpu import w4 as cpu_w4
from engine.kernels.cpu.build import cpu_flags

logger = logging.getLogger("tessera.engine")

ALWAYS = sys.maxsize
NEVER = 0


@dataclass(frozen=True)
class RowPlan:
    isa: str
    dp_max_rows: int  # bf16 layers: cpu_gemm's kernel up to this many rows of x
    amx: bool  # above them: AMX-bf16 tiles (cpu_amx.linear), else oneDNN's F.linear
    gguf_dot_max_rows: int  # GGUF layers: the dot kernels up to this; above, AMX or dequantize
    amx_max_rows: int = 0  # AMX up to this many rows; more (prefill): oneDNN / dequantize
    amx_w4_max_rows: int = 0  # w4 tiles on AMX up to this many rows; more: dequantize + oneDNN

    def amx_rows(self, rows: int) -> bool:
        """Whether a call of this many rows above the dot kernels' goes to AMX tiles."""
        return self.amx and rows <= self.amx_max_rows

    def amx_w4_rows(self, rows: int) -> bool:
        """Whether a call of this many rows above the w4 kernel's goes to AMX tiles."""
        return self.amx and rows <= self.amx_w4_max_rows

    def describe(self) -> str:
        dense = "oneDNN" if self.dp_max_rows != ALWAYS else "the C widening kernel"
        if self.dp_max_rows == ALWAYS:
            bf16 = "the C widening kernel at every batch"
        else:
            above = (
                f"AMX-bf16 tiles up to {self.amx_max_rows}, oneDNN F.linear"
                if self.amx
                else "oneDNN F.linear"
            )
            bf16 = f"AVX512-BF16 dot kernel up to {self.dp_max_rows} rows, {above} above"
        gguf = (
            f"AMX-bf16 tiles on decoded rows up to {self.amx_max_rows}, dequantize + {dense}"
            if self.amx
            else f"dequantize + {dense}"
        )
        w4_rows = cpu_w4.max_rows()
        if not w4_rows:
            w4 = "no w4 kernel: on the dot kernels"
        elif w4_rows >= ALWAYS_W4:
            w4 = "the w4 kernel at every batch (AVX2: int8 activations per 32)"
        else:
            batch = "the batch kernel (int8 activations per 32)"
            if not cpu_w4.batch_available():
                batch = f"dequantize + {dense}"
            above = (
                f"AMX-bf16 tiles up to {self.amx_w4_max_rows}, dequantize + oneDNN"
                if self.amx
                else batch
            )
            w4 = f"the w4 kernel up to {w4_rows} rows, {above} above"
        return (
            f"bf16 linear: {bf16} ({self.isa}); GGUF Q4_0/Q4_1 as w4 tiles: {w4}; other GGUF "
            f"linear: dot kernels up to {self.gguf_dot_max_rows} rows, {gguf} above"
        )


ALWAYS_W4 = 1 << 20  # cpu_w4.max_rows() from here: the AVX2 kernel, which takes any batch
GGUF_AMX_ROWS = 2  # GGUF with AMX: the dot kernels up to this many rows (see above)
AMX_MAX_ROWS = 128  # AMX tiles up to this many rows; prefill chunks: oneDNN (see above)
AMX_W4_MAX_ROWS = 1024  # w4 tiles: AMX up to here (the CPU's default step budget; see above)
PLANS = {
    "amx": RowPlan("amx_bf16 present", 1, True, GGUF_AMX_ROWS, AMX_MAX_ROWS, AMX_W4_MAX_ROWS),
    "amx_off": RowPlan("amx_bf16 present, TESSERA_AMX=0", 8, False, 16),
    "avx512_bf16": RowPlan("avx512_bf16, no AMX", 32, False, 16),
    "other": RowPlan("no native bf16", ALWAYS, False, 16),
}

_plan: list[RowPlan] = []


def isa() -> str:
    """The key of PLANS for this CPU and build."""
    flags = cpu_flags().split()
    if cpu_amx.available():
        return "amx"
    dp = ops.function("linear_bf16_dp") is not None
    if "amx_bf16" in flags and dp:
        return "amx_off"
    if ("avx512_bf16" in flags or "amx_bf16" in flags) and dp:
        return "avx512_bf16"
    return "other"


def plan() -> RowPlan:
    """This process's plan (decided and logged once)."""
    if not _plan:
        _plan.append(PLANS[isa()])
        logger.info("%s", _plan[0].describe())
    return _plan[0]


def w4_int8_x_from_rows() -> int | None:
    """The rows from which this CPU's w4 paths take x as int8 per group of 32: 1 with AVX2
    (the w4 kernel, every call), cpu_w4.max_rows() + 1 with AVX512-VNNI and no AMX (the batch
    kernel); None where no call does (AMX-bf16 tiles, or the tiles dequantized, above the w4
    kernel's rows)."""
    if not cpu_w4.available():
        return None
    if cpu_w4.x_as_int8():
        return 1
    return cpu_w4.max_rows() + 1 if cpu_w4.batch_available() and not plan().amx else None
