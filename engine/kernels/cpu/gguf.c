/* GGUF weight blocks as they are in the file (engine/layers/quantization/gguf.py has the why):
   y = x W^T with W in Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 blocks of 32 weights along K (Q5's
   fifth bits in 4 bytes qh after the scales: bit j is weight j's; Q5_0 and Q5_1 are what
   llama.cpp writes for Q4_K and Q5_K tensors whose K is not a multiple of 256, as in most
   small models' Q4_K_M files), or IQ4_NL (fp16 d, 16 bytes of codes into a fixed grid of
   int8 values: what llama.cpp writes for IQ4_XS, Q3_K and Q2_K tensors whose K is not a
   multiple of 256; its values' dot products run as Q8_0's), or MXFP4 (an E8M0 byte, 16 bytes
   of e2m1 codes laid out as IQ4_NL's: gpt-oss's experts, 4.25 bits a weight; twice each value
   is an int8 in [-12, 12], so its dot products run as Q8_0's too), or NVFP4 (superblocks of 64:
   4 ue4m3 scale bytes, one per 16 values, then per 16 values 8 bytes of e2m1 codes, values 0-7
   in the low nibbles and 8-15 in the high ones: compressed-tensors' NVFP4 checkpoints repacked;
   a 32-value chunk of x spans two scales, applied per int32 lane). x is quantized per
   block of 32 to int8 with a float scale (llama.cpp's Q8_0/Q8_1 activations), each block's
   integer dot product is scaled in float. Three variants of the same arithmetic: scalar,
   AVX2 (maddubs) and AVX-512 VNNI (dpbusd, two blocks an instruction); gguf_isa picks one at
   run time (capped at what this build has), so the tests can force the slower ones. The
   superblocks of 256 (Q2_K..Q6_K, IQ4_XS) go to gguf_k.c from the entry points. */
#include "tessera_kernels.h"
#include "avx2_math.h"
#include "bf16_convert.h"
#include "f16_convert.h"
#include "iq4_values.h"
#include "fp4_values.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define ISA_MAX GGUF_ISA_VNNI
#elif defined(__AVX2__) && defined(__FMA__)
#define ISA_MAX GGUF_ISA_AVX2
#else
#define ISA_MAX GGUF_ISA_SCALAR
#endif

int gguf_isa = ISA_MAX;
int gguf_isa_max(void) { return ISA_MAX; }

static int block_bytes(int type) {
  switch (type) {
    case GGUF_Q4_0: return 18;
    case GGUF_Q4_1: return 20;
    case GGUF_Q5_0: return 22;
    case GGUF_Q5_1: return 24;
    case GGUF_Q8_0: return 34;
    case GGUF_IQ4_NL: return 18;
    case GGUF_MXFP4: return 17;
    case GGUF_NVFP4: return 36;  /* superblocks of 64 weights */
    case GGUF_Q4_K: return 144;  /* superblocks of 256 weights: gguf_k.c */
    case GGUF_Q5_K: return 176;
    case GGUF_Q6_K: return 210;
    case GGUF_IQ4_XS: return 136;
    case GGUF_Q2_K: return 84;
    case GGUF_Q3_K: return 110;
    default: return 0;
  }
}
static int superblocks(int type) {
  return type == GGUF_Q2_K || type == GGUF_Q3_K || type == GGUF_Q4_K || type == GGUF_Q5_K ||
         type == GGUF_Q6_K || type == GGUF_IQ4_XS;
}
int gguf_block_bytes(int type) { return block_bytes(type); }
/* NVFP4's scale bytes decoded once: ue4m3_half branches on subnormals, which mispredict where
   a row's scales straddle them (the dot kernels ran 4-5x slower than MXFP4's) */
static float UE4M3_HALF[256];
__attribute__((constructor)) static void fill_ue4m3_half(void) {
  for (int i = 0; i < 256; ++i) UE4M3_HALF[i] = ue4m3_half((uint8_t)i);
}
/* weights along K a block holds */
static int block_values(int type) {
  return superblocks(type) ? 256 : type == GGUF_NVFP4 ? 64 : 32;
}

/* The 4- and 5-bit types: where the nibbles start, the code's offset (w = d * (q - off)), and
   whether the block holds a minimum (w = d * q + m) */
