/* IQ4_NL and IQ4_XS: each 4-bit code indexes these int8 values (ggml's kvalues_iq4nl, a
   non-uniform grid denser near zero), times its block's scale. */
#ifndef TESSERA_IQ4_VALUES_H
#define TESSERA_IQ4_VALUES_H
#include <stdint.h>

static const int8_t IQ4_VALUES[16] = {
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

#if defined(__AVX2__)
#include <immintrin.h>
/* codes (bytes 0..15) -> their values, 32 at a time */
static inline __m256i iq4_lookup(__m256i codes) {
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)IQ4_VALUES));
  return _mm256_shuffle_epi8(table, codes);
}
#endif
#endif
