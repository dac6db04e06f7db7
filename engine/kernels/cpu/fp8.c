/* FP8 e4m3 weights at one byte a weight (float8_e4m3fn checkpoints and --quantization fp8:
   engine.kernels.cpu.fp8): weight[n][k] = e4m3(codes[n][k]) * scales[n][k / G] in float32.

   Layout: codes uint8 [N, K], the checkpoint's bytes as they are; scales float32 [N, ceil(K /
   G)] (per-tensor and per-channel scales: G = K, one a row; block-wise: G = the block's K, a
   multiple of 32). K % 32 == 0, else -1.

   The conversion: e4m3 (s eeee mmm, bias 7) is float16 (s eeeee mmmmmmmmmm, bias 15) with its
   bits moved: h = (b + (b & 0x80)) << 7 (the sign carried from bit 14 to bit 15) is the value
   times 2^-8 exactly, subnormals included (an e4m3 subnormal lands on a float16 subnormal,
   which F16C's vcvtph2ps widens exactly). The 2^8 goes into the scale. (e4m3fn's NaN, 0x7F,
   reads as 480: checkpoints hold none.)

   The dot kernel (fp8_linear, a few rows of x): per group of G weights the widened values
   FMA'd with x in float32, the group's sum times its scale. Three variants of the same
   arithmetic: scalar (a 256-entry table), AVX2 + F16C and AVX-512; fp8_isa picks one at run
   time, capped at what this build has, so the tests can force the slower ones. bf16 x on a
   CPU with AVX512-BF16 takes the codes as bf16 instead (bf16_bits32: exact, in integer ops)
   for vdpbf16ps. Larger batches decode rows to bf16 (fp8_dequant_row_bf16: each value times
   its scale in float32, rounded once; with one scale a row, the exact values, the scale on
   each sum) for a bf16 GEMM: 32 rows at a time in cache for the AVX512-BF16 dot kernel
   (fp8_linear_bf16_tiles), 16 at a time for AMX (amx_bf16.c's SRC_FP8), or whole slices for
   oneDNN (fp8_dequantize). */
#include "tessera_kernels.h"
#include "avx2_math.h"
#include "bf16_convert.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define ISA_MAX FP8_ISA_AVX512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ISA_MAX FP8_ISA_AVX2
#else
#define ISA_MAX FP8_ISA_SCALAR
#endif

int fp8_isa = ISA_MAX;
int fp8_isa_max(void) { return ISA_MAX; }

#define MAX_R 4           /* rows of x each weight chunk is widened for at once */
#define ROWS_PER_TASK 16  /* output rows a parallel task takes */
#define F16_SHIFT 256.f   /* the widened float16 is the value times 2^-8 */
/* The codes are prefetched this far ahead in software, as gemm.c's decode kernels do: the
   hardware prefetcher ramps up anew for every matrix. Without it one Xeon core read a
   model's worth of FP8 layers (past L3) at 6.9 GB/s, half the bf16 kernel's 15. */
#define PF_BYTES 16384

static int isa_now(void) { return fp8_isa < ISA_MAX ? fp8_isa : ISA_MAX; }

/* the 256 values, for the scalar variant */
static float e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const float v = e ? ldexpf(1.f + m / 8.f, e - 7) : ldexpf(m / 8.f, -6);
  return (b & 0x80) ? -v : v;
}
/* the table, built only where the scalar variant runs (the vector ones convert in lanes) */
static void e4m3_table(float* t) {
  if (isa_now() > FP8_ISA_SCALAR) return;
  for (int b = 0; b < 256; ++b) t[b] = e4m3_value((uint8_t)b);
}

static inline int64_t groups_of(int64_t K, int64_t G) { return (K + G - 1) / G; }

/* R rows of x (float32, row m at x + m * ldx) against one weight row: out[m]. */
typedef void (*dot_fn)(const float* x, int64_t ldx, int R, const uint8_t* codes,
    const float* scales, int64_t G, int64_t K, const float* table, float* out);

static void dot_scalar(const float* x, int64_t ldx, int R, const uint8_t* codes,
    const float* scales, int64_t G, int64_t K, const float* table, float* out) {
  float acc[MAX_R] = {0};
  for (int64_t g0 = 0, g = 0; g0 < K; g0 += G, ++g) {
    const int64_t g1 = g0 + G < K ? g0 + G : K;
    for (int m = 0; m < R; ++m) {
      const float* xr = x + m * ldx;
      float s = 0.f;
      for (int64_t k = g0; k < g1; ++k) s += table[codes[k]] * xr[k];
      acc[m] += s * scales[g];
    }
  }
  for (int m = 0; m < R; ++m) out[m] = acc[m];
}

