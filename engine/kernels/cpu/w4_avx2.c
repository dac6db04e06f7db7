/* The w4 tiles' kernel on CPUs with AVX2 but without AVX512-VNNI (AMD Zen 2/3, Intel before
   Ice Lake): linear_q4_bf16 for any number of rows. w4.c is the AVX512-VNNI one; a build has
   exactly one of the two. engine/kernels/cpu/w4.py has the tiles' format.

   x is quantized per group of 32 to int8 with a float scale (llama.cpp's Q8_1 activations, as
   gguf.c's dot kernels do). A tile's chunk (32 bytes: byte 2r + j holds row r's codes for
   k = 4c + j and 4c + 2 + j) is unpacked to its low and high nibbles, whose 16-bit pairs
   interleaved (vpunpcklwd / vpunpckhwd) are 8 rows x 4 consecutive codes each: lanes A hold
   rows 0-3 and 8-11, lanes B rows 4-7 and 12-15. Both meet the same 4 values of x, one dword
   broadcast from memory, in vpmaddubsw (unsigned codes times signed x, adjacent pairs summed
   into int16). A whole group sums in int16 (8 chunks x 2 * 15 * 127 = 30,480 < 2^15), then
   vpmaddwd with ones widens each row's two halves to one int32, scaled in float once per
   group. No horizontal sums: y_r = sum_g d_g (s_gr * (q_gr . xq_g) + m_gr * sum(xq_g)).

   Against pairs of x broadcast by vpshufd into one 16-row vector, widened every half group
   (the first version), that is one shuffle less per two products and a third of the
   widening: the 120 linears of SmolLM2 on two Zen 3 cores 1.23x faster at one row, 1.43-1.50x
   at 4-128. R rows of x share each unpacked chunk (R <= 4: their 8 int16 sums, the chunk's
   two halves and x fill the 16 vector registers; the float sums live in memory, touched
   once a group). From UNPACK_MIN_ROWS rows (prefill, large decode batches) a thread unpacks
   each tile once into a buffer (the A / B vectors, the scales as floats) that passes of 6
   rows read: 1.2-1.35x at 128-512 rows. */
#include "tessera_kernels.h"
#include "bf16_convert.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
      defined(__F16C__)) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#define TILE W4_TILE
#define GROUP_BYTES W4_GROUP_BYTES
#define MAX_R 4         /* rows of x a pass over a tile's weights takes */
#define TASK_TILES 2    /* tiles per parallel task */
#define PF_BYTES 2048   /* the weight stream is prefetched this far ahead (small batches) */

int w4_max_rows(void) { return 1 << 30; }

/* One row of bf16 x [K] -> int8 groups (xq [K]), each group's scale d (xd) and d * sum(q)
   (xm). amax / 127 maps the group onto -127..127, rounded to nearest even like gguf.c's
   quantize_row. */
static void prep_row(const uint16_t* x, int64_t K, int8_t* xq, float* xd, float* xm) {
  for (int64_t g = 0; g < K / 32; ++g) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int i = 0; i < 4; ++i) {
      const __m128i b = _mm_loadu_si128((const __m128i*)(x + g * 32 + 8 * i));
      v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float a = _mm_cvtss_f32(m4);
    const __m256 inv = _mm256_set1_ps(a > 0.f ? 127.f / a : 0.f);
    __m256i r[4];
    for (int i = 0; i < 4; ++i) r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    /* int32 x 32 -> int8 x 32 in order: packs work per 128-bit lane, the permute restores it */
    const __m256i w16a = _mm256_packs_epi32(r[0], r[1]), w16b = _mm256_packs_epi32(r[2], r[3]);
    const __m256i q = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16a, w16b),
                                                  _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    xd[g] = a / 127.f;
    xm[g] = xd[g] * (float)_mm_cvtsi128_si32(s4);
    _mm256_storeu_si256((__m256i*)(xq + g * 32), q);
  }
}

