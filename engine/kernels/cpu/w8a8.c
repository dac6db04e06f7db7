/* int8 activations: row quantizers, dequantizing and SiLU epilogues, and the int8 GEMM on a
   packed weight (AVX512-VNNI or AMX tiles): engine/kernels/cpu/w8a8.py says why. */
#include "tessera_kernels.h"
#include "bf16_convert.h"
#include "int8_quant.h"
#include "avx512_math.h"

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
    s[m] = q8_scale(amax);                                                                   \
    const float inv = q8_inv(amax);                                                          \
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

/* The MLP's middle in one pass: gate_up's int32 sums acc [M][2I] scaled (+ bias) into
   gate | up, h = silu(gate) * up in float, each row of h quantized to int8 for down_proj
   (q [M][I], scale qs[m]). h never exists in the model's dtype. tmp: I floats per thread. */
#define SILU_PRODUCT(BG, BU) do {                                                            \
    const float g = (float)a[i] * sm * wscale[i] + (BG);                                     \
    const float v = g / (1.f + expf(-g)) * ((float)a[I + i] * sm * wscale[I + i] + (BU));    \
    h[i] = v; amax = fmaxf(amax, fabsf(v));                                                  \
  } while (0)
#define DEFINE_SILU_QUANT(NAME, T, LOAD)                                                      \
void NAME(const int32_t* acc, int64_t M, int64_t I, const float* s, const float* wscale,     \
    const T* bias, int8_t* q, float* qs, float* tmp, int nthreads) {                         \
  _Pragma("omp parallel for num_threads(nthreads) if(M >= PAR_ROWS) schedule(static)")      \
  for (int64_t m = 0; m < M; ++m) {                                                          \
    const int32_t* a = acc + m * 2 * I; const float sm = s[m];                               \
    float* h = tmp + (int64_t)omp_get_thread_num() * I;                                      \
    float amax = 0.f;                                                                        \
    if (bias) {  /* two loops: with the bias test inside, GCC runs the scalar version */     \
      _Pragma("omp simd reduction(max:amax)")                                                \
      for (int64_t i = 0; i < I; ++i)                                                        \
        SILU_PRODUCT(LOAD(bias[i]), LOAD(bias[I + i]));                                      \
    } else {                                                                                 \
      _Pragma("omp simd reduction(max:amax)")                                                \
      for (int64_t i = 0; i < I; ++i) SILU_PRODUCT(0.f, 0.f);                                \
    }                                                                                        \
    qs[m] = q8_scale(amax);                                                                  \
    const float inv = q8_inv(amax);                                                          \
    int8_t* qr = q + m * I;                                                                  \
    _Pragma("omp simd")                                                                      \
    for (int64_t i = 0; i < I; ++i) {                                                        \
      const float v = nearbyintf(h[i] * inv);                                                \
      qr[i] = (int8_t)(v > 127.f ? 127.f : (v < -127.f ? -127.f : v));                       \
    }                                                                                        \
  }                                                                                          \
}
DEFINE_SILU_QUANT(silu_quant_f32, float, f2f)
DEFINE_SILU_QUANT(silu_quant_bf16, uint16_t, bf2f)

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#include <stdlib.h>
/* The int8 GEMM on weights packed once: y [M][N] int32 = x [M][K] . w [N][K]^T, exact.
   w is stored as unsigned bytes (w + 128) in [N/16][K/4][16][4]: 64 bytes = 4 k-steps of 16
   columns, the operand layout of vpdpbusd, which multiplies them with 4 bytes of one x row
   broadcast from memory (folded into the instruction, which GCC does not do by itself);
   the +128 comes back out as 128 * sum(x row). Tiles of 8 rows x 48 columns keep 24
   accumulators in registers; a thread takes whole column blocks, so each 48-column slice of
   w is read once per 8 rows from L1. torch._int_mm (oneDNN) repacks w on every call, which
   costs as much as the multiply at a few dozen rows. */