static inline int qs_offset(int type) {
  return type == GGUF_MXFP4 ? 1 : type == GGUF_Q4_0 || type == GGUF_IQ4_NL ? 2
      : type == GGUF_Q4_1 ? 4 : type == GGUF_Q5_0 ? 6 : 8;
}
/* the int8 values of a block whose dot products run as Q8_0's (Q8_0: as stored; IQ4_NL and
   MXFP4: looked up) */
static inline int signed_values(int type) {
  return type == GGUF_Q8_0 || type == GGUF_IQ4_NL || type == GGUF_MXFP4;
}
/* a block's scale: float16 at its start, or MXFP4's E8M0 byte (halved: its values doubled) */
static inline float block_scale(int type, const uint8_t* blk) {
  return type == GGUF_MXFP4 ? e8m0_half(blk[0]) : h2f(blk);
}
static inline int code_offset(int type) {
  return type == GGUF_Q4_0 ? 8 : type == GGUF_Q5_0 ? 16 : 0;
}
static inline int has_min(int type) { return type == GGUF_Q4_1 || type == GGUF_Q5_1; }
static inline int has_qh(int type) { return type == GGUF_Q5_0 || type == GGUF_Q5_1; }
static inline uint32_t qh_bits(int type, const uint8_t* blk) {
  uint32_t h;
  memcpy(&h, blk + qs_offset(type) - 4, 4);
  return h;
}
/* code j of a 4- or 5-bit block, 0..31 (j < 32) */
static inline int code_at(int type, const uint8_t* blk, int j) {
  const uint8_t* q = blk + qs_offset(type);
  const int c = j < 16 ? q[j] & 15 : q[j - 16] >> 4;
  return has_qh(type) ? c | (int)((qh_bits(type, blk) >> j) & 1) << 4 : c;
}

/* One row of x -> int8 blocks q, a scale per block (d) and each block's sum of q. */
static void quantize_row(const void* x, int bf16, int64_t K, int8_t* q, float* d, int32_t* sum) {
  for (int64_t b = 0; b < K / 32; ++b) {
    float v[32], amax = 0.f;
    for (int j = 0; j < 32; ++j) {
      v[j] = bf16 ? bf2f(((const uint16_t*)x)[b * 32 + j]) : ((const float*)x)[b * 32 + j];
      amax = fmaxf(amax, fabsf(v[j]));
    }
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t s = 0;
    for (int j = 0; j < 32; ++j) {
      const int r = (int)nearbyintf(v[j] * inv);
      q[b * 32 + j] = (int8_t)r;
      s += r;
    }
    d[b] = amax / 127.f;
    sum[b] = s;
  }
}

/* ---- scalar ---- */
/* NVFP4: nb (x's blocks of 32) is even; each 16 values' integer sum times its own scale */
static float dot_scalar_nvfp4(const uint8_t* w, const int8_t* xq, const float* xd, int64_t nb) {
  float acc = 0.f;
  for (int64_t b = 0; b < nb; b += 2) {
    const uint8_t* blk = w + b / 2 * 36;
    for (int s = 0; s < 4; ++s) {
      const uint8_t* q = blk + 4 + 8 * s;
      const int8_t* x = xq + b * 32 + 16 * s;
      int32_t sum = 0;
      for (int j = 0; j < 8; ++j)
        sum += MXFP4_VALUES[q[j] & 15] * x[j] + MXFP4_VALUES[q[j] >> 4] * x[j + 8];
      acc += UE4M3_HALF[blk[s]] * xd[b + s / 2] * (float)sum;
    }
  }
  return acc;
}

