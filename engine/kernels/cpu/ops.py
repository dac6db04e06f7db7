"""The ctypes bindings of the CPU kernel library: one table of every exported function's
argtypes and restype, set once when build.py has loaded the library, and the ctypes mirrors
of the structs it takes (STRUCTS). It mirrors include/tessera_kernels.h, and
tests/engine/kernels/test_bindings.py holds the two to each other. The compile-time
constants Python needs are read from that header too (CONSTANTS).

The Python wrappers (beside the sources: gemm.py, w4.py, w8a8.py, amx_bf16.py, gguf.py,
lut4.py, fused_ops.py, isa.py; engine.attention.cpu_kernel, the decode plan) get their C
functions here: function(name), or library() for getattr by a dtype-suffixed name.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import re
import threading
from collections.abc import Iterator
from typing import Any

from engine.kernels.cpu import build

logger = logging.getLogger("tessera.engine")


def _constants(header: str) -> dict[str, int]:
    """The header's `#define NAME <integer>` lines."""
    return {m[1]: int(m[2]) for m in re.finditer(r"^#define\s+(\w+)\s+(\d+)\b", header, re.M)}


CONSTANTS = _constants(build.header_text())
ROWS_MAX_M = CONSTANTS["ROWS_MAX_M"]
W4_MAX_ROWS = CONSTANTS["W4_MAX_ROWS"]
W4_TILE = CONSTANTS["W4_TILE"]
W4_GROUP_BYTES = CONSTANTS["W4_GROUP_BYTES"]
W8A8_BLOCK_COLS = CONSTANTS["W8A8_BLOCK_COLS"]
ATTN_MAX_ROW = CONSTANTS["ATTN_MAX_ROW"]

_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# x, ldx, M, K, w, w_scale, N, bias, y, ldy, threads
_LINEAR = [_P, _I64, _I64, _I64, _P, _P, _I64, _P, _P, _I64, _INT]
# x, ldx, M, K, q, s, threads
_QUANT = [_P, _I64, _I64, _I64, _P, _P, _INT]
# acc, M, N, s, w_scale, bias, y, threads
_DEQUANT = [_P, _I64, _I64, _P, _P, _P, _P, _INT]
# acc, M, I, s, w_scale, bias, q, q_scale, tmp, threads
_SILU_QUANT = [_P, _I64, _I64, _P, _P, _P, _P, _P, _P, _INT]
# x, ldx, residual, ldr, w, out, ldo, rows, H, eps, threads
_RMSNORM = [_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _F32, _INT]
# x, ldx, out, ldo, rows, I, threads
_SILU_MUL = [_P, _I64, _P, _I64, _I64, _I64, _INT]
# x, ldx, cos, sin, out, rows, heads, D, threads
_ROPE = [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _INT]
# out, out_stride, q, q_stride, k_cache, v_cache, k_scales, v_scales, block_tables,
# max_blocks, context_lens, n, H, Hkv, D, block_size, window (0: none), scale, scratch,
# scratch_size, threads
_DECODE = [_P, _I64, _P, _I64, _P, _P, _P, _P, _P, _I64, _P, _I64, _INT, _INT, _INT, _INT]
_DECODE += [_INT, _F32, _P, _P, _I64, _INT]  # ..., window, scale, sinks, scratch, ...
# k_cache, v_cache, k_scales, v_scales, slots, n, k, k_stride, v, v_stride, Hkv, D, block_size
_KV8_WRITE = [_P, _P, _P, _P, _P, _I64, _P, _I64, _P, _I64, _INT, _INT, _INT]

_LORA = [_P, _I64, _P, _I64, _I64, _P, _P, _P, _P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64]
_LORA += [_P, _P, _P, _P, _INT]

Signature = tuple[list[Any], Any]  # (argtypes, restype)