/* 8 floats -> bf16, rounded to nearest even (f2bf's rule) */
static inline __m128i f2bf256(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb,
                                      _mm256_set1_epi32(0x7FFF))), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* A tile's group unpacked once for many rows of x (unpack_tile): the 8 chunks' A and B
   vectors, then the scales and minimums as floats in the A and B lanes' order. */
#define UNPACKED_BYTES(planes) ((planes) * 8 * 64 + 4 * 32)  /* a group of `planes` code planes */
#define UNPACKED_GROUP_BYTES UNPACKED_BYTES(1)
#define MAX_UR 6  /* rows of x a pass over an unpacked tile takes: 12 int16 sums, A, B, x */
#define UNPACK_MIN_ROWS 16  /* from here tiles are unpacked once for all passes */

/* A chunk's codes as the A (rows 0-3, 8-11) and B (rows 4-7, 12-15) vectors of 8 rows x 4
   consecutive codes. */
static inline void unpack_chunk(const uint8_t* p, __m256i* wa, __m256i* wb) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256((const __m256i*)p);
  const __m256i lo = _mm256_and_si256(v, low4);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  *wa = _mm256_unpacklo_epi16(lo, hi); *wb = _mm256_unpackhi_epi16(lo, hi);
}

/* 16 float16 values (rows 0-15) -> floats in the A and B lanes' order */
static inline void halves_ab(const uint8_t* p, __m256* a, __m256* b) {
  const __m256 v0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
  const __m256 v1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)));
  *a = _mm256_permute2f128_ps(v0, v1, 0x20); *b = _mm256_permute2f128_ps(v0, v1, 0x31);
}

/* A tile of `planes` code planes (w4: 1, Q8: 2; group_bytes a group) unpacked: per group,
   each plane's 8 chunks as A and B vectors, then the scales and minimums as floats. */
static void unpack_tile(const uint8_t* wt, int64_t G, int planes, int64_t group_bytes,
    uint8_t* out) {
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = wt + g * group_bytes;
    uint8_t* u = out + g * UNPACKED_BYTES(planes);
    for (int p = 0; p < planes; ++p)
      for (int c = 0; c < 8; ++c) {
        __m256i wa, wb;
        unpack_chunk(wg + 256 * p + 32 * c, &wa, &wb);
        _mm256_store_si256((__m256i*)(u + 512 * p + 64 * c), wa);
        _mm256_store_si256((__m256i*)(u + 512 * p + 64 * c + 32), wb);
      }
    __m256 f[4];
    halves_ab(wg + 256 * planes, &f[0], &f[1]);
    halves_ab(wg + 256 * planes + 32, &f[2], &f[3]);
    for (int i = 0; i < 4; ++i) _mm256_store_ps((float*)(u + 512 * planes + 32 * i), f[i]);
  }
}

/* x [M][K] bf16 quantized by prep_row into one allocation: xq int8 [M][K], then xd and xm
   float [M][K / 32] (K a multiple of 64, so the floats are aligned); NULL where malloc
   fails. */
static int8_t* quantize_x(const uint16_t* x, int64_t ldx, int64_t M, int64_t K) {
  const int64_t G = K / 32;
  int8_t* xq = (int8_t*)malloc((size_t)M * K + sizeof(float) * 2 * M * G);
  if (!xq) return NULL;
  float* xd = (float*)(xq + M * K);
  for (int64_t m = 0; m < M; ++m)
    prep_row(x + m * ldx, K, xq + m * K, xd + m * G, xd + M * G + m * G);
  return xq;
}

/* One buffer of `bytes` per thread (unpacked tiles), 64-byte aligned. */
static uint8_t* thread_buffers(int64_t bytes, int nthreads) {
  return (uint8_t*)aligned_alloc(64, (size_t)bytes * (nthreads > 1 ? nthreads : 1));
}