static void row_scalar(const uint8_t* codes, const float* scales, int64_t G, int64_t K,
    const float* table, float* out) {
  for (int64_t k = 0; k < K; ++k) out[k] = table[codes[k]] * scales[k / G];
}

#if ISA_MAX >= FP8_ISA_AVX2
/* 16 codes -> their float16 bits (value * 2^-8), 16 lanes of 16 bits */
static inline __m256i f16_bits16(const uint8_t* q) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)q));
  const __m256i sign = _mm256_and_si256(w, _mm256_set1_epi16(0x80));
  return _mm256_slli_epi16(_mm256_add_epi16(w, sign), 7);
}

static inline __attribute__((always_inline)) void dot_avx2_rows(const float* x, int64_t ldx,
    int R, const uint8_t* codes, const float* scales, int64_t G, int64_t K, const float* table,
    float* out) {
  (void)table;
  __m256 tot[MAX_R];
  for (int m = 0; m < R; ++m) tot[m] = _mm256_setzero_ps();
  for (int64_t g0 = 0, g = 0; g0 < K; g0 += G, ++g) {
    const int64_t g1 = g0 + G < K ? g0 + G : K;
    __m256 a0[MAX_R], a1[MAX_R];
    for (int m = 0; m < R; ++m) a0[m] = a1[m] = _mm256_setzero_ps();
    for (int64_t k = g0; k < g1; k += 16) {
      if (!(k & 63)) _mm_prefetch((const char*)(codes + k) + PF_BYTES, _MM_HINT_T0);
      const __m256i h = f16_bits16(codes + k);
      const __m256 w0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
      const __m256 w1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
      for (int m = 0; m < R; ++m) {
        const float* xr = x + m * ldx + k;
        a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), a0[m]);
        a1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), a1[m]);
      }
    }
    const __m256 s = _mm256_set1_ps(scales[g] * F16_SHIFT);
    for (int m = 0; m < R; ++m) tot[m] = _mm256_fmadd_ps(_mm256_add_ps(a0[m], a1[m]), s, tot[m]);
  }
  for (int m = 0; m < R; ++m) out[m] = hsum8(tot[m]);
}

static void row_avx2(const uint8_t* codes, const float* scales, int64_t G, int64_t K,
    const float* table, float* out) {
  (void)table;
  for (int64_t k = 0; k < K; k += 16) {
    const __m256 s = _mm256_set1_ps(scales[k / G] * F16_SHIFT);
    const __m256i h = f16_bits16(codes + k);
    _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), s));
    _mm256_storeu_ps(out + k + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), s));
  }
}
#endif

#if ISA_MAX >= FP8_ISA_AVX512
/* 32 codes -> their float16 bits, 32 lanes of 16 bits */
static inline __m512i f16_bits32(const uint8_t* q) {
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)q));
  const __m512i sign = _mm512_and_si512(w, _mm512_set1_epi16(0x80));
  return _mm512_slli_epi16(_mm512_add_epi16(w, sign), 7);
}

static inline __attribute__((always_inline)) void dot_avx512_rows(const float* x, int64_t ldx,
    int R, const uint8_t* codes, const float* scales, int64_t G, int64_t K, const float* table,
    float* out) {
  (void)table;
  __m512 tot[MAX_R];
  for (int m = 0; m < R; ++m) tot[m] = _mm512_setzero_ps();
  for (int64_t g0 = 0, g = 0; g0 < K; g0 += G, ++g) {
    const int64_t g1 = g0 + G < K ? g0 + G : K;
    /* two independent FMA chains a row (their latency), one array each so that they stay in
       registers */
    __m512 a0[MAX_R], a1[MAX_R];
    for (int m = 0; m < R; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    for (int64_t k = g0; k < g1; k += 32) {
      if (!(k & 63)) _mm_prefetch((const char*)(codes + k) + PF_BYTES, _MM_HINT_T0);
      const __m512i h = f16_bits32(codes + k);
      const __m512 w0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
      const __m512 w1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
      for (int m = 0; m < R; ++m) {
        const float* xr = x + m * ldx + k;
        a0[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), a0[m]);
        a1[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), a1[m]);
      }
    }
    const __m512 s = _mm512_set1_ps(scales[g] * F16_SHIFT);
    for (int m = 0; m < R; ++m) tot[m] = _mm512_fmadd_ps(_mm512_add_ps(a0[m], a1[m]), s, tot[m]);
  }
  for (int m = 0; m < R; ++m) out[m] = _mm512_reduce_add_ps(tot[m]);
}