# Every function tessera_kernels.h declares, in its order.
SIGNATURES: dict[str, Signature] = {
    # gemm.c
    "linear_bf16": (_LINEAR, _INT),
    "linear_f32": (_LINEAR, _INT),
    "linear_i8_bf16": (_LINEAR, _INT),
    "linear_i8_f32": (_LINEAR, _INT),
    "linear_bf16_dp": (_LINEAR, _INT),
    "linear_i8_bf16_dp": (_LINEAR, _INT),
    # w4.c or w4_avx2.c: x, ldx, M, K, weight tiles, N, bias, y, ldy, threads
    "linear_q4_bf16": ([_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _INT], _INT),
    "w4_max_rows": ([], _INT),
    "linear_q4_bf16_batch": ([_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _INT], _INT),
    "linear_q8_vnni_f32": ([_P, _I64, _I64, _I64, _P, _I64, _P, _I64, _INT], _INT),
    "linear_q8_vnni_argmax": ([_P, _I64, _I64, _I64, _P, _I64, _P, _INT], _INT),
    "linear_q8w4_f32": ([_P, _I64, _I64, _I64, _P, _I64, _P, _I64, _INT], _INT),
    # w4_tiles.c: tiles, N, K, out, bf16, threads
    "w4_dequantize": ([_P, _I64, _I64, _P, _INT, _INT], _INT),
    # gguf.c: x, ldx, M, K, blocks, type, N, bias, y, ldy, bf16, threads
    "gguf_linear": ([_P, _I64, _I64, _I64, _P, _INT, _I64, _P, _P, _I64, _INT, _INT], _INT),
    # blocks, type, N, K, out, bf16, threads
    "gguf_dequantize": ([_P, _INT, _I64, _I64, _P, _INT, _INT], _INT),
    # type, row, K, out
    "gguf_dequant_row": ([_INT, _P, _I64, _P], _INT),
    # blocks, type, N, K, ids, n, out, bf16
    "gguf_gather_rows": ([_P, _INT, _I64, _I64, _P, _I64, _P, _INT], _INT),
    "gguf_block_bytes": ([_INT], _INT),
    "gguf_isa_max": ([], _INT),
    # gguf_k.c: gguf_linear's and gguf_dequantize's arguments; type, row, K, out
    "gguf_k_linear": ([_P, _I64, _I64, _I64, _P, _INT, _I64, _P, _P, _I64, _INT, _INT], _INT),
    "gguf_k_dequantize": ([_P, _INT, _I64, _I64, _P, _INT, _INT], _INT),
    "gguf_k_dequant_row": ([_INT, _P, _I64, _P], _INT),
    "gguf_k_dequant_row_bf16": ([_INT, _P, _I64, _P], _INT),
    # lut4.c: x, ldx, M, K, codes, scales, table, N, bias, y, ldy, bf16, threads
    "lut4_linear": ([_P, _I64, _I64, _I64, _P, _P, _P, _I64, _P, _P, _I64, _INT, _INT], _INT),
    # codes, scales, table, N, K, out, bf16, threads
    "lut4_dequantize": ([_P, _P, _P, _I64, _I64, _P, _INT, _INT], _INT),
    "lut4_linear_bf16_tiles": ([_P, _I64, _I64, _I64, _P, _P, _P, _I64, _P, _P, _I64, _INT], _INT),
    "lut4_tiles_max_rows": ([], _INT),
    "lut4_isa_max": ([], _INT),
    # fp8.c: x, ldx, M, K, codes, scales, G, N, bias, y, ldy, bf16, threads
    "fp8_linear": ([_P, _I64, _I64, _I64, _P, _P, _I64, _I64, _P, _P, _I64, _INT, _INT], _INT),
    # codes, scales, G, N, K, out, bf16, threads
    "fp8_dequantize": ([_P, _P, _I64, _I64, _I64, _P, _INT, _INT], _INT),
    # codes, scales, G, K, out
    "fp8_dequant_row_bf16": ([_P, _P, _I64, _I64, _P], _INT),
    "fp8_tiles_max_rows": ([], _INT),
    "fp8_linear_bf16_tiles": ([_P, _I64, _I64, _I64, _P, _P, _I64, _I64, _P, _P, _I64, _INT], _INT),
    "fp8_isa_max": ([], _INT),
    # w8a8.c
    "quantize_rows_f32": (_QUANT, None),
    "quantize_rows_bf16": (_QUANT, None),
    "dequant_f32": (_DEQUANT, None),
    "dequant_bf16": (_DEQUANT, None),
    "silu_quant_f32": (_SILU_QUANT, None),
    "silu_quant_bf16": (_SILU_QUANT, None),
    # w, N, K, out
    "pack_i8": ([_P, _I64, _I64, _P], None),
    # x, ldx, M, K, packed, N, y, ldy, threads
    "gemm_i8": ([_P, _I64, _I64, _I64, _P, _I64, _P, _I64, _INT], _INT),
    # x, ldx, M, K, packed, N, xs, ws, bias, y, bf16, threads
    "gemm_i8_scaled": ([_P, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _P, _INT, _INT], _INT),
    # x, ldx, M, K, packed, N, xs, ws, val, col, token, threads
    "gemm_i8_argmax": ([_P, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _P, _P, _INT], _INT),
    # x, ldx, M, K, packed, I, xs, ws, bias, bias_bf16, h, hmax, q, qs, threads
    "gemm_i8_silu_quant": (
        [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _INT, _P, _P, _P, _P, _INT],
        _INT,
    ),
    "amx_enabled": ([], _INT),
    # amx_bf16.c
    "amx_bf16_enabled": ([], _INT),
    # x, ldx, M, K, w, N, bias, y, ldy, out_f32, threads
    "amx_bf16_linear": ([_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _INT, _INT], _INT),
    "amx_bf16_linear_argmax": ([_P, _I64, _I64, _I64, _P, _I64, _P, _INT], _INT),
    # x, ldx, M, K, w4 tiles, N, bias, y, ldy, out_f32, threads
    "amx_bf16_linear_w4": ([_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _INT, _INT], _INT),
    "amx_bf16_linear_w4_prefetch": (
        [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _INT, _P, _INT],
        _INT,
    ),
    "amx_bf16_gated_w4": ([_P, _I64, _I64, _I64, _P, _I64, _P, _I64, _INT], _INT),
    # x, ldx, M, K, rows, row_bytes, type, N, bias, y, ldy, out_f32, threads
    "amx_bf16_linear_gguf": (
        [_P, _I64, _I64, _I64, _P, _I64, _INT, _I64, _P, _P, _I64, _INT, _INT],
        _INT,
    ),
    # x, ldx, M, K, codes, scales, G, N, bias, y, ldy, out_f32, threads
    "amx_bf16_linear_fp8": (
        [_P, _I64, _I64, _I64, _P, _P, _I64, _I64, _P, _P, _I64, _INT, _INT],
        _INT,
    ),
    # fused_ops.c
    "rmsnorm_f32": (_RMSNORM, None),
    "rmsnorm_bf16": (_RMSNORM, None),
    "silu_mul_f32": (_SILU_MUL, None),
    "silu_mul_bf16": (_SILU_MUL, None),
    "rope_f32": (_ROPE, None),
    "rope_bf16": (_ROPE, None),
    # lora.c: x, ldx, y, ldy, K, rows, seg_start, seg_len, seg_slot, nseg, a, a_rows, width,
    # bt, out, R, nslices, slice_row, slice_size, slice_off, slice_rank, threads
    "lora_apply_f32": (_LORA, _INT),
    "lora_apply_bf16": (_LORA, _INT),
    "lora_apply_bf16w": (_LORA, _INT),  # bf16 slots
    "lora_apply_bf16w_portable": (_LORA, _INT),
    "lora_apply_bf16w_amx": (_LORA, _INT),  # 1: not taken (no AMX-bf16, K % 32)
    # paged_attention.c
    "paged_decode_f32": (_DECODE, None),
    "paged_decode_bf16": (_DECODE, None),
    "paged_decode_kv8_f32": (_DECODE, None),
    "paged_decode_kv8_bf16": (_DECODE, None),
    "kv8_write_f32": (_KV8_WRITE, None),
    "kv8_write_bf16": (_KV8_WRITE, None),
    "kv_write": ([_P, _P, _P, _I64, _P, _I64, _P, _I64, _I64, _INT], None),
    # decode_plan.c: Shape*, Layer[n_layers], n_layers, Step*
    "run_decode": ([_P, _P, _I64, _P], _INT),
}
# The structs the header defines (decode_plan.c's arguments), field for field: the decode
# plan (engine.worker.cpu_graph) fills them.