/* Tile wt's 16 output rows (from n0) for R rows of x; UNPACKED: wt is unpack_tile's. */
static inline __attribute__((always_inline)) void tile_rows(const int R, const int UNPACKED,
    const int8_t* xq, const float* xd, const float* xm, int64_t G, const uint8_t* wt,
    const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t n0, int64_t N, int prefetch) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t K = G * 32;
  const int64_t group_bytes = UNPACKED ? UNPACKED_GROUP_BYTES : GROUP_BYTES;
  __m256 acc[MAX_UR][2];  /* [m][A, B] */
  for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = wt + g * group_bytes;
    if (prefetch)
      for (int l = 0; l < GROUP_BYTES; l += 64) _mm_prefetch((const char*)wg + PF_BYTES + l, _MM_HINT_T0);
    __m256i a[MAX_UR][2];
    for (int m = 0; m < R; ++m) a[m][0] = a[m][1] = _mm256_setzero_si256();
    #pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      __m256i wa, wb;
      if (UNPACKED) {
        wa = _mm256_load_si256((const __m256i*)(wg + 64 * c));
        wb = _mm256_load_si256((const __m256i*)(wg + 64 * c + 32));
      } else {
        unpack_chunk(wg + 32 * c, &wa, &wb);
      }
      for (int m = 0; m < R; ++m) {
        const __m256i xb = _mm256_set1_epi32(*(const int32_t*)(xq + m * K + g * 32 + 4 * c));
        a[m][0] = _mm256_add_epi16(a[m][0], _mm256_maddubs_epi16(wa, xb));
        a[m][1] = _mm256_add_epi16(a[m][1], _mm256_maddubs_epi16(wb, xb));
        /* GCC otherwise regroups the unrolled sums into a tree of spilled partial sums */
        __asm__("" : "+x"(a[m][0]), "+x"(a[m][1]));
      }
    }
    /* the 16 rows' scales, then minimums, in the A and B lanes' order */
    __m256 sa, sb, ma, mb;
    if (UNPACKED) {
      sa = _mm256_load_ps((const float*)(wg + 512)); sb = _mm256_load_ps((const float*)(wg + 544));
    } else {
      halves_ab(wg + 256, &sa, &sb);
    }
    for (int m = 0; m < R; ++m) {
      const __m256 d = _mm256_set1_ps(xd[m * G + g]);
      const __m256 qa = _mm256_cvtepi32_ps(_mm256_madd_epi16(a[m][0], ones));
      const __m256 qb = _mm256_cvtepi32_ps(_mm256_madd_epi16(a[m][1], ones));
      acc[m][0] = _mm256_fmadd_ps(qa, _mm256_mul_ps(sa, d), acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(qb, _mm256_mul_ps(sb, d), acc[m][1]);
    }
    if (UNPACKED) {
      ma = _mm256_load_ps((const float*)(wg + 576)); mb = _mm256_load_ps((const float*)(wg + 608));
    } else {
      halves_ab(wg + 288, &ma, &mb);
    }
    for (int m = 0; m < R; ++m) {
      const __m256 xs = _mm256_set1_ps(xm[m * G + g]);
      acc[m][0] = _mm256_fmadd_ps(ma, xs, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(mb, xs, acc[m][1]);
    }
  }
  const int64_t n = N - n0 < TILE ? N - n0 : TILE;
  float b[TILE] = {0};
  if (bias)
    for (int64_t i = 0; i < n; ++i) b[i] = bf2f(bias[n0 + i]);
  for (int m = 0; m < R; ++m) {
    /* rows 0-7: A's and B's low lanes; rows 8-15: their high lanes */
    const __m256 r0 = _mm256_permute2f128_ps(acc[m][0], acc[m][1], 0x20);
    const __m256 r1 = _mm256_permute2f128_ps(acc[m][0], acc[m][1], 0x31);
    uint16_t out[TILE];
    _mm_storeu_si128((__m128i*)out, f2bf256(_mm256_add_ps(r0, _mm256_loadu_ps(b))));
    _mm_storeu_si128((__m128i*)(out + 8), f2bf256(_mm256_add_ps(r1, _mm256_loadu_ps(b + 8))));
    memcpy(y + m * ldy + n0, out, sizeof(uint16_t) * n);
  }
}

