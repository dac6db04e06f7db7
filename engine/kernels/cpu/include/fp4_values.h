/* MXFP4 (OCP microscaling FP4, gpt-oss's experts): each 4-bit e2m1 code (sign, then 0, 0.5,
   1, 1.5, 2, 3, 4, 6) indexes these int8 values, twice the e2m1 value (ggml's kvalues_mxfp4),
   times half its block's E8M0 power of two: exact, and the dot products run as Q8_0's. */
#ifndef TESSERA_FP4_VALUES_H
#define TESSERA_FP4_VALUES_H
#include <stdint.h>
#include <string.h>

static const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* half of E8M0's 2^(e - 127), as ggml's GGML_E8M0_TO_FP32_HALF: 2^-128 and 2^-127 (e = 0, 1)
   are float32 subnormals */
static inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

/* NVFP4's ue4m3 scale byte (e4m3 without its sign: bias 7, subnormals m * 2^-9) halved, its
   values doubled as MXFP4's: gguf-py's NVFP4.ue4m3_to_fp32 bit for bit (bit 7 ignored, 0x7F,
   e4m3's NaN, read as 0). Every result is a normal float32, built from its bits. */
static inline float ue4m3_half(uint8_t x) {
  if (x == 0 || x == 0x7F) return 0.f;
  const uint32_t e = (x >> 3) & 15u, m = x & 7u;
  if (e == 0) return (float)m * 0x1p-10f;
  const uint32_t bits = (e - 8u + 127u) << 23 | m << 20;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

#if defined(__AVX2__)
#include <immintrin.h>
/* codes (bytes 0..15) -> their values, 32 at a time */
static inline __m256i mxfp4_lookup(__m256i codes) {
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)MXFP4_VALUES));
  return _mm256_shuffle_epi8(table, codes);
}
#endif
#endif
