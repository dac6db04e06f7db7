"""y = x W^T (+ b) with int8 weights AND int8 activations on CPU (`--quantization w8a8`).

Why: from a few dozen rows (prefill, large decode batches) a CPU step is bound by GEMM
compute, and the CPU's int8 dot products (VNNI) do twice the work per cycle of its bf16 ones:
torch._int_mm (oneDNN) reaches 700-800 GOP/s on two Zen 4 cores at 128-1024 rows where the
bf16 matmul reaches 320-390 GFLOP/s, and 1.4x the AVX512-BF16 kernel at 32 rows.

Each row m of x is quantized on the fly, symmetrically: s[m] = max|x[m]| / 127,
q[m] = round(x[m] / s[m]); then y[m][n] = s[m] * w_scale[n] * (q[m] . w_q[n]) (+ b[n]), the
dot products exact in int32. This costs accuracy that weight-only int8 does not: on
SmolLM2-135M-Instruct over 1,024 tokens of English, the mean KL divergence from the bf16
model's next-token distribution is 0.049 (weight-only int8: 0.007), about the loss of the
Q4_1 file llama.cpp serves (0.051, simulated the same way). Small batches (fewer than
W8A8_MIN_ROWS rows, AMX_W8A8_MIN_ROWS on AMX: engine.layers.quantization.w8a8) keep the
weight-only kernel: they are bound by reading the weights, which are the same int8 rows, and
_int_mm is slower there.

Small C loops around the int8 GEMM: quantizing the rows and the scaled epilogue (each one
pass, where the torch ops would be several). The GEMM itself runs on a packed copy of the
weights (int_mm, on AVX512-VNNI) up to PACKED_MAX_ROWS rows, torch._int_mm beyond: oneDNN
repacks the weight on every call, which at 13-256 rows costs as much as the multiply. The
MLP (mlp_w8a8) goes further: between its two GEMMs one pass takes gate_up's int32 sums to
the int8 rows down_proj needs (scales, SiLU, product, quantization), 10% less MLP time at
32-128 rows than layer by layer; on the packed weight that pass runs in the GEMM's own tiles
(gemm_i8_silu_quant), so gate_up's int32 sums never reach memory. On CPUs with AMX (Intel
Sapphire Rapids and later) the packed GEMMs run on its tiles instead of VNNI's (K % 64 == 0;
TESSERA_AMX=0 keeps VNNI): the same packed weight, the same exact sums; on two cores of a
Xeon with AMX, ~2x faster at 32-128 rows and 2-3x at 1,024, and 128 streams of w4a8
1.3-1.6x faster (served and LLM.generate). Built with the other CPU kernels
(engine/kernels/cpu/w8a8.c); TESSERA_CPU_KERNELS=0 disables them (the torch fallback stays
exact to the same arithmetic, only slower).
"""

from __future__ import annotations

import ctypes
import os

import torch

from engine.kernels.cpu import ops

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _load() -> ctypes.CDLL | None:
    return ops.library()


# Above this many rows torch._int_mm's repacking is amortized (16-48% slower than the packed
# GEMM at 13-256 rows, 0-13% faster at 1,024-2,048 on a Zen 4). Up to it the MLP runs its
# SiLU pass inside the GEMM (20% less MLP time at 1,024 rows) and the decode plan takes the
# step: 1,024 covers the server's prefill chunks (--max-num-batched-tokens on a CPU).
PACKED_MAX_ROWS = 1024
# the packed GEMM's column blocks (16 * GEMM_NV): the SiLU and argmax epilogues keep one
# partial maximum per row and block
BLOCK_COLS = ops.W8A8_BLOCK_COLS
_gemm: list = []  # (pack_i8, gemm_i8, gemm_i8_scaled, gemm_i8_silu_quant, gemm_i8_argmax)


def _gemm_functions():
    if not _gemm:
        lib = _load()
        fns = None
        if lib is not None and hasattr(lib, "gemm_i8"):
            ops.variable("use_amx").value = os.environ.get("TESSERA_AMX") != "0"
            fns = (
                lib.pack_i8, lib.gemm_i8, lib.gemm_i8_scaled, lib.gemm_i8_silu_quant,
                lib.gemm_i8_argmax,
            )  # fmt: skip
        _gemm.append(fns)
    return _gemm[0]


def set_amx(enabled: bool) -> bool:
    """Let the packed GEMMs run on AMX tiles where the CPU has them (the default;
    TESSERA_AMX=0 turns them off) or keep them on AVX512-VNNI; returns whether a K % 64 == 0
    GEMM now runs on AMX."""
    _amx.clear()
    if _gemm_functions() is None:
        return False
    ops.variable("use_amx").value = enabled
    return amx_runs(64)


_amx: list[bool] = []  # whether the packed GEMMs run on AMX now, once asked


