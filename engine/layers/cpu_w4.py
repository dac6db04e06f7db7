"""4-bit weights for decode steps of one or two rows (`--quantization w4a8`).

A one-stream decode step reads every weight once, so its time is weight bytes over memory
bandwidth. Here each group of 32 consecutive weights of a row keeps 4-bit codes q in 0..15,
a scale s and a minimum m (both float16): w ~ s * q + m, like llama.cpp's Q4_1. With the
scales that is 0.625 bytes a weight against int8's 1.0. Groups of 32 follow outliers far
better than one int8 scale per row: on SmolLM2-135M, 4-bit groups on every linear layer
cost a mean next-token KL of 0.002 from bf16 (int8 rows on them and the LM head: 0.006).

The kernel takes one or two rows of x, quantized to int16 with one scale per row (as
cpu_gemm's `rows_i16`), unpacks 64 codes at a time to int16 and multiplies them with
vpdpwssd; each group's sum is scaled in float, and the minimums meet per-group sums of x:
y = xs * (sum_g s_g * (q_g . xq_g) + sum_g m_g * sum(xq_g)). Needs AVX512-VNNI, BW and F16C,
and K a multiple of 64; other layers and larger batches use the int8 weights the layer
keeps too (w8a8). Built once per machine like the other CPU kernels (engine.cpu_build).
"""

from __future__ import annotations

import ctypes

import torch

from engine.cpu_build import C_BF16_HELPERS, load_library

GROUP = 32
MAX_ROWS = 2  # rows of x the kernel takes; larger batches use the int8 weights
K_MULTIPLE = 64  # in features must be a multiple of this (two groups per 32 bytes)

_SOURCE = (
    C_BF16_HELPERS
    + r"""
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <omp.h>
#include <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define PF_BYTES 16384  /* the weight stream is prefetched this far ahead (see cpu_gemm) */
#define NB 64           /* weight rows per parallel task */

/* x [M][K] bf16 -> xq int16 with one scale per row (xs), each 64 values reordered as the
   kernel pairs them with two groups' codes: x[0..15], x[32..47], x[16..31], x[48..63];
   xg: each group's sum of xq. */
static void prep_x(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, int16_t* xq,
    float* xs, float* xg) {
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* xr = x + m * ldx;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = fmaxf(amax, fabsf(bf2f(xr[k])));
    xs[m] = amax / 32767.f;
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
    int16_t* q = xq + m * K;
    for (int64_t p = 0; p < K; p += 64)
      for (int i = 0; i < 16; ++i) {
        q[p + i] = (int16_t)nearbyintf(bf2f(xr[p + i]) * inv);
        q[p + 16 + i] = (int16_t)nearbyintf(bf2f(xr[p + 32 + i]) * inv);
        q[p + 32 + i] = (int16_t)nearbyintf(bf2f(xr[p + 16 + i]) * inv);
        q[p + 48 + i] = (int16_t)nearbyintf(bf2f(xr[p + 48 + i]) * inv);
      }
    for (int64_t g = 0; g < K / 32; ++g) {
      const int64_t p = (g / 2) * 64, h = (g % 2) * 16;  /* group g's halves in the order */
      int32_t sum = 0;
      for (int i = 0; i < 16; ++i) sum += q[p + h + i] + q[p + 32 + h + i];
      xg[m * (K / 32) + g] = (float)sum;
    }
  }
}

/* Weight rows [n0, n1), each K / 2 bytes of codes, then G float16 scales, then G float16
   minimums (one stream: separate arrays were two more streams, each row's first touch of
   them a cache miss). 32 bytes of codes hold two groups (byte j of a group: code j in the
   low nibble, code j + 16 in the high one). The scales are widened 16 at a time and spread
   to their groups' lanes with one permute; the minimums' term is one vector product per 16
   groups, added before the row's single horizontal sum. */
static inline __attribute__((always_inline)) void rows_q4(const int16_t* xq, const float* xs,
    const float* xg, const int M, int64_t K,
    const uint8_t* w, const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t n0, int64_t n1) {
  const int64_t G = K / 32, row_bytes = K / 2 + 4 * G;
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  const __m512i first = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    const uint16_t* sr = (const uint16_t*)(wr + K / 2); const uint16_t* mr = sr + G;
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t g0 = 0; g0 < G; g0 += 16) {  /* 16 groups: 512 weights, 16 scales */
      const int64_t gn = G - g0 < 16 ? G - g0 : 16;
      const __mmask16 k16 = (__mmask16)((1u << gn) - 1);
      const __m512 s16 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k16, sr + g0));
      __m512i idx = first;
      for (int64_t g = 0; g < gn; g += 2) {
        const int64_t p = (g0 + g) * 32;
        _mm_prefetch((const char*)(wr + p / 2) + PF_BYTES, _MM_HINT_T0);
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(wr + p / 2)));
        const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_srli_epi16(v, 4);
        const __m512 s = _mm512_permutexvar_ps(idx, s16);
        idx = _mm512_add_epi32(idx, _mm512_set1_epi32(2));
        for (int m = 0; m < M; ++m) {
          const int16_t* xm = xq + m * K + p;
          __m512i a = _mm512_dpwssd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xm));
          a = _mm512_dpwssd_epi32(a, hi, _mm512_loadu_si512(xm + 32));
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), s, acc[m]);
        }
      }
      for (int m = 0; m < M; ++m)  /* the minimums' term of these 16 groups */
        acc[m] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k16, mr + g0)),
                                 _mm512_maskz_loadu_ps(k16, xg + m * G + g0), acc[m]);
    }
    for (int m = 0; m < M; ++m) {
      const float v = _mm512_reduce_add_ps(acc[m]) * xs[m];
      y[m * ldy + n] = f2bf(v + (bias ? bf2f(bias[n]) : 0.f));
    }
  }
}

/* M is a constant in each copy, so the accumulators stay in registers (a runtime M put them
   on the stack: 10 GB/s instead of ~30). */
static void rows_q4_m1(const int16_t* xq, const float* xs, const float* xg, int64_t K,
    const uint8_t* w, const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t n0, int64_t n1) {
  rows_q4(xq, xs, xg, 1, K, w, bias, y, ldy, n0, n1);
}
static void rows_q4_m2(const int16_t* xq, const float* xs, const float* xg, int64_t K,
    const uint8_t* w, const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t n0, int64_t n1) {
  rows_q4(xq, xs, xg, 2, K, w, bias, y, ldy, n0, n1);
}

int linear_q4_bf16(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w,
    int64_t N, const uint16_t* bias, uint16_t* y, int64_t ldy, int nthreads) {
  if (M < 1 || M > 2 || K % 64) return -1;
  int16_t* xq = (int16_t*)malloc(sizeof(int16_t) * M * K + sizeof(float) * M * (K / 32 + 1));
  if (!xq) return -1;
  float* xs = (float*)(xq + M * K + (M * K) % 2);  /* float-aligned after the int16 values */
  float* xg = xs + M;
  prep_x(x, ldx, M, K, xq, xs, xg);
  const int64_t nblocks = (N + NB - 1) / NB;
  _Pragma("omp parallel for num_threads(nthreads) if(nthreads > 1) schedule(static)")
  for (int64_t b = 0; b < nblocks; ++b)
    (M == 1 ? rows_q4_m1 : rows_q4_m2)(xq, xs, xg, K, w, bias, y, ldy, b * NB,
                                       (b + 1) * NB < N ? (b + 1) * NB : N);
  free(xq);
  return 0;
}
#endif
"""
)
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
# x, ldx, M, K, weight rows, N, bias, y, ldy, threads
_ARGS = [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, ctypes.c_int]


