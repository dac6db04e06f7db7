/* 4-bit codes into a 16-entry float table (bitsandbytes' NF4 and FP4: engine.kernels.cpu.lut4):
   weight = table[code] * scale, in float32, as bnb dequantizes. The levels are not integers,
   so the dot products run in float32: per block of 64 weights the table is scaled by the
   block's scale once (16 multiplies, each weight then the very float bnb's dequantize makes),
   and every code looks its weight up in the scaled table, FMA'd with x.

   Layout (made by lut4.pack): codes [N, K/2], per chunk of 32 weights along K 16 bytes, byte
   j's low nibble weight j of the chunk and its high nibble weight j + 16 (so 16 bytes widened
   to 16 lanes give both halves with one shift); scales float32 [N, K/64]. K % 64 == 0.

   Three variants of the same arithmetic: scalar, AVX2 (two 8-entry permutes and a blend on
   code bit 3) and AVX-512 (one 16-entry permute); lut4_isa picks one at run time, capped at
   what this build has, so the tests can force the slower ones. */
#include "tessera_kernels.h"
#include "avx2_math.h"
#include "bf16_convert.h"

#include <stdint.h>
#include <stdlib.h>
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define ISA_MAX LUT4_ISA_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define ISA_MAX LUT4_ISA_AVX2
#else
#define ISA_MAX LUT4_ISA_SCALAR
#endif

int lut4_isa = ISA_MAX;
int lut4_isa_max(void) { return ISA_MAX; }

#define MAX_R 4           /* rows of x each weight block is looked up for at once */
#define ROWS_PER_TASK 16  /* output rows a parallel task takes */

/* R rows of x (float32, row m at x + m * ldx) against one weight row: out[m]. */
typedef void (*dot_fn)(const float* x, int64_t ldx, int R, const uint8_t* codes,
    const float* scales, const float* table, int64_t K, float* out);

/* ---- scalar ---- */
static void dot_scalar(const float* x, int64_t ldx, int R, const uint8_t* codes,
    const float* scales, const float* table, int64_t K, float* out) {
  float acc[MAX_R] = {0};
  for (int64_t b = 0; b < K / 64; ++b) {
    float t[16];
    for (int i = 0; i < 16; ++i) t[i] = table[i] * scales[b];
    for (int c = 0; c < 2; ++c) {
      const uint8_t* q = codes + b * 32 + c * 16;
      const int64_t k0 = b * 64 + c * 32;
      for (int m = 0; m < R; ++m) {
        const float* xr = x + m * ldx + k0;
        float s = 0.f;
        for (int j = 0; j < 16; ++j) s += t[q[j] & 15] * xr[j] + t[q[j] >> 4] * xr[j + 16];
        acc[m] += s;
      }
    }
  }
  for (int m = 0; m < R; ++m) out[m] = acc[m];
}

/* one row of K weights as float32 */
static void row_scalar(const uint8_t* codes, const float* scales, const float* table, int64_t K,
    float* out) {
  for (int64_t b = 0; b < K / 64; ++b) {
    float t[16];
    for (int i = 0; i < 16; ++i) t[i] = table[i] * scales[b];
    for (int c = 0; c < 2; ++c) {
      const uint8_t* q = codes + b * 32 + c * 16;
      float* v = out + b * 64 + c * 32;
      for (int j = 0; j < 16; ++j) { v[j] = t[q[j] & 15]; v[j + 16] = t[q[j] >> 4]; }
    }
  }
}

#if ISA_MAX >= LUT4_ISA_AVX2
/* table[idx] for 8 codes 0..15: each half of the table permuted by the low 3 bits, the half
   chosen by bit 3 (shifted to the sign bit, which blendv reads) */
static inline __m256 lookup8(__m256 lo, __m256 hi, __m256i idx) {
  const __m256 pick_hi = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx),
                          pick_hi);
}
/* 8 code bytes widened to 8 lanes: their low nibbles (weights j..j+7) and high (j+16..j+23).
   lookup8 reads only bits 0-3 of an index, so the low nibbles need no mask. */