class Shape(ctypes.Structure):
    _fields_ = [
        (n, _I64)
        for n in ("hidden", "heads", "kv_heads", "head_dim", "inter", "block_size", "kv_int8")
    ] + [("eps", _F32), ("scale", _F32)]


class LoraLayer(ctypes.Structure):
    _fields_ = [
        (n, _P) for n in ("a", "bt", "width", "slice_row", "slice_size", "slice_off", "slice_rank")
    ] + [(n, _I64) for n in ("a_rows", "out", "rank", "nslices", "bf16_slots", "amx")]


class PrefetchRanges(ctypes.Structure):
    _fields_ = [
        ("ptr", _P * CONSTANTS["PREFETCH_MAX_RANGES"]),
        ("bytes", _I64 * CONSTANTS["PREFETCH_MAX_RANGES"]),
        ("n", _I64),
    ]


class Layer(ctypes.Structure):
    _fields_ = [
        ("in_norm", _P), ("post_norm", _P), ("w4", _P * 4), ("bias", _P * 4),
        ("packed", _P * 4), ("wscale", _P * 4), ("k_cache", _P), ("v_cache", _P),
        ("k_scales", _P), ("v_scales", _P), ("lora", _P * 4), ("lut4", _P * 4),
        ("lut4_scales", _P * 4), ("lut4_levels", _P * 4),
    ]  # fmt: skip


