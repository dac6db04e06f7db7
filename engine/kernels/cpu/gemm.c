/* y = x W^T (+ b) on CPU: bf16, float32 or int8 weights, float32 arithmetic; the AVX512-BF16
   kernels for bf16 activations (engine/kernels/cpu/gemm.py says why and when each runs). */
#include "tessera_kernels.h"
#include "avx2_math.h"
#include "bf16_convert.h"
#include "avx512_math.h"

#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <immintrin.h>
#include <omp.h>

#define MR 4   /* input rows per tile */
#define NR 3   /* weight rows per tile: 12 accumulators + 3 weights + 1 input = 16 ymm */
#define NB 48  /* weight rows per block handed to a thread (a multiple of NR and of DNR) */

static inline __m256 load8_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline __m256 load8_f32(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline float i2f(int8_t x) { return (float)x; }
static inline void store8_f32(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline void store8_bf16(uint16_t* p, __m256 v) {  /* round to nearest even, as f2bf */
  __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);
  _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(packed));
}

/* One mr x nr tile (mr <= MR, nr <= NR, constants after inlining): out[i][j] = x_i . w_j. */
#define DEFINE_TILE(NAME, TW, LOADW8, LOADW)                                                  \
static inline __attribute__((always_inline)) void NAME(const float* x, int64_t ldx,          \
    const TW* w, int64_t ldw, int64_t K, const int mr, const int nr, float out[MR][NR]) {    \
  __m256 acc[MR][NR];                                                                        \
  for (int i = 0; i < mr; ++i) for (int j = 0; j < nr; ++j) acc[i][j] = _mm256_setzero_ps(); \
  int64_t k = 0;                                                                             \
  for (; k + 8 <= K; k += 8) {                                                               \
    __m256 wv[NR];                                                                           \
    for (int j = 0; j < nr; ++j) wv[j] = LOADW8(w + j * ldw + k);                            \
    for (int i = 0; i < mr; ++i) {                                                           \
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);                                    \
      for (int j = 0; j < nr; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);        \
    }                                                                                        \
  }                                                                                          \
  for (int i = 0; i < mr; ++i)                                                               \
    for (int j = 0; j < nr; ++j) {                                                           \
      float s = hsum8(acc[i][j]);                                                            \
      for (int64_t kk = k; kk < K; ++kk) s += x[i * ldx + kk] * LOADW(w[j * ldw + kk]);      \
      out[i][j] = s;                                                                         \
    }                                                                                        \
}
DEFINE_TILE(tile_bf16, uint16_t, load8_bf16, bf2f)
DEFINE_TILE(tile_f32, float, load8_f32, f2f)
DEFINE_TILE(tile_i8, int8_t, load8_i8, i2f)

/* Larger batches: the block's weights are widened once into float32 panels of 16 rows laid
   out k-major ([K][16]), then a 6 x 16 outer-product tile (12 accumulators) broadcasts one
   input element per row against two panel vectors: 8 loads per 12 FMAs, so it runs near
   the FMA units' peak instead of re-widening the weights for every 4 input rows. */
#define PM 6
#define PN 16
#define PACKED_MIN_M 48  /* below this, packing costs more than it saves (measured) */
static inline __attribute__((always_inline)) void tile_packed(const float* x, int64_t ldx,
    const float* panel, int64_t K, const int mr, float out[PM][PN]) {
  __m256 acc[PM][2];
  for (int i = 0; i < mr; ++i) { acc[i][0] = _mm256_setzero_ps(); acc[i][1] = _mm256_setzero_ps(); }
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_load_ps(panel + k * PN), b1 = _mm256_load_ps(panel + k * PN + 8);
    for (int i = 0; i < mr; ++i) {
      const __m256 a = _mm256_broadcast_ss(x + i * ldx + k);
      acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
    }
  }
  for (int i = 0; i < mr; ++i) { _mm256_storeu_ps(out[i], acc[i][0]); _mm256_storeu_ps(out[i] + 8, acc[i][1]); }
}

/* Scratch (widened inputs, weight panels) lives in per-thread buffers that only grow
   (bounded by the largest batch x hidden size this thread has seen): no allocation per call. */
