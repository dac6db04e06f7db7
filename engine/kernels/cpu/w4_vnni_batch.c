/* The w4 tiles for batches larger than w4.c takes (decode steps of 13+ sequences, prefill
   chunks) on CPUs with AVX512-VNNI: linear_q4_bf16_batch, any number of rows; and the GGUF LM
   head's Q8_0 rows in the same kernel's layout, read in place (linear_q8_vnni_f32).
   engine/kernels/cpu/w4.py has both formats.

   x is quantized per group of 32 to int8 with a float scale (llama.cpp's Q8_1 activations, as
   w4_avx2.c and gguf.c do), so the unsigned codes meet it in vpdpbusd: 64 products a 512-bit
   instruction into int32, twice vpdpwssd's 32 on w4.c's int16 x, with nothing to widen. Each
   thread unpacks a w4 tile once into a buffer: per group, 8 vectors of 16 rows x 4
   consecutive codes (lane r = row r, so the output needs no shuffle), then the 16 scales and
   minimums as floats. Passes of up to MAX_R rows of x then read it: per chunk one load and
   one vpdpbusd a row, x's 4 codes broadcast from memory inside the instruction.
   y_r = sum_g d_g (s_gr * (q_gr . xq_g)) + m_gr * (d_g * sum(xq_g)). A Q8 tile stores its
   codes (q + 128, unsigned) in that layout already, its scales and minimums (-128 d) as
   float16: nothing to unpack. */
#include "tessera_kernels.h"
#include "avx512_math.h"

#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <omp.h>
#include <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define TILE W4_TILE
#define GROUP_BYTES W4_GROUP_BYTES
#define UNPACKED_GROUP_BYTES (8 * 64 + 2 * 64)  /* 8 code vectors, 16 float scales, 16 minimums */
#define Q8_GROUP_BYTES (8 * 64 + 2 * 32)        /* 8 code vectors, 16 float16 scales, 16 minimums */
#define MAX_R 8        /* rows of x a pass takes: 8 int32 and 8 float sums stay in registers */
#define TASK_TILES 2   /* tiles per parallel task */

/* One row of bf16 x [K] -> int8 groups (xq), each group's scale d (xd) and d * sum(q) (xm):
   amax / 127 maps a group onto -127..127, rounded to nearest even. */
static void prep_row(const uint16_t* x, int64_t K, int8_t* xq, float* xd, float* xm) {
  for (int64_t g = 0; g < K / 32; ++g) {
    __m512 v[2];
    for (int h = 0; h < 2; ++h)
      v[h] = bf16x16_to_f32(_mm256_loadu_si256((const __m256i*)(x + g * 32 + 16 * h)));
    const float a = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
    const __m512 inv = _mm512_set1_ps(a > 0.f ? 127.f / a : 0.f);
    const __m512i r0 = _mm512_cvtps_epi32(_mm512_mul_ps(v[0], inv));
    const __m512i r1 = _mm512_cvtps_epi32(_mm512_mul_ps(v[1], inv));
    _mm_storeu_si128((__m128i*)(xq + g * 32), _mm512_cvtsepi32_epi8(r0));
    _mm_storeu_si128((__m128i*)(xq + g * 32 + 16), _mm512_cvtsepi32_epi8(r1));
    xd[g] = a / 127.f;
    xm[g] = xd[g] * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(r0, r1));
  }
}

/* A tile [G groups] unpacked (see the top): a chunk's 32 bytes (byte 2r + j: row r's code for
   k = 4c + j in its low nibble, 4c + 2 + j in its high one) become lane r's 4 bytes
   [lo(2r), lo(2r + 1), hi(2r), hi(2r + 1)], the codes of k = 4c..4c + 3 in order. */