void pack_i8(const int8_t* w, int64_t N, int64_t K, uint8_t* out) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      out[((n / 16) * (K / 4) + k / 4) * 64 + (n % 16) * 4 + k % 4] = (uint8_t)(w[n * K + k] + 128);
}
static inline __m512i dpbusd_bcast(__m512i acc, __m512i b, const int32_t* p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(b), "m"(*p));
  return acc;
}
#define GEMM_MR 8
#define GEMM_NV 3
_Static_assert(16 * GEMM_NV == W8A8_BLOCK_COLS, "Python sizes the epilogues' scratch by it");
static inline __attribute__((always_inline)) void gemm_tile(const int MR, const int NV,
    const int8_t* x, int64_t ldx, const uint8_t* wp, int64_t K, const int32_t* xsum,
    int32_t* y, int64_t ldy, int64_t m0, int64_t n0) {
  __m512i acc[GEMM_MR][GEMM_NV];
  for (int r = 0; r < MR; ++r) for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_si512();
  const uint8_t* b0 = wp + (n0 / 16) * (K / 4) * 64;
  const int64_t bstride = (K / 4) * 64;
  for (int64_t k4 = 0; k4 < K / 4; ++k4) {
    __m512i b[GEMM_NV];
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_si512(b0 + v * bstride + k4 * 64);
    for (int r = 0; r < MR; ++r) {
      const int32_t* xp = (const int32_t*)(x + (m0 + r) * ldx) + k4;
      for (int v = 0; v < NV; ++v) acc[r][v] = dpbusd_bcast(acc[r][v], b[v], xp);
    }
  }
  for (int r = 0; r < MR; ++r) {
    const __m512i c = _mm512_set1_epi32(128 * xsum[m0 + r]);
    for (int v = 0; v < NV; ++v)
      _mm512_storeu_si512(y + r * ldy + 16 * v, _mm512_sub_epi32(acc[r][v], c));
  }
}
/* AMX (Sapphire Rapids and later): one tdpbsud multiplies 16 rows x 64 k of x with 64 k x 16
   columns of w, 16x a vpdpbusd's work. w's packed layout is already its operand layout (a
   column block's k4 rows of 64 bytes); x's rows load as they are. Tiles of 16 rows x 48
   columns: sums in tiles 0-2, x in 3, w in 4-6. x is signed and w unsigned (tdpbsud), so the
   +128 comes out as with VNNI. Linux hands out the tile registers on request
   (arch_prctl); where it refuses, or K % 64, the VNNI tiles run. use_amx = 0 forces them
   (tests hold one path against the other). */
#define AMX_ROWS 16
#include <string.h>
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
int use_amx = 1;
static int amx_permitted = 0;  /* 0: not asked yet, 1: granted, -1: refused */
static int amx_on(int64_t K) {
  if (!use_amx || K % 64) return 0;
  if (!amx_permitted)  /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
    amx_permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
  return amx_permitted > 0;
}
typedef struct {
  uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16];
} amx_config;
static void amx_begin(int amx) {  /* the tile shapes are per thread */
  if (!amx) return;
  amx_config c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int i = 0; i < 7; ++i) { c.rows[i] = 16; c.colsb[i] = 64; }
  _tile_loadconfig(&c);
}
static void amx_end(int amx) { if (amx) _tile_release(); }
/* 16 rows of x (lda apart) . the nv column blocks at b0 -> t (16 x 16nv int32, ldt apart) */
static void amx_tile(int nv, const int8_t* a, int64_t lda, const uint8_t* b0, int64_t K,
    int32_t* t, int64_t ldt) {
  const int64_t bstride = (K / 4) * 64;
  _tile_zero(0); _tile_zero(1); _tile_zero(2);
  for (int64_t k = 0; k < K; k += 64) {
    const uint8_t* b = b0 + k * 16;
    _tile_loadd(3, a + k, lda);
    _tile_loadd(4, b, 64);
    _tile_dpbsud(0, 3, 4);
    if (nv > 1) { _tile_loadd(5, b + bstride, 64); _tile_dpbsud(1, 3, 5); }
    if (nv > 2) { _tile_loadd(6, b + 2 * bstride, 64); _tile_dpbsud(2, 3, 6); }
  }
  _tile_stored(0, t, ldt * 4);
  if (nv > 1) _tile_stored(1, t + 16, ldt * 4);
  if (nv > 2) _tile_stored(2, t + 32, ldt * 4);
}
#else
int use_amx = 0;
static int amx_on(int64_t K) { return 0; }
static void amx_begin(int amx) {}
static void amx_end(int amx) {}
static void amx_tile(int nv, const int8_t* a, int64_t lda, const uint8_t* b0, int64_t K,
    int32_t* t, int64_t ldt) {}  /* never called: amx_on() is 0 */