typedef struct { float* p; int64_t cap; } scratch_t;
static float* grow(scratch_t* b, int64_t n) {
  if (n > b->cap) {
    free(b->p);
    b->p = (float*)aligned_alloc(64, ((n * sizeof(float) + 63) / 64) * 64);
    b->cap = b->p ? n : 0;
  }
  return b->p;
}
static __thread scratch_t xbuf, pbuf;

/* y[M][N] (row stride ldy) = x[M][K] (row stride ldx) . w[N][K]^T (+ bias[N]).
   TX: activation type (input, bias, output); TW: weight type. Returns 0, or -1 when the
   widening buffer cannot be allocated (the caller falls back to torch). */
#define DEFINE_LINEAR(NAME, TX, TW, TILE, LOADW, LOADX, STOREX, LOADX8, STOREX8, WIDEN)                              \
int NAME(const TX* x, int64_t ldx, int64_t M, int64_t K, const TW* w, const float* wscale,  \
    int64_t N, const TX* bias, TX* y, int64_t ldy, int nthreads) {                           \
  const float* xf = (const float*)x; int64_t ldxf = ldx;                                     \
  if (WIDEN) {                                                                               \
    float* buf = grow(&xbuf, M * K);                                                        \
    if (!buf) return -1;                                                                     \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                       \
    for (int64_t m = 0; m < M; ++m)                                                          \
      for (int64_t k = 0; k < K; ++k) buf[m * K + k] = LOADX(x[m * ldx + k]);                \
    xf = buf; ldxf = K;                                                                      \
  }                                                                                          \
  const int64_t nblocks = (N + NB - 1) / NB;                                                 \
  if (M >= PACKED_MIN_M) {                                                                   \
    int failed = 0;                                                                          \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static) reduction(|:failed)")   \
    for (int64_t b = 0; b < nblocks; ++b) {                                                  \
      float* panels = grow(&pbuf, NB * K);                                                  \
      if (!panels) { failed = 1; continue; }                                                 \
      const int64_t n_base = b * NB, n_cnt = (b + 1) * NB < N ? NB : N - b * NB;             \
      for (int64_t r = 0; r < NB; ++r) {  /* widen + transpose; missing rows are zeros */    \
        float* dst = panels + (r / PN) * K * PN + (r % PN);                                  \
        const TW* src = w + (n_base + r) * K;                                                \
        if (r < n_cnt) for (int64_t k = 0; k < K; ++k) dst[k * PN] = LOADW(src[k]);          \
        else for (int64_t k = 0; k < K; ++k) dst[k * PN] = 0.f;                              \
      }                                                                                      \
      for (int64_t m0 = 0; m0 < M; m0 += PM) {                                               \
        const int mr = M - m0 < PM ? (int)(M - m0) : PM;                                     \
        for (int64_t p0 = 0; p0 < n_cnt; p0 += PN) {                                         \
          float out[PM][PN];                                                                 \
          const float* panel = panels + (p0 / PN) * K * PN;                                  \
          if (mr == PM) tile_packed(xf + m0 * ldxf, ldxf, panel, K, PM, out);                \
          else tile_packed(xf + m0 * ldxf, ldxf, panel, K, mr, out);                         \
          const int nr = n_cnt - p0 < PN ? (int)(n_cnt - p0) : PN;                           \
          const int64_t n0 = n_base + p0;                                                    \
          for (int i = 0; i < mr; ++i) {                                                     \
            TX* yr = y + (m0 + i) * ldy + n0;                                                \
            if (nr == PN) {  /* vector epilogue: a scalar one costs as much as the tile */   \
              for (int h = 0; h < PN; h += 8) {                                              \
                __m256 v = _mm256_loadu_ps(out[i] + h);                                      \
                if (wscale) v = _mm256_mul_ps(v, _mm256_loadu_ps(wscale + n0 + h));          \
                if (bias) v = _mm256_add_ps(v, LOADX8(bias + n0 + h));                       \
                STOREX8(yr + h, v);                                                          \
              }                                                                              \
            } else {                                                                         \
              for (int j = 0; j < nr; ++j)                                                   \
                yr[j] = STOREX(out[i][j] * (wscale ? wscale[n0 + j] : 1.f)                   \
                               + (bias ? LOADX(bias[n0 + j]) : 0.f));                        \
            }                                                                                \
          }                                                                                  \
        }                                                                                    \
      }                                                                                      \
    }                                                                                        \
    return failed ? -1 : 0;                                                                  \
  }                                                                                          \
  _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                         \
  for (int64_t b = 0; b < nblocks; ++b) {                                                    \
    const int64_t n_end = (b + 1) * NB < N ? (b + 1) * NB : N;                               \
    for (int64_t m0 = 0; m0 < M; m0 += MR) {                                                 \
      const int mr = M - m0 < MR ? (int)(M - m0) : MR;                                       \
      const float* xt = xf + m0 * ldxf;                                                      \
      for (int64_t n0 = b * NB; n0 < n_end; n0 += NR) {                                      \
        const int nr = n_end - n0 < NR ? (int)(n_end - n0) : NR;                             \
        const TW* wt = w + n0 * K;                                                           \
        float out[MR][NR];                                                                   \
        switch (mr * 4 + nr) {  /* constant shapes, so each case keeps its tile in registers */ \
          case 4 * 4 + 3: TILE(xt, ldxf, wt, K, K, 4, 3, out); break;                        \
          case 1 * 4 + 3: TILE(xt, ldxf, wt, K, K, 1, 3, out); break;                        \
          case 2 * 4 + 3: TILE(xt, ldxf, wt, K, K, 2, 3, out); break;                        \
          case 3 * 4 + 3: TILE(xt, ldxf, wt, K, K, 3, 3, out); break;                        \
          case 4 * 4 + 2: TILE(xt, ldxf, wt, K, K, 4, 2, out); break;                        \
          case 4 * 4 + 1: TILE(xt, ldxf, wt, K, K, 4, 1, out); break;                        \
          default: TILE(xt, ldxf, wt, K, K, mr, nr, out);                                    \
        }                                                                                    \
        for (int i = 0; i < mr; ++i)                                                         \
          for (int j = 0; j < nr; ++j) {                                                     \
            float v = out[i][j];                                                             \
            if (wscale) v *= wscale[n0 + j];                                                 \
            if (bias) v += LOADX(bias[n0 + j]);                                              \
            y[(m0 + i) * ldy + n0 + j] = STOREX(v);                                          \
          }                                                                                  \
      }                                                                                      \
    }                                                                                        \
  }                                                                                          \
  return 0;                                                                                  \
}
DEFINE_LINEAR(linear_bf16, uint16_t, uint16_t, tile_bf16, bf2f, bf2f, f2bf, load8_bf16, store8_bf16, 1)
DEFINE_LINEAR(linear_f32, float, float, tile_f32, f2f, f2f, f2f, load8_f32, store8_f32, 0)
/* int8 weights with a float32 scale per output row (engine.layers.quantization). */
DEFINE_LINEAR(linear_i8_bf16, uint16_t, int8_t, tile_i8, i2f, bf2f, f2bf, load8_bf16, store8_bf16, 1)
DEFINE_LINEAR(linear_i8_f32, float, int8_t, tile_i8, i2f, f2f, f2f, load8_f32, store8_f32, 0)

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
/* bf16 on CPUs with AVX512-BF16, small batches: vdpbf16ps multiplies 32 bf16 pairs of x and
   w straight from memory (exact products, float32 sums), so nothing is widened at all. A
   4 x 6 tile keeps 24 accumulators in registers; K tails use masked loads. Where oneDNN's
   own bf16 GEMM is fast (large batches) the caller keeps torch. */
#define DMR 4
#define DNR 6
static inline __m512bh w32_bf16(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
static inline __m512bh w32_bf16_tail(const uint16_t* p, __mmask32 m) {
  return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}
/* int8 weights: 32 values widened to bf16 exactly (|v| <= 127 needs 7 bits). */
static inline __m512bh i8x32_to_bf16(__m256i b) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);
}
static inline __m512bh w32_i8(const int8_t* p) {
  return i8x32_to_bf16(_mm256_loadu_si256((const __m256i*)p));
}
static inline __m512bh w32_i8_tail(const int8_t* p, __mmask32 m) {
  return i8x32_to_bf16(_mm256_maskz_loadu_epi8(m, p));
}