#if !defined(__AVX512BF16__)
/* 16 floats rounded to bf16 to nearest even (f2bf's integer rounding, in lanes) */
static inline __m256i bf16_16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
#endif

static void row_avx512(const uint8_t* codes, const float* scales, int64_t G, int64_t K,
    void* out, int bf16) {
  for (int64_t k = 0; k < K; k += 32) {
    if (!(k & 63)) _mm_prefetch((const char*)(codes + k) + PF_BYTES, _MM_HINT_T0);
    const __m512 s = _mm512_set1_ps(scales[k / G] * F16_SHIFT);
    const __m512i h = f16_bits32(codes + k);
    const __m512 lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), s);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), s);
    if (bf16) {
#if defined(__AVX512BF16__)  /* one instruction, the same rounding (to nearest even) */
      _mm512_storeu_si512((uint16_t*)out + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
#else
      _mm256_storeu_si256((__m256i*)((uint16_t*)out + k), bf16_16(lo));
      _mm256_storeu_si256((__m256i*)((uint16_t*)out + k + 16), bf16_16(hi));
#endif
    } else {
      _mm512_storeu_ps((float*)out + k, lo);
      _mm512_storeu_ps((float*)out + k + 16, hi);
    }
  }
}
#endif

#if ISA_MAX >= FP8_ISA_AVX512 && defined(__AVX512BF16__)
#define HAVE_BF16_DOT 1
/* 32 codes -> their exact values as bf16, in integer ops: a normal e4m3 (exponent field e > 0)
   is bf16 with the exponent rebased by 120, (b & 0x7F) << 4 plus 120 << 7; the 7 subnormals
   (m * 2^-9, m = 1..7) and zero come from a table; the sign moves from bit 7 to bit 15. No
   float conversions (the float16 route's three cost as much as the rest). */
static inline __m512i bf16_bits32(const uint8_t* q, __m512i subnormals) {
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)q));
  const __m512i mag = _mm512_and_si512(w, _mm512_set1_epi16(0x7F));
  const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(0x3C00));
  const __mmask32 sub = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8));
  const __m512i v = _mm512_mask_permutexvar_epi16(normal, sub, mag, subnormals);
  /* v | (w << 8 & 0x8000): the sign bit */
  return _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(w, 8), _mm512_set1_epi16((short)0x8000), 0xF8);
}
/* the table bf16_bits32 reads: the bf16 of m * 2^-9 at lane m (m = 0..7; a constant, since
   it is loaded for every weight row) */
static const uint16_t SUBNORMALS[32] = {0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};
static inline __m512i subnormal_table(void) { return _mm512_loadu_si512(SUBNORMALS); }
/* bf16 x: each chunk's 32 values as bf16 (exact: 3 bits of mantissa; bf16_bits32) multiplied
   with every row of x by vdpbf16ps (32 products an instruction, float32 sums), instead of two
   float32 FMAs a row on x widened first. The products are exact; the sums' order is
   vdpbf16ps's. x: bf16 rows as they are. */
