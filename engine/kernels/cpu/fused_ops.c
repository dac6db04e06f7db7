/* Fused row kernels: RMSNorm with its residual add, SiLU-and-mul, rotary embedding, each
   following the torch path's rounding step for step (engine/kernels/cpu/fused_ops.py). */
#include "tessera_kernels.h"
#include "bf16_convert.h"
#include "avx512_math.h"

#include <stdint.h>
#include <math.h>
#include <omp.h>

/* Rows from which a loop is split over threads. Single decode rows stay on the calling
   thread (a fork-join costs more than they do). At 128 decode rows (SmolLM2-135M, two Xeon
   AMX cores) splitting norms, SiLU and rotary from 32 rows made the step 4-10% faster
   (80.4 / 83.4 -> 77.3 / 74.6 ms, alternated runs) and 32-row steps 3-7%, and the server,
   its front end on the same cores, served 32 and 128 streams 1.08x faster with it (and the
   fused MLP). The earlier limit (256) was set while the server held two OpenMP teams, which
   turned every fork-join into a futex wake-up (BENCHMARKS.md, Lessons). */
#define PAR_ROWS 32

/* residual (optional) += x; out = w * dtype(float(r) / rms(r)), per row of H.
   Rows of x, residual and out are contiguous, with row strides. */
#define DEFINE_RMSNORM(NAME, T, LOAD, STORE)                                                  \
void NAME(const T* x, int64_t ldx, T* residual, int64_t ldr, const T* w, T* out, int64_t ldo, \
    int64_t rows, int64_t H, float eps, int nthreads) {                                      \
  _Pragma("omp parallel for num_threads(nthreads) if(rows >= PAR_ROWS) schedule(static)")   \
  for (int64_t t = 0; t < rows; ++t) {                                                       \
    const T* xr = x + t * ldx; T* o = out + t * ldo;                                         \
    const T* src = xr;                                                                       \
    if (residual) {                                                                          \
      T* r = residual + t * ldr;                                                             \
      for (int64_t i = 0; i < H; ++i) r[i] = STORE(LOAD(r[i]) + LOAD(xr[i]));                \
      src = r;                                                                               \
    }                                                                                        \
    float ss = 0.f;                                                                          \
    _Pragma("omp simd reduction(+:ss)")                                                      \
    for (int64_t i = 0; i < H; ++i) { const float v = LOAD(src[i]); ss += v * v; }          \
    const float inv = 1.f / sqrtf(ss / (float)H + eps);                                      \
    _Pragma("omp simd")                                                                      \
    for (int64_t i = 0; i < H; ++i)                                                          \
      o[i] = STORE(LOAD(w[i]) * LOAD(STORE(LOAD(src[i]) * inv)));                            \
  }                                                                                          \
}
DEFINE_RMSNORM(rmsnorm_f32, float, f2f, f2f)
DEFINE_RMSNORM(rmsnorm_bf16, uint16_t, bf2f, f2bf)

/* out[t][i] = dtype(silu(gate)) * up, gate = x[t][i], up = x[t][I + i] (like F.silu(gate).mul_(up):
   silu rounded to the dtype, then the product rounded again). */
#define DEFINE_SILU_MUL(NAME, T, LOAD, STORE)                                                 \
void NAME(const T* x, int64_t ldx, T* out, int64_t ldo, int64_t rows, int64_t I, int nthreads) { \
  _Pragma("omp parallel for num_threads(nthreads) if(rows >= PAR_ROWS) schedule(static)")   \
  for (int64_t t = 0; t < rows; ++t) {                                                       \
    const T* g = x + t * ldx; const T* u = g + I; T* o = out + t * ldo;                      \
    _Pragma("omp simd")                                                                      \
    for (int64_t i = 0; i < I; ++i) {                                                        \
      const float a = LOAD(g[i]);                                                            \
      o[i] = STORE(LOAD(STORE(a / (1.f + expf(-a)))) * LOAD(u[i]));                          \
    }                                                                                        \
  }                                                                                          \
}
DEFINE_SILU_MUL(silu_mul_f32, float, f2f, f2f)
#if defined(__AVX512F__)
/* bf16 with AVX-512: 16 values at a time through silu_mul_bf16x16 (libmvec's 8-wide expf took
   ~0.8 ns a value); the same two roundings. The AMX gate_up epilogue uses the same helper. */
void silu_mul_bf16(const uint16_t* x, int64_t ldx, uint16_t* out, int64_t ldo, int64_t rows,
    int64_t I, int nthreads) {
  _Pragma("omp parallel for num_threads(nthreads) if(rows >= PAR_ROWS) schedule(static)")
  for (int64_t t = 0; t < rows; ++t) {
    const uint16_t* g = x + t * ldx; const uint16_t* u = g + I; uint16_t* o = out + t * ldo;
    for (int64_t i = 0; i < I; i += 16) {
      const __mmask16 k = I - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (I - i)) - 1);
      _mm256_mask_storeu_epi16(o + i, k, silu_mul_bf16x16(
          bf16x16_to_f32(_mm256_maskz_loadu_epi16(k, g + i)),
          bf16x16_to_f32(_mm256_maskz_loadu_epi16(k, u + i))));
    }
  }
}
#else
DEFINE_SILU_MUL(silu_mul_bf16, uint16_t, bf2f, f2bf)
#endif

/* Rotary embedding, "rotate half": out[t][h] = (x1 c - x2 s, x2 c + x1 s) for x[t][h] =
   (x1, x2), c/s = cos/sin[t] (D/2 each), every product and sum rounded to the dtype like
   the torch path. x rows have stride ldx, heads are D apart; out is contiguous. */
#define DEFINE_ROPE(NAME, T, LOAD, STORE)                                                     \
void NAME(const T* x, int64_t ldx, const T* cos, const T* sin, T* out, int64_t rows,        \
    int64_t heads, int64_t D, int nthreads) {                                                \
  const int64_t half = D / 2;                                                                \
  _Pragma("omp parallel for num_threads(nthreads) if(rows >= PAR_ROWS) schedule(static)")   \
  for (int64_t t = 0; t < rows; ++t) {                                                       \
    const T* c = cos + t * half; const T* sn = sin + t * half;                               \
    for (int64_t h = 0; h < heads; ++h) {                                                    \
      const T* a = x + t * ldx + h * D; T* o = out + (t * heads + h) * D;                    \
      _Pragma("omp simd")                                                                    \
      for (int64_t i = 0; i < half; ++i) {                                                   \
        const float x1 = LOAD(a[i]), x2 = LOAD(a[i + half]);                                 \
        const float ci = LOAD(c[i]), si = LOAD(sn[i]);                                       \
        o[i] = STORE(LOAD(STORE(x1 * ci)) - LOAD(STORE(x2 * si)));                           \
        o[i + half] = STORE(LOAD(STORE(x2 * ci)) + LOAD(STORE(x1 * si)));                    \
      }                                                                                      \
    }                                                                                        \
  }                                                                                          \
}
DEFINE_ROPE(rope_f32, float, f2f, f2f)
DEFINE_ROPE(rope_bf16, uint16_t, bf2f, f2bf)

