/* AVX2 helpers shared by the kernels, compiled only where the CPU has AVX2: elsewhere this
   header declares nothing. */
#ifndef TESSERA_AVX2_MATH_H
#define TESSERA_AVX2_MATH_H

#if defined(__AVX2__)
#include <immintrin.h>
/* the sum of 8 floats */
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#endif
