/* An IEEE half (the scales of GGUF blocks and w4 tiles, possibly unaligned) -> float32:
   F16C's instruction where the build has it, else the bit arithmetic (subnormals, inf, NaN). */
#ifndef TESSERA_F16_CONVERT_H
#define TESSERA_F16_CONVERT_H

#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

static inline float h2f(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  union { uint32_t u; float f; } v;
  if (e == 0) {
    v.f = (float)m * 5.9604644775390625e-8f; /* subnormal: m * 2^-24 */
    v.u |= s;
  } else {
    v.u = s | (e == 31 ? 0x7F800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
  }
  return v.f;
#endif
}
#endif