static float dot_scalar(int type, const uint8_t* w, const int8_t* xq, const float* xd,
    const int32_t* xs, int64_t nb) {
  if (type == GGUF_NVFP4) return dot_scalar_nvfp4(w, xq, xd, nb);
  float acc = 0.f;
  const int bs = block_bytes(type);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bs;
    const int8_t* x = xq + b * 32;
    int32_t s = 0;
    if (type == GGUF_Q8_0) {
      const int8_t* q = (const int8_t*)(blk + 2);
      for (int j = 0; j < 32; ++j) s += q[j] * x[j];
      acc += h2f(blk) * xd[b] * (float)s;
    } else if (type == GGUF_IQ4_NL || type == GGUF_MXFP4) {
      const int8_t* values = type == GGUF_MXFP4 ? MXFP4_VALUES : IQ4_VALUES;
      for (int j = 0; j < 32; ++j) s += values[code_at(type, blk, j)] * x[j];
      acc += block_scale(type, blk) * xd[b] * (float)s;
    } else {
      for (int j = 0; j < 32; ++j) s += code_at(type, blk, j) * x[j];
      if (has_min(type)) acc += xd[b] * (h2f(blk) * (float)s + h2f(blk + 2) * (float)xs[b]);
      else acc += h2f(blk) * xd[b] * (float)(s - code_offset(type) * xs[b]);
    }
  }
  return acc;
}

#if ISA_MAX >= GGUF_ISA_AVX2
/* the 32 weights of a block as bytes: Q4 codes 0..15 (unsigned), Q8 as they are */
static inline __m256i q4_bytes(const uint8_t* qs) {
  const __m128i b = _mm_loadu_si128((const __m128i*)qs), m4 = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m4), _mm_and_si128(b, m4));
}
/* byte j = 16 where bit j of h is set: the Q5 codes' fifth bits (AVX2 only, so that every
   build runs, and tests, the instructions an AVX2-only CPU runs) */
static inline __m256i fifth_bits(uint32_t h) {
  const __m256i byte_of_bit = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
      2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);  /* in-lane: each lane has h's 4 bytes */
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)h), byte_of_bit), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(16));
}
/* a 4- or 5-bit block's 32 codes as unsigned bytes, in weight order */
static inline __m256i codes_bytes(int type, const uint8_t* blk) {
  const __m256i u = q4_bytes(blk + qs_offset(type));
  return has_qh(type) ? _mm256_or_si256(u, fifth_bits(qh_bits(type, blk))) : u;
}
/* a signed-values block's 32 int8 values, in weight order */
static inline __m256i signed_bytes(int type, const uint8_t* blk) {
  if (type == GGUF_Q8_0) return _mm256_loadu_si256((const __m256i*)(blk + 2));
  const __m256i codes = q4_bytes(blk + qs_offset(type));
  return type == GGUF_MXFP4 ? mxfp4_lookup(codes) : iq4_lookup(codes);
}
/* chunk c (0, 1) of an NVFP4 superblock: 32 int8 values in weight order. The 16 code bytes
   are sub-block A's 8 then B's 8; q4_bytes gives 64-bit lanes [A lo, B lo, A hi, B hi] (low
   nibbles: values 0-7, high: 8-15), the permute puts them as [A lo, A hi, B lo, B hi]. */
