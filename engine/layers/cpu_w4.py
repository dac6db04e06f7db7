"""4-bit weights for decode steps of up to 12 rows (`--quantization w4a8`).

A one-stream decode step reads every weight once, so its time is weight bytes over memory
bandwidth. Here each group of 32 consecutive weights of a row keeps 4-bit codes q in 0..15,
a scale s and a minimum m (both float16): w ~ s * q + m, like llama.cpp's Q4_1. With the
scales that is 0.625 bytes a weight against int8's 1.0. Groups of 32 follow outliers far
better than one int8 scale per row: on SmolLM2-135M, 4-bit groups on every linear layer
cost a mean next-token KL of 0.002 from bf16 (int8 rows on them and the LM head: 0.006).

The kernel takes 1-12 rows of x, quantized to int16 with one scale per row (as
cpu_gemm's `rows_i16`). Rows are stored in tiles of 16 so that each float lane of the kernel
accumulates one output row: 32 bytes hold 16 rows x 4 codes, widened to int16 they are the
operands of two vpdpwssd against pairs of x broadcast from memory, and no horizontal sums
are left (a row-wise layout spent a third of its instructions on them: 120 one-row GEMMs of
SmolLM2 on a Zen 4 core, 7.1 -> 3.5-4.0 ms). Each group's sum is scaled in float, and the
minimums meet per-group sums of x:
y = xs * (sum_g s_g * (q_g . xq_g) + sum_g m_g * sum(xq_g)). Needs AVX512-VNNI, BW and F16C,
and K a multiple of 64; other layers and larger batches use the int8 weights the layer
keeps too (w8a8). Built once per machine like the other CPU kernels (engine.cpu_build).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from engine.cpu_build import C_AVX512_HELPERS, C_BF16_HELPERS, load_library

GROUP = 32
MAX_ROWS = 12  # rows of x the kernel takes (W4_MAX_ROWS); larger batches use the int8 weights
K_MULTIPLE = 64  # in features must be a multiple of this (the x quantizer's step)
TILE = 16  # output rows per tile, one per float lane of the kernel
GROUP_BYTES = TILE * GROUP // 2 + 2 * TILE * 2  # a tile's group: codes, scales, minimums

_SOURCE = (
    C_BF16_HELPERS
    + C_AVX512_HELPERS
    + r"""
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <omp.h>
#include <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define PF_BYTES 4096   /* the weight stream is prefetched this far ahead */
#define TILE 16         /* output rows a tile holds: one per float lane */
#define GROUP_BYTES 320 /* a tile's group: 16 x 32 codes, 16 float16 scales, 16 minimums */
#define TASK_TILES 4    /* tiles per parallel task */
#define W4_MAX_ROWS 12  /* MAX_ROWS */

/* x [M][K] bf16 -> xq int16 with one scale per row (xs) and each group's sum of xq (xg). */
static void prep_x(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, int16_t* xq,
    float* xs, float* xg) {
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* xr = x + m * ldx;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(xr + k)));
      amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_castsi512_ps(_mm512_slli_epi32(b, 16))));
    }
    const float a = _mm512_reduce_max_ps(amax);
    xs[m] = a / 32767.f;
    const __m512 inv = _mm512_set1_ps(a > 0.f ? 32767.f / a : 0.f);
    int16_t* q = xq + m * K;
    for (int64_t k = 0; k < K; k += 32) {  /* one group */
      __m512i sum = _mm512_setzero_si512();
      for (int h = 0; h < 32; h += 16) {
        const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(xr + k + h)));
        const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), inv);
        const __m512i r = _mm512_cvtps_epi32(v);  /* to nearest even, like nearbyintf */
        _mm256_storeu_si256((__m256i*)(q + k + h), _mm512_cvtsepi32_epi16(r));
        sum = _mm512_add_epi32(sum, r);
      }
      xg[m * (K / 32) + k / 32] = (float)_mm512_reduce_add_epi32(sum);
    }
  }
}

/* vpdpwssd with a dword of x (two int16) broadcast from memory inside the instruction. */
static inline __m512i dpwssd_bcast(__m512i acc, __m512i w, const int16_t* p) {
  __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t*)p));
  return acc;
}

/* Tiles [t0, t1) of 16 output rows. A tile stores, group after group, 8 chunks of 32 bytes
   (chunk c: byte 2r + j holds row r's code for k = 4c + j in its low nibble, k = 4c + 2 + j
   in its high one), then the 16 rows' float16 scales, then their minimums. Widened to int16,
   a chunk's low (high) nibbles are 16 rows x 2 k: the operand layout of vpdpwssd against
   x[k], x[k + 1] broadcast, so each float lane accumulates one output row and no horizontal
   sum is needed (a row-wise layout spent a third of its instructions on them). */