/* R (and UNPACKED) are constants in each copy, so the accumulators stay in registers. */
#define DEFINE_ROWS(R, U) static void tile_rows_##R##_##U(const int8_t* xq, const float* xd,   \
    const float* xm, int64_t G, const uint8_t* wt, const uint16_t* bias, uint16_t* y,         \
    int64_t ldy, int64_t n0, int64_t N, int prefetch) {                                       \
  tile_rows(R, U, xq, xd, xm, G, wt, bias, y, ldy, n0, N, prefetch); }
DEFINE_ROWS(1, 0) DEFINE_ROWS(2, 0) DEFINE_ROWS(3, 0) DEFINE_ROWS(4, 0)
DEFINE_ROWS(1, 1) DEFINE_ROWS(2, 1) DEFINE_ROWS(3, 1) DEFINE_ROWS(4, 1) DEFINE_ROWS(5, 1)
DEFINE_ROWS(6, 1)
typedef void (*rows_fn)(const int8_t*, const float*, const float*, int64_t, const uint8_t*,
    const uint16_t*, uint16_t*, int64_t, int64_t, int64_t, int);
static const rows_fn ROWS[MAX_R] = {tile_rows_1_0, tile_rows_2_0, tile_rows_3_0, tile_rows_4_0};
static const rows_fn UROWS[MAX_UR] = {tile_rows_1_1, tile_rows_2_1, tile_rows_3_1,
    tile_rows_4_1, tile_rows_5_1, tile_rows_6_1};

int linear_q4_bf16(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w,
    int64_t N, const uint16_t* bias, uint16_t* y, int64_t ldy, int nthreads) {
  if (M < 1 || K % 64 || K < 64) return -1;
  const int64_t G = K / 32;
  int8_t* xq = quantize_x(x, ldx, M, K);
  if (!xq) return -1;
  const float* xd = (const float*)(xq + M * K);
  const float* xm = xd + M * G;
  const int64_t tiles = (N + TILE - 1) / TILE, tasks = (tiles + TASK_TILES - 1) / TASK_TILES;
  /* More rows than one pass takes: each tile is unpacked once into the thread's buffer and
     read by passes of MAX_UR rows (the codes' unpacking and the scales' conversion are then
     paid once a tile, not once a pass). */
  const int unpack = M >= UNPACK_MIN_ROWS;
  const int64_t ubytes = G * UNPACKED_GROUP_BYTES;
  uint8_t* ubuf = unpack ? thread_buffers(ubytes, nthreads) : NULL;
  if (unpack && !ubuf) { free(xq); return -1; }
  _Pragma("omp parallel for num_threads(nthreads) if(nthreads > 1) schedule(static)")
  for (int64_t b = 0; b < tasks; ++b) {
    const int64_t t1 = (b + 1) * TASK_TILES < tiles ? (b + 1) * TASK_TILES : tiles;
    uint8_t* u = unpack ? ubuf + ubytes * omp_get_thread_num() : NULL;
    for (int64_t t = b * TASK_TILES; t < t1; ++t) {
      const uint8_t* wt = w + t * G * GROUP_BYTES;
      if (!unpack) {  /* unpacked on the fly; one pass prefetches the weight stream */
        for (int64_t m0 = 0; m0 < M; m0 += MAX_R) {
          const int R = M - m0 < MAX_R ? (int)(M - m0) : MAX_R;
          ROWS[R - 1](xq + m0 * K, xd + m0 * G, xm + m0 * G, G, wt, bias, y + m0 * ldy, ldy,
                      t * TILE, N, M <= MAX_R);
        }
        continue;
      }
      unpack_tile(wt, G, 1, GROUP_BYTES, u);
      for (int64_t m0 = 0; m0 < M; m0 += MAX_UR) {
        const int R = M - m0 < MAX_UR ? (int)(M - m0) : MAX_UR;
        UROWS[R - 1](xq + m0 * K, xd + m0 * G, xm + m0 * G, G, u, bias, y + m0 * ldy, ldy,
                     t * TILE, N, 0);
      }
    }
  }
  free(ubuf);
  free(xq);
  return 0;
}