static inline __m256i nvfp4_values(const uint8_t* blk, int c) {
  return mxfp4_lookup(_mm256_permute4x64_epi64(q4_bytes(blk + 4 + 16 * c), 0xD8));
}
/* an 8-lane dot product's scales: lanes 0-3 hold sub-block A's sums, 4-7 B's */
static inline __m256 nvfp4_lane_scales(float a, float b) {
  return _mm256_setr_m128(_mm_set1_ps(a), _mm_set1_ps(b));
}
/* sum of u8 * s8 in 8 int32 lanes (pairs of int16 products cannot overflow: |u| <= 128) */
static inline __m256i dot_avx2(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#if ISA_MAX >= GGUF_ISA_VNNI
static inline __m256i dot_vnni256(__m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}
#endif

/* One block's integer dot product in 8 lanes; vnni selects the instruction. */
static inline __attribute__((always_inline)) __m256i block_dot(int type, int vnni,
    const uint8_t* blk, const int8_t* x) {
  __m256i u, s = _mm256_loadu_si256((const __m256i*)x);
  if (signed_values(type)) {
    const __m256i q = signed_bytes(type, blk);
    u = _mm256_sign_epi8(q, q);  /* |w| as unsigned, w's sign moved onto x */
    s = _mm256_sign_epi8(s, q);
  } else {
    u = codes_bytes(type, blk);
  }
#if ISA_MAX >= GGUF_ISA_VNNI
  if (vnni) return dot_vnni256(u, s);
#endif
  (void)vnni;
  return dot_avx2(u, s);
}

/* R rows of x (row m at xq + m * K, xd/xs + m * nb) against one weight row: each weight
   block is decoded once for all R; out[m] = the dot product. */
/* dot_vec for NVFP4: a superblock (two blocks of x) a 512-bit dpbusd, its 16 lanes scaled by
   their sub-blocks' scales; AVX2 a chunk of 32 at a time. nb is even. */
static inline __attribute__((always_inline)) void dot_vec_nvfp4(int vnni, int R,
    const uint8_t* w, const int8_t* xq, int64_t K, const float* xd, int64_t nb, float* out) {
  __m256 acc[4];
  for (int m = 0; m < R; ++m) acc[m] = _mm256_setzero_ps();
#if ISA_MAX >= GGUF_ISA_VNNI
  if (vnni) {
    __m512 acc2[4];
    for (int m = 0; m < R; ++m) acc2[m] = _mm512_setzero_ps();
    const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int64_t b = 0; b < nb; b += 2) {
      const uint8_t* blk = w + b / 2 * 36;
      const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(nvfp4_values(blk, 0)),
                                           nvfp4_values(blk, 1), 1);
      const __m512i u = _mm512_abs_epi8(q);  /* |w| as unsigned, w's sign moved onto x */
      const __mmask64 neg = _mm512_movepi8_mask(q);
      const float d[4] = {UE4M3_HALF[blk[0]], UE4M3_HALF[blk[1]], UE4M3_HALF[blk[2]],
                          UE4M3_HALF[blk[3]]};
      const __m512 wd = _mm512_permutexvar_ps(quarter, _mm512_castps128_ps512(_mm_loadu_ps(d)));
      for (int m = 0; m < R; ++m) {
        const float* dx = xd + m * nb;
        __m512i s = _mm512_loadu_si512((const void*)(xq + m * K + b * 32));
        s = _mm512_mask_sub_epi8(s, neg, _mm512_setzero_si512(), s);
        const __m512i dp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
        const __m512 xs2 = _mm512_insertf32x8(_mm512_set1_ps(dx[b]), _mm256_set1_ps(dx[b + 1]), 1);
        acc2[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), _mm512_mul_ps(wd, xs2), acc2[m]);
      }
    }
    for (int m = 0; m < R; ++m)
      out[m] = _mm512_reduce_add_ps(acc2[m]);
    return;
  }
#endif
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b / 2 * 36;
    const int c = (int)(b & 1);
    const __m256i q = nvfp4_values(blk, c);
    const __m256i u = _mm256_sign_epi8(q, q);
    const float da = UE4M3_HALF[blk[2 * c]], db = UE4M3_HALF[blk[2 * c + 1]];
    for (int m = 0; m < R; ++m) {
      const __m256i s = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)(xq + m * K + b * 32)), q);
      const __m256i dp = dot_avx2(u, s);
      const float dx = xd[m * nb + b];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp), nvfp4_lane_scales(da * dx, db * dx), acc[m]);
    }
  }
  for (int m = 0; m < R; ++m) out[m] = hsum8(acc[m]);
}

