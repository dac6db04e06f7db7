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
Q4_1 file llama.cpp serves (0.051, simulated the same way). Small batches (fewer than
W8A8_MIN_ROWS rows, AMX_W8A8_MIN_ROWS on AMX: engine.layers.quantization.w8a8) keep the
weight-only kernel: they are bound by reading the weights, which are the same int8 rows, and
_int_mm is slower there.

Small C loops around the int8 GEMM: quantizing the rows and the scaled epilogue (each one
pass, where the torch ops would be several). The GEMM itself runs on a packed copy of the
weights (int_mm, on AVX512-VNNI) up to PACKED_MAX_ROWS rows, torch._int_mm beyond: oneDNN
repacks the weight on every call, which at 13-256 rows costs as much as the multiply. The
MLP (mlp_w8a8) goes further: between its two GEMMs one pass takes gate_up's int32 sums to
the int8 rows down_proj needs (scales, SiLU, product, quantization), 10% less MLP time at
32-128 rows than layer by layer; on the packed weight that pass runs in the GEMM's own tiles
(gemm_i8_silu_quant), so gate_up's int32 sums never reach memory. On CPUs with AMX (Intel
Sapphire Rapids and later) the packed GEMMs run on its tiles instead of VNNI's (K % 64 == 0;
TESSERA_AMX=0 keeps VNNI): the same packed weight, the same exact sums; on two cores of a
Xeon with AMX, ~2x faster at 32-128 rows and 2-3x at 1,024, and 128 streams of w4a8
1.3-1.6x faster (served and LLM.generate). Built with the other CPU kernels
(engine.cpu_build); TESSERA_CPU_KERNELS=0 disables them (the torch fallback stays exact to
the same arithmetic, only slower).
"""

from __future__ import annotations

import ctypes
import os

import torch

from engine.cpu_build import (
    C_AVX512_HELPERS,
    C_BF16_HELPERS,
    C_INT8_QUANT_HELPERS,
    load_library,
)

_SOURCE = (
    C_BF16_HELPERS
    + C_INT8_QUANT_HELPERS
    + C_AVX512_HELPERS
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
        const __m512 f = ep->bias ? _mm512_fmadd_ps(as, wn, _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)ep->bias + n))), 16)))
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
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
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
"""
)

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
# x, ldx, M, K, q, s, threads
_QUANT_ARGS = [_P, _I64, _I64, _I64, _P, _P, ctypes.c_int]
# acc, M, N, s, w_scale, bias, y, threads
_DEQUANT_ARGS = [_P, _I64, _I64, _P, _P, _P, _P, ctypes.c_int]
# acc, M, I, s, w_scale, bias, q, q_scale, tmp, threads
_SILU_QUANT_ARGS = [_P, _I64, _I64, _P, _P, _P, _P, _P, _P, ctypes.c_int]
_SIGNATURES = {f"quantize_rows_{sfx}": (_QUANT_ARGS, None) for sfx in _SUFFIX.values()}
_SIGNATURES |= {f"dequant_{sfx}": (_DEQUANT_ARGS, None) for sfx in _SUFFIX.values()}
_SIGNATURES |= {f"silu_quant_{sfx}": (_SILU_QUANT_ARGS, None) for sfx in _SUFFIX.values()}


def _load() -> ctypes.CDLL | None:
    return load_library("w8a8", _SOURCE, "int8 activations", _SIGNATURES)