def amx_runs(k: int) -> bool:
    """Whether a packed GEMM over k input columns runs on AMX tiles (not VNNI's)."""
    if not _amx:
        _amx.append(_gemm_functions() is not None and bool(_load().amx_enabled()))
    return _amx[0] and k % 64 == 0


def packed_available() -> bool:
    """Whether the packed int8 GEMM is built for this CPU (AVX512-VNNI or AMX; not AVX2)."""
    return _gemm_functions() is not None


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """int8 [N, K] -> the packed copy int_mm multiplies without repacking (uint8, N * K
    bytes), or None where the kernel cannot take it (no AVX512-VNNI, N % 16, K % 4)."""
    fns = _gemm_functions()
    n, k = weight.shape
    if fns is None or n % 16 or k % 4 or weight.dtype != torch.int8:
        return None
    w = weight.contiguous()
    out = torch.empty(n * k, dtype=torch.uint8)
    fns[0](w.data_ptr(), n, k, out.data_ptr())
    return out


def _ok(rc: int) -> None:
    """The packed GEMMs return -1 when a buffer could not be allocated."""
    if rc != 0:
        raise MemoryError("int8 GEMM: out of memory")


def int_mm(q: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    """q int8 [M, K] . weight int8 [N, K]^T -> exact int32 [M, N]: on the packed copy when
    there is one (up to PACKED_MAX_ROWS rows), else torch._int_mm."""
    m, k = q.shape
    fns = _gemm_functions()
    if packed is None or fns is None or m > PACKED_MAX_ROWS or q.stride(1) != 1:
        return torch._int_mm(q, weight.t())
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=torch.int32)
    _ok(fns[1](q.data_ptr(), q.stride(0), m, k, packed.data_ptr(), n, y.data_ptr(), n,
               torch.get_num_threads()))  # fmt: skip
    return y


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (float32 or bfloat16) -> (int8 [M, K], float32 scale [M]), x ~ q * s[:, None]."""
    lib = _load()
    if lib is None or x.dtype not in _SUFFIX or x.stride(-1) != 1:
        return quantize_rows_reference(x)
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    s = torch.empty(m, dtype=torch.float32)
    getattr(lib, f"quantize_rows_{_SUFFIX[x.dtype]}")(
        x.data_ptr(), x.stride(0), m, k, q.data_ptr(), s.data_ptr(), torch.get_num_threads()
    )
    return q, s


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch version of quantize_rows (the tests' reference and the fallback)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    # a true division, as the C quantizer's q8_inv (python's 127.0 / tensor would not be)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, amax / 127.0


def linear_w8a8(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] (float32/bfloat16) against int8 weight [N, K] with float32 weight_scale [N]
    (and its packed copy, pack_weight): x quantized per row, an exact int32 GEMM, then the two
    scales (and bias) in one pass, rounded to out_dtype (default x's: the LM head asks for
    float32 logits directly)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    q, s = quantize_rows(x2)
    y = _scaled_mm(q, s, weight, packed, weight_scale, bias, out_dtype or x.dtype)
    return y.view(*x.shape[:-1], n)


def argmax_w8a8(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, packed: torch.Tensor | None
) -> torch.Tensor | None:
    """argmax over the last dim of linear_w8a8(x, weight, None, weight_scale, torch.float32,
    packed), the first maximum winning, as int64 [M]; or None where the packed GEMM cannot take
    the call. The same float32 values are compared, but none is written: at 128 rows of a
    49,152-token vocabulary that is 25 MB of logits a greedy step never needs."""
    fns = _gemm_functions()
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if packed is None or fns is None or m > PACKED_MAX_ROWS or x.dtype not in _SUFFIX:
        return None
    q, s = quantize_rows(x2)
    ncb = -(-n // BLOCK_COLS)
    val = torch.empty(m, ncb, dtype=torch.float32)
    col = torch.empty(m, ncb, dtype=torch.int32)
    token = torch.empty(m, dtype=torch.int64)
    _ok(fns[4](
        q.data_ptr(), q.stride(0), m, k, packed.data_ptr(), n, s.data_ptr(),
        weight_scale.data_ptr(), val.data_ptr(), col.data_ptr(), token.data_ptr(),
        torch.get_num_threads(),
    ))  # fmt: skip
    return token


def _scaled_mm(
    q: torch.Tensor,
    s: torch.Tensor,
    weight: torch.Tensor,
    packed: torch.Tensor | None,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """_scaled(int_mm(q, weight, packed), s, weight_scale, bias, dtype) in one pass where the
    packed GEMM takes the call: it scales each tile's sums as it finishes them, so the int32
    [M, N] never goes through memory (the LM head's is 25 MB at 128 rows). Equal up to the
    order of the float multiplications (the compiler's choice in dequant's loop)."""
    fns = _gemm_functions()
    m, k = q.shape
    if (
        packed is None
        or fns is None
        or m > PACKED_MAX_ROWS
        or q.stride(1) != 1
        or dtype not in _SUFFIX
        or (bias is not None and (bias.dtype != dtype or not bias.is_contiguous()))
    ):
        return _scaled(int_mm(q, weight, packed), s, weight_scale, bias, dtype)
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=dtype)
    _ok(fns[2](
        q.data_ptr(), q.stride(0), m, k, packed.data_ptr(), n, s.data_ptr(),
        weight_scale.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
        int(dtype == torch.bfloat16), torch.get_num_threads(),
    ))  # fmt: skip
    return y


def _scaled(
    acc: torch.Tensor,
    s: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """acc [M, N] int32 -> acc * s[:, None] * weight_scale (+ bias), in dtype."""
    lib = _load()
    m, n = acc.shape
    if lib is None or dtype not in _SUFFIX or (bias is not None and bias.dtype != dtype):
        y = acc.float() * s[:, None] * weight_scale
        return (y if bias is None else y + bias.float()).to(dtype)
    y = torch.empty(m, n, dtype=dtype)
    b = None if bias is None else bias.contiguous()  # kept alive across the call
    getattr(lib, f"dequant_{_SUFFIX[dtype]}")(
        acc.data_ptr(), m, n, s.data_ptr(), weight_scale.data_ptr(),
        None if b is None else b.data_ptr(), y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return y


def mlp_w8a8(x: torch.Tensor, gate_up, down) -> torch.Tensor:
    """down(silu(gate) * up) with [gate | up] = gate_up(x), both layers w8a8 (int8 weight,
    weight_scale, optional bias; down unsharded): two int8 GEMMs with one C pass between
    them (scales, SiLU, product, and the int8 rows down_proj needs), where the layer by layer
    path takes four passes over the activations and rounds them to x's dtype twice. On the
    packed weight (up to PACKED_MAX_ROWS rows) that pass runs inside the first GEMM's tiles
    (gemm_i8_silu_quant)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    q, s = quantize_rows(x2)
    hq, hs = _silu_quant_fused(q, s, gate_up, x.dtype) or _silu_quant(q, s, gate_up, x.dtype)
    y = _scaled_mm(hq, hs, down.weight, down.packed_int8, down.weight_scale, down.bias, x.dtype)
    return y.view(*x.shape[:-1], -1)


def _silu_quant_fused(q: torch.Tensor, s: torch.Tensor, gate_up, dtype: torch.dtype):
    """(hq, hs) from the packed GEMM with the SiLU pass in its epilogue, or None where it
    cannot take the call (then _silu_quant does: int32 sums first)."""
    fns = _gemm_functions()
    m = q.shape[0]
    i = gate_up.weight.shape[0] // 2
    bias = gate_up.bias
    if (
        fns is None
        or gate_up.packed_int8 is None
        or m > PACKED_MAX_ROWS
        or i % 16
        or q.stride(1) != 1
        or dtype not in _SUFFIX
        or (bias is not None and (bias.dtype != dtype or not bias.is_contiguous()))
    ):
        return None
    hq = torch.empty(m, i, dtype=torch.int8)
    hs = torch.empty(m, dtype=torch.float32)
    h = torch.empty(m, i, dtype=torch.float32)
    hmax = torch.empty(m, -(-i // BLOCK_COLS), dtype=torch.float32)
    _ok(fns[3](
        q.data_ptr(), q.stride(0), m, q.shape[1], gate_up.packed_int8.data_ptr(), i, s.data_ptr(),
        gate_up.weight_scale.data_ptr(), None if bias is None else bias.data_ptr(),
        int(dtype == torch.bfloat16), h.data_ptr(), hmax.data_ptr(), hq.data_ptr(),
        hs.data_ptr(), torch.get_num_threads(),
    ))  # fmt: skip
    return hq, hs


def _silu_quant(q: torch.Tensor, s: torch.Tensor, gate_up, dtype: torch.dtype):
    """(hq, hs): gate_up's int32 sums, then one C pass (or its torch reference)."""
    acc = int_mm(q, gate_up.weight, gate_up.packed_int8)  # [M, 2I]
    m, i = acc.shape[0], acc.shape[1] // 2
    lib = _load()
    bias = gate_up.bias
    if lib is None or dtype not in _SUFFIX or (bias is not None and bias.dtype != dtype):
        gu = acc.float() * s[:, None] * gate_up.weight_scale
        if bias is not None:
            gu = gu + bias.float()
        h = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
        return quantize_rows_reference(h)
    hq = torch.empty(m, i, dtype=torch.int8)
    hs = torch.empty(m, dtype=torch.float32)
    threads = torch.get_num_threads()
    tmp = torch.empty(threads, i, dtype=torch.float32)
    getattr(lib, f"silu_quant_{_SUFFIX[dtype]}")(
        acc.data_ptr(), m, i, s.data_ptr(), gate_up.weight_scale.data_ptr(),
        None if bias is None else bias.data_ptr(), hq.data_ptr(), hs.data_ptr(),
        tmp.data_ptr(), threads,
    )  # fmt: skip
    return hq, hs
