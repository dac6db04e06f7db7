/* What the kernels on AMX tiles share (amx_bf16.c, lora_amx.c): the tiles' set-up, and the
   transpose that packs rows of x as a B operand. Include where __AMX_TILE__ is defined. */
#ifndef TESSERA_AMX_TILES_H
#define TESSERA_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>

typedef struct {
  uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16];
} tile_config;

/* Every tile 16 rows x 64 bytes (the largest; each kernel says what it keeps where). The
   configuration is per thread: each thread of a parallel region calls this first. A constant
   object: built on the stack, GCC 12 dropped the stores of rows and colsb before ldtilecfg once
   the function was inlined (its builtin does not tell it reads the 64 bytes): a #GP. */
static const tile_config amx_tiles_16x64 = {
  .palette = 1,
  .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
  .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};
static inline void tiles_begin(void) { _tile_loadconfig(&amx_tiles_16x64); }

/* r[i] (16 dwords each) -> r[j] lane i = old r[i] lane j. */
static inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  /* u[4g + c], 128-bit lane L: rows 4g..4g+3 of column 4L + c */
  for (int g = 0; g < 4; ++g) {
    u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {  /* a 4 x 4 transpose of 128-bit lanes across u[c], u[4 + c], ... */
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

#endif