#endif
/* 1 where a K % 64 GEMM runs on AMX tiles now */
int amx_enabled(void) { return amx_on(64); }
#define GEMM_ROWS(NV) switch (mr) {                                                           \
    case 8: gemm_tile(8, NV, x, ldx, wp, K, xsum, yt, ldt, m0, n0); break;                    \
    case 7: gemm_tile(7, NV, x, ldx, wp, K, xsum, yt, ldt, m0, n0); break;                    \
    case 6: gemm_tile(6, NV, x, ldx, wp, K, xsum, yt, ldt, m0, n0); break;                    \
    case 5: gemm_tile(5, NV, x, ldx, wp, K, xsum, yt, ldt, m0, n0); break;                    \
    case 4: gemm_tile(4, NV, x, ldx, wp, K, xsum, yt, ldt, m0, n0); break;                    \
    case 3: gemm_tile(3, NV, x, ldx, wp, K, xsum, yt, ldt, m0, n0); break;                    \
    case 2: gemm_tile(2, NV, x, ldx, wp, K, xsum, yt, ldt, m0, n0); break;                    \
    default: gemm_tile(1, NV, x, ldx, wp, K, xsum, yt, ldt, m0, n0); }
/* The sums of rows m0.. (mr of them: up to AMX_ROWS) x columns n0.. (nv blocks of 16) on AMX
   tiles into yt, ldt apart. */
__attribute__((noinline)) static void amx_block_sums(const int8_t* x, int64_t ldx,
    const int8_t* xtail, int64_t K, const uint8_t* wp, const int32_t* xsum, int mr, int nv,
    int64_t m0, int64_t n0, int32_t* yt, int64_t ldt) {
  int32_t buf[AMX_ROWS * 16 * GEMM_NV];  /* a last tile's 16 rows, of which mr are wanted */
  const int full = mr == AMX_ROWS;
  int32_t* t = full ? yt : buf;
  const int64_t ldb = full ? ldt : 16 * GEMM_NV;
  amx_tile(nv, full ? x + m0 * ldx : xtail, full ? ldx : K, wp + (n0 / 16) * (K / 4) * 64, K,
           t, ldb);
  for (int r = 0; r < mr; ++r) {
    const __m512i c = _mm512_set1_epi32(128 * xsum[m0 + r]);
    for (int v = 0; v < nv; ++v)
      _mm512_storeu_si512(yt + r * ldt + 16 * v,
          _mm512_sub_epi32(_mm512_loadu_si512(t + r * ldb + 16 * v), c));
  }
}
/* The same on the VNNI tiles (mr up to GEMM_MR), or on AMX's. */
static inline __attribute__((always_inline)) void block_sums(int amx, const int8_t* x,
    int64_t ldx, const int8_t* xtail, int64_t K, const uint8_t* wp, const int32_t* xsum, int mr,
    int nv, int64_t m0, int64_t n0, int32_t* yt, int64_t ldt) {
  if (amx) {
    amx_block_sums(x, ldx, xtail, K, wp, xsum, mr, nv, m0, n0, yt, ldt);
    return;
  }
  if (nv == 3) { GEMM_ROWS(3) } else if (nv == 2) { GEMM_ROWS(2) } else { GEMM_ROWS(1) }
}
/* The dequantizing epilogue a GEMM can apply to each tile (NULL: int32 sums out): y [M][N] =
   sums * xs[m] * ws[n] (+ bias[n]), float32 or bf16 (bias in y's dtype). A tile's sums go
   through a buffer in L1 first: inlined into gemm_tile, this code's constants took registers
   from the accumulators and the k loop spilled (2x slower). */
typedef struct { const float* xs; const float* ws; const void* bias; void* y; int bf16; } gemm_epilogue;
__attribute__((noinline)) static void epilogue_tile(const int32_t* t, int mr, int nv, int64_t m0,
    int64_t n0, int64_t ldy, const gemm_epilogue* ep) {
  for (int r = 0; r < mr; ++r) {
    const __m512 sm = _mm512_set1_ps(ep->xs[m0 + r]);
    for (int v = 0; v < nv; ++v) {
      const int64_t n = n0 + 16 * v, at = (m0 + r) * ldy + n;
      const __m512 as = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(t + r * 16 * GEMM_NV + 16 * v)), sm);
      const __m512 wn = _mm512_loadu_ps(ep->ws + n);
      if (ep->bf16) {
        const __m512 f = ep->bias ? _mm512_fmadd_ps(as, wn, bf16x16_to_f32(
            _mm256_loadu_si256((const __m256i*)((const uint16_t*)ep->bias + n))))
                                  : _mm512_mul_ps(as, wn);
        _mm256_storeu_si256((__m256i*)((uint16_t*)ep->y + at), f2bf512(f));
      } else {
        _mm512_storeu_ps((float*)ep->y + at, ep->bias
            ? _mm512_fmadd_ps(as, wn, _mm512_loadu_ps((const float*)ep->bias + n)) : _mm512_mul_ps(as, wn));
      }
    }
  }
}
/* The other epilogue, for greedy sampling: each tile row's largest value of sums * xs[m] *
   ws[n] (float32, as gemm_i8_scaled would write the logits) and its first column, one pair
   per (row, column block); gemm_i8_argmax reduces them, so no [M][N] logits are written. */