#define DEFINE_TILE_DP(NAME, TW, LOADW, LOADW_TAIL)                                           \
static inline __attribute__((always_inline)) void NAME(const uint16_t* x, int64_t ldx,       \
    const TW* w, int64_t K, const int mr, const int nr, float out[DMR][DNR]) {               \
  __m512 acc[DMR][DNR];                                                                      \
  for (int i = 0; i < mr; ++i) for (int j = 0; j < nr; ++j) acc[i][j] = _mm512_setzero_ps(); \
  int64_t k = 0;                                                                             \
  for (; k + 32 <= K; k += 32) {                                                             \
    __m512bh wv[DNR];                                                                        \
    for (int j = 0; j < nr; ++j) wv[j] = LOADW(w + j * K + k);                               \
    for (int i = 0; i < mr; ++i) {                                                           \
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * ldx + k);                     \
      for (int j = 0; j < nr; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);       \
    }                                                                                        \
  }                                                                                          \
  if (k < K) {                                                                               \
    const __mmask32 mk = (__mmask32)((1ull << (K - k)) - 1);                                 \
    __m512bh wv[DNR];                                                                        \
    for (int j = 0; j < nr; ++j) wv[j] = LOADW_TAIL(w + j * K + k, mk);                      \
    for (int i = 0; i < mr; ++i) {                                                           \
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mk, x + i * ldx + k);           \
      for (int j = 0; j < nr; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);       \
    }                                                                                        \
  }                                                                                          \
  /* Sum each accumulator's lanes 16 at a time (reduce16: ~2 instructions a sum, not 8). */  \
  __m512 v[32]; float sums[32];                                                              \
  for (int i = 0; i < mr; ++i) for (int j = 0; j < nr; ++j) v[i * nr + j] = acc[i][j];      \
  const int cnt = mr * nr;                                                                   \
  for (int c = cnt; c < ((cnt + 15) & ~15); ++c) v[c] = _mm512_setzero_ps();                \
  for (int c = 0; c < cnt; c += 16) _mm512_storeu_ps(sums + c, reduce16(v + c));             \
  for (int i = 0; i < mr; ++i) for (int j = 0; j < nr; ++j) out[i][j] = sums[i * nr + j];    \
}
DEFINE_TILE_DP(tile_dp_bf16, uint16_t, w32_bf16, w32_bf16_tail)
DEFINE_TILE_DP(tile_dp_i8, int8_t, w32_i8, w32_i8_tail)