static inline __attribute__((always_inline)) void dot_vec(int type, int vnni, int R,
    const uint8_t* w, const int8_t* xq, int64_t K, const float* xd, const int32_t* xs,
    int64_t nb, float* out) {
  if (type == GGUF_NVFP4) {
    dot_vec_nvfp4(vnni, R, w, xq, K, xd, nb, out);
    return;
  }
  const int bs = block_bytes(type);
  __m256 acc[4];
  float extra[4];  /* the per-block offsets (Q4_0's -8, Q5_0's -16) or minimums, times sum(x) */
  for (int m = 0; m < R; ++m) { acc[m] = _mm256_setzero_ps(); extra[m] = 0.f; }
  int64_t b = 0;
#if ISA_MAX >= GGUF_ISA_VNNI
  if (vnni) {  /* two blocks a 512-bit dpbusd */
    __m512 acc2[4];
    for (int m = 0; m < R; ++m) acc2[m] = _mm512_setzero_ps();
    for (; b + 2 <= nb; b += 2) {
      const uint8_t* b0 = w + b * bs, *b1 = b0 + bs;
      __m512i u;
      __mmask64 neg = 0;
      if (signed_values(type)) {
        const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(signed_bytes(type, b0)),
                                             signed_bytes(type, b1), 1);
        u = _mm512_abs_epi8(q);  /* |w| as unsigned, w's sign moved onto x */
        neg = _mm512_movepi8_mask(q);
      } else {
        u = _mm512_inserti64x4(_mm512_castsi256_si512(codes_bytes(type, b0)), codes_bytes(type, b1), 1);
      }
      const float w0 = block_scale(type, b0), w1 = block_scale(type, b1);
      const float m0 = has_min(type) ? h2f(b0 + 2) : 0.f, m1 = has_min(type) ? h2f(b1 + 2) : 0.f;
      for (int m = 0; m < R; ++m) {
        const float* d = xd + m * nb;
        const int32_t* sx = xs + m * nb;
        __m512i s = _mm512_loadu_si512((const void*)(xq + m * K + b * 32));
        if (signed_values(type)) s = _mm512_mask_sub_epi8(s, neg, _mm512_setzero_si512(), s);
        const __m512i dp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
        const float d0 = w0 * d[b], d1 = w1 * d[b + 1];
        const __m512 scale = _mm512_insertf32x8(_mm512_set1_ps(d0), _mm256_set1_ps(d1), 1);
        acc2[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), scale, acc2[m]);
        if (code_offset(type)) extra[m] -= code_offset(type) * (d0 * sx[b] + d1 * sx[b + 1]);
        else if (has_min(type)) extra[m] += m0 * d[b] * sx[b] + m1 * d[b + 1] * sx[b + 1];
      }
    }
    for (int m = 0; m < R; ++m)
      acc[m] = _mm256_add_ps(_mm512_castps512_ps256(acc2[m]),
          _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc2[m]), 1)));
  }
#endif
  for (; b < nb; ++b) {
    const uint8_t* blk = w + b * bs;
    const float wd = block_scale(type, blk), wm = has_min(type) ? h2f(blk + 2) : 0.f;
    for (int m = 0; m < R; ++m) {
      const float d = wd * xd[m * nb + b];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(type, vnni, blk, xq + m * K + b * 32)),
                               _mm256_set1_ps(d), acc[m]);
      if (code_offset(type)) extra[m] -= code_offset(type) * d * xs[m * nb + b];
      else if (has_min(type)) extra[m] += wm * xd[m * nb + b] * xs[m * nb + b];
    }
  }
  for (int m = 0; m < R; ++m) out[m] = hsum8(acc[m]) + extra[m];
}
#endif

#define MAX_R 4  /* rows of x a weight row's blocks are decoded for at once */
typedef void (*dot_fn)(const uint8_t*, const int8_t*, int64_t, const float*, const int32_t*,
    int64_t, float*);
static inline __attribute__((always_inline)) void dot_scalar_rows(int type, int R,
    const uint8_t* w, const int8_t* xq, int64_t K, const float* xd, const int32_t* xs,
    int64_t nb, float* out) {
  for (int m = 0; m < R; ++m) out[m] = dot_scalar(type, w, xq + m * K, xd + m * nb, xs + m * nb, nb);
}
#define DEFINE_DOT(NAME, CALL)                                                              \
  static void NAME(const uint8_t* w, const int8_t* xq, int64_t K, const float* xd,          \
      const int32_t* xs, int64_t nb, float* out) { CALL; }