static void unpack_tile(const uint8_t* wt, int64_t G, uint8_t* out) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = wt + g * GROUP_BYTES;
    uint8_t* u = out + g * UNPACKED_GROUP_BYTES;
    for (int c = 0; c < 8; ++c) {
      /* lane r = bytes 2r, 2r + 1 in its low half; their high nibbles shifted up by 12 land
         in bits 16-19 and 24-27, the upper half's low nibble positions */
      const __m512i d = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(wg + 32 * c)));
      const __m512i both = _mm512_mask_blend_epi16(0xAAAAAAAA, d, _mm512_slli_epi32(d, 12));
      _mm512_store_si512((__m512i*)(u + 64 * c), _mm512_and_si512(both, low4));
    }
    _mm512_store_ps((float*)(u + 512), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(wg + 256))));
    _mm512_store_ps((float*)(u + 576), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(wg + 288))));
  }
}

/* vpdpbusd with x's 4 codes broadcast from memory inside the instruction. */
static inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t*)p));
  return acc;
}

/* A tile's 16 output rows (from n0) for R rows of x: u is an unpacked w4 tile (float scales,
   bf16 out with the bias) or, Q8, a Q8 tile (float16 scales, float32 out). */
static inline __attribute__((always_inline)) void tile_rows(const int R, const int Q8,
    const int8_t* xq, const float* xd, const float* xm, int64_t G, const uint8_t* u,
    const uint16_t* bias, void* y, int64_t ldy, int64_t n0, int64_t N) {
  const int64_t K = G * 32, group_bytes = Q8 ? Q8_GROUP_BYTES : UNPACKED_GROUP_BYTES;
  __m512 acc[MAX_R];
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* ug = u + g * group_bytes;
    __m512i a[MAX_R];
    for (int m = 0; m < R; ++m) a[m] = _mm512_setzero_si512();
    #pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m512i w = _mm512_loadu_si512((const __m512i*)(ug + 64 * c));
      for (int m = 0; m < R; ++m) a[m] = dpbusd_bcast(a[m], w, xq + m * K + g * 32 + 4 * c);
    }
    const __m512 s = Q8 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(ug + 512)))
                        : _mm512_load_ps((const float*)(ug + 512));
    const __m512 mn = Q8 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(ug + 544)))
                         : _mm512_load_ps((const float*)(ug + 576));
    for (int m = 0; m < R; ++m) {
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[m]), _mm512_mul_ps(s, _mm512_set1_ps(xd[m * G + g])), acc[m]);
      acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xm[m * G + g]), acc[m]);
    }
  }
  const __mmask16 keep = N - n0 >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
  if (Q8) {
    for (int m = 0; m < R; ++m) _mm512_mask_storeu_ps((float*)y + m * ldy + n0, keep, acc[m]);
    return;
  }
  __m512 b = _mm512_setzero_ps();
  if (bias)
    b = bf16x16_to_f32(_mm256_maskz_loadu_epi16(keep, bias + n0));
  for (int m = 0; m < R; ++m)
    _mm256_mask_storeu_epi16((uint16_t*)y + m * ldy + n0, keep, f2bf512(_mm512_add_ps(acc[m], b)));
}

/* R and Q8 are constants in each copy, so the sums stay in registers. */
#define DEFINE_ROWS(R, Q8) static void tile_rows_##R##_##Q8(const int8_t* xq, const float* xd, \
    const float* xm, int64_t G, const uint8_t* u, const uint16_t* bias, void* y, int64_t ldy, \
    int64_t n0, int64_t N) { tile_rows(R, Q8, xq, xd, xm, G, u, bias, y, ldy, n0, N); }
DEFINE_ROWS(1, 0) DEFINE_ROWS(2, 0) DEFINE_ROWS(3, 0) DEFINE_ROWS(4, 0)
DEFINE_ROWS(5, 0) DEFINE_ROWS(6, 0) DEFINE_ROWS(7, 0) DEFINE_ROWS(8, 0)
DEFINE_ROWS(1, 1) DEFINE_ROWS(2, 1) DEFINE_ROWS(3, 1) DEFINE_ROWS(4, 1)
DEFINE_ROWS(5, 1) DEFINE_ROWS(6, 1) DEFINE_ROWS(7, 1) DEFINE_ROWS(8, 1)
typedef void (*rows_fn)(const int8_t*, const float*, const float*, int64_t, const uint8_t*,
    const uint16_t*, void*, int64_t, int64_t, int64_t);