static inline __attribute__((always_inline)) void tiles_q4(const int16_t* xq, const float* xs,
    const float* xg, const int M, int64_t K, const uint8_t* w, const uint16_t* bias,
    uint16_t* y, int64_t ldy, int64_t N, int64_t t0, int64_t t1) {
  const int64_t G = K / 32;
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* wt = w + t * G * GROUP_BYTES;
    /* one or two rows: four sum chains per row to hide vpdpwssd's latency; more rows are
       independent chains enough (and their registers are needed) */
    const int NACC = M <= 2 ? 4 : 1;
    __m512 acc[W4_MAX_ROWS];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* wg = wt + g * GROUP_BYTES;
      for (int l = 0; l < GROUP_BYTES; l += 64) _mm_prefetch((const char*)wg + PF_BYTES + l, _MM_HINT_T0);
      __m512i a[W4_MAX_ROWS][4];
      for (int m = 0; m < M; ++m)
        for (int i = 0; i < NACC; ++i) a[m][i] = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) {
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(wg + 32 * c)));
        const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_srli_epi16(v, 4);
        const int i = NACC == 4 ? (c & 1) * 2 : 0, j = NACC == 4 ? i + 1 : 0;
        for (int m = 0; m < M; ++m) {
          const int16_t* xk = xq + m * K + g * 32 + 4 * c;
          a[m][i] = dpwssd_bcast(a[m][i], lo, xk);
          a[m][j] = dpwssd_bcast(a[m][j], hi, xk + 2);
        }
      }
      const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(wg + 256)));
      const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(wg + 288)));
      for (int m = 0; m < M; ++m) {
        const __m512i sum = NACC == 4 ? _mm512_add_epi32(_mm512_add_epi32(a[m][0], a[m][1]),
                                                         _mm512_add_epi32(a[m][2], a[m][3]))
                                      : a[m][0];
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), s, acc[m]);
        acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xg[m * G + g]), acc[m]);
      }
    }
    const int64_t n0 = t * TILE;
    const __mmask16 keep = N - n0 >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
    __m512 b = _mm512_setzero_ps();
    if (bias)
      b = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, bias + n0)), 16));
    for (int m = 0; m < M; ++m) {
      _mm256_mask_storeu_epi16(y + m * ldy + n0, keep,
                               f2bf512(_mm512_fmadd_ps(acc[m], _mm512_set1_ps(xs[m]), b)));
    }
  }
}

/* M is a constant in each copy, so the accumulators stay in registers. */
#define DEFINE_TILES(M) static void tiles_q4_m##M(const int16_t* xq, const float* xs,            \
    const float* xg, int64_t K, const uint8_t* w, const uint16_t* bias, uint16_t* y, int64_t ldy, \
    int64_t N, int64_t t0, int64_t t1) { tiles_q4(xq, xs, xg, M, K, w, bias, y, ldy, N, t0, t1); }
DEFINE_TILES(1) DEFINE_TILES(2) DEFINE_TILES(3) DEFINE_TILES(4)
DEFINE_TILES(5) DEFINE_TILES(6) DEFINE_TILES(7) DEFINE_TILES(8)
DEFINE_TILES(9) DEFINE_TILES(10) DEFINE_TILES(11) DEFINE_TILES(12)
typedef void (*tiles_fn)(const int16_t*, const float*, const float*, int64_t, const uint8_t*,
    const uint16_t*, uint16_t*, int64_t, int64_t, int64_t, int64_t);
static const tiles_fn TILES[W4_MAX_ROWS] = {tiles_q4_m1, tiles_q4_m2, tiles_q4_m3, tiles_q4_m4,
    tiles_q4_m5, tiles_q4_m6, tiles_q4_m7, tiles_q4_m8, tiles_q4_m9, tiles_q4_m10, tiles_q4_m11,
    tiles_q4_m12};