typedef struct { const float* xs; const float* ws; float* val; int32_t* col; int64_t ncb; } argmax_epilogue;
__attribute__((noinline)) static void argmax_tile(const int32_t* t, int mr, int nv, int64_t m0,
    int64_t n0, int64_t cb, const argmax_epilogue* am) {
  for (int r = 0; r < mr; ++r) {
    const __m512 sm = _mm512_set1_ps(am->xs[m0 + r]);
    float best = -INFINITY; int32_t col = (int32_t)n0;
    for (int v = 0; v < nv; ++v) {
      const int64_t n = n0 + 16 * v;
      const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(
          _mm512_loadu_si512(t + r * 16 * GEMM_NV + 16 * v)), sm), _mm512_loadu_ps(am->ws + n));
      const float mx = _mm512_reduce_max_ps(y);
      if (mx > best) {  /* strictly: the first maximum wins, as torch.argmax */
        best = mx;
        col = (int32_t)(n + __builtin_ctz(_mm512_cmp_ps_mask(y, _mm512_set1_ps(mx), _CMP_EQ_OQ)));
      }
    }
    am->val[(m0 + r) * am->ncb + cb] = best; am->col[(m0 + r) * am->ncb + cb] = col;
  }
}
/* Each row's sum of x (malloc'd; NULL if out of memory): the +128 of the packed weight's
   unsigned bytes comes back out as 128 * sum. */
static int32_t* row_sums(const int8_t* x, int64_t ldx, int64_t M, int64_t K) {
  int32_t* xsum = (int32_t*)malloc(sizeof(int32_t) * (M > 0 ? M : 1));
  if (xsum)
    for (int64_t m = 0; m < M; ++m) {
      int32_t sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += x[m * ldx + k];
      xsum[m] = sum;
    }
  return xsum;
}
/* What a packed GEMM prepares: the tile kind and its rows, x's row sums and, where AMX tiles
   (which load 16 rows) meet M % 16, x's last rows copied with zero rows after them (K bytes
   each). 0, or -1 if out of memory. */
typedef struct { int amx, step; int8_t* xtail; int32_t* xsum; } gemm_setup;
static int setup_gemm(gemm_setup* g, const int8_t* x, int64_t ldx, int64_t M, int64_t K) {
  g->amx = amx_on(K);
  g->step = g->amx ? AMX_ROWS : GEMM_MR;
  g->xtail = NULL;
  const int64_t m0 = M - M % AMX_ROWS;
  if (g->amx && m0 < M) {
    g->xtail = (int8_t*)calloc(AMX_ROWS * K, 1);
    if (!g->xtail) return -1;
    for (int64_t m = m0; m < M; ++m) memcpy(g->xtail + (m - m0) * K, x + m * ldx, K);
  }
  g->xsum = row_sums(x, ldx, M, K);
  if (!g->xsum) { free(g->xtail); return -1; }
  return 0;
}
static void free_gemm(gemm_setup* g) { free(g->xsum); free(g->xtail); }
/* x rows ldx apart (K % 4 == 0, N % 16 == 0); y: int32 sums, ldy apart (NULL with an
   epilogue, whose output rows are ldy apart). Returns -1 if out of memory. */