/* ---- Q8_0 rows as two planes of the same tiles (engine/kernels/cpu/w4.py: pack_q8_0) ----
   A Q8_0 weight d * q (q in -128..127) is d * (16 * hi + lo) - 128 * d with u = q + 128 =
   16 * hi + lo: each nibble plane is a w4 tile's codes, summed in int16 like them and
   widened by vpmaddwd against 16 and 1; the scale is d and the minimum -128 * d. A group:
   the high plane's 256 code bytes, the low plane's, 16 float16 scales, 16 minimums. The LM
   head's file rows (the bundled model's tied Q8_0 embedding) at any batch, float32 out. */
#define Q8_GROUP_BYTES (2 * 256 + 2 * TILE * 2)
#define Q8_R 2   /* rows of x a pass takes: 4 int16 sums a row, a plane's halves, x */
#define Q8_UR 3  /* the same over an unpacked tile (no decoding registers) */
#define Q8_UNPACKED_GROUP_BYTES UNPACKED_BYTES(2)
/* an unpacked Q8 tile is twice a w4 tile's: with K = 576 it and 16-32 rows of x outgrow L1
   (16 / 32 rows: 0.78x / 0.83x the packed passes; 128: 1.15x) */
#define Q8_UNPACK_MIN_ROWS 64

static inline __attribute__((always_inline)) void tile_rows_q8(const int R, const int UNPACKED,
    const int8_t* xq, const float* xd, const float* xm, int64_t G, const uint8_t* wt, float* y,
    int64_t ldy, int64_t n0, int64_t N) {
  const __m256i ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
  const int64_t K = G * 32;
  const int64_t group_bytes = UNPACKED ? Q8_UNPACKED_GROUP_BYTES : Q8_GROUP_BYTES;
  __m256 acc[Q8_UR][2];
  for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = wt + g * group_bytes;
    __m256i a[Q8_UR][4];  /* [m][high A, high B, low A, low B] */
    for (int m = 0; m < R; ++m) a[m][0] = a[m][1] = a[m][2] = a[m][3] = _mm256_setzero_si256();
    #pragma GCC unroll 8
    for (int c = 0; c < 8; ++c)
      for (int p = 0; p < 2; ++p) {
        __m256i wa, wb;
        if (UNPACKED) {
          wa = _mm256_load_si256((const __m256i*)(wg + 512 * p + 64 * c));
          wb = _mm256_load_si256((const __m256i*)(wg + 512 * p + 64 * c + 32));
        } else {
          unpack_chunk(wg + 256 * p + 32 * c, &wa, &wb);
        }
        for (int m = 0; m < R; ++m) {
          const __m256i xb = _mm256_set1_epi32(*(const int32_t*)(xq + m * K + g * 32 + 4 * c));
          a[m][2 * p] = _mm256_add_epi16(a[m][2 * p], _mm256_maddubs_epi16(wa, xb));
          a[m][2 * p + 1] = _mm256_add_epi16(a[m][2 * p + 1], _mm256_maddubs_epi16(wb, xb));
          __asm__("" : "+x"(a[m][2 * p]), "+x"(a[m][2 * p + 1]));
        }
      }
    __m256 sa, sb, ma, mb;
    if (UNPACKED) {
      sa = _mm256_load_ps((const float*)(wg + 1024)); sb = _mm256_load_ps((const float*)(wg + 1056));
      ma = _mm256_load_ps((const float*)(wg + 1088)); mb = _mm256_load_ps((const float*)(wg + 1120));
    } else {
      halves_ab(wg + 512, &sa, &sb);
      halves_ab(wg + 544, &ma, &mb);
    }
    for (int m = 0; m < R; ++m) {
      const __m256 d = _mm256_set1_ps(xd[m * G + g]), xs = _mm256_set1_ps(xm[m * G + g]);
      const __m256i ia = _mm256_add_epi32(_mm256_madd_epi16(a[m][0], sixteen), _mm256_madd_epi16(a[m][2], ones));
      const __m256i ib = _mm256_add_epi32(_mm256_madd_epi16(a[m][1], sixteen), _mm256_madd_epi16(a[m][3], ones));
      acc[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_mul_ps(sa, d), acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ib), _mm256_mul_ps(sb, d), acc[m][1]);
      acc[m][0] = _mm256_fmadd_ps(ma, xs, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(mb, xs, acc[m][1]);
    }
  }
  const int64_t n = N - n0 < TILE ? N - n0 : TILE;
  for (int m = 0; m < R; ++m) {
    float out[TILE];
    _mm256_storeu_ps(out, _mm256_permute2f128_ps(acc[m][0], acc[m][1], 0x20));
    _mm256_storeu_ps(out + 8, _mm256_permute2f128_ps(acc[m][0], acc[m][1], 0x31));
    memcpy(y + m * ldy + n0, out, sizeof(float) * n);
  }
}

