/* AVX-512 helpers (bf16 rounding, a vector exp, a 16-way lane sum), compiled only where the
   CPU has AVX-512: elsewhere this header declares nothing. */
#ifndef TESSERA_AVX512_MATH_H
#define TESSERA_AVX512_MATH_H

#if defined(__AVX512F__)
#include <immintrin.h>
/* 16 floats -> 16 bf16, rounded like f2bf (to nearest even). */
static inline __m256i f2bf512(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16));
}
/* e^x as 2^n * p(f), |rel err| < 2e-7; x clamped to [-87, 88], where e^x stays a normal
   float (softmax's scores after the max, SiLU's -x). */
static inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718f));
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
/* 16 bf16 values -> floats. */
static inline __m512 bf16x16_to_f32(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
/* SiLU-and-mul on 16 bf16 values g and u (given as floats holding them): silu(g) rounded to
   bf16, times u, rounded again (torch's F.silu(g) * u in bf16). The division is a reciprocal
   with one Newton step (~1 ulp of float32). */
static inline __m256i silu_mul_bf16x16(__m512 g, __m512 u) {
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g)));
  __m512 r = _mm512_rcp14_ps(d);
  r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
  return f2bf512(_mm512_mul_ps(bf16x16_to_f32(f2bf512(_mm512_mul_ps(g, r))), u));
}
/* lane j of the result = sum of v[j]'s lanes (a transpose-and-add tree, then one permute). */
static inline __m512 reduce16(const __m512 v[16]) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_ps(_mm512_unpacklo_ps(y[2 * i], y[2 * i + 1]),
                         _mm512_unpackhi_ps(y[2 * i], y[2 * i + 1]));
  const __m512 w = _mm512_add_ps(_mm512_unpacklo_ps(z[0], z[1]), _mm512_unpackhi_ps(z[0], z[1]));
  /* w holds v[k], v[8+k], v[4+k], v[12+k] in its 128-bit lane k (element 4k..4k+3): put v[j]'s sum at lane j. */
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, w);
}
#endif
#endif