/* Decode batches (at most ROWS_MAX_M rows of x) read each weight once, so memory decides their
   speed: the 4 x 6 tile's six interleaved row streams held one core to ~11 GB/s on a Zen 4,
   against ~25 GB/s for one sequential stream. Here the weight rows are read one after
   another (a single stream the hardware prefetcher follows), each against every row of x,
   and the lane sums of 16 rows are done together (reduce16). MC rows of x share each loaded
   weight vector: 4 for bf16 weights, 8 for int8 ones, whose widening to bf16 costs more than
   the dot products (the model's int8 GEMMs at 8 rows on one Zen 5 core: 13.0 -> 10.4 ms). */
#define RN 16          /* weight rows summed together */
/* The weight stream is also prefetched 16 KB ahead in software: the hardware prefetcher
   ramps up anew for every matrix (a layer's are 0.3-1.8 MB), and the prefetch runs on past
   a matrix's end into the next one's start (harmless: a prefetch never faults). The model's
   GEMMs at 1 row on one Zen 5 core: int8 5.2 -> 4.5 ms (25 -> 30 GB/s), bf16 at 8 rows
   14.4 -> 11.5 ms; 4-16 KB ahead into L2 (T1) gained less, 1-2 KB lost. */
#define PF_BYTES 16384
#define DEFINE_ROWS_DP(NAME, TW, LOADW, LOADW_TAIL, MC)                                       \
static inline __attribute__((always_inline)) void NAME(const uint16_t* x, int64_t ldx,       \
    const TW* w, int64_t K, const int mr, const int nr, float out[ROWS_MAX_M][RN]) {         \
  __m512 acc[ROWS_MAX_M][RN];                                                                \
  for (int j = 0; j < nr; ++j) {                                                             \
    const TW* wr = w + j * K;                                                                \
    for (int m0 = 0; m0 < mr; m0 += MC) {  /* MC rows of x at a time; the row stays in L1 */ \
      const int mc = mr - m0 < MC ? mr - m0 : MC;                                            \
      const uint16_t* xm = x + m0 * ldx;                                                     \
      __m512 a[MC];                                                                          \
      for (int i = 0; i < mc; ++i) a[i] = _mm512_setzero_ps();                               \
      int64_t k = 0;                                                                         \
      for (; k + 32 <= K; k += 32) {                                                         \
        _mm_prefetch((const char*)(wr + k) + PF_BYTES, _MM_HINT_T0);                        \
        const __m512bh wv = LOADW(wr + k);                                                   \
        for (int i = 0; i < mc; ++i)                                                         \
          a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_loadu_si512(xm + i * ldx + k), wv);  \
      }                                                                                      \
      if (k < K) {                                                                           \
        const __mmask32 mk = (__mmask32)((1ull << (K - k)) - 1);                             \
        const __m512bh wv = LOADW_TAIL(wr + k, mk);                                          \
        for (int i = 0; i < mc; ++i)                                                         \
          a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_maskz_loadu_epi16(mk, xm + i * ldx + k), wv); \
      }                                                                                      \
      for (int i = 0; i < mc; ++i) acc[m0 + i][j] = a[i];                                    \
    }                                                                                        \
  }                                                                                          \
  for (int i = 0; i < mr; ++i) {                                                             \
    for (int j = nr; j < RN; ++j) acc[i][j] = _mm512_setzero_ps();                           \
    _mm512_storeu_ps(out[i], reduce16(acc[i]));                                              \
  }                                                                                          \
}
DEFINE_ROWS_DP(rows_dp_bf16, uint16_t, w32_bf16, w32_bf16_tail, 4)
DEFINE_ROWS_DP(rows_dp_i8, int8_t, w32_i8, w32_i8_tail, 8)