# Above this many rows torch._int_mm's repacking is amortized (16-48% slower than the packed
# GEMM at 13-256 rows, 0-13% faster at 1,024-2,048 on a Zen 4). Up to it the MLP runs its
# SiLU pass inside the GEMM (20% less MLP time at 1,024 rows) and the decode plan takes the
# step: 1,024 covers the server's prefill chunks (--max-num-batched-tokens on a CPU).
PACKED_MAX_ROWS = 1024
_GEMM_ARGS = [_P, _I64, _I64, _I64, _P, _I64, _P, _I64, ctypes.c_int]
# the packed GEMM's column blocks (16 * GEMM_NV): the SiLU and argmax epilogues keep one
# partial maximum per row and block
BLOCK_COLS = 48
# x, ldx, M, K, packed, N, xs, ws, bias, y, bf16, threads
_GEMM_SCALED_ARGS = [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _P, ctypes.c_int, ctypes.c_int]
# x, ldx, M, K, packed, I, xs, ws, bias, bias_bf16, h, hmax, q, qs, threads
_GEMM_SILU_ARGS = [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _P, ctypes.c_int, _P, _P, _P, _P]
_GEMM_SILU_ARGS += [ctypes.c_int]
# x, ldx, M, K, packed, N, xs, ws, val, col, token, threads
_GEMM_ARGMAX_ARGS = [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _P, _P, ctypes.c_int]
_gemm: list = []  # (pack_i8, gemm_i8, gemm_i8_scaled, gemm_i8_silu_quant, gemm_i8_argmax)


def _gemm_functions():
    if not _gemm:
        lib = _load()
        fns = None
        if lib is not None and hasattr(lib, "gemm_i8"):
            lib.pack_i8.argtypes, lib.pack_i8.restype = [_P, _I64, _I64, _P], None
            lib.gemm_i8.argtypes, lib.gemm_i8.restype = _GEMM_ARGS, ctypes.c_int
            lib.gemm_i8_scaled.argtypes = _GEMM_SCALED_ARGS
            lib.gemm_i8_scaled.restype = ctypes.c_int
            lib.gemm_i8_silu_quant.argtypes = _GEMM_SILU_ARGS
            lib.gemm_i8_silu_quant.restype = ctypes.c_int
            lib.gemm_i8_argmax.argtypes = _GEMM_ARGMAX_ARGS
            lib.gemm_i8_argmax.restype = ctypes.c_int
            lib.amx_enabled.argtypes, lib.amx_enabled.restype = [], ctypes.c_int
            ctypes.c_int.in_dll(lib, "use_amx").value = os.environ.get("TESSERA_AMX") != "0"
            fns = (
                lib.pack_i8, lib.gemm_i8, lib.gemm_i8_scaled, lib.gemm_i8_silu_quant,
                lib.gemm_i8_argmax,
            )  # fmt: skip
        _gemm.append(fns)
    return _gemm[0]


def set_amx(enabled: bool) -> bool:
    """Let the packed GEMMs run on AMX tiles where the CPU has them (the default;
    TESSERA_AMX=0 turns them off) or keep them on AVX512-VNNI; returns whether a K % 64 == 0
    GEMM now runs on AMX."""
    _amx.clear()
    if _gemm_functions() is None:
        return False
    ctypes.c_int.in_dll(_load(), "use_amx").value = enabled
    return amx_runs(64)


_amx: list[bool] = []  # whether the packed GEMMs run on AMX now, once asked


def amx_runs(k: int) -> bool:
    """Whether a packed GEMM over k input columns runs on AMX tiles (not VNNI's)."""
    if not _amx:
        _amx.append(_gemm_functions() is not None and bool(_load().amx_enabled()))
    return _amx[0] and k % 64 == 0


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """int8 [N, K] -> the packed copy int_mm multiplies without repacking (uint8, N * K
    bytes), or None where the kernel cannot take it (no AVX512-VNNI, N % 16, K % 4)."""
    fns = _gemm_functions()
    n, k = weight.shape
    if fns is None or n % 16 or k % 4 or weight.dtype != torch.int8:
        return None
    w = weight.contiguous()
    out = torch.empty(n * k, dtype=torch.uint8)
    fns[0](w.data_ptr(), n, k, out.data_ptr())
    return out


def _ok(rc: int) -> None:
    """The packed GEMMs return -1 when a buffer could not be allocated."""
    if rc != 0:
        raise MemoryError("int8 GEMM: out of memory")