#define DEFINE_ROWS(SUFFIX, TYPE, CALLER, ...)                                              \
  DEFINE_DOT(dot_##SUFFIX##_1, CALLER(TYPE, __VA_ARGS__ 1, w, xq, K, xd, xs, nb, out))      \
  DEFINE_DOT(dot_##SUFFIX##_2, CALLER(TYPE, __VA_ARGS__ 2, w, xq, K, xd, xs, nb, out))      \
  DEFINE_DOT(dot_##SUFFIX##_3, CALLER(TYPE, __VA_ARGS__ 3, w, xq, K, xd, xs, nb, out))      \
  DEFINE_DOT(dot_##SUFFIX##_4, CALLER(TYPE, __VA_ARGS__ 4, w, xq, K, xd, xs, nb, out))      \
  static const dot_fn DOT_##SUFFIX[MAX_R] = {dot_##SUFFIX##_1, dot_##SUFFIX##_2,            \
      dot_##SUFFIX##_3, dot_##SUFFIX##_4};
DEFINE_ROWS(q4_0_s, GGUF_Q4_0, dot_scalar_rows, )
DEFINE_ROWS(q4_1_s, GGUF_Q4_1, dot_scalar_rows, )
DEFINE_ROWS(q5_0_s, GGUF_Q5_0, dot_scalar_rows, )
DEFINE_ROWS(q5_1_s, GGUF_Q5_1, dot_scalar_rows, )
DEFINE_ROWS(q8_0_s, GGUF_Q8_0, dot_scalar_rows, )
DEFINE_ROWS(iq4nl_s, GGUF_IQ4_NL, dot_scalar_rows, )
DEFINE_ROWS(mxfp4_s, GGUF_MXFP4, dot_scalar_rows, )
DEFINE_ROWS(nvfp4_s, GGUF_NVFP4, dot_scalar_rows, )
#if ISA_MAX >= GGUF_ISA_AVX2
DEFINE_ROWS(q4_0_a, GGUF_Q4_0, dot_vec, 0,)
DEFINE_ROWS(q4_1_a, GGUF_Q4_1, dot_vec, 0,)
DEFINE_ROWS(q5_0_a, GGUF_Q5_0, dot_vec, 0,)
DEFINE_ROWS(q5_1_a, GGUF_Q5_1, dot_vec, 0,)
DEFINE_ROWS(q8_0_a, GGUF_Q8_0, dot_vec, 0,)
DEFINE_ROWS(iq4nl_a, GGUF_IQ4_NL, dot_vec, 0,)
DEFINE_ROWS(mxfp4_a, GGUF_MXFP4, dot_vec, 0,)
DEFINE_ROWS(nvfp4_a, GGUF_NVFP4, dot_vec, 0,)
#endif
#if ISA_MAX >= GGUF_ISA_VNNI
DEFINE_ROWS(q4_0_v, GGUF_Q4_0, dot_vec, 1,)
DEFINE_ROWS(q4_1_v, GGUF_Q4_1, dot_vec, 1,)
DEFINE_ROWS(q5_0_v, GGUF_Q5_0, dot_vec, 1,)
DEFINE_ROWS(q5_1_v, GGUF_Q5_1, dot_vec, 1,)
DEFINE_ROWS(q8_0_v, GGUF_Q8_0, dot_vec, 1,)
DEFINE_ROWS(iq4nl_v, GGUF_IQ4_NL, dot_vec, 1,)
DEFINE_ROWS(mxfp4_v, GGUF_MXFP4, dot_vec, 1,)
DEFINE_ROWS(nvfp4_v, GGUF_NVFP4, dot_vec, 1,)
#endif

#define PICK(V)                                                                             \
  switch (type) {                                                                           \
    case GGUF_Q4_0: return DOT_q4_0_##V;                                                    \
    case GGUF_Q4_1: return DOT_q4_1_##V;                                                    \
    case GGUF_Q5_0: return DOT_q5_0_##V;                                                    \
    case GGUF_Q5_1: return DOT_q5_1_##V;                                                    \
    case GGUF_IQ4_NL: return DOT_iq4nl_##V;                                                 \
    case GGUF_MXFP4: return DOT_mxfp4_##V;                                                  \
    case GGUF_NVFP4: return DOT_nvfp4_##V;                                                  \
    default: return DOT_q8_0_##V;                                                           \
  }
static const dot_fn* pick(int type, int isa) {
  if (isa > ISA_MAX) isa = ISA_MAX;
#if ISA_MAX >= GGUF_ISA_VNNI
  if (isa >= GGUF_ISA_VNNI) PICK(v)
#endif
#if ISA_MAX >= GGUF_ISA_AVX2
  if (isa >= GGUF_ISA_AVX2) PICK(a)
#endif
  (void)isa;
  PICK(s)
}

#define ROWS_PER_TASK 16  /* output rows a parallel task takes */

int gguf_linear(const void* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int type,
    int64_t N, const void* bias, void* y, int64_t ldy, int bf16, int nthreads) {
  if (superblocks(type))
    return gguf_k_linear(x, ldx, M, K, w, type, N, bias, y, ldy, bf16, nthreads);
  const int bs = block_bytes(type);
  if (!bs || K % block_values(type) || M < 1) return -1;
  const int64_t nb = K / 32, rb = K / block_values(type) * bs;
  int8_t* xq = (int8_t*)malloc((size_t)M * K + (size_t)M * nb * 8);
  if (!xq) return -1;
  float* xd = (float*)(xq + M * K);  /* K % 32 == 0: aligned enough for floats */
  int32_t* xs = (int32_t*)(xd + M * nb);
  const size_t esize = bf16 ? 2 : 4;
  for (int64_t m = 0; m < M; ++m)
    quantize_row((const char*)x + m * ldx * esize, bf16, K, xq + m * K, xd + m * nb, xs + m * nb);
  const dot_fn* dot = pick(type, gguf_isa);
  const int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
  _Pragma("omp parallel for num_threads(nthreads) if(nthreads > 1) schedule(static)")
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t n1 = (t + 1) * ROWS_PER_TASK < N ? (t + 1) * ROWS_PER_TASK : N;
    for (int64_t n = t * ROWS_PER_TASK; n < n1; ++n) {
      const uint8_t* row = w + n * rb;
      const float b = bias ? (bf16 ? bf2f(((const uint16_t*)bias)[n]) : ((const float*)bias)[n]) : 0.f;
      for (int64_t m0 = 0; m0 < M; m0 += MAX_R) {
        const int R = M - m0 < MAX_R ? (int)(M - m0) : MAX_R;
        float v[MAX_R];
        dot[R - 1](row, xq + m0 * K, K, xd + m0 * nb, xs + m0 * nb, nb, v);
        for (int r = 0; r < R; ++r) {
          if (bf16) ((uint16_t*)y)[(m0 + r) * ldy + n] = f2bf(v[r] + b);
          else ((float*)y)[(m0 + r) * ldy + n] = v[r] + b;
        }
      }
    }
  }
  free(xq);
  return 0;
}

/* One row of K weights -> float32; -1 for a type this file and gguf_k.c do not read. */
int gguf_dequant_row(int type, const uint8_t* row, int64_t K, float* out) {
  if (superblocks(type))
    return gguf_k_dequant_row(type, row, K, out);
  const int bs = block_bytes(type);
  if (!bs || K % block_values(type)) return -1;
  if (type == GGUF_NVFP4) {  /* scale * value: exact in float32 (gguf-py's product) */
    for (int64_t b = 0; b < K / 64; ++b) {
      const uint8_t* blk = row + b * 36;
      for (int c = 0; c < 2; ++c) {
        float* v = out + b * 64 + c * 32;
        const float da = UE4M3_HALF[blk[2 * c]], db = UE4M3_HALF[blk[2 * c + 1]];
#if defined(__AVX512F__) && defined(__AVX512BW__)
        const __m256i q = nvfp4_values(blk, c);
        _mm512_storeu_ps(v, _mm512_mul_ps(_mm512_set1_ps(da), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)))));
        _mm512_storeu_ps(v + 16, _mm512_mul_ps(_mm512_set1_ps(db), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)))));
#else
        const uint8_t* qa = blk + 4 + 16 * c;
        for (int j = 0; j < 8; ++j) {
          v[j] = da * (float)MXFP4_VALUES[qa[j] & 15];
          v[j + 8] = da * (float)MXFP4_VALUES[qa[j] >> 4];
          v[j + 16] = db * (float)MXFP4_VALUES[qa[j + 8] & 15];
          v[j + 24] = db * (float)MXFP4_VALUES[qa[j + 8] >> 4];
        }
#endif
      }
    }
    return 0;
  }
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* blk = row + b * bs;
    const float d = block_scale(type, blk), mn = has_min(type) ? h2f(blk + 2) : 0.f;
    float* v = out + b * 32;