static inline void nibbles8(const uint8_t* q, __m256i* lo, __m256i* hi) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)q));
  *lo = v;
  *hi = _mm256_srli_epi32(v, 4);
}

static inline __attribute__((always_inline)) void dot_avx2_rows(const float* x, int64_t ldx,
    int R, const uint8_t* codes, const float* scales, const float* table, int64_t K,
    float* out) {
  const __m256 t_lo = _mm256_loadu_ps(table), t_hi = _mm256_loadu_ps(table + 8);
  /* independent FMA chains (their latency), one array each so that they stay in registers:
     four a row up to 2 rows, two a row above (16 ymm registers) */
  __m256 a0[MAX_R], a1[MAX_R], a2[MAX_R], a3[MAX_R];
  for (int m = 0; m < R; ++m) a0[m] = a1[m] = a2[m] = a3[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / 64; ++b) {
    const __m256 s = _mm256_set1_ps(scales[b]);
    const __m256 lo_t = _mm256_mul_ps(t_lo, s), hi_t = _mm256_mul_ps(t_hi, s);
    for (int c = 0; c < 2; ++c) {  /* a chunk of 32: its bytes 0-7, then 8-15 */
      const int64_t k0 = b * 64 + c * 32;
      __m256i i0, i1, i2, i3;
      nibbles8(codes + k0 / 2, &i0, &i1);      /* weights k0..k0+7, k0+16..k0+23 */
      nibbles8(codes + k0 / 2 + 8, &i2, &i3);  /* weights k0+8..k0+15, k0+24..k0+31 */
      const __m256 w0 = lookup8(lo_t, hi_t, i0), w1 = lookup8(lo_t, hi_t, i1);
      const __m256 w2 = lookup8(lo_t, hi_t, i2), w3 = lookup8(lo_t, hi_t, i3);
      for (int m = 0; m < R; ++m) {
        const float* xr = x + m * ldx + k0;
        a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), a0[m]);
        a1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 16), a1[m]);
        if (R <= 2) {
          a2[m] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 8), a2[m]);
          a3[m] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), a3[m]);
        } else {
          a0[m] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 8), a0[m]);
          a1[m] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), a1[m]);
        }
      }
    }
  }
  for (int m = 0; m < R; ++m)
    out[m] = hsum8(_mm256_add_ps(_mm256_add_ps(a0[m], a1[m]), _mm256_add_ps(a2[m], a3[m])));
}

static void row_avx2(const uint8_t* codes, const float* scales, const float* table, int64_t K,
    float* out) {
  const __m256 t_lo = _mm256_loadu_ps(table), t_hi = _mm256_loadu_ps(table + 8);
  for (int64_t b = 0; b < K / 64; ++b) {
    const __m256 s = _mm256_set1_ps(scales[b]);
    const __m256 lo_t = _mm256_mul_ps(t_lo, s), hi_t = _mm256_mul_ps(t_hi, s);
    for (int h = 0; h < 4; ++h) {
      float* v = out + b * 64 + (h >> 1) * 32 + (h & 1) * 8;
      __m256i ilo, ihi;
      nibbles8(codes + b * 32 + h * 8, &ilo, &ihi);
      _mm256_storeu_ps(v, lookup8(lo_t, hi_t, ilo));
      _mm256_storeu_ps(v + 16, lookup8(lo_t, hi_t, ihi));
    }
  }
}
#endif