static int gemm_i8_run(const int8_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* wp,
    int64_t N, int32_t* y, int64_t ldy, int nthreads, const gemm_epilogue* ep,
    const argmax_epilogue* am) {
  gemm_setup g;
  if (setup_gemm(&g, x, ldx, M, K)) return -1;
  const int amx = g.amx, step = g.step;
  const int8_t* xtail = g.xtail; const int32_t* xsum = g.xsum;
  const int64_t ncb = (N + 16 * GEMM_NV - 1) / (16 * GEMM_NV);
  _Pragma("omp parallel num_threads(nthreads) if(nthreads > 1)")
  {
    amx_begin(amx);
    _Pragma("omp for schedule(static)")
    for (int64_t cb = 0; cb < ncb; ++cb) {
      const int64_t n0 = cb * 16 * GEMM_NV;
      const int nv = (N - n0) / 16 < GEMM_NV ? (int)((N - n0) / 16) : GEMM_NV;
      int32_t tile[AMX_ROWS * 16 * GEMM_NV];
      for (int64_t m0 = 0; m0 < M; m0 += step) {
        const int mr = M - m0 < step ? (int)(M - m0) : step;
        int32_t* yt = ep || am ? tile : y + m0 * ldy + n0;  /* the tile's sums */
        const int64_t ldt = ep || am ? 16 * GEMM_NV : ldy;
        block_sums(amx, x, ldx, xtail, K, wp, xsum, mr, nv, m0, n0, yt, ldt);
        if (ep) epilogue_tile(tile, mr, nv, m0, n0, ldy, ep);
        if (am) argmax_tile(tile, mr, nv, m0, n0, cb, am);
      }
    }
    amx_end(amx);
  }
  free_gemm(&g);
  return 0;
}
int gemm_i8(const int8_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* wp, int64_t N,
    int32_t* y, int64_t ldy, int nthreads) {
  return gemm_i8_run(x, ldx, M, K, wp, N, y, ldy, nthreads, NULL, NULL);
}
/* gemm_i8 with the epilogue: y [M][N] = (x . w) * xs[m] * ws[n] (+ bias), float32 or bf16. */
int gemm_i8_scaled(const int8_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* wp,
    int64_t N, const float* xs, const float* ws, const void* bias, void* y, int bf16,
    int nthreads) {
  const gemm_epilogue ep = {xs, ws, bias, y, bf16};
  return gemm_i8_run(x, ldx, M, K, wp, N, NULL, N, nthreads, &ep, NULL);
}
/* argmax over n of (x . w)[m][n] * xs[m] * ws[n] for each row (the first maximum): token[m].
   val, col: scratch of M * ceil(N / 48) floats and int32s. */
int gemm_i8_argmax(const int8_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* wp,
    int64_t N, const float* xs, const float* ws, float* val, int32_t* col, int64_t* token,
    int nthreads) {
  const int64_t ncb = (N + 16 * GEMM_NV - 1) / (16 * GEMM_NV);
  const argmax_epilogue am = {xs, ws, val, col, ncb};
  if (gemm_i8_run(x, ldx, M, K, wp, N, NULL, N, nthreads, NULL, &am)) return -1;
  for (int64_t m = 0; m < M; ++m) {
    float best = val[m * ncb]; int64_t at = col[m * ncb];
    for (int64_t cb = 1; cb < ncb; ++cb)
      if (val[m * ncb + cb] > best) { best = val[m * ncb + cb]; at = col[m * ncb + cb]; }
    token[m] = at;
  }
  return 0;
}

/* The MLP's first half with no int32 [M][2I] in memory: x . [gate | up]^T on the packed
   weight, a thread taking a gate column block with its up block (I columns on); each 8-row
   tile pair goes through L1 to h = silu(gate) * up in float (silu_quant's arithmetic, term
   for term) with the tile's |h| max; after a barrier, each row of h quantized to int8 for
   down_proj. The sums were 2x the bytes of h and a second pass over them. I % 16 == 0. */
typedef struct { const float* xs; const float* ws; const void* bias; int bias_bf16;
                 float* h; float* hmax; int64_t I, nblk; } silu_epilogue;