#if defined(__AVX512F__)
    if (type == GGUF_IQ4_NL || type == GGUF_MXFP4) {  /* d * value, as gguf-py: one rounding */
      const __m256i q = signed_bytes(type, blk);
      const __m512 dv = _mm512_set1_ps(d);
      _mm512_storeu_ps(v, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)))));
      _mm512_storeu_ps(v + 16, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)))));
      continue;
    }
    /* 32 weights in two vectors: the scalar loops below run ~5x slower (the AMX GEMM's
       large batches decode every weight once per call) */
    if (type == GGUF_Q8_0) {
      const __m256i q = _mm256_loadu_si256((const __m256i*)(blk + 2));
      const __m512 dv = _mm512_set1_ps(d);
      _mm512_storeu_ps(v, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)))));
      _mm512_storeu_ps(v + 16, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)))));
    } else {
      const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + qs_offset(type))));
      const __m512 dv = _mm512_set1_ps(d);
      const __m512 base = _mm512_set1_ps(has_min(type) ? mn : -(float)code_offset(type) * d);
      __m512i lo = _mm512_and_si512(q, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(q, 4);
      if (has_qh(type)) {  /* the fifth bits: weights 0..15 in h's low half, 16..31 high */
        const uint32_t h = qh_bits(type, blk);
        const __m512i sixteen = _mm512_set1_epi32(16);
        lo = _mm512_mask_or_epi32(lo, (__mmask16)(h & 0xFFFF), lo, sixteen);
        hi = _mm512_mask_or_epi32(hi, (__mmask16)(h >> 16), hi, sixteen);
      }
      _mm512_storeu_ps(v, _mm512_fmadd_ps(dv, _mm512_cvtepi32_ps(lo), base));
      _mm512_storeu_ps(v + 16, _mm512_fmadd_ps(dv, _mm512_cvtepi32_ps(hi), base));
    }
    continue;
