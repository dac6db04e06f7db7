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
Q4_1 file llama.cpp serves (0.051, simulated the same way). Small batches (at most
cpu_gemm's ROWS_MAX_M rows) keep the weight-only kernel: they are bound by reading the
weights, which are the same int8 rows.

Two small C loops around torch._int_mm: quantizing the rows and the scaled epilogue (each
one pass, where the torch ops would be several). Built with the other CPU kernels
(engine.cpu_build); TESSERA_CPU_KERNELS=0 disables them (the torch fallback stays exact to
the same arithmetic, only slower).
"""

from __future__ import annotations

import ctypes

import torch

from engine.cpu_build import C_BF16_HELPERS, load_library

_SOURCE = (
    C_BF16_HELPERS
    + r"""
#include <stdint.h>
#include <math.h>
#include <omp.h>

#define PAR_ROWS 256  /* below this the loops stay on the calling thread */

/* q[m] = round(x[m] / s[m]) with s[m] = max|x[m]| / 127 (0 for an all-zero row). */
#define DEFINE_QUANTIZE(NAME, T, LOAD)                                                        \
void NAME(const T* x, int64_t ldx, int64_t M, int64_t K, int8_t* q, float* s, int nthreads) { \
  _Pragma("omp parallel for num_threads(nthreads) if(M >= PAR_ROWS) schedule(static)")      \
  for (int64_t m = 0; m < M; ++m) {                                                          \
    const T* xr = x + m * ldx; int8_t* qr = q + m * K;                                       \
    float amax = 0.f;                                                                        \
    _Pragma("omp simd reduction(max:amax)")                                                  \
    for (int64_t k = 0; k < K; ++k) amax = fmaxf(amax, fabsf(LOAD(xr[k])));                  \
    const float scale = amax / 127.f;                                                        \
    s[m] = scale;                                                                            \
    const float inv = scale > 0.f ? 127.f / amax : 0.f;                                      \
    _Pragma("omp simd")                                                                      \
    for (int64_t k = 0; k < K; ++k) {                                                        \
      const float v = nearbyintf(LOAD(xr[k]) * inv);                                         \
      qr[k] = (int8_t)(v > 127.f ? 127.f : (v < -127.f ? -127.f : v));                       \
    }                                                                                        \
  }                                                                                          \
}
DEFINE_QUANTIZE(quantize_rows_f32, float, f2f)
DEFINE_QUANTIZE(quantize_rows_bf16, uint16_t, bf2f)

/* y[m][n] = acc[m][n] * s[m] * w_scale[n] (+ bias[n]), rounded once to the output type. */
#define DEFINE_DEQUANT(NAME, T, LOAD, STORE)                                                  \
void NAME(const int32_t* acc, int64_t M, int64_t N, const float* s, const float* wscale,    \
    const T* bias, T* y, int nthreads) {                                                     \
  _Pragma("omp parallel for num_threads(nthreads) if(M >= PAR_ROWS) schedule(static)")      \
  for (int64_t m = 0; m < M; ++m) {                                                          \
    const int32_t* a = acc + m * N; T* yr = y + m * N; const float sm = s[m];                \
    if (bias) {                                                                              \
      _Pragma("omp simd")                                                                    \
      for (int64_t n = 0; n < N; ++n) yr[n] = STORE((float)a[n] * sm * wscale[n] + LOAD(bias[n])); \
    } else {                                                                                 \
      _Pragma("omp simd")                                                                    \
      for (int64_t n = 0; n < N; ++n) yr[n] = STORE((float)a[n] * sm * wscale[n]);          \
    }                                                                                        \
  }                                                                                          \
}
DEFINE_DEQUANT(dequant_f32, float, f2f, f2f)
DEFINE_DEQUANT(dequant_bf16, uint16_t, bf2f, f2bf)
"""
)

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
# x, ldx, M, K, q, s, threads
_QUANT_ARGS = [_P, _I64, _I64, _I64, _P, _P, ctypes.c_int]
# acc, M, N, s, w_scale, bias, y, threads
_DEQUANT_ARGS = [_P, _I64, _I64, _P, _P, _P, _P, ctypes.c_int]
_SIGNATURES = {f"quantize_rows_{sfx}": (_QUANT_ARGS, None) for sfx in _SUFFIX.values()}
_SIGNATURES |= {f"dequant_{sfx}": (_DEQUANT_ARGS, None) for sfx in _SUFFIX.values()}


def _load() -> ctypes.CDLL | None:
    return load_library("w8a8", _SOURCE, "int8 activations", _SIGNATURES)


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
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, amax / 127.0


def linear_w8a8(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_scale: torch.Tensor,
) -> torch.Tensor:
    """x [..., K] (float32/bfloat16) against int8 weight [N, K] with float32 weight_scale [N]:
    x quantized per row, an exact int32 GEMM, then the two scales (and bias) in one pass."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    q, s = quantize_rows(x2)
    acc = torch._int_mm(q, weight.t())  # [M, N] int32, exact
    lib = _load()
    m = x2.shape[0]
    if lib is None or x.dtype not in _SUFFIX or (bias is not None and bias.dtype != x.dtype):
        y = acc.float() * s[:, None] * weight_scale
        y = (y if bias is None else y + bias.float()).to(x.dtype)
    else:
        y = torch.empty(m, n, dtype=x.dtype)
        b = None if bias is None else bias.contiguous()  # kept alive across the call
        getattr(lib, f"dequant_{_SUFFIX[x.dtype]}")(
            acc.data_ptr(), m, n, s.data_ptr(), weight_scale.data_ptr(),
            None if b is None else b.data_ptr(), y.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
    return y.view(*x.shape[:-1], n)