#define DEFINE_Q8_ROWS(R, U) static void tile_rows_q8_##R##_##U(const int8_t* xq,              \
    const float* xd, const float* xm, int64_t G, const uint8_t* wt, float* y, int64_t ldy,    \
    int64_t n0, int64_t N) { tile_rows_q8(R, U, xq, xd, xm, G, wt, y, ldy, n0, N); }
DEFINE_Q8_ROWS(1, 0) DEFINE_Q8_ROWS(2, 0) DEFINE_Q8_ROWS(1, 1) DEFINE_Q8_ROWS(2, 1)
DEFINE_Q8_ROWS(3, 1)
typedef void (*q8_rows_fn)(const int8_t*, const float*, const float*, int64_t, const uint8_t*,
    float*, int64_t, int64_t, int64_t);
static const q8_rows_fn Q8_ROWS[Q8_R] = {tile_rows_q8_1_0, tile_rows_q8_2_0};
static const q8_rows_fn Q8_UROWS[Q8_UR] = {tile_rows_q8_1_1, tile_rows_q8_2_1, tile_rows_q8_3_1};

int linear_q8w4_f32(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w,
    int64_t N, float* y, int64_t ldy, int nthreads) {
  if (M < 1 || K % 64 || K < 64) return -1;
  const int64_t G = K / 32;
  int8_t* xq = quantize_x(x, ldx, M, K);
  if (!xq) return -1;
  const float* xd = (const float*)(xq + M * K);
  const float* xm = xd + M * G;
  const int64_t tiles = (N + TILE - 1) / TILE, tasks = (tiles + TASK_TILES - 1) / TASK_TILES;
  const int unpack = M >= Q8_UNPACK_MIN_ROWS;
  const int64_t ubytes = G * Q8_UNPACKED_GROUP_BYTES;
  uint8_t* ubuf = unpack ? thread_buffers(ubytes, nthreads) : NULL;
  if (unpack && !ubuf) { free(xq); return -1; }
  _Pragma("omp parallel for num_threads(nthreads) if(nthreads > 1) schedule(static)")
  for (int64_t b = 0; b < tasks; ++b) {
    const int64_t t1 = (b + 1) * TASK_TILES < tiles ? (b + 1) * TASK_TILES : tiles;
    uint8_t* u = unpack ? ubuf + ubytes * omp_get_thread_num() : NULL;
    for (int64_t t = b * TASK_TILES; t < t1; ++t) {
      const uint8_t* wt = w + t * G * Q8_GROUP_BYTES;
      if (unpack) unpack_tile(wt, G, 2, Q8_GROUP_BYTES, u);
      const int step = unpack ? Q8_UR : Q8_R;
      for (int64_t m0 = 0; m0 < M; m0 += step) {
        const int R = M - m0 < step ? (int)(M - m0) : step;
        (unpack ? Q8_UROWS : Q8_ROWS)[R - 1](xq + m0 * K, xd + m0 * G, xm + m0 * G, G,
            unpack ? u : wt, y + m0 * ldy, ldy, t * TILE, N);
      }
    }
  }
  free(ubuf);
  free(xq);
  return 0;
}
#endif
