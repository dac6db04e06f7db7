"""A step's LoRA deltas on one linear layer in one C call (lora.c), the CPU's batched LoRA.

Why: the torch path (engine.lora.layers) runs, per adapter in the step, a shrink and one
expand per slice, each a few microseconds of dispatch around a few microseconds of work:
with 8 adapters in a batch that is ~40 small calls per layer, ~5,000 a step on a 30-layer
model. Here it is one call per layer, whatever the number of adapters, over the same
segments (rows grouped by slot) the Triton kernels read. The torch path stays the
reference; tests check this against it.
"""

from __future__ import annotations

import torch

from engine.kernels.cpu import amx_bf16 as cpu_amx
from engine.kernels.cpu import build, ops

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
MAX_RANK = ops.CONSTANTS["LORA_MAX_RANK"]  # a slot's rank the kernel takes (its stack block)


def available() -> bool:
    """Whether the kernel is on: built, and TESSERA_CPU_KERNELS not 0."""
    return build.kernels_enabled() and ops.function("lora_apply_f32") is not None


def supports(x: torch.Tensor, y: torch.Tensor, bt: torch.Tensor) -> bool:
    """Whether lora_apply takes these: CPU x/y of one float32/bfloat16 dtype with unit last
    stride, slots of rank up to MAX_RANK (bt [slots, R, out]): float32, or bfloat16 over
    bfloat16 rows."""
    return (
        x.device.type == "cpu"
        and x.dtype in _SUFFIX
        and y.dtype == x.dtype
        and x.stride(-1) == 1
        and y.stride(-1) == 1
        and (bt.dtype == torch.float32 or bt.dtype == x.dtype == torch.bfloat16)
        and bt.shape[1] <= MAX_RANK
    )


def slot_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The CPU slots' dtype for a model: bfloat16 for a bfloat16 model (half the bytes a
    step streams, the products on AVX512-BF16 where the CPU has it: lora_apply_bf16w),
    float32 otherwise (float32 models, float16: the kernel takes neither half type's rows
    with the other's slots)."""
    return torch.bfloat16 if model_dtype == torch.bfloat16 else torch.float32


def amx_takes(slot_dtype: torch.dtype, in_features: int) -> bool:
    """Whether a layer of these slots runs on AMX-bf16 tiles (lora_amx.c): bf16 slots, K a
    multiple of 32, the tiles here and not turned off (TESSERA_AMX=0)."""
    return (
        slot_dtype == torch.bfloat16
        and in_features % 32 == 0
        and cpu_amx.available()
        and ops.function("lora_apply_bf16w_amx") is not None
    )


def lora_apply(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    width: torch.Tensor,
    slice_row: torch.Tensor,
    slice_size: torch.Tensor,
    slice_off: torch.Tensor,
    slice_rank: torch.Tensor,
    rows: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    seg_slot: torch.Tensor,
    variant: str = "auto",
) -> bool:
    """y[rows] += each row's slot's B (A x) in place; False where the variant asked for could
    not take the call (y untouched). x [T, K], y [T, out] (row strides free); a [slots, n*R, K] and bt [slots, R, out] (B transposed) contiguous, float32 or
    (x bfloat16) bfloat16; variant, for bf16 slots: "auto" (AMX-bf16 tiles where amx_takes,
    else the vector kernel), "vector" (AVX512-BF16 where built, else plain C), "portable"
    (plain C: what CPUs without AVX512-BF16 run), "amx" (the tiles; False where they cannot
    take the call: the tests' way to force each); width [slots];
    slice_row / slice_size [n]; slice_off / slice_rank [slots, n]; rows, seg_start, seg_len,
    seg_slot as engine.lora.layers.LoRABatch sets them (int32, contiguous)."""
    assert a.is_contiguous() and bt.is_contiguous()
    args = (
        x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), x.shape[1],
        rows.data_ptr(), seg_start.data_ptr(), seg_len.data_ptr(), seg_slot.data_ptr(),
        seg_slot.numel(), a.data_ptr(), a.shape[1], width.data_ptr(), bt.data_ptr(),
        bt.shape[2], bt.shape[1], slice_row.numel(), slice_row.data_ptr(),
        slice_size.data_ptr(), slice_off.data_ptr(), slice_rank.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if bt.dtype != torch.bfloat16:
        names = [f"lora_apply_{_SUFFIX[x.dtype]}"]
    elif variant == "auto":
        amx = amx_takes(bt.dtype, x.shape[1])
        names = ["lora_apply_bf16w_amx", "lora_apply_bf16w"] if amx else ["lora_apply_bf16w"]
    else:
        names = [{"vector": "lora_apply_bf16w", "portable": "lora_apply_bf16w_portable",
                  "amx": "lora_apply_bf16w_amx"}[variant]]  # fmt: skip
    for name in names:
        rc = ops.function(name)(*args)
        if rc == 1:  # the tiles could not take it: the next
            continue
        if rc != 0:
            raise MemoryError("lora_apply: could not allocate its scratch")
        return True
    return False