static inline __m512 bf16x16(const uint16_t* p) {
  return bf16x16_to_f32(_mm256_loadu_si256((const __m256i*)p));
}
/* 16 values of a tile row: sums * sm * ws (+ bias), as float */
static inline __m512 scaled16(const int32_t* t, __m512 sm, const float* ws, const void* bias,
    int bias_bf16, int64_t n) {
  const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(t)), sm),
                                 _mm512_loadu_ps(ws + n));
  if (!bias) return y;
  return _mm512_add_ps(y, bias_bf16 ? bf16x16((const uint16_t*)bias + n)
                                    : _mm512_loadu_ps((const float*)bias + n));
}
__attribute__((noinline)) static void silu_tile(const int32_t* tg, const int32_t* tu, int mr,
    int nv, int64_t m0, int64_t n0, int64_t cb, const silu_epilogue* ep) {
  const int64_t I = ep->I;
  for (int r = 0; r < mr; ++r) {
    const __m512 sm = _mm512_set1_ps(ep->xs[m0 + r]);
    float* hr = ep->h + (m0 + r) * I + n0;
    __m512 amax = _mm512_setzero_ps();
    for (int v = 0; v < nv; ++v) {
      const int64_t n = n0 + 16 * v;
      const __m512 g = scaled16(tg + r * 16 * GEMM_NV + 16 * v, sm, ep->ws, ep->bias, ep->bias_bf16, n);
      const __m512 u = scaled16(tu + r * 16 * GEMM_NV + 16 * v, sm, ep->ws, ep->bias, ep->bias_bf16, I + n);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 h = _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), u);
      _mm512_storeu_ps(hr + 16 * v, h);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(h));
    }
    ep->hmax[(m0 + r) * ep->nblk + cb] = _mm512_reduce_max_ps(amax);
  }
}
/* h: [M][I] floats, hmax: [M][ceil(I / 48)] floats (scratch); q [M][I], qs [M] out. */
int gemm_i8_silu_quant(const int8_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* wp,
    int64_t I, const float* xs, const float* ws, const void* bias, int bias_bf16, float* h,
    float* hmax, int8_t* q, float* qs, int nthreads) {
  if (I % 16) return -2;
  gemm_setup g;
  if (setup_gemm(&g, x, ldx, M, K)) return -1;
  const int amx = g.amx, step = g.step;
  const int8_t* xtail = g.xtail; const int32_t* xsum = g.xsum;
  const int64_t nblk = (I + 16 * GEMM_NV - 1) / (16 * GEMM_NV);
  const silu_epilogue ep = {xs, ws, bias, bias_bf16, h, hmax, I, nblk};
  const int64_t Mp = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
  int failed = 0;
  _Pragma("omp parallel num_threads(nthreads) if(nthreads > 1) reduction(|:failed)")
  {
    /* a block's gate sums for every row (then its up tiles against them): each weight panel
       stays in L1 across the row tiles, as in gemm_i8 */
    int32_t* gate = (int32_t*)malloc(sizeof(int32_t) * Mp * 16 * GEMM_NV);
    int32_t tu[AMX_ROWS * 16 * GEMM_NV];
    const int64_t ldt = 16 * GEMM_NV;
    failed |= gate == NULL;
    amx_begin(amx);
    _Pragma("omp for schedule(static)")
    for (int64_t cb = 0; cb < nblk; ++cb) {
      if (!gate) continue;
      const int64_t g0 = cb * 16 * GEMM_NV;
      const int nv = (I - g0) / 16 < GEMM_NV ? (int)((I - g0) / 16) : GEMM_NV;
      for (int64_t m0 = 0; m0 < M; m0 += step) {
        const int mr = M - m0 < step ? (int)(M - m0) : step;
        block_sums(amx, x, ldx, xtail, K, wp, xsum, mr, nv, m0, g0, gate + m0 * ldt, ldt);
      }
      for (int64_t m0 = 0; m0 < M; m0 += step) {
        const int mr = M - m0 < step ? (int)(M - m0) : step;
        block_sums(amx, x, ldx, xtail, K, wp, xsum, mr, nv, m0, I + g0, tu, ldt);
        silu_tile(gate + m0 * ldt, tu, mr, nv, m0, g0, cb, &ep);
      }
    }
    amx_end(amx);
    free(gate);
    _Pragma("omp for schedule(static)")
    for (int64_t m = 0; m < M; ++m) {
      float amax = 0.f;
      for (int64_t b = 0; b < nblk; ++b) amax = fmaxf(amax, hmax[m * nblk + b]);
      qs[m] = q8_scale(amax);
      const float inv = q8_inv(amax);
      const float* hr = h + m * I; int8_t* qr = q + m * I;
      _Pragma("omp simd")
      for (int64_t i = 0; i < I; ++i) {
        const float v = nearbyintf(hr[i] * inv);
        qr[i] = (int8_t)(v > 127.f ? 127.f : (v < -127.f ? -127.f : v));
      }
    }
  }
  free_gemm(&g);
  return failed ? -1 : 0;
}
#endif