#if ISA_MAX >= LUT4_ISA_AVX512
/* permutexvar reads only an index's low 4 bits: the low nibbles need no mask */
static inline __attribute__((always_inline)) void dot_avx512_rows(const float* x, int64_t ldx,
    int R, const uint8_t* codes, const float* scales, const float* table, int64_t K,
    float* out) {
  const __m512 t = _mm512_loadu_ps(table);
  /* four independent FMA chains a row (their latency), one array each so that they stay in
     registers */
  __m512 a0[MAX_R], a1[MAX_R], a2[MAX_R], a3[MAX_R];
  for (int m = 0; m < R; ++m) a0[m] = a1[m] = a2[m] = a3[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / 64; ++b) {
    const __m512 ts = _mm512_mul_ps(t, _mm512_set1_ps(scales[b]));
    const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(codes + b * 32)));
    const __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(codes + b * 32 + 16)));
    const __m512 w0 = _mm512_permutexvar_ps(v0, ts);  /* weights 0-15 of the block */
    const __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v0, 4), ts);  /* 16-31 */
    const __m512 w2 = _mm512_permutexvar_ps(v1, ts);  /* 32-47 */
    const __m512 w3 = _mm512_permutexvar_ps(_mm512_srli_epi32(v1, 4), ts);  /* 48-63 */
    for (int m = 0; m < R; ++m) {
      const float* xr = x + m * ldx + b * 64;
      a0[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), a0[m]);
      a1[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), a1[m]);
      a2[m] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xr + 32), a2[m]);
      a3[m] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xr + 48), a3[m]);
    }
  }
  for (int m = 0; m < R; ++m)
    out[m] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0[m], a1[m]),
                                                _mm512_add_ps(a2[m], a3[m])));
}

/* 16 floats rounded to bf16 to nearest even (f2bf's integer rounding, in lanes) */
static inline __m256i bf16_16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

static void row_avx512(const uint8_t* codes, const float* scales, const float* table, int64_t K,
    void* out, int bf16) {
  const __m512 t = _mm512_loadu_ps(table);
  for (int64_t b = 0; b < K / 64; ++b) {
    const __m512 ts = _mm512_mul_ps(t, _mm512_set1_ps(scales[b]));
#if defined(__AVX512BW__)
    if (bf16) {
      /* the scaled table rounded once (16 values, the same roundings as each weight's), then
         a chunk's 32 weights looked up as bf16 words in one permute */
      const __m512i tb = _mm512_castsi256_si512(bf16_16(ts));
      for (int c = 0; c < 2; ++c) {
        const int64_t k0 = b * 64 + c * 32;
        const __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(codes + k0 / 2)));
        const __m512i idx = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_and_si256(q, _mm256_set1_epi16(15))),
            _mm256_srli_epi16(q, 4), 1);
        _mm512_storeu_si512((uint16_t*)out + k0, _mm512_permutexvar_epi16(idx, tb));
      }
      continue;
    }
#endif
    for (int c = 0; c < 2; ++c) {
      const int64_t k0 = b * 64 + c * 32;
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(codes + k0 / 2)));
      const __m512 lo = _mm512_permutexvar_ps(v, ts);
      const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), ts);
      if (bf16) {
        _mm256_storeu_si256((__m256i*)((uint16_t*)out + k0), bf16_16(lo));
        _mm256_storeu_si256((__m256i*)((uint16_t*)out + k0 + 16), bf16_16(hi));
      } else {
        _mm512_storeu_ps((float*)out + k0, lo);
        _mm512_storeu_ps((float*)out + k0 + 16, hi);
      }
    }
  }
}
#endif

/* the vector kernels specialized per R (a constant: the accumulators stay in registers) */
#define DEFINE_R(NAME, BODY, R)                                                               \
  static void NAME(const float* x, int64_t ldx, int r, const uint8_t* codes,                \
      const float* scales, const float* table, int64_t K, float* out) {                     \
    (void)r;                                                                                \
    BODY(x, ldx, R, codes, scales, table, K, out);                                          \
  }
