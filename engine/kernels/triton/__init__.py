"""Triton kernels of the CUDA path (the `triton` attention backend).

kv_store: this step's K/V into the paged cache through the slot mapping (bf16/fp16/fp32, or
fp8 e4m3 with per-tensor scales); paged_attention: one varlen kernel for decodes and prefill
chunks over the block table, with a context-split (flash-decoding) reduce for small batches.
Imported by their users, not here: quant_gemm (W4A16 / W8A16 GEMM over GPTQ-style packed
integer weights, dequantized in the loop) and fp8 (dynamic per-token fp8 activation
quantization, for engine.kernels.fp8).

Importing this package imports triton: only the triton backend does, when it is chosen. Under
TRITON_INTERPRET=1 (set before the first import) the kernels run on CPU tensors, which is how
the tests check them without a GPU; the interpreter's arithmetic on bf16 values is broken and
its fp32 -> bf16 cast truncates, so the kernels upcast before any arithmetic.
"""

from engine.kernels.triton.kv_store import store_kv
from engine.kernels.triton.paged_attention import (
    MAX_SPLITS,
    AttentionLaunch,
    max_split_rows,
    paged_attention,
    plan_launch,
)

__all__ = [
    "MAX_SPLITS",
    "AttentionLaunch",
    "max_split_rows",
    "paged_attention",
    "plan_launch",
    "store_kv",
]