#endif
    if (type == GGUF_Q8_0) {
      for (int j = 0; j < 32; ++j) v[j] = d * (float)((const int8_t*)(blk + 2))[j];
    } else if (type == GGUF_IQ4_NL || type == GGUF_MXFP4) {
      const int8_t* values = type == GGUF_MXFP4 ? MXFP4_VALUES : IQ4_VALUES;
      for (int j = 0; j < 32; ++j) v[j] = d * (float)values[code_at(type, blk, j)];
    } else {
      for (int j = 0; j < 32; ++j) v[j] = d * (float)(code_at(type, blk, j) - code_offset(type)) + mn;
    }
  }
  return 0;
}

/* out[i] = row ids[i] of w (N rows of K weights) as floats or bf16: an embedding's lookup on
   the file's blocks. -1: a type or K it does not read; -2: an id outside [0, N). */
int gguf_gather_rows(const uint8_t* w, int type, int64_t N, int64_t K, const int64_t* ids,
    int64_t n, void* out, int bf16) {
  const int bs = block_bytes(type);
  if (!bs) return -1;
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= N) return -2;
  const int64_t rb = K / block_values(type) * bs;
  float* v = (float*)malloc(sizeof(float) * K);
  if (!v) return -1;
  for (int64_t i = 0; i < n; ++i) {
    float* row = bf16 ? v : (float*)out + i * K;
    if (gguf_dequant_row(type, w + ids[i] * rb, K, row)) { free(v); return -1; }
    if (bf16) for (int64_t k = 0; k < K; ++k) ((uint16_t*)out)[i * K + k] = f2bf(v[k]);
  }
  free(v);
  return 0;
}

int gguf_dequantize(const uint8_t* w, int type, int64_t N, int64_t K, void* out, int bf16,
    int nthreads) {
  if (superblocks(type))
    return gguf_k_dequantize(w, type, N, K, out, bf16, nthreads);
  const int bs = block_bytes(type);
  if (!bs || K % block_values(type)) return -1;
  const int64_t rb = K / block_values(type) * bs;
  int failed = 0;
  _Pragma("omp parallel num_threads(nthreads) if(nthreads > 1) reduction(|:failed)")
  {
    float* v = bf16 ? (float*)malloc(sizeof(float) * K) : NULL;  /* a row, then rounded */
    if (bf16 && !v) failed = 1;
    _Pragma("omp for schedule(static)")
    for (int64_t n = 0; n < N; ++n) {
      if (failed) continue;
      float* row = bf16 ? v : (float*)out + n * K;
      if (gguf_dequant_row(type, w + n * rb, K, row)) { failed = 1; continue; }
      if (bf16) for (int64_t k = 0; k < K; ++k) ((uint16_t*)out)[n * K + k] = f2bf(v[k]);
    }
    free(v);
  }
  return failed ? -1 : 0;
}