# Step's activation buffers, and those of its int8-activation (w8a8) steps, by field name
STEP_BUFFERS = ("hidden", "residual", "normed", "qkv", "qk", "attn", "gate_up", "act")
STEP_W8A8_BUFFERS = ("xq", "xs", "h", "hmax", "hq", "hs")


class Step(ctypes.Structure):
    _fields_ = (
        [(n, _I64) for n in ("rows", "max_blocks", "scratch_size")]
        + [(n, _P) for n in STEP_BUFFERS]
        + [(n, _P) for n in ("cos", "sin", "slots", "block_tables", "context_lens", "scratch")]
        + [("threads", _INT), ("decode_threads", _INT), ("w8a8", _INT)]
        + [(n, _P) for n in STEP_W8A8_BUFFERS]
        + [("amx", _INT)]
        + [(n, _P) for n in ("lora_rows", "lora_seg_start", "lora_seg_len", "lora_seg_slot")]
        + [("lora_nseg", _I64)]
    )


# Every struct tessera_kernels.h defines, by its C name.
STRUCTS: dict[str, type[ctypes.Structure]] = {
    "Shape": Shape,
    "LoraLayer": LoraLayer,
    "Layer": Layer,
    "Step": Step,
    "prefetch_ranges": PrefetchRanges,
}

# Compiled only where the CPU has the instructions they need (see the header): absent from
# the library elsewhere, and function() answers None for them.
OPTIONAL = frozenset(
    {
        "linear_bf16_dp", "linear_i8_bf16_dp", "linear_q4_bf16", "w4_max_rows", "linear_q8w4_f32",
        "linear_q4_bf16_batch", "linear_q8_vnni_f32", "linear_q8_vnni_argmax", "pack_i8", "gemm_i8", "gemm_i8_scaled", "gemm_i8_argmax", "gemm_i8_silu_quant", "amx_enabled",
    }
)  # fmt: skip
# Exported variables (`extern` in the header), with their ctypes type.
VARIABLES: dict[str, Any] = {
    "use_amx": ctypes.c_int,
    "gguf_isa": ctypes.c_int,
    "lut4_isa": ctypes.c_int,
    "fp8_isa": ctypes.c_int,
}

_lock = threading.Lock()
_bound: list[ctypes.CDLL | None] = []  # the library with its signatures set, or None


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL | None:
    for name, (argtypes, restype) in SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is None:
            if name in OPTIONAL:
                continue
            logger.warning("The CPU kernel library lacks %s; torch paths", name)
            return None
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def library() -> ctypes.CDLL | None:
    """The kernel library with every signature set, or None (disabled, no compiler, a failed
    build). Cheap after the first call: the hot paths ask on every call."""
    if _bound:
        return _bound[0]
    with _lock:
        if not _bound:
            lib = build.load_library()
            _bound.append(None if lib is None else _bind(lib))
        return _bound[0]


def function(name: str):
    """The bound C function, or None: no library, or one of the OPTIONAL functions this CPU
    does not build."""
    if name not in SIGNATURES:
        raise KeyError(f"{name} is not in tessera_kernels.h")
    lib = library()
    return None if lib is None else getattr(lib, name, None)


def variable(name: str):
    """An exported variable (ctypes.c_int.in_dll), or None where it is not built."""
    lib = library()
    if lib is None:
        return None
    try:
        return VARIABLES[name].in_dll(lib, name)
    except ValueError:  # not in the library
        return None


def variant_names(max_function: str, variants: dict[str, int]) -> list[str]:
    """The variants (name -> the kernel's value) a kernel with a run-time choice has in this
    build, slowest first: those up to what `max_function` returns (gguf_isa_max, ...)."""
    fn = function(max_function)
    top = -1 if fn is None else fn()
    return [n for n, v in variants.items() if v <= top]


@contextlib.contextmanager
def forced_variable(name: str, value: int) -> Iterator[None]:
    """The exported int `name` set to value inside the block (the tests' way to reach each
    variant of a kernel: gguf_isa, lut4_isa)."""
    var = variable(name)
    old = var.value
    var.value = value
    try:
        yield
    finally:
        var.value = old