static const rows_fn ROWS[2][MAX_R] = {
    {tile_rows_1_0, tile_rows_2_0, tile_rows_3_0, tile_rows_4_0, tile_rows_5_0, tile_rows_6_0,
     tile_rows_7_0, tile_rows_8_0},
    {tile_rows_1_1, tile_rows_2_1, tile_rows_3_1, tile_rows_4_1, tile_rows_5_1, tile_rows_6_1,
     tile_rows_7_1, tile_rows_8_1}};

/* The argmax epilogue's per-thread state (Q8 tiles with `token`): a tile's [M][16] sums, then
   each row's best value and column so far. */
typedef struct { float* tile; float* val; int64_t* col; } Best;

/* The tile's sums tb [M][16] (cols valid) against each row's best so far: the first maximum
   wins (tiles come in column order, lanes too). */
static void best_of_tile(const float* tb, int64_t M, int64_t col0, int64_t cols, Best* b) {
  const __mmask16 keep = cols >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
  for (int64_t m = 0; m < M; ++m) {
    const __m512 v = _mm512_maskz_loadu_ps(keep, tb + m * TILE);
    const float mx = _mm512_mask_reduce_max_ps(keep, v);
    if (mx > b->val[m]) {
      b->val[m] = mx;
      b->col[m] = col0 + __builtin_ctz(_mm512_mask_cmp_ps_mask(keep, v, _mm512_set1_ps(mx), _CMP_EQ_OQ));
    }
  }
}

/* y [M][N] (ldy apart) for tiles w [tiles][G groups]: w4 tiles (bf16 out, bias), each unpacked
   once into the thread's buffer, or Q8 tiles (float32 out) read in place; with `token` (Q8
   only) each row's argmax instead of y, the first maximum winning. */