#define DEFINE_RS(V)                                                                          \
  DEFINE_R(dot_##V##_1, dot_##V##_rows, 1)                                                    \
  DEFINE_R(dot_##V##_2, dot_##V##_rows, 2)                                                    \
  DEFINE_R(dot_##V##_3, dot_##V##_rows, 3)                                                    \
  DEFINE_R(dot_##V##_4, dot_##V##_rows, 4)                                                    \
  static const dot_fn DOT_##V[MAX_R] = {dot_##V##_1, dot_##V##_2, dot_##V##_3, dot_##V##_4};
static const dot_fn DOT_scalar[MAX_R] = {dot_scalar, dot_scalar, dot_scalar, dot_scalar};
#if ISA_MAX >= LUT4_ISA_AVX2
DEFINE_RS(avx2)
#endif
#if ISA_MAX >= LUT4_ISA_AVX512
DEFINE_RS(avx512)
#endif

typedef void (*row_fn)(const uint8_t*, const float*, const float*, int64_t, float*);

static int isa_now(void) { return lut4_isa < ISA_MAX ? lut4_isa : ISA_MAX; }

static const dot_fn* pick_dot(void) {
  const int isa = isa_now();
  (void)isa;
#if ISA_MAX >= LUT4_ISA_AVX512
  if (isa >= LUT4_ISA_AVX512) return DOT_avx512;
#endif
#if ISA_MAX >= LUT4_ISA_AVX2
  if (isa >= LUT4_ISA_AVX2) return DOT_avx2;
#endif
  return DOT_scalar;
}

/* the float32 row of the variants below AVX-512 (which lut4_dequantize calls itself) */
static row_fn pick_row(void) {
#if ISA_MAX >= LUT4_ISA_AVX2
  if (isa_now() >= LUT4_ISA_AVX2) return row_avx2;
#endif
  return row_scalar;
}

int lut4_linear(const void* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* codes,
    const float* scales, const float* table, int64_t N, const void* bias, void* y, int64_t ldy,
    int bf16, int nthreads) {
  if (K <= 0 || K % 64 || M < 1 || N < 0) return -1;
  /* bf16 x widened to float32 once (M is small: the dot kernel's rows), float32 x read as is */
  float* xf = NULL;
  const float* xs = (const float*)x;
  int64_t lds = ldx;
  if (bf16) {
    xf = (float*)malloc(sizeof(float) * M * K);
    if (!xf) return -1;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) xf[m * K + k] = bf2f(((const uint16_t*)x)[m * ldx + k]);
    xs = xf;
    lds = K;
  }
  const dot_fn* dot = pick_dot();
  const int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
  _Pragma("omp parallel for num_threads(nthreads) if(nthreads > 1) schedule(static)")
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t n1 = (t + 1) * ROWS_PER_TASK < N ? (t + 1) * ROWS_PER_TASK : N;
    /* x's rows outer: a pass's MAX_R rows stay in L1 across the task's weight rows (small:
       K/2 bytes each), rather than every row of x streaming from L2 for each weight row */
    for (int64_t m0 = 0; m0 < M; m0 += MAX_R) {
      const int R = M - m0 < MAX_R ? (int)(M - m0) : MAX_R;
      for (int64_t n = t * ROWS_PER_TASK; n < n1; ++n) {
        const float b = bias ? (bf16 ? bf2f(((const uint16_t*)bias)[n]) : ((const float*)bias)[n]) : 0.f;
        float v[MAX_R];
        dot[R - 1](xs + m0 * lds, lds, R, codes + n * (K / 2), scales + n * (K / 64), table, K, v);
        for (int r = 0; r < R; ++r) {
          if (bf16) ((uint16_t*)y)[(m0 + r) * ldy + n] = f2bf(v[r] + b);
          else ((float*)y)[(m0 + r) * ldy + n] = v[r] + b;
        }
      }
    }
  }
  free(xf);
  return 0;
}

int lut4_dequantize(const uint8_t* codes, const float* scales, const float* table, int64_t N,
    int64_t K, void* out, int bf16, int nthreads) {
  if (K <= 0 || K % 64 || N < 0) return -1;
  const row_fn row = pick_row();
  int wide = 0;  /* the AVX-512 variant writes bf16 itself; the others a float32 row first */
#if ISA_MAX >= LUT4_ISA_AVX512
  wide = isa_now() >= LUT4_ISA_AVX512;
#endif
  const int buffered = bf16 && !wide;
  int failed = 0;
  _Pragma("omp parallel num_threads(nthreads) if(nthreads > 1) reduction(|:failed)")
  {
    float* v = buffered ? (float*)malloc(sizeof(float) * K) : NULL;  /* a row, then rounded */
    if (buffered && !v) failed = 1;
    _Pragma("omp for schedule(static)")
    for (int64_t n = 0; n < N; ++n) {
      if (failed) continue;
      const uint8_t* c = codes + n * (K / 2);
      const float* s = scales + n * (K / 64);
#if ISA_MAX >= LUT4_ISA_AVX512
      if (wide) {
        row_avx512(c, s, table, K, (char*)out + n * K * (bf16 ? 2 : 4), bf16);
        continue;
      }
#endif
      if (!bf16) { row(c, s, table, K, (float*)out + n * K); continue; }
      row(c, s, table, K, v);
      for (int64_t k = 0; k < K; ++k) ((uint16_t*)out)[n * K + k] = f2bf(v[k]);
    }
    free(v);
  }
  return failed ? -1 : 0;
}

/* bf16 x of more rows than the dot kernel pays for (decode steps of 9-32 streams): each thread
   decodes TILE_N weight rows at a time into a bf16 buffer that stays in cache and runs the
   AVX512-BF16 dot kernel (gemm.c's linear_bf16_dp, on one thread) on it, so the weight is never
   written out whole in bf16 and read back (the dequantize-then-GEMM path's round trip through
   memory). The same bf16-rounded weights and bf16 products as that path. -1 where this build
   has no AVX512-BF16 kernel (the caller takes that path). */
#define TILE_N 32
#if ISA_MAX >= LUT4_ISA_AVX512 && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_TILES 1
#else
#define HAVE_TILES 0
#endif
int lut4_tiles_max_rows(void) { return HAVE_TILES ? LUT4_TILES_MAX_ROWS : 0; }

int lut4_linear_bf16_tiles(const uint16_t* x, int64_t ldx, int64_t M, int64_t K,
    const uint8_t* codes, const float* scales, const float* table, int64_t N,
    const uint16_t* bias, uint16_t* y, int64_t ldy, int nthreads) {
#if HAVE_TILES
  if (K <= 0 || K % 64 || M < 1 || N < 0 || isa_now() < LUT4_ISA_AVX512) return -1;
  const int64_t tiles = (N + TILE_N - 1) / TILE_N;
  int failed = 0;
  _Pragma("omp parallel num_threads(nthreads) if(nthreads > 1) reduction(|:failed)")
  {
    uint16_t* buf = (uint16_t*)malloc(sizeof(uint16_t) * TILE_N * K);
    if (!buf) failed = 1;
    _Pragma("omp for schedule(static)")
    for (int64_t t = 0; t < tiles; ++t) {
      if (!buf) continue;
      const int64_t n0 = t * TILE_N, nt = N - n0 < TILE_N ? N - n0 : TILE_N;
      for (int64_t j = 0; j < nt; ++j)
        row_avx512(codes + (n0 + j) * (K / 2), scales + (n0 + j) * (K / 64), table, K,
            (char*)(buf + j * K), 1);
      linear_bf16_dp(x, ldx, M, K, buf, NULL, nt, bias ? bias + n0 : NULL, y + n0, ldy, 1);
    }
    free(buf);
  }
  return failed ? -1 : 0;
#else
  (void)x; (void)ldx; (void)M; (void)K; (void)codes; (void)scales; (void)table; (void)N;
  (void)bias; (void)y; (void)ldy; (void)nthreads;
  return -1;
#endif
}