static inline __attribute__((always_inline)) void dot_bf16x_rows(const uint16_t* x,
    int64_t ldx, int R, const uint8_t* codes, const float* scales, int64_t G, int64_t K,
    float* out) {
  const __m512i sub = subnormal_table();
  __m512 tot[MAX_R];
  for (int m = 0; m < R; ++m) tot[m] = _mm512_setzero_ps();
  for (int64_t g0 = 0, g = 0; g0 < K; g0 += G, ++g) {
    const int64_t g1 = g0 + G < K ? g0 + G : K;
    __m512 a0[MAX_R], a1[MAX_R];
    for (int m = 0; m < R; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    int64_t k = g0;
    for (; k + 64 <= g1; k += 64) {  /* two chunks: two independent chains a row */
      _mm_prefetch((const char*)(codes + k) + PF_BYTES, _MM_HINT_T0);
      const __m512bh w0 = (__m512bh)bf16_bits32(codes + k, sub);
      const __m512bh w1 = (__m512bh)bf16_bits32(codes + k + 32, sub);
      for (int m = 0; m < R; ++m) {
        const uint16_t* xr = x + m * ldx + k;
        a0[m] = _mm512_dpbf16_ps(a0[m], (__m512bh)_mm512_loadu_si512(xr), w0);
        a1[m] = _mm512_dpbf16_ps(a1[m], (__m512bh)_mm512_loadu_si512(xr + 32), w1);
      }
    }
    if (k < g1) {  /* a last chunk of 32 */
      const __m512bh w = (__m512bh)bf16_bits32(codes + k, sub);
      for (int m = 0; m < R; ++m)
        a0[m] = _mm512_dpbf16_ps(a0[m], (__m512bh)_mm512_loadu_si512(x + m * ldx + k), w);
    }
    const __m512 s = _mm512_set1_ps(scales[g]);
    for (int m = 0; m < R; ++m) tot[m] = _mm512_fmadd_ps(_mm512_add_ps(a0[m], a1[m]), s, tot[m]);
  }
  for (int m = 0; m < R; ++m) out[m] = _mm512_reduce_add_ps(tot[m]);
}
typedef void (*dot_bf16x_fn)(const uint16_t* x, int64_t ldx, const uint8_t* codes,
    const float* scales, int64_t G, int64_t K, float* out);
#define DEFINE_BF16X(R)                                                                       \
  static void dot_bf16x_##R(const uint16_t* x, int64_t ldx, const uint8_t* codes,           \
      const float* scales, int64_t G, int64_t K, float* out) {                              \
    dot_bf16x_rows(x, ldx, R, codes, scales, G, K, out);                                    \
  }
DEFINE_BF16X(1)
DEFINE_BF16X(2)
DEFINE_BF16X(3)
DEFINE_BF16X(4)
static const dot_bf16x_fn DOT_bf16x[MAX_R] = {dot_bf16x_1, dot_bf16x_2, dot_bf16x_3, dot_bf16x_4};
#else
#define HAVE_BF16_DOT 0
#endif

/* the vector kernels specialized per R (a constant: the accumulators stay in registers) */
#define DEFINE_R(NAME, BODY, R)                                                               \
  static void NAME(const float* x, int64_t ldx, int r, const uint8_t* codes,                \
      const float* scales, int64_t G, int64_t K, const float* table, float* out) {          \
    (void)r;                                                                                \
    BODY(x, ldx, R, codes, scales, G, K, table, out);                                       \
  }