_fn: list = []  # the kernel's function, or None where it is not built; resolved once


def _kernel():
    """linear_q4_bf16 with its signature set, or None (no compiler, no AVX512-VNNI)."""
    if not _fn:
        lib = load_library("w4", _SOURCE, "4-bit weights", {})
        fn = getattr(lib, "linear_q4_bf16", None) if lib is not None else None
        if fn is not None:
            fn.argtypes, fn.restype = _ARGS, ctypes.c_int
        _fn.append(fn)
    return _fn[0]


def available() -> bool:
    return _kernel() is not None


def quantize_groups(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (K a multiple of 64) -> uint8 [N, K / 2 + K / 8]: each row's 4-bit codes
    (two groups per 32 bytes), then its K / 32 float16 scales, then its float16 minimums;
    dequantize() inverts it."""
    n, k = weight.shape
    if k % K_MULTIPLE:
        raise ValueError(f"4-bit groups need K a multiple of {K_MULTIPLE}, got {k}")
    g = weight.float().view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scales, mins = ((hi - lo) / 15).half(), lo.half()
    s, m = scales.float()[..., None], mins.float()[..., None]  # the stored values
    codes = torch.where(s > 0, torch.round((g - m) / s.clamp_min(1e-30)), 0).clamp_(0, 15)
    codes = codes.to(torch.uint8)
    packed = (codes[..., :16] | (codes[..., 16:] << 4)).reshape(n, k // 2)
    tail = torch.cat([scales, mins], dim=1).view(torch.uint8)  # [N, 4 * K / 32]
    return torch.cat([packed, tail], dim=1).contiguous()


def _split(q4: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, row = q4.shape
    k = row * 8 // 5  # row = K / 2 + K / 8
    g = k // GROUP
    tail = q4[:, k // 2 :].contiguous().view(torch.float16)
    return q4[:, : k // 2], tail[:, :g], tail[:, g:]


def in_features(q4: torch.Tensor) -> int:
    return q4.shape[1] * 8 // 5


def dequantize(q4: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] the codes stand for (the tests' reference)."""
    packed, scales, mins = _split(q4)
    n = packed.shape[0]
    b = packed.reshape(n, -1, 16)
    codes = torch.cat([b & 15, b >> 4], dim=-1).float()  # [N, G, 32]
    return (codes * scales.float()[..., None] + mins.float()[..., None]).reshape(n, -1)


def linear(
    x: torch.Tensor, q4: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """x [..., K] bf16 (at most MAX_ROWS rows) against the 4-bit weight; None where the kernel
    cannot take the call (the caller uses its int8 weights)."""
    fn = _kernel()
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], q4.shape[0]
    if (
        fn is None
        or x.dtype != torch.bfloat16
        or not 1 <= m <= MAX_ROWS
        or x2.stride(-1) != 1
        or in_features(q4) != k
        or (bias is not None and bias.dtype != x.dtype)
    ):
        return None
    y = torch.empty(m, n, dtype=x.dtype)
    rc = fn(
        x2.data_ptr(), x2.stride(0), m, k, q4.data_ptr(), n,
        None if bias is None else bias.data_ptr(), y.data_ptr(), n, torch.get_num_threads(),
    )  # fmt: skip
    return None if rc != 0 else y.view(*x.shape[:-1], n)