#define WIDEN_MIN_M 16  /* int8 from this many rows: widen each block to bf16 once, not per tile */
static __thread scratch_t wbuf;
/* The block's int8 rows as bf16 (exact), in a per-thread buffer that only grows. */
static const uint16_t* widen_block(const int8_t* w, int64_t rows, int64_t K) {
  uint16_t* out = (uint16_t*)grow(&wbuf, (rows * K + 1) / 2);  /* two bf16 per float slot */
  if (!out) return NULL;
  for (int64_t i = 0; i < rows * K; ++i) out[i] = f2bf((float)w[i]);
  return out;
}
/* Weight rows [n_begin, n_end) (row n at w + n * K) against all M rows of x. */
#define DEFINE_DP_BLOCK(NAME, TW, TILE, ROWS)                                                 \
static void NAME(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const TW* w,          \
    const float* wscale, const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t n_begin,    \
    int64_t n_end) {                                                                         \
  if (M <= ROWS_MAX_M) {                                                                     \
    for (int64_t n0 = n_begin; n0 < n_end; n0 += RN) {                                       \
      const int nr = n_end - n0 < RN ? (int)(n_end - n0) : RN;                               \
      float out[ROWS_MAX_M][RN];                                                             \
      switch (M) {  /* a constant row count keeps the accumulators in registers */           \
        case 1: ROWS(x, ldx, w + n0 * K, K, 1, nr, out); break;                              \
        case 2: ROWS(x, ldx, w + n0 * K, K, 2, nr, out); break;                              \
        case 3: ROWS(x, ldx, w + n0 * K, K, 3, nr, out); break;                              \
        case 4: ROWS(x, ldx, w + n0 * K, K, 4, nr, out); break;                              \
        default: ROWS(x, ldx, w + n0 * K, K, (int)M, nr, out);                               \
      }                                                                                      \
      for (int i = 0; i < M; ++i)                                                            \
        for (int j = 0; j < nr; ++j)                                                         \
          y[i * ldy + n0 + j] = f2bf(out[i][j] * (wscale ? wscale[n0 + j] : 1.f)            \
                                     + (bias ? bf2f(bias[n0 + j]) : 0.f));                   \
    }                                                                                        \
    return;                                                                                  \
  }                                                                                          \
  for (int64_t m0 = 0; m0 < M; m0 += DMR) {                                                  \
    const int mr = M - m0 < DMR ? (int)(M - m0) : DMR;                                       \
    const uint16_t* xt = x + m0 * ldx;                                                       \
    for (int64_t n0 = n_begin; n0 < n_end; n0 += DNR) {                                      \
      const int nr = n_end - n0 < DNR ? (int)(n_end - n0) : DNR;                             \
      const TW* wt = w + n0 * K;                                                             \
      float out[DMR][DNR];                                                                   \
      switch (mr * 8 + nr) {  /* constant shapes keep the tile in registers */               \
        case 4 * 8 + 6: TILE(xt, ldx, wt, K, 4, 6, out); break;                              \
        case 1 * 8 + 6: TILE(xt, ldx, wt, K, 1, 6, out); break;                              \
        case 2 * 8 + 6: TILE(xt, ldx, wt, K, 2, 6, out); break;                              \
        case 3 * 8 + 6: TILE(xt, ldx, wt, K, 3, 6, out); break;                              \
        default: TILE(xt, ldx, wt, K, mr, nr, out);                                          \
      }                                                                                      \
      for (int i = 0; i < mr; ++i)                                                           \
        for (int j = 0; j < nr; ++j)                                                         \
          y[(m0 + i) * ldy + n0 + j] = f2bf(out[i][j] * (wscale ? wscale[n0 + j] : 1.f)     \
                                            + (bias ? bf2f(bias[n0 + j]) : 0.f));            \
    }                                                                                        \
  }                                                                                          \
}
DEFINE_DP_BLOCK(dp_block_bf16, uint16_t, tile_dp_bf16, rows_dp_bf16)
DEFINE_DP_BLOCK(dp_block_i8, int8_t, tile_dp_i8, rows_dp_i8)