#define DEFINE_RS(V)                                                                          \
  DEFINE_R(dot_##V##_1, dot_##V##_rows, 1)                                                    \
  DEFINE_R(dot_##V##_2, dot_##V##_rows, 2)                                                    \
  DEFINE_R(dot_##V##_3, dot_##V##_rows, 3)                                                    \
  DEFINE_R(dot_##V##_4, dot_##V##_rows, 4)                                                    \
  static const dot_fn DOT_##V[MAX_R] = {dot_##V##_1, dot_##V##_2, dot_##V##_3, dot_##V##_4};
static const dot_fn DOT_scalar[MAX_R] = {dot_scalar, dot_scalar, dot_scalar, dot_scalar};
#if ISA_MAX >= FP8_ISA_AVX2
DEFINE_RS(avx2)
#endif
#if ISA_MAX >= FP8_ISA_AVX512
DEFINE_RS(avx512)
#endif

static const dot_fn* pick_dot(void) {
  const int isa = isa_now();
  (void)isa;
#if ISA_MAX >= FP8_ISA_AVX512
  if (isa >= FP8_ISA_AVX512) return DOT_avx512;
#endif
#if ISA_MAX >= FP8_ISA_AVX2
  if (isa >= FP8_ISA_AVX2) return DOT_avx2;
#endif
  return DOT_scalar;
}

static int shape_ok(int64_t K, int64_t G, int64_t N) {
  return K > 0 && K % 32 == 0 && G > 0 && (G % 32 == 0 || G >= K) && N >= 0;
}

#if HAVE_BF16_DOT
static int linear_bf16x(const void* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* codes,
    const float* scales, int64_t G, int64_t N, const void* bias, void* y, int64_t ldy,
    int nthreads) {
  const int64_t ng = groups_of(K, G);
  const int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
  _Pragma("omp parallel for num_threads(nthreads) if(nthreads > 1) schedule(static)")
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t n1 = (t + 1) * ROWS_PER_TASK < N ? (t + 1) * ROWS_PER_TASK : N;
    for (int64_t m0 = 0; m0 < M; m0 += MAX_R) {
      const int R = M - m0 < MAX_R ? (int)(M - m0) : MAX_R;
      for (int64_t n = t * ROWS_PER_TASK; n < n1; ++n) {
        float v[MAX_R];
        DOT_bf16x[R - 1]((const uint16_t*)x + m0 * ldx, ldx, codes + n * K, scales + n * ng, G,
                         K, v);
        const float b = bias ? bf2f(((const uint16_t*)bias)[n]) : 0.f;
        for (int r = 0; r < R; ++r) ((uint16_t*)y)[(m0 + r) * ldy + n] = f2bf(v[r] + b);
      }
    }
  }
  return 0;
}
#endif

int fp8_linear(const void* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* codes,
    const float* scales, int64_t G, int64_t N, const void* bias, void* y, int64_t ldy, int bf16,
    int nthreads) {
  if (!shape_ok(K, G, N) || M < 1) return -1;
#if HAVE_BF16_DOT
  if (bf16 && isa_now() >= FP8_ISA_AVX512) return linear_bf16x(x, ldx, M, K, codes,
      scales, G, N, bias, y, ldy, nthreads);
#endif
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
  float table[256];
  e4m3_table(table);
  const dot_fn* dot = pick_dot();
  const int64_t ng = groups_of(K, G);
  const int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
  _Pragma("omp parallel for num_threads(nthreads) if(nthreads > 1) schedule(static)")
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t n1 = (t + 1) * ROWS_PER_TASK < N ? (t + 1) * ROWS_PER_TASK : N;
    /* x's rows outer: a pass's MAX_R rows stay in L1/L2 across the task's weight rows */
    for (int64_t m0 = 0; m0 < M; m0 += MAX_R) {
      const int R = M - m0 < MAX_R ? (int)(M - m0) : MAX_R;
      for (int64_t n = t * ROWS_PER_TASK; n < n1; ++n) {
        const float b = bias ? (bf16 ? bf2f(((const uint16_t*)bias)[n]) : ((const float*)bias)[n]) : 0.f;
        float v[MAX_R];
        dot[R - 1](xs + m0 * lds, lds, R, codes + n * K, scales + n * ng, G, K, table, v);
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

/* One row of K weights in float32 (bf16 = 0) or bf16, rounded once from float32, on the
   variant isa_now() picks; tmp (K floats) is where the variants below AVX-512 write float32
   before the rounding. */
static void row_any(const uint8_t* codes, const float* scales, int64_t G, int64_t K,
    const float* table, void* out, int bf16, float* tmp) {
#if ISA_MAX >= FP8_ISA_AVX512
  if (isa_now() >= FP8_ISA_AVX512) { row_avx512(codes, scales, G, K, out, bf16); return; }
#endif
  float* v = bf16 ? tmp : (float*)out;
#if ISA_MAX >= FP8_ISA_AVX2
  if (isa_now() >= FP8_ISA_AVX2) row_avx2(codes, scales, G, K, table, v);
  else
#endif
    row_scalar(codes, scales, G, K, table, v);
  if (bf16)
    for (int64_t k = 0; k < K; ++k) ((uint16_t*)out)[k] = f2bf(v[k]);
}

int fp8_dequant_row_bf16(const uint8_t* codes, const float* scales, int64_t G, int64_t K,
    uint16_t* out) {
  if (!shape_ok(K, G, 0)) return -1;
  if (!scales) {  /* the exact values, unscaled: the caller scales each row's sums */
#if HAVE_BF16_DOT
    if (isa_now() >= FP8_ISA_AVX512) {
      const __m512i sub = subnormal_table();
      for (int64_t k = 0; k < K; k += 32) {
        if (!(k & 63)) _mm_prefetch((const char*)(codes + k) + PF_BYTES, _MM_HINT_T0);
        _mm512_storeu_si512(out + k, bf16_bits32(codes + k, sub));
      }
      return 0;
    }
#endif
    for (int64_t k = 0; k < K; ++k) out[k] = f2bf(e4m3_value(codes[k]));
    return 0;
  }
#if ISA_MAX >= FP8_ISA_AVX512
  if (isa_now() >= FP8_ISA_AVX512) { row_avx512(codes, scales, G, K, out, 1); return 0; }
#endif
  float table[256];
  float* tmp = (float*)malloc(sizeof(float) * K);
  if (!tmp) return -1;
  e4m3_table(table);
  row_any(codes, scales, G, K, table, out, 1, tmp);
  free(tmp);
  return 0;
}

int fp8_dequantize(const uint8_t* codes, const float* scales, int64_t G, int64_t N, int64_t K,
    void* out, int bf16, int nthreads) {
  if (!shape_ok(K, G, N)) return -1;
  float table[256];
  e4m3_table(table);
  const int64_t ng = groups_of(K, G);
  int failed = 0;
  _Pragma("omp parallel num_threads(nthreads) if(nthreads > 1) reduction(|:failed)")
  {
    float* tmp = bf16 ? (float*)malloc(sizeof(float) * K) : NULL;
    if (bf16 && !tmp) failed = 1;
    _Pragma("omp for schedule(static)")
    for (int64_t n = 0; n < N; ++n) {
      if (failed) continue;
      row_any(codes + n * K, scales + n * ng, G, K, table, (char*)out + n * K * (bf16 ? 2 : 4),
              bf16, tmp);
    }
    free(tmp);
  }
  return failed ? -1 : 0;
}

/* bf16 x of more rows than the dot kernel pays for, on CPUs with AVX512-BF16 but no AMX: each
   thread decodes TILE_N weight rows at a time into a bf16 buffer that stays in cache and runs
   gemm.c's AVX512-BF16 dot kernel on it (one thread), so the weight is never written out whole
   in bf16 and read back. -1 where this build has no AVX512-BF16 kernel (the caller takes the
   dequantized slices). */
#define TILE_N 32
#if ISA_MAX >= FP8_ISA_AVX512 && defined(__AVX512BF16__)
#define HAVE_TILES 1
#else
#define HAVE_TILES 0
#endif
int fp8_tiles_max_rows(void) { return HAVE_TILES ? FP8_TILES_MAX_ROWS : 0; }

int fp8_linear_bf16_tiles(const uint16_t* x, int64_t ldx, int64_t M, int64_t K,
    const uint8_t* codes, const float* scales, int64_t G, int64_t N, const uint16_t* bias,
    uint16_t* y, int64_t ldy, int nthreads) {
#if HAVE_TILES
  if (!shape_ok(K, G, N) || M < 1 || isa_now() < FP8_ISA_AVX512) return -1;
  const int64_t tiles = (N + TILE_N - 1) / TILE_N, ng = groups_of(K, G);
  int failed = 0;
  _Pragma("omp parallel num_threads(nthreads) if(nthreads > 1) reduction(|:failed)")
  {
    uint16_t* buf = (uint16_t*)malloc(sizeof(uint16_t) * TILE_N * K);
    if (!buf) failed = 1;
    _Pragma("omp for schedule(static)")
    for (int64_t t = 0; t < tiles; ++t) {
      if (!buf) continue;
      const int64_t n0 = t * TILE_N, nt = N - n0 < TILE_N ? N - n0 : TILE_N;
      if (G >= K) {  /* one scale a row: the exact values, the scale on each sum */
        for (int64_t j = 0; j < nt; ++j)
          fp8_dequant_row_bf16(codes + (n0 + j) * K, NULL, G, K, buf + j * K);
        linear_bf16_dp(x, ldx, M, K, buf, scales + n0, nt, bias ? bias + n0 : NULL, y + n0, ldy, 1);
        continue;
      }
      for (int64_t j = 0; j < nt; ++j)
        row_avx512(codes + (n0 + j) * K, scales + (n0 + j) * ng, G, K, buf + j * K, 1);
      linear_bf16_dp(x, ldx, M, K, buf, NULL, nt, bias ? bias + n0 : NULL, y + n0, ldy, 1);
    }
    free(buf);
  }
  return failed ? -1 : 0;
#else
  (void)x; (void)ldx; (void)M; (void)K; (void)codes; (void)scales; (void)G; (void)N;
  (void)bias; (void)y; (void)ldy; (void)nthreads;
  return -1;
#endif
}
