/* bf16 <-> float32 conversions that round like torch (to nearest even), and f2f: the float32
   variant of the same macros (the kernels are written once over LOAD/STORE functions). */
#ifndef TESSERA_BF16_CONVERT_H
#define TESSERA_BF16_CONVERT_H

#include <stdint.h>
static inline float bf2f(uint16_t x) { union { uint32_t u; float f; } v; v.u = (uint32_t)x << 16; return v.f; }
static inline uint16_t f2bf(float f) {
  union { uint32_t u; float f; } v; v.f = f;
  return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}
static inline float f2f(float x) { return x; }
#endif