def int_mm(q: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    """q int8 [M, K] . weight int8 [N, K]^T -> exact int32 [M, N]: on the packed copy when
    there is one (up to PACKED_MAX_ROWS rows), else torch._int_mm."""
    m, k = q.shape
    fns = _gemm_functions()
    if packed is None or fns is None or m > PACKED_MAX_ROWS or q.stride(1) != 1:
        return torch._int_mm(q, weight.t())
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=torch.int32)
    _ok(fns[1](q.data_ptr(), q.stride(0), m, k, packed.data_ptr(), n, y.data_ptr(), n,
               torch.get_num_threads()))  # fmt: skip
    return y


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
    # a true division, as the C quantizer's q8_inv (python's 127.0 / tensor would not be)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, amax / 127.0


def linear_w8a8(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] (float32/bfloat16) against int8 weight [N, K] with float32 weight_scale [N]
    (and its packed copy, pack_weight): x quantized per row, an exact int32 GEMM, then the two
    scales (and bias) in one pass, rounded to out_dtype (default x's: the LM head asks for
    float32 logits directly)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    q, s = quantize_rows(x2)
    y = _scaled_mm(q, s, weight, packed, weight_scale, bias, out_dtype or x.dtype)
    return y.view(*x.shape[:-1], n)


def argmax_w8a8(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, packed: torch.Tensor | None
) -> torch.Tensor | None:
    """argmax over the last dim of linear_w8a8(x, weight, None, weight_scale, torch.float32,
    packed), the first maximum winning, as int64 [M]; or None where the packed GEMM cannot take
    the call. The same float32 values are compared, but none is written: at 128 rows of a
    49,152-token vocabulary that is 25 MB of logits a greedy step never needs."""
    fns = _gemm_functions()
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if packed is None or fns is None or m > PACKED_MAX_ROWS or x.dtype not in _SUFFIX:
        return None
    q, s = quantize_rows(x2)
    ncb = -(-n // BLOCK_COLS)
    val = torch.empty(m, ncb, dtype=torch.float32)
    col = torch.empty(m, ncb, dtype=torch.int32)
    token = torch.empty(m, dtype=torch.int64)
    _ok(fns[4](
        q.data_ptr(), q.stride(0), m, k, packed.data_ptr(), n, s.data_ptr(),
        weight_scale.data_ptr(), val.data_ptr(), col.data_ptr(), token.data_ptr(),
        torch.get_num_threads(),
    ))  # fmt: skip
    return token


def _scaled_mm(
    q: torch.Tensor,
    s: torch.Tensor,
    weight: torch.Tensor,
    packed: torch.Tensor | None,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """_scaled(int_mm(q, weight, packed), s, weight_scale, bias, dtype) in one pass where the
    packed GEMM takes the call: it scales each tile's sums as it finishes them, so the int32
    [M, N] never goes through memory (the LM head's is 25 MB at 128 rows). Equal up to the
    order of the float multiplications (the compiler's choice in dequant's loop)."""
    fns = _gemm_functions()
    m, k = q.shape
    if (
        packed is None
        or fns is None
        or m > PACKED_MAX_ROWS
        or q.stride(1) != 1
        or dtype not in _SUFFIX
        or (bias is not None and (bias.dtype != dtype or not bias.is_contiguous()))
    ):
        return _scaled(int_mm(q, weight, packed), s, weight_scale, bias, dtype)
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=dtype)
    _ok(fns[2](
        q.data_ptr(), q.stride(0), m, k, packed.data_ptr(), n, s.data_ptr(),
        weight_scale.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
        int(dtype == torch.bfloat16), torch.get_num_threads(),
    ))  # fmt: skip
    return y


def _scaled(
    acc: torch.Tensor,
    s: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """acc [M, N] int32 -> acc * s[:, None] * weight_scale (+ bias), in dtype."""
    lib = _load()
    m, n = acc.shape
    if lib is None or dtype not in _SUFFIX or (bias is not None and bias.dtype != dtype):
        y = acc.float() * s[:, None] * weight_scale
        return (y if bias is None else y + bias.float()).to(dtype)
    y = torch.empty(m, n, dtype=dtype)
    b = None if bias is None else bias.contiguous()  # kept alive across the call
    getattr(lib, f"dequant_{_SUFFIX[dtype]}")(
        acc.data_ptr(), m, n, s.data_ptr(), weight_scale.data_ptr(),
        None if b is None else b.data_ptr(), y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return y


def mlp_w8a8(x: torch.Tensor, gate_up, down) -> torch.Tensor:
    """down(silu(gate) * up) with [gate | up] = gate_up(x), both layers w8a8 (int8 weight,
    weight_scale, optional bias; down unsharded): two int8 GEMMs with one C pass between
    them (scales, SiLU, product, and the int8 rows down_proj needs), where the layer by layer
    path takes four passes over the activations and rounds them to x's dtype twice. On the
    packed weight (up to PACKED_MAX_ROWS rows) that pass runs inside the first GEMM's tiles
    (gemm_i8_silu_quant)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    q, s = quantize_rows(x2)
    hq, hs = _silu_quant_fused(q, s, gate_up, x.dtype) or _silu_quant(q, s, gate_up, x.dtype)
    y = _scaled_mm(hq, hs, down.weight, down.packed_int8, down.weight_scale, down.bias, x.dtype)
    return y.view(*x.shape[:-1], -1)


def _silu_quant_fused(q: torch.Tensor, s: torch.Tensor, gate_up, dtype: torch.dtype):
    """(hq, hs) from the packed GEMM with the SiLU pass in its epilogue, or None where it
    cannot take the call (then _silu_quant does: int32 sums first)."""
    fns = _gemm_functions()
    m = q.shape[0]
    i = gate_up.weight.shape[0] // 2
    bias = gate_up.bias
    if (
        fns is None
        or gate_up.packed_int8 is None
        or m > PACKED_MAX_ROWS
        or i % 16
        or q.stride(1) != 1
        or dtype not in _SUFFIX
        or (bias is not None and (bias.dtype != dtype or not bias.is_contiguous()))
    ):
        return None
    hq = torch.empty(m, i, dtype=torch.int8)
    hs = torch.empty(m, dtype=torch.float32)
    h = torch.empty(m, i, dtype=torch.float32)
    hmax = torch.empty(m, -(-i // BLOCK_COLS), dtype=torch.float32)
    _ok(fns[3](
        q.data_ptr(), q.stride(0), m, q.shape[1], gate_up.packed_int8.data_ptr(), i, s.data_ptr(),
        gate_up.weight_scale.data_ptr(), None if bias is None else bias.data_ptr(),
        int(dtype == torch.bfloat16), h.data_ptr(), hmax.data_ptr(), hq.data_ptr(),
        hs.data_ptr(), torch.get_num_threads(),
    ))  # fmt: skip
    return hq, hs


def _silu_quant(q: torch.Tensor, s: torch.Tensor, gate_up, dtype: torch.dtype):
    """(hq, hs): gate_up's int32 sums, then one C pass (or its torch reference)."""
    acc = int_mm(q, gate_up.weight, gate_up.packed_int8)  # [M, 2I]
    m, i = acc.shape[0], acc.shape[1] // 2
    lib = _load()
    bias = gate_up.bias
    if lib is None or dtype not in _SUFFIX or (bias is not None and bias.dtype != dtype):
        gu = acc.float() * s[:, None] * gate_up.weight_scale
        if bias is not None:
            gu = gu + bias.float()
        h = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
        return quantize_rows_reference(h)
    hq = torch.empty(m, i, dtype=torch.int8)
    hs = torch.empty(m, dtype=torch.float32)
    threads = torch.get_num_threads()
    tmp = torch.empty(threads, i, dtype=torch.float32)
    getattr(lib, f"silu_quant_{_SUFFIX[dtype]}")(
        acc.data_ptr(), m, i, s.data_ptr(), gate_up.weight_scale.data_ptr(),
        None if bias is None else bias.data_ptr(), hq.data_ptr(), hs.data_ptr(),
        tmp.data_ptr(), threads,
    )  # fmt: skip
    return hq, hs