int linear_q4_bf16(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w,
    int64_t N, const uint16_t* bias, uint16_t* y, int64_t ldy, int nthreads) {
  if (M < 1 || M > W4_MAX_ROWS || K % 64) return -1;
  int16_t* xq = (int16_t*)malloc(sizeof(int16_t) * M * K + sizeof(float) * M * (K / 32 + 1));
  if (!xq) return -1;
  float* xs = (float*)(xq + M * K);  /* K % 64 == 0: float-aligned after the int16 values */
  float* xg = xs + M;
  prep_x(x, ldx, M, K, xq, xs, xg);
  const int64_t tiles = (N + TILE - 1) / TILE, tasks = (tiles + TASK_TILES - 1) / TASK_TILES;
  _Pragma("omp parallel for num_threads(nthreads) if(nthreads > 1) schedule(static)")
  for (int64_t b = 0; b < tasks; ++b) {
    const int64_t t0 = b * TASK_TILES, t1 = t0 + TASK_TILES < tiles ? t0 + TASK_TILES : tiles;
    TILES[M - 1](xq, xs, xg, K, w, bias, y, ldy, N, t0, t1);
  }
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


@dataclass(frozen=True)
class Q4Weight:
    """A linear layer's weight [out_features, in_features] as 4-bit groups in tiles of 16
    rows (the kernel's layout, see its source); `data` is uint8 [tiles, G * 320]."""

    data: torch.Tensor
    out_features: int
    in_features: int


def quantize_groups(weight: torch.Tensor) -> Q4Weight:
    """weight [N, K] (K a multiple of 64) -> its 4-bit groups of 32 (codes 0..15, a float16
    scale and minimum per group), rows padded to tiles of 16; dequantize() inverts it."""
    n, k = weight.shape
    if k % K_MULTIPLE:
        raise ValueError(f"4-bit groups need K a multiple of {K_MULTIPLE}, got {k}")
    g = weight.float().view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scales, mins = ((hi - lo) / 15).half(), lo.half()
    s, m = scales.float()[..., None], mins.float()[..., None]  # the stored values
    codes = torch.where(s > 0, torch.round((g - m) / s.clamp_min(1e-30)), 0).clamp_(0, 15)
    pad = -n % TILE  # padded rows: codes, scales and minimums 0
    codes = torch.nn.functional.pad(codes.to(torch.uint8), (0, 0, 0, 0, 0, pad))
    scales, mins = (torch.nn.functional.pad(v, (0, 0, 0, pad)) for v in (scales, mins))
    t, groups = (n + pad) // TILE, k // GROUP
    # [tile, row, group, chunk, 4 k] -> bytes [tile, group, chunk, row, 2]: k = 4c + j low,
    # 4c + 2 + j high
    c = codes.view(t, TILE, groups, 8, 4)
    chunks = (c[..., :2] | (c[..., 2:] << 4)).permute(0, 2, 3, 1, 4).reshape(t, groups, 256)

    def per_group(v: torch.Tensor) -> torch.Tensor:  # [N, G] float16 -> [tile, group, 32 bytes]
        return v.view(t, TILE, groups).transpose(1, 2).contiguous().view(torch.uint8)

    data = torch.cat([chunks, per_group(scales), per_group(mins)], dim=2)
    return Q4Weight(data.reshape(t, groups * GROUP_BYTES).contiguous(), n, k)


def dequantize(q4: Q4Weight) -> torch.Tensor:
    """The float32 weight [N, K] the codes stand for (the tests' reference)."""
    t, groups = q4.data.shape[0], q4.in_features // GROUP
    d = q4.data.view(t, groups, GROUP_BYTES)
    b = d[..., :256].reshape(t, groups, 8, TILE, 2)
    codes = torch.cat([b & 15, b >> 4], dim=-1).permute(0, 3, 1, 2, 4)  # [t, row, g, c, 4]
    codes = codes.reshape(t * TILE, groups, GROUP).float()

    def per_row(v: torch.Tensor) -> torch.Tensor:  # [tile, group, 32 bytes] -> [N, G] float
        return v.contiguous().view(torch.float16).transpose(1, 2).reshape(-1, groups).float()

    scales, mins = per_row(d[..., 256:288]), per_row(d[..., 288:])
    w = codes * scales[..., None] + mins[..., None]
    return w.reshape(t * TILE, -1)[: q4.out_features]


def linear(x: torch.Tensor, q4: Q4Weight, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., K] bf16 (at most MAX_ROWS rows) against the 4-bit weight; None where the kernel
    cannot take the call (the caller uses its int8 weights)."""
    fn = _kernel()
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], q4.out_features
    if (
        fn is None
        or x.dtype != torch.bfloat16
        or not 1 <= m <= MAX_ROWS
        or x2.stride(-1) != 1
        or q4.in_features != k
        or (bias is not None and bias.dtype != x.dtype)
    ):
        return None
    y = torch.empty(m, n, dtype=x.dtype)
    rc = fn(
        x2.data_ptr(), x2.stride(0), m, k, q4.data.data_ptr(), n,
        None if bias is None else bias.data_ptr(), y.data_ptr(), n, torch.get_num_threads(),
    )  # fmt: skip
    return None if rc != 0 else y.view(*x.shape[:-1], n)
