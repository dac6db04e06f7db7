/* w4 tiles (engine/kernels/cpu/w4.py's layout) dequantized to rows of bf16 or float32, for the
   GEMM of batches the w4 kernel does not take, where a layer holds nothing but its tiles (a
   GGUF file's Q4_0/Q4_1 blocks repacked: engine/gguf/w4.py). Plain C, any CPU; the
   compiler vectorizes the inner loops. */
#include "tessera_kernels.h"
#include "bf16_convert.h"
#include "f16_convert.h"

#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* Each group of a tile: 8 chunks of 32 bytes (chunk c, byte 2r + j: row r's code for
   k = 4c + j in the low nibble, 4c + 2 + j in the high one), 16 float16 scales, 16 minimums.
   s * q is exact in float32 (an 11-bit mantissa times 4 bits), so fused or not the values
   are cpu_w4.dequantize's. */
int w4_dequantize(const uint8_t* w, int64_t N, int64_t K, void* out, int bf16, int nthreads) {
  if (N < 0 || K % 32) return -1;
  const int64_t groups = K / 32, tiles = (N + W4_TILE - 1) / W4_TILE;
  _Pragma("omp parallel for num_threads(nthreads) if(nthreads > 1) schedule(static)")
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = w + (t * groups + g) * W4_GROUP_BYTES;
      for (int r = 0; r < W4_TILE; ++r) {
        const int64_t n = t * W4_TILE + r;
        if (n >= N) break;
        const float s = h2f(p + 256 + 2 * r), m = h2f(p + 288 + 2 * r);
        float v[32];
        for (int c = 0; c < 8; ++c) {
          for (int j = 0; j < 2; ++j) {
            const uint8_t b = p[32 * c + 2 * r + j];
            v[4 * c + j] = s * (float)(b & 15) + m;
            v[4 * c + 2 + j] = s * (float)(b >> 4) + m;
          }
        }
        const int64_t o = n * K + g * 32;
        if (bf16) {
          for (int k = 0; k < 32; ++k) ((uint16_t*)out)[o + k] = f2bf(v[k]);
        } else {
          memcpy((float*)out + o, v, sizeof v);
        }
      }
    }
  }
  return 0;
}