/* Blocks of NB weight rows over the threads. Returns 0, or -1 when a widening buffer cannot
   be allocated (the caller falls back to torch). */
int linear_bf16_dp(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w,
    const float* wscale, int64_t N, const uint16_t* bias, uint16_t* y, int64_t ldy,
    int nthreads) {
  const int64_t nblocks = (N + NB - 1) / NB;
  _Pragma("omp parallel for num_threads(nthreads) schedule(static)")
  for (int64_t b = 0; b < nblocks; ++b)
    dp_block_bf16(x, ldx, M, K, w, wscale, bias, y, ldy, b * NB, (b + 1) * NB < N ? (b + 1) * NB : N);
  return 0;
}
#if defined(__AVX512VNNI__)
/* int8 weights at decode batches: widening 32 int8 to bf16 takes ~8 instructions, which one
   core cannot issue as fast as memory delivers the weights. Instead each row of x is
   quantized to int16 once per call (s[m] = max|x[m]| / 32767: finer than bf16's own 8-bit
   significand for all but the smallest values), the int8 weights are sign-extended to int16
   (one instruction) and vpdpwssd sums int16 pairs exactly in int32. An int32 lane gains at
   most 2 * 32767 * 127 per instruction, so every I16_CHUNK elements the sums move to float32
   before they could overflow. Measured on one Zen 4 core, the model's int8 GEMMs: 9.7 -> 8.6
   ms at 1 row, 11.1 -> 10.5 at 2, but 12.5 -> 14.2 at 4, where the bf16 widening is shared
   by four rows: so 1-2 rows only (two cores are at memory speed either way). */