static int run_tiles(const int Q8, const uint16_t* x, int64_t ldx, int64_t M, int64_t K,
    const uint8_t* w, int64_t N, const uint16_t* bias, void* y, int64_t ldy, int64_t* token,
    int nthreads) {
  if (M < 1 || K % 64 || K < 64 || (token && !Q8)) return -1;
  const int64_t G = K / 32, esize = Q8 ? sizeof(float) : sizeof(uint16_t);
  const int T = nthreads > 1 ? nthreads : 1;
  /* x [M][K] as int8 groups in one allocation: xq [M][K], then xd and xm float [M][G] (K a
     multiple of 64 keeps the floats aligned); quantized inside the parallel region below */
  int8_t* xq = (int8_t*)malloc((size_t)M * K + sizeof(float) * 2 * M * G);
  const int64_t ubytes = G * UNPACKED_GROUP_BYTES;
  uint8_t* ubuf = Q8 ? NULL : (uint8_t*)aligned_alloc(64, (size_t)ubytes * T);
  /* per thread: tile sums [M][16], best values [M], best columns [M] */
  const int64_t best_bytes = M * (TILE + 1) * sizeof(float) + M * sizeof(int64_t);
  char* bbuf = token ? (char*)malloc((size_t)best_bytes * T) : NULL;
  if (!xq || (!Q8 && !ubuf) || (token && !bbuf)) { free(xq); free(ubuf); free(bbuf); return -1; }
  for (int i = 0; token && i < T; ++i)
    for (int64_t m = 0; m < M; ++m) {
      char* base = bbuf + best_bytes * i;
      ((float*)(base + M * TILE * sizeof(float)))[m] = -INFINITY;
      ((int64_t*)(base + M * (TILE + 1) * sizeof(float)))[m] = 0;
    }
  float* xd = (float*)(xq + M * K);
  float* xm = xd + M * G;
  const int64_t tiles = (N + TILE - 1) / TILE, tasks = (tiles + TASK_TILES - 1) / TASK_TILES;
  const int64_t tile_bytes = G * (Q8 ? Q8_GROUP_BYTES : GROUP_BYTES);
  _Pragma("omp parallel num_threads(nthreads) if(nthreads > 1)")
  {
  /* x's rows side by side (on one thread, before the region, the other thread waited through
     them: 4.4% of the engine thread's samples at 128 streams on D, prefill's 1,024 rows) */
  _Pragma("omp for schedule(static)")
  for (int64_t m = 0; m < M; ++m) prep_row(x + m * ldx, K, xq + m * K, xd + m * G, xm + m * G);
  /* static: each thread's tasks are one run of columns, in thread order (the argmax's merge) */
  _Pragma("omp for schedule(static)")
  for (int64_t b = 0; b < tasks; ++b) {
    const int64_t t1 = (b + 1) * TASK_TILES < tiles ? (b + 1) * TASK_TILES : tiles;
    const int me = omp_get_thread_num();
    uint8_t* u = Q8 ? NULL : ubuf + ubytes * me;
    char* base = token ? bbuf + best_bytes * me : NULL;
    Best best = {(float*)base, (float*)(base + M * TILE * sizeof(float)),
                 (int64_t*)(base + M * (TILE + 1) * sizeof(float))};
    for (int64_t t = b * TASK_TILES; t < t1; ++t) {
      if (Q8) u = (uint8_t*)w + t * tile_bytes;
      else unpack_tile(w + t * tile_bytes, G, u);
      for (int64_t m0 = 0; m0 < M; m0 += MAX_R) {
        const int R = M - m0 < MAX_R ? (int)(M - m0) : MAX_R;
        if (token)  /* this tile's 16 columns (N - t * TILE left) into the thread's [M][16] */
          ROWS[1][R - 1](xq + m0 * K, xd + m0 * G, xm + m0 * G, G, u, NULL,
                         best.tile + m0 * TILE, TILE, 0, N - t * TILE);
        else
          ROWS[Q8][R - 1](xq + m0 * K, xd + m0 * G, xm + m0 * G, G, u, bias,
                          (char*)y + m0 * ldy * esize, ldy, t * TILE, N);
      }
      if (token) best_of_tile(best.tile, M, t * TILE, N - t * TILE, &best);
    }
  }
  }
  for (int64_t m = 0; token && m < M; ++m) {  /* threads in column order: strict > keeps the first */
    float v = -INFINITY; int64_t c = 0;
    for (int i = 0; i < T; ++i) {
      const char* base = bbuf + best_bytes * i;
      const float bv = ((const float*)(base + M * TILE * sizeof(float)))[m];
      if (bv > v) { v = bv; c = ((const int64_t*)(base + M * (TILE + 1) * sizeof(float)))[m]; }
    }
    token[m] = c;
  }
  free(bbuf);
  free(ubuf);
  free(xq);
  return 0;
}

int linear_q4_bf16_batch(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w,
    int64_t N, const uint16_t* bias, uint16_t* y, int64_t ldy, int nthreads) {
  return run_tiles(0, x, ldx, M, K, w, N, bias, y, ldy, NULL, nthreads);
}

int linear_q8_vnni_f32(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w,
    int64_t N, float* y, int64_t ldy, int nthreads) {
  return run_tiles(1, x, ldx, M, K, w, N, NULL, y, ldy, NULL, nthreads);
}

/* token[m] = argmax over n of linear_q8_vnni_f32's y[m][n] (the same float32 sums, the first
   maximum winning), without y: a greedy step's LM head writes no logits. */
int linear_q8_vnni_argmax(const uint16_t* x, int64_t ldx, int64_t M, int64_t K,
    const uint8_t* w, int64_t N, int64_t* token, int nthreads) {
  return run_tiles(1, x, ldx, M, K, w, N, NULL, NULL, 0, token, nthreads);
}
#endif
