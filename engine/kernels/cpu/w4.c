/* 4-bit weight groups (w ~ s * q + m per 32 weights) for decode steps of up to W4_MAX_ROWS
   rows on CPUs with AVX512-VNNI (w4_avx2.c: the AVX2 variant): engine/kernels/cpu/w4.py has
   the format and why. */
#include "tessera_kernels.h"
#include "bf16_convert.h"
#include "avx512_math.h"

#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <omp.h>
#include <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define PF_BYTES 4096   /* the weight stream is prefetched this far ahead */
#define TILE W4_TILE          /* output rows a tile holds: one per float lane */
#define GROUP_BYTES W4_GROUP_BYTES /* a tile's group: 16 x 32 codes, 16 float16 scales, 16 minimums */
#define TASK_TILES 4    /* tiles per parallel task */

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
      b = bf16x16_to_f32(_mm256_maskz_loadu_epi16(keep, bias + n0));
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

int w4_max_rows(void) { return W4_MAX_ROWS; }

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