#define I16_CHUNK 8192
#define I16_MAX_M 2
static __thread scratch_t xqbuf;
static inline __m512i w32_i8_i16(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p));
}
static void rows_i16(const int16_t* xq, const float* xs, int64_t M, int64_t K, const int8_t* w,
    const float* wscale, const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t n_begin,
    int64_t n_end) {
  for (int64_t n0 = n_begin; n0 < n_end; n0 += RN) {
    const int nr = n_end - n0 < RN ? (int)(n_end - n0) : RN;
    __m512 acc[I16_MAX_M][RN];
    for (int j = 0; j < nr; ++j) {
      const int8_t* wr = w + (n0 + j) * K;
      __m512 f[I16_MAX_M];
      for (int i = 0; i < M; ++i) f[i] = _mm512_setzero_ps();
      for (int64_t c0 = 0; c0 < K; c0 += I16_CHUNK) {
        const int64_t c1 = K - c0 < I16_CHUNK ? K : c0 + I16_CHUNK;
        __m512i a[I16_MAX_M];
        for (int i = 0; i < M; ++i) a[i] = _mm512_setzero_si512();
        int64_t k = c0;
        for (; k + 32 <= c1; k += 32) {
          if (!(k & 63)) _mm_prefetch((const char*)(wr + k) + PF_BYTES, _MM_HINT_T0);
          const __m512i wv = w32_i8_i16(wr + k);
          for (int i = 0; i < M; ++i)
            a[i] = _mm512_dpwssd_epi32(a[i], _mm512_loadu_si512(xq + i * K + k), wv);
        }
        if (k < c1) {
          const __mmask32 mk = (__mmask32)((1ull << (c1 - k)) - 1);
          const __m512i wv = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mk, wr + k));
          for (int i = 0; i < M; ++i)
            a[i] = _mm512_dpwssd_epi32(a[i], _mm512_maskz_loadu_epi16(mk, xq + i * K + k), wv);
        }
        for (int i = 0; i < M; ++i) f[i] = _mm512_add_ps(f[i], _mm512_cvtepi32_ps(a[i]));
      }
      for (int i = 0; i < M; ++i) acc[i][j] = f[i];
    }
    for (int64_t i = 0; i < M; ++i) {
      float out[RN];
      for (int j = nr; j < RN; ++j) acc[i][j] = _mm512_setzero_ps();
      _mm512_storeu_ps(out, reduce16(acc[i]));
      for (int j = 0; j < nr; ++j)
        y[i * ldy + n0 + j] = f2bf(out[j] * xs[i] * wscale[n0 + j] + (bias ? bf2f(bias[n0 + j]) : 0.f));
    }
  }
}
/* x rows -> int16 with one scale each (round to nearest); 0 for an all-zero row. */
static void quantize_i16(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, int16_t* xq, float* xs) {
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* xr = x + m * ldx;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) { const float v = fabsf(bf2f(xr[k])); amax = v > amax ? v : amax; }
    xs[m] = amax / 32767.f;
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
    for (int64_t k = 0; k < K; ++k) xq[m * K + k] = (int16_t)nearbyintf(bf2f(xr[k]) * inv);
  }
}
#endif

int linear_i8_bf16_dp(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const int8_t* w,
    const float* wscale, int64_t N, const uint16_t* bias, uint16_t* y, int64_t ldy,
    int nthreads) {
  const int64_t nblocks = (N + NB - 1) / NB;
#if defined(__AVX512VNNI__)
  if (M <= I16_MAX_M) {
    int16_t* xq = (int16_t*)grow(&xqbuf, (M * K + 1) / 2);  /* two int16 per float slot */
    if (!xq) return -1;
    float xs[I16_MAX_M];
    quantize_i16(x, ldx, M, K, xq, xs);
    _Pragma("omp parallel for num_threads(nthreads) schedule(static)")
    for (int64_t b = 0; b < nblocks; ++b)
      rows_i16(xq, xs, M, K, w, wscale, bias, y, ldy, b * NB, (b + 1) * NB < N ? (b + 1) * NB : N);
    return 0;
  }
#endif
  int failed = 0;
  _Pragma("omp parallel for num_threads(nthreads) schedule(static) reduction(|:failed)")
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t n0 = b * NB, n_end = (b + 1) * NB < N ? (b + 1) * NB : N;
    if (M < WIDEN_MIN_M) {
      dp_block_i8(x, ldx, M, K, w, wscale, bias, y, ldy, n0, n_end);
      continue;
    }
    const uint16_t* wb = widen_block(w + n0 * K, n_end - n0, K);
    if (!wb) { failed = 1; continue; }
    dp_block_bf16(x, ldx, M, K, wb - n0 * K, wscale, bias, y, ldy, n0, n_end);
  }
  return failed ? -1 : 0;
}
#endif
