/* GGUF's K-quants as they are in the file: Q2_K, Q3_K, Q4_K, Q5_K and Q6_K, superblocks of
   256 weights along K in ggml's layouts (gguf-py's numpy dequantizers are the reference):
     Q2_K (84 bytes): 16 bytes of 4-bit scale and min per sub-block of 16, 64 bytes of 2-bit
       codes (weight 128h + 32t + l: bits 2t of byte 32h + l), fp16 d, fp16 dmin;
       w = d * sc_i * q - dmin * m_i.
     Q3_K (110 bytes): 32 bytes hmask (bit k of byte l: weight 32k + l's third bit), Q2_K's 64
       bytes of low bits, 12 bytes of 6-bit scales of sub-blocks of 16, fp16 d;
       w = d * (sc_i - 32) * (q - 4), q 0..7 (hmask's bit set: 4 more).
     Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks
       of 32, 128 bytes of 4-bit codes (a 32-byte run holds sub-block 2j's low nibbles and
       2j+1's high ones); w = d * sc_j * q - dmin * m_j.
     Q5_K (176 bytes): Q4_K's head, 32 bytes qh (bit j of byte l: sub-block j's 5th bit of
       weight l), then the 128 bytes of low nibbles.
     Q6_K (210 bytes): 128 bytes ql (low nibbles), 64 bytes qh (2 bits each), 16 int8 scales
       of sub-blocks of 16, fp16 d; w = d * sc_i * (q - 32).
     IQ4_XS (136 bytes): fp16 d, 2 bytes of the sub-blocks' scales' high 2 bits, 4 bytes of
       their low 4 bits, then 16 bytes of codes per sub-block of 32 (low nibbles weights
       0-15, high 16-31); w = (d * (ls_j - 32)) * IQ4_VALUES[q]. The AVX2 variant multiplies
       the values as Q8_0's (|w| against x with w's sign); VNNI takes value + 128 (unsigned)
       and the -128 as Q4_K's minimum.
   gguf.c's entry points dispatch here for these types. The arithmetic is gguf.c's: x is
   quantized per block of 32 to int8 with a float scale, and each block's integer dot product
   with the codes is scaled in float. Q4_K/Q5_K sub-blocks line up with x's blocks, their
   minimum takes x's block sum; Q6_K's sub-blocks of 16 take x's sums per 16 for the -32, as
   Q3_K's for the -4 and Q2_K's for their minimums.
   Variants: scalar, AVX2 (maddubs) and AVX-512 VNNI (dpbusd, two sub-blocks of 32 an
   instruction), picked by gguf.c's gguf_isa, so the tests can force the slower ones.
   Each superblock's codes are decoded once for up to MAX_R rows of x. The dequantizer
   (gguf_k_dequant_row: the large-batch path's rows) has the same three variants, equal to
   the bit. */
#include "tessera_kernels.h"
#include "avx2_math.h"
#include "bf16_convert.h"
#include "f16_convert.h"
#include "avx512_math.h"
#include "iq4_values.h"

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

#define QK 256     /* weights a superblock */
#define MAX_R 4    /* rows of x a superblock's codes are decoded for at once */
#define ROWS_PER_TASK 16

static int sb_bytes(int type) {
  switch (type) {
    case GGUF_Q4_K: return 144;
    case GGUF_Q5_K: return 176;
    case GGUF_Q6_K: return 210;
    case GGUF_Q2_K: return 84;
    case GGUF_Q3_K: return 110;
    case GGUF_IQ4_XS: return 136;
    default: return 0;
  }
}

/* Q4_K/Q5_K's 12 scale bytes -> out[0..7] the sub-blocks' scales, out[8..15] their mins */
static inline void k4_scales(const uint8_t* s, uint8_t out[16]) {
  uint32_t u[4];
  memcpy(u, s, 12);
  const uint32_t k1 = 0x3f3f3f3fu, k2 = 0x0f0f0f0fu, k3 = 0x03030303u;
  u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
  const uint32_t mins_lo = u[1] & k1;
  u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
  u[2] = mins_lo;
  u[0] &= k1;
  memcpy(out, u, 16);
}

/* the types with sub-blocks of 16 (x's sums per 16 take their offsets), and the offset their
   codes carry (w = scale * (q - offset)); Q2_K's minimums are per sub-block instead */
static inline int sub16(int type) {
  return type == GGUF_Q6_K || type == GGUF_Q3_K || type == GGUF_Q2_K;
}
static inline int offset16(int type) {
  return type == GGUF_Q6_K ? 32 : type == GGUF_Q3_K ? 4 : 0;
}

/* Q6_K, Q3_K, Q2_K: the 16 sub-blocks' scales (d * sc, as gguf-py: exact) and minimums
   (Q2_K's dmin * m; 0 for the others) */
static inline __attribute__((always_inline)) void k16_scales(int type, const uint8_t* b,
    float sc[16], float mn[16]) {
  if (type == GGUF_Q6_K) {
    const float d = h2f(b + 208);
    for (int i = 0; i < 16; ++i) { sc[i] = d * (float)((const int8_t*)(b + 192))[i]; mn[i] = 0.f; }
  } else if (type == GGUF_Q3_K) {
    const float d = h2f(b + 108);
    for (int i = 0; i < 16; ++i) {
      const int lo = (b[96 + i % 8] >> (4 * (i / 8))) & 15;
      const int hi = (b[96 + 8 + i % 4] >> (2 * (i / 4))) & 3;
      sc[i] = d * (float)((lo | hi << 4) - 32);
      mn[i] = 0.f;
    }
  } else {
    const float d = h2f(b + 80), dmin = h2f(b + 82);
    for (int i = 0; i < 16; ++i) { sc[i] = d * (float)(b[i] & 15); mn[i] = dmin * (float)(b[i] >> 4); }
  }
}

/* IQ4_XS: sub-block j's scale, ls_j - 32 (-32..31) */
static inline int iq4xs_scale(const uint8_t* b, int j) {
  const int lo = (b[4 + j / 2] >> (4 * (j & 1))) & 15;
  const int hi = ((b[2] | b[3] << 8) >> (2 * j)) & 3;
  return (lo | hi << 4) - 32;
}

/* One superblock's codes in weight order: Q4_K 0..15, Q5_K 0..31, Q6_K 0..63 (before -32),
   IQ4_XS 0..15 (indices into IQ4_VALUES), Q2_K 0..3, Q3_K 0..7 (before -4) */
static void decode_codes(int type, const uint8_t* b, uint8_t q[QK]) {
  if (type == GGUF_Q2_K || type == GGUF_Q3_K) {
    const uint8_t* qs = b + (type == GGUF_Q3_K ? 32 : 16);
    for (int w = 0; w < QK; ++w) {
      const int h = w / 128, t = (w / 32) % 4, l = w % 32;
      q[w] = (qs[32 * h + l] >> (2 * t)) & 3;
      if (type == GGUF_Q3_K) q[w] |= ((b[l] >> (w / 32)) & 1) << 2;
    }
    return;
  }
  if (type == GGUF_IQ4_XS) {
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 16; ++l) {
        q[32 * j + l] = b[8 + 16 * j + l] & 15;
        q[32 * j + 16 + l] = b[8 + 16 * j + l] >> 4;
      }
    return;
  }
  if (type == GGUF_Q6_K) {
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = b + 64 * h, *qh = b + 128 + 32 * h;
      uint8_t* o = q + 128 * h;
      for (int l = 0; l < 32; ++l) {
        o[l] = (ql[l] & 15) | ((qh[l] & 3) << 4);
        o[l + 32] = (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4);
        o[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
        o[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
      }
    }
    return;
  }
  const uint8_t* qs = b + (type == GGUF_Q5_K ? 48 : 16), *qh = b + 16;
  for (int j = 0; j < 8; ++j)
    for (int l = 0; l < 32; ++l) {
      uint8_t c = (qs[(j / 2) * 32 + l] >> (4 * (j & 1))) & 15;
      if (type == GGUF_Q5_K) c |= ((qh[l] >> j) & 1) << 4;
      q[j * 32 + l] = c;
    }
}

/* The float weights, each as gguf-py computes it ((d * sc) * q - dmin * m): every product of
   an fp16 and these small integers is exact in float32, so FMA contraction or reassociation
   under -ffast-math cannot change a bit. */
static void dequant_sb(int type, const uint8_t* b, float* out) {
  uint8_t q[QK];
  decode_codes(type, b, q);
  if (type == GGUF_Q2_K || type == GGUF_Q3_K) {  /* (d * sc) * q exact; then - dmin * m */
    float sc[16], mn[16];
    k16_scales(type, b, sc, mn);
    for (int w = 0; w < QK; ++w) out[w] = sc[w / 16] * (float)(q[w] - offset16(type)) - mn[w / 16];
    return;
  }
  if (type == GGUF_IQ4_XS) {  /* (d * scale) exact in float32, times the value: one rounding */
    const float d = h2f(b);
    for (int j = 0; j < 8; ++j) {
      const float dl = d * (float)iq4xs_scale(b, j);
      for (int l = 0; l < 32; ++l) out[32 * j + l] = dl * (float)IQ4_VALUES[q[32 * j + l]];
    }
    return;
  }
  if (type == GGUF_Q6_K) {
    const float d = h2f(b + 208);
    const int8_t* sc = (const int8_t*)(b + 192);
    for (int i = 0; i < 16; ++i) {
      const float ds = d * (float)sc[i];
      for (int l = 0; l < 16; ++l) out[16 * i + l] = ds * (float)((int)q[16 * i + l] - 32);
    }
    return;
  }
  const float d = h2f(b), dmin = h2f(b + 2);
  uint8_t sm[16];
  k4_scales(b + 4, sm);
  for (int j = 0; j < 8; ++j) {
    const float ds = d * (float)sm[j], dm = dmin * (float)sm[8 + j];
    for (int l = 0; l < 32; ++l) out[32 * j + l] = ds * (float)q[32 * j + l] - dm;
  }
}

/* ---- x, quantized as gguf.c's quantize_row does (the same codes and scales), with more
   per block: per row q[K], and per block of 32 its scale d and d * sum(q) (the Q4_K/Q5_K
   minimums' term); per 16, the block's scale again and sum(q) (Q6_K's -32) ---- */
typedef struct {
  const int8_t* q;
  const float *d, *dsum, *d16, *sum16;
  int64_t K, nb;  /* row strides: q K, d/dsum nb, d16/sum16 2 nb */
} xrows;

static void quantize_row(const void* x, int bf16, int64_t K, int8_t* q, float* d, float* dsum,
    float* d16, float* sum16) {
  for (int64_t b = 0; b < K / 32; ++b) {
    float v[32], amax = 0.f;
    for (int j = 0; j < 32; ++j) {
      v[j] = bf16 ? bf2f(((const uint16_t*)x)[b * 32 + j]) : ((const float*)x)[b * 32 + j];
      amax = fmaxf(amax, fabsf(v[j]));
    }
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t s[2] = {0, 0};
    for (int j = 0; j < 32; ++j) {
      const int r = (int)nearbyintf(v[j] * inv);
      q[b * 32 + j] = (int8_t)r;
      s[j / 16] += r;
    }
    d[b] = amax / 127.f;
    dsum[b] = d[b] * (float)(s[0] + s[1]);
    d16[2 * b] = d16[2 * b + 1] = d[b];
    sum16[2 * b] = (float)s[0];
    sum16[2 * b + 1] = (float)s[1];
  }
}

/* ---- scalar ---- */
static inline __attribute__((always_inline)) void dot_scalar(int type, int R, const uint8_t* w,
    int64_t nsb, const xrows* X, float* out) {
  const int bs = sb_bytes(type);
  float acc[MAX_R] = {0.f};
  uint8_t q[QK];
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* b = w + s * bs;
    decode_codes(type, b, q);
    for (int r = 0; r < R; ++r) {
      const int8_t* x = X->q + r * X->K + s * QK;
      if (type == GGUF_IQ4_XS) {
        const float* xd = X->d + r * X->nb + s * 8;
        for (int j = 0; j < 8; ++j) {
          int32_t isum = 0;
          for (int l = 0; l < 32; ++l) isum += IQ4_VALUES[q[32 * j + l]] * x[32 * j + l];
          acc[r] += h2f(b) * (float)iq4xs_scale(b, j) * xd[j] * (float)isum;
        }
      } else if (sub16(type)) {
        float sc[16], mn[16];
        k16_scales(type, b, sc, mn);
        const float* d16 = X->d16 + r * 2 * X->nb + s * 16, *s16 = X->sum16 + r * 2 * X->nb + s * 16;
        for (int i = 0; i < 16; ++i) {
          int32_t isum = 0;
          for (int l = 0; l < 16; ++l) isum += q[16 * i + l] * x[16 * i + l];
          acc[r] += sc[i] * d16[i] * ((float)isum - (float)offset16(type) * s16[i]) -
                    mn[i] * d16[i] * s16[i];
        }
      } else {
        const float d = h2f(b), dmin = h2f(b + 2);
        uint8_t sm[16];
        k4_scales(b + 4, sm);
        const float* xd = X->d + r * X->nb + s * 8, *xds = X->dsum + r * X->nb + s * 8;
        for (int j = 0; j < 8; ++j) {
          int32_t isum = 0;
          for (int l = 0; l < 32; ++l) isum += q[32 * j + l] * x[32 * j + l];
          acc[r] += d * (float)sm[j] * xd[j] * (float)isum - dmin * (float)sm[8 + j] * xds[j];
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

#if ISA_MAX >= GGUF_ISA_AVX2
/* sum of u8 * s8 in 8 int32 lanes of 4 neighbours each (codes <= 63, |x| <= 127: the int16
   pair sums of maddubs cannot saturate) */
static inline __m256i dot_avx2(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* One superblock's codes as 8 runs of 32 bytes (sub-blocks of 32, weight order). */
static inline __attribute__((always_inline)) void decode_vec(int type, const uint8_t* b,
    __m256i u[8]) {
  const __m256i m4 = _mm256_set1_epi8(15);
  if (type == GGUF_Q2_K || type == GGUF_Q3_K) {  /* run k: bits 2(k % 4) of bytes 32(k / 4).. */
    const uint8_t* qs = b + (type == GGUF_Q3_K ? 32 : 16);
    const __m256i m2 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    const __m256i hm = _mm256_loadu_si256((const __m256i*)b);
    for (int k = 0; k < 8; ++k) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * (k / 4)));
      __m256i c = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * (k % 4))), m2);
      if (type == GGUF_Q3_K)  /* hmask's bit k, as 4 */
        c = _mm256_or_si256(c, _mm256_slli_epi16(
            _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128(k)), one), 2));
      u[k] = c;
    }
    return;
  }
  if (type == GGUF_IQ4_XS) {  /* the values themselves, signed */
    const __m128i m4x = _mm_set1_epi8(15);
    for (int j = 0; j < 8; ++j) {
      const __m128i v = _mm_loadu_si128((const __m128i*)(b + 8 + 16 * j));
      u[j] = iq4_lookup(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4x),
                                         _mm_and_si128(v, m4x)));
    }
    return;
  }
  if (type == GGUF_Q6_K) {
    const __m256i m30 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m256i qa = _mm256_loadu_si256((const __m256i*)(b + 64 * h));
      const __m256i qb = _mm256_loadu_si256((const __m256i*)(b + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h));
      /* 16-bit shifts move bits within each byte's 2-bit field here (masked after) */
      u[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(qa, m4),
                                     _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
      u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(qb, m4),
                                     _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
      u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), m4),
                                     _mm256_and_si256(qh, m30));
      u[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), m4),
                                     _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
    }
    return;
  }
  const uint8_t* qs = b + (type == GGUF_Q5_K ? 48 : 16);
  __m256i qh = type == GGUF_Q5_K ? _mm256_loadu_si256((const __m256i*)(b + 16)) : _mm256_setzero_si256();
  const __m256i bit4 = _mm256_set1_epi8(16);
  for (int j = 0; j < 4; ++j) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * j));
    __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if (type == GGUF_Q5_K) {  /* bits 2j and 2j+1 of qh, moved to bit 4 (qh shifts by 2 a pair) */
      lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(qh, 4), bit4));
      hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(qh, 3), bit4));
      qh = _mm256_srli_epi16(qh, 2);
    }
    u[2 * j] = lo;
    u[2 * j + 1] = hi;
  }
}

/* Q4_K/Q5_K: d * sc and dmin * m per sub-block as floats. k4_scales in SSE registers (its
   dword lanes L0 L1 L2 = the 12 bytes): a scalar unpack stored to memory and loaded back as
   one vector stalls on store forwarding, about half of a 1-row superblock's time. */
static inline void k4_scales_vec(const uint8_t* b, __m256* dsc, __m256* dm) {
  const __m128i v = _mm_loadu_si128((const __m128i*)(b + 4));  /* 12 bytes + 4 of the codes */
  const __m128i a = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0));  /* L0 L2 L1 L2 */
  const __m128i c = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0));  /* L0 L0 L1 L1 */
  const __m128i as = _mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 0, 4));
  const __m128i lo = _mm_and_si128(as, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  const __m128i hi = _mm_and_si128(_mm_slli_epi32(_mm_srli_epi32(c, 6), 4),
                                   _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  const __m128i sm = _mm_or_si128(lo, hi);  /* bytes 0-7 the scales, 8-15 the mins */
  *dsc = _mm256_mul_ps(_mm256_set1_ps(h2f(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)));
  *dm = _mm256_mul_ps(_mm256_set1_ps(h2f(b + 2)),
                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
}

/* IQ4_XS: d * scale per sub-block, and 128 times that (the unsigned values' offset) */
static inline void iq4xs_scales_vec(const uint8_t* b, __m256* dsc, __m256* dm) {
  const __m256i ls = _mm256_setr_epi32(iq4xs_scale(b, 0), iq4xs_scale(b, 1), iq4xs_scale(b, 2),
      iq4xs_scale(b, 3), iq4xs_scale(b, 4), iq4xs_scale(b, 5), iq4xs_scale(b, 6), iq4xs_scale(b, 7));
  *dsc = _mm256_mul_ps(_mm256_set1_ps(h2f(b)), _mm256_cvtepi32_ps(ls));
  *dm = _mm256_mul_ps(*dsc, _mm256_set1_ps(128.f));
}

/* Q3_K: d * (sc - 32) for the 16 sub-blocks, as two vectors of 8 (k16_scales' unpack in one
   register: low nibbles of bytes 0-7 then their high ones; 2 bits of bytes 8-11, shifted by
   2 per group of 4) */
static inline void k3_scales_vec(const uint8_t* b, __m256* lo, __m256* hi) {
  const __m128i l8 = _mm_loadl_epi64((const __m128i*)(b + 96));
  const __m128i m4 = _mm_set1_epi8(15);
  const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(l8, m4), _mm_and_si128(_mm_srli_epi16(l8, 4), m4));
  int32_t h;
  memcpy(&h, b + 104, 4);
  const __m128i high = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(h), _mm_setr_epi32(0, 2, 4, 6)),
                                     _mm_set1_epi8(3));
  const __m128i sc = _mm_or_si128(low, _mm_slli_epi16(high, 4));  /* bytes: 6-bit scales */
  const __m256i off = _mm256_set1_epi32(32);
  const __m256 d = _mm256_set1_ps(h2f(b + 108));
  *lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(sc), off)));
  *hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(sc, 8)), off)));
}

/* Q6_K: d * sc for the 16 sub-blocks, as two vectors of 8 */
static inline void k6_scales_vec(const uint8_t* b, __m256* lo, __m256* hi) {
  const __m128i v = _mm_loadu_si128((const __m128i*)(b + 192));
  const __m256 d = _mm256_set1_ps(h2f(b + 208));
  *lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
  *hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))));
}

/* 8 floats to out (float32) or outb (bf16, rounded as f2bf: to nearest even) */
static inline void store8(float* out, uint16_t* outb, int64_t o, __m256 v) {
  if (!outb) {
    _mm256_storeu_ps(out + o, v);
    return;
  }
  __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);
  _mm_storeu_si128((__m128i*)(outb + o), _mm256_castsi256_si128(packed));
}

/* dequant_sb in vectors, 8 weights an instruction: the same products, each exact (so the
   same bits whether or not the compiler fuses the subtraction) */
static void dequant_sb_vec(int type, const uint8_t* b, float* out, uint16_t* outb) {
  __m256i u[8];
  decode_vec(type, b, u);
  __m256 s0, s1;  /* Q6_K: d * sc of sub-blocks 0-7, 8-15; else d * sc, dmin * m */
  if (type == GGUF_Q6_K) k6_scales_vec(b, &s0, &s1);
  else k4_scales_vec(b, &s0, &s1);
  for (int j = 0; j < 8; ++j) {
    const __m128i h[2] = {_mm256_castsi256_si128(u[j]), _mm256_extracti128_si256(u[j], 1)};
    for (int t = 0; t < 4; ++t) {
      const __m128i c = t & 1 ? _mm_srli_si128(h[t / 2], 8) : h[t / 2];
      const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c));
      __m256 v;
      if (type == GGUF_Q6_K) {  /* sub-block of 16: 2j + t / 2 */
        const int i = 2 * j + t / 2;
        const __m256 ds = _mm256_permutevar8x32_ps(i < 8 ? s0 : s1, _mm256_set1_epi32(i & 7));
        v = _mm256_mul_ps(ds, _mm256_sub_ps(q, _mm256_set1_ps(32.f)));
      } else {
        const __m256i jj = _mm256_set1_epi32(j);
        v = _mm256_sub_ps(_mm256_mul_ps(_mm256_permutevar8x32_ps(s0, jj), q),
                          _mm256_permutevar8x32_ps(s1, jj));
      }
      store8(out, outb, 32 * j + 8 * t, v);
    }
  }
}

/* Q2_K, Q3_K, IQ4_XS in vectors (AVX2 for both variants): decode_vec's runs, 8 weights at a
   time against their sub-block's scale (and minimum) from the scalar unpack. Each product of
   a scale and a code is exact in float32 as in dequant_sb, so the bits are the same. */
static void dequant_sb_small(int type, const uint8_t* b, float* out, uint16_t* outb) {
  __m256i u[8];
  decode_vec(type, b, u);
  float sc[16], mn[16];
  if (type == GGUF_IQ4_XS) {
    for (int j = 0; j < 8; ++j) sc[j] = h2f(b) * (float)iq4xs_scale(b, j);
  } else {
    k16_scales(type, b, sc, mn);
  }
  const __m256 off = _mm256_set1_ps((float)offset16(type));
  for (int k = 0; k < 8; ++k) {
    const __m128i h[2] = {_mm256_castsi256_si128(u[k]), _mm256_extracti128_si256(u[k], 1)};
    for (int t = 0; t < 4; ++t) {
      const __m128i c = t & 1 ? _mm_srli_si128(h[t / 2], 8) : h[t / 2];
      __m256 v;
      if (type == GGUF_IQ4_XS) {  /* signed values, the 32-block's scale */
        v = _mm256_mul_ps(_mm256_set1_ps(sc[k]), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)));
      } else {
        const int i = 2 * k + t / 2;  /* the sub-block of 16 */
        const __m256 q = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c)), off);
        v = _mm256_mul_ps(_mm256_set1_ps(sc[i]), q);
        if (type == GGUF_Q2_K) v = _mm256_sub_ps(v, _mm256_set1_ps(mn[i]));
      }
      store8(out, outb, 32 * k + 8 * t, v);
    }
  }
}

/* ---- AVX2: a sub-block of 32 an instruction; the per-lane scales are lanes of the
   per-superblock scale vector, spread with permutevar8x32 ---- */
static inline __attribute__((always_inline)) void dot_avx2_rows(int type, int R,
    const uint8_t* w, int64_t nsb, const xrows* X, float* out) {
  const int bs = sb_bytes(type);
  __m256 acc[MAX_R], off[MAX_R];
  for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); off[r] = _mm256_setzero_ps(); }
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* b = w + s * bs;
    __m256i u[8];
    decode_vec(type, b, u);
    if (type == GGUF_IQ4_XS) {
      __m256 dsc, dm;
      iq4xs_scales_vec(b, &dsc, &dm);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = X->q + r * X->K + s * QK;
        const __m256 sc8 = _mm256_mul_ps(dsc, _mm256_loadu_ps(X->d + r * X->nb + s * 8));
        for (int j = 0; j < 8; ++j) {  /* |w| against x with w's sign: maddubs cannot saturate */
          const __m256i xs = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)(x + 32 * j)), u[j]);
          const __m256i dp = dot_avx2(_mm256_sign_epi8(u[j], u[j]), xs);
          const __m256 sc = _mm256_permutevar8x32_ps(sc8, _mm256_set1_epi32(j));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp), sc, acc[r]);
        }
      }
    } else if (sub16(type)) {  /* sub-blocks of 16 */
      __m256 slo, shi, olo, ohi;  /* olo/ohi: what x's sums per 16 take */
      if (type == GGUF_Q2_K) {
        float sc[16], mn[16];
        k16_scales(type, b, sc, mn);
        slo = _mm256_loadu_ps(sc); shi = _mm256_loadu_ps(sc + 8);
        olo = _mm256_loadu_ps(mn); ohi = _mm256_loadu_ps(mn + 8);
      } else {  /* the scales themselves, for the offset (times 32 or 4 at the end) */
        if (type == GGUF_Q6_K) k6_scales_vec(b, &slo, &shi);
        else k3_scales_vec(b, &slo, &shi);
        olo = slo;
        ohi = shi;
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* x = X->q + r * X->K + s * QK;
        const float* d16 = X->d16 + r * 2 * X->nb + s * 16, *s16 = X->sum16 + r * 2 * X->nb + s * 16;
        const __m256 d16lo = _mm256_loadu_ps(d16), d16hi = _mm256_loadu_ps(d16 + 8);
        const __m256 lo = _mm256_mul_ps(slo, d16lo), hi = _mm256_mul_ps(shi, d16hi);
        off[r] = _mm256_fmadd_ps(_mm256_mul_ps(olo, d16lo), _mm256_loadu_ps(s16), off[r]);
        off[r] = _mm256_fmadd_ps(_mm256_mul_ps(ohi, d16hi), _mm256_loadu_ps(s16 + 8), off[r]);
        for (int k = 0; k < 8; ++k) {  /* lanes 0-3: sub-block 2k of 16, 4-7: 2k+1 */
          const int i = 2 * (k & 3);
          const __m256i idx = _mm256_setr_epi32(i, i, i, i, i + 1, i + 1, i + 1, i + 1);
          const __m256 sc8 = _mm256_permutevar8x32_ps(k < 4 ? lo : hi, idx);
          const __m256i dp = dot_avx2(u[k], _mm256_loadu_si256((const __m256i*)(x + 32 * k)));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp), sc8, acc[r]);
        }
      }
    } else {
      __m256 dsc, dm;
      k4_scales_vec(b, &dsc, &dm);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = X->q + r * X->K + s * QK;
        const __m256 sc8 = _mm256_mul_ps(dsc, _mm256_loadu_ps(X->d + r * X->nb + s * 8));
        off[r] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(X->dsum + r * X->nb + s * 8), off[r]);
        for (int j = 0; j < 8; ++j) {
          const __m256 sc = _mm256_permutevar8x32_ps(sc8, _mm256_set1_epi32(j));
          const __m256i dp = dot_avx2(u[j], _mm256_loadu_si256((const __m256i*)(x + 32 * j)));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp), sc, acc[r]);
        }
      }
    }
  }
  /* off: Q6_K's and Q3_K's scaled sums of x per 16, for their offsets; else the minimums */
  const float k = type == GGUF_Q6_K || type == GGUF_Q3_K ? (float)offset16(type) : 1.f;
  for (int r = 0; r < R; ++r) out[r] = hsum8(acc[r]) - k * hsum8(off[r]);
}
#endif

#if ISA_MAX >= GGUF_ISA_VNNI
/* ---- AVX-512 VNNI: two sub-blocks of 32 a dpbusd; each lane's float scale is picked from
   the superblock's scales (d * sc * x's scale, one vector per row) with permutexvar ---- */
/* One superblock's codes as 4 pairs of sub-blocks of 32 (decode_vec's runs 2p, 2p+1), built
   in 512-bit registers: a run of 32 bytes broadcast to both halves and shifted per half
   takes fewer instructions than two 256-bit halves joined. */
static inline __attribute__((always_inline)) void decode_vec512(int type, const uint8_t* b,
    __m512i u[4]) {
  const __m512i m4 = _mm512_set1_epi8(15);
  if (type == GGUF_IQ4_XS) {  /* value + 128 (the int8 values with their sign bit flipped) */
    const __m512i table = _mm512_xor_si512(
        _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)IQ4_VALUES)), _mm512_set1_epi8(-128));
    const __m256i m4y = _mm256_set1_epi8(15);
    for (int p = 0; p < 4; ++p) {  /* sub-blocks 2p, 2p+1: [2p lo | 2p+1 lo], [.. hi ..] */
      const __m256i v = _mm256_loadu_si256((const __m256i*)(b + 8 + 32 * p));
      const __m256i lo = _mm256_and_si256(v, m4y), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4y);
      const __m512i codes = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_permute2x128_si256(lo, hi, 0x20)),
          _mm256_permute2x128_si256(lo, hi, 0x31), 1);
      u[p] = _mm512_shuffle_epi8(table, codes);
    }
    return;
  }
  if (type == GGUF_Q6_K) {
    const __m512i m30 = _mm512_set1_epi8(0x30);
    const __m512i sh_lo = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i sh_hi = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    for (int h = 0; h < 2; ++h) {
      const __m512i q = _mm512_loadu_si512((const void*)(b + 64 * h));  /* ql runs a | b */
      const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h)));
      u[2 * h] = _mm512_or_si512(_mm512_and_si512(q, m4),
                                 _mm512_and_si512(_mm512_sllv_epi16(qh, sh_lo), m30));
      u[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q, 4), m4),
                                     _mm512_and_si512(_mm512_srlv_epi16(qh, sh_hi), m30));
    }
    return;
  }
  if (type == GGUF_Q2_K || type == GGUF_Q3_K) {  /* runs 2p and 2p+1 of decode_vec's */
    const uint8_t* qs = b + (type == GGUF_Q3_K ? 32 : 16);
    const __m512i m2 = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1);
    const __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)b));
    for (int p = 0; p < 4; ++p) {
      const int t = 2 * (p % 2);
      const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(qs + 32 * (p / 2))));
      const __m512i sh = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * t)), _mm256_set1_epi16((short)(2 * t + 2)), 1);
      __m512i c = _mm512_and_si512(_mm512_srlv_epi16(v, sh), m2);
      if (type == GGUF_Q3_K) {
        const __m512i hs = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * p)), _mm256_set1_epi16((short)(2 * p + 1)), 1);
        c = _mm512_or_si512(c, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hm, hs), one), 2));
      }
      u[p] = c;
    }
    return;
  }
  const uint8_t* qs = b + (type == GGUF_Q5_K ? 48 : 16);
  const __m512i sh = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  __m512i qh = type == GGUF_Q5_K
      ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + 16))) : _mm512_setzero_si512();
  /* Q5_K: sub-block 2p's 5th bits are qh's bit 2p, 2p+1's bit 2p+1 */
  const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8(1), _mm256_set1_epi8(2), 1);
  for (int p = 0; p < 4; ++p) {
    const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(qs + 32 * p)));
    __m512i c = _mm512_and_si512(_mm512_srlv_epi16(v, sh), m4);
    if (type == GGUF_Q5_K) {
      const __mmask64 k = _mm512_test_epi8_mask(qh, bit);
      c = _mm512_mask_add_epi8(c, k, c, _mm512_set1_epi8(16));
      qh = _mm512_srli_epi16(qh, 2);
    }
    u[p] = c;
  }
}

/* dequant_sb_vec 16 weights an instruction */
static void dequant_sb_512(int type, const uint8_t* b, float* out, uint16_t* outb) {
  __m512i u[4];
  decode_vec512(type, b, u);
  __m256 s0, s1;
  if (type == GGUF_Q6_K) k6_scales_vec(b, &s0, &s1);
  else k4_scales_vec(b, &s0, &s1);
  float sc[16];  /* Q6_K: d * sc of the 16 sub-blocks; else 8 of d * sc, then 8 of dmin * m */
  _mm256_storeu_ps(sc, s0);
  _mm256_storeu_ps(sc + 8, s1);
  for (int p = 0; p < 4; ++p)
    for (int g = 0; g < 4; ++g) {  /* 16 codes: Q6_K's sub-block 4p + g, else 2p + g / 2 */
      const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(u[p], g)));
      __m512 v;
      if (type == GGUF_Q6_K) {
        v = _mm512_mul_ps(_mm512_set1_ps(sc[4 * p + g]), _mm512_sub_ps(q, _mm512_set1_ps(32.f)));
      } else {
        const int j = 2 * p + g / 2;
        v = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(sc[j]), q), _mm512_set1_ps(sc[8 + j]));
      }
      const int64_t o = 64 * p + 16 * g;
      if (outb) _mm256_storeu_si256((__m256i*)(outb + o), f2bf512(v));
      else _mm512_storeu_ps(out + o, v);
    }
}

static inline __attribute__((always_inline)) void dot_vnni_rows(int type, int R,
    const uint8_t* w, int64_t nsb, const xrows* X, float* out) {
  const int bs = sb_bytes(type);
  __m512 acc[MAX_R];
  __m512 off6[MAX_R];  /* Q6_K/Q3_K: sum of scale * x's sums per 16 (the -32, -4); Q2_K:
                          of its minimums times them */
  __m256 off4[MAX_R];  /* Q4_K/Q5_K: sum of dmin * m * x's scaled block sums */
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    off6[r] = _mm512_setzero_ps();
    off4[r] = _mm256_setzero_ps();
  }
  /* pair p's lanes: Q4/5 [2p x8, 2p+1 x8] of 8 scales; Q6/3/2 [4p x4 .. 4p+3 x4] of 16 */
  __m512i idx[4];
  for (int p = 0; p < 4; ++p)
    idx[p] = sub16(type)
        ? _mm512_setr_epi32(4 * p, 4 * p, 4 * p, 4 * p, 4 * p + 1, 4 * p + 1, 4 * p + 1, 4 * p + 1,
              4 * p + 2, 4 * p + 2, 4 * p + 2, 4 * p + 2, 4 * p + 3, 4 * p + 3, 4 * p + 3, 4 * p + 3)
        : _mm512_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p, 2 * p,
              2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1);
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* b = w + s * bs;
    __m512i u[4];
    decode_vec512(type, b, u);
    if (sub16(type)) {
      __m512 dsc, dmn = _mm512_setzero_ps();
      if (type == GGUF_Q6_K) {
        dsc = _mm512_mul_ps(_mm512_set1_ps(h2f(b + 208)),
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 192)))));
      } else if (type == GGUF_Q3_K) {
        __m256 lo, hi;
        k3_scales_vec(b, &lo, &hi);
        dsc = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
      } else {
        float sc[16], mn[16];
        k16_scales(type, b, sc, mn);
        dsc = _mm512_loadu_ps(sc);
        dmn = _mm512_loadu_ps(mn);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* x = X->q + r * X->K + s * QK;
        const int64_t o = r * 2 * X->nb + s * 16;
        const __m512 d16 = _mm512_loadu_ps(X->d16 + o);
        const __m512 sc16 = _mm512_mul_ps(dsc, d16);
        off6[r] = _mm512_fmadd_ps(type == GGUF_Q2_K ? _mm512_mul_ps(dmn, d16) : sc16,
                                  _mm512_loadu_ps(X->sum16 + o), off6[r]);
        for (int p = 0; p < 4; ++p) {
          const __m512i dp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[p],
                                                 _mm512_loadu_si512((const void*)(x + 64 * p)));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), _mm512_permutexvar_ps(idx[p], sc16), acc[r]);
        }
      }
    } else {
      __m256 dsc, dm;
      if (type == GGUF_IQ4_XS) iq4xs_scales_vec(b, &dsc, &dm);
      else k4_scales_vec(b, &dsc, &dm);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = X->q + r * X->K + s * QK;
        const __m512 sc8 = _mm512_castps256_ps512(
            _mm256_mul_ps(dsc, _mm256_loadu_ps(X->d + r * X->nb + s * 8)));
        off4[r] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(X->dsum + r * X->nb + s * 8), off4[r]);
        for (int p = 0; p < 4; ++p) {
          const __m512i dp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[p],
                                                 _mm512_loadu_si512((const void*)(x + 64 * p)));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), _mm512_permutexvar_ps(idx[p], sc8), acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    out[r] = _mm512_reduce_add_ps(acc[r]) -
             (type == GGUF_Q2_K ? _mm512_reduce_add_ps(off6[r])
              : sub16(type) ? (float)offset16(type) * _mm512_reduce_add_ps(off6[r])
              : hsum8(off4[r]));
}
#endif

/* ---- dequantization: vectors where gguf_isa allows (the scalar code stays reachable for
   the tests), the same bits either way; IQ4_XS, Q3_K and Q2_K on dequant_sb_small ---- */
static inline int small_codes(int type) {
  return type == GGUF_IQ4_XS || type == GGUF_Q3_K || type == GGUF_Q2_K;
}
static void dequant_row(int type, const uint8_t* row, int64_t K, float* out, uint16_t* outb) {
  const int bs = sb_bytes(type);
  for (int64_t s = 0; s < K / QK; ++s) {
    float* o = out ? out + s * QK : NULL;
    uint16_t* ob = outb ? outb + s * QK : NULL;
#if ISA_MAX >= GGUF_ISA_VNNI
    if (gguf_isa >= GGUF_ISA_VNNI && !small_codes(type)) {
      dequant_sb_512(type, row + s * bs, o, ob);
      continue;
    }
#endif
#if ISA_MAX >= GGUF_ISA_AVX2
    if (gguf_isa >= GGUF_ISA_AVX2) {
      if (small_codes(type)) dequant_sb_small(type, row + s * bs, o, ob);
      else dequant_sb_vec(type, row + s * bs, o, ob);
      continue;
    }
#endif
    if (o) {
      dequant_sb(type, row + s * bs, o);
    } else {
      float v[QK];
      dequant_sb(type, row + s * bs, v);
      for (int j = 0; j < QK; ++j) ob[j] = f2bf(v[j]);
    }
  }
}

int gguf_k_dequant_row(int type, const uint8_t* row, int64_t K, float* out) {
  if (!sb_bytes(type) || K % QK) return -1;
  dequant_row(type, row, K, out, NULL);
  return 0;
}

int gguf_k_dequant_row_bf16(int type, const uint8_t* row, int64_t K, uint16_t* out) {
  if (!sb_bytes(type) || K % QK) return -1;
  dequant_row(type, row, K, NULL, out);
  return 0;
}

int gguf_k_dequantize(const uint8_t* w, int type, int64_t N, int64_t K, void* out, int bf16,
    int nthreads) {
  const int bs = sb_bytes(type);
  if (!bs || K % QK) return -1;
  const int64_t rb = K / QK * bs;
  _Pragma("omp parallel for num_threads(nthreads) if(nthreads > 1) schedule(static)")
  for (int64_t n = 0; n < N; ++n)
    dequant_row(type, w + n * rb, K, bf16 ? NULL : (float*)out + n * K,
                bf16 ? (uint16_t*)out + n * K : NULL);
  return 0;
}

typedef void (*dot_fn)(const uint8_t*, int64_t, const xrows*, float*);
#define DEFINE_DOT(NAME, CALL) \
  static void NAME(const uint8_t* w, int64_t nsb, const xrows* X, float* out) { CALL; }
#define DEFINE_ROWS(SUFFIX, TYPE, CALLER)                                                     \
  DEFINE_DOT(dot_##SUFFIX##_1, CALLER(TYPE, 1, w, nsb, X, out))                               \
  DEFINE_DOT(dot_##SUFFIX##_2, CALLER(TYPE, 2, w, nsb, X, out))                               \
  DEFINE_DOT(dot_##SUFFIX##_3, CALLER(TYPE, 3, w, nsb, X, out))                               \
  DEFINE_DOT(dot_##SUFFIX##_4, CALLER(TYPE, 4, w, nsb, X, out))                               \
  static const dot_fn DOT_##SUFFIX[MAX_R] = {dot_##SUFFIX##_1, dot_##SUFFIX##_2,              \
      dot_##SUFFIX##_3, dot_##SUFFIX##_4};
DEFINE_ROWS(q4k_s, GGUF_Q4_K, dot_scalar)
DEFINE_ROWS(q5k_s, GGUF_Q5_K, dot_scalar)
DEFINE_ROWS(q6k_s, GGUF_Q6_K, dot_scalar)
DEFINE_ROWS(iq4xs_s, GGUF_IQ4_XS, dot_scalar)
DEFINE_ROWS(q2k_s, GGUF_Q2_K, dot_scalar)
DEFINE_ROWS(q3k_s, GGUF_Q3_K, dot_scalar)
#if ISA_MAX >= GGUF_ISA_AVX2
DEFINE_ROWS(q4k_a, GGUF_Q4_K, dot_avx2_rows)
DEFINE_ROWS(q5k_a, GGUF_Q5_K, dot_avx2_rows)
DEFINE_ROWS(q6k_a, GGUF_Q6_K, dot_avx2_rows)
DEFINE_ROWS(iq4xs_a, GGUF_IQ4_XS, dot_avx2_rows)
DEFINE_ROWS(q2k_a, GGUF_Q2_K, dot_avx2_rows)
DEFINE_ROWS(q3k_a, GGUF_Q3_K, dot_avx2_rows)
#endif
#if ISA_MAX >= GGUF_ISA_VNNI
DEFINE_ROWS(q4k_v, GGUF_Q4_K, dot_vnni_rows)
DEFINE_ROWS(q5k_v, GGUF_Q5_K, dot_vnni_rows)
DEFINE_ROWS(q6k_v, GGUF_Q6_K, dot_vnni_rows)
DEFINE_ROWS(iq4xs_v, GGUF_IQ4_XS, dot_vnni_rows)
DEFINE_ROWS(q2k_v, GGUF_Q2_K, dot_vnni_rows)
DEFINE_ROWS(q3k_v, GGUF_Q3_K, dot_vnni_rows)
#endif

#define PICK(V)                                                                             \
  switch (type) {                                                                           \
    case GGUF_Q4_K: return DOT_q4k_##V;                                                     \
    case GGUF_Q5_K: return DOT_q5k_##V;                                                     \
    case GGUF_IQ4_XS: return DOT_iq4xs_##V;                                                 \
    case GGUF_Q2_K: return DOT_q2k_##V;                                                     \
    case GGUF_Q3_K: return DOT_q3k_##V;                                                     \
    default: return DOT_q6k_##V;                                                            \
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

int gguf_k_linear(const void* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int type,
    int64_t N, const void* bias, void* y, int64_t ldy, int bf16, int nthreads) {
  const int bs = sb_bytes(type);
  if (!bs || K % QK || M < 1) return -1;
  const int64_t nb = K / 32, nsb = K / QK;
  /* q [M K] int8, then floats: d, dsum [M nb], d16, sum16 [M 2nb] (K % 256: aligned) */
  int8_t* xq = (int8_t*)malloc((size_t)M * K + (size_t)M * nb * 6 * sizeof(float));
  if (!xq) return -1;
  float* xd = (float*)(xq + M * K);
  float* xds = xd + M * nb, *xd16 = xds + M * nb, *xs16 = xd16 + 2 * M * nb;
  const size_t esize = bf16 ? 2 : 4;
  for (int64_t m = 0; m < M; ++m)
    quantize_row((const char*)x + m * ldx * esize, bf16, K, xq + m * K, xd + m * nb,
                 xds + m * nb, xd16 + 2 * m * nb, xs16 + 2 * m * nb);
  const dot_fn* dot = pick(type, gguf_isa);
  const int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK, rb = nsb * bs;
  _Pragma("omp parallel for num_threads(nthreads) if(nthreads > 1) schedule(static)")
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t n1 = (t + 1) * ROWS_PER_TASK < N ? (t + 1) * ROWS_PER_TASK : N;
    for (int64_t n = t * ROWS_PER_TASK; n < n1; ++n) {
      const float bn = bias ? (bf16 ? bf2f(((const uint16_t*)bias)[n]) : ((const float*)bias)[n]) : 0.f;
      for (int64_t m0 = 0; m0 < M; m0 += MAX_R) {
        const int R = M - m0 < MAX_R ? (int)(M - m0) : MAX_R;
        const xrows X = {xq + m0 * K, xd + m0 * nb, xds + m0 * nb, xd16 + 2 * m0 * nb,
                         xs16 + 2 * m0 * nb, K, nb};
        float v[MAX_R];
        dot[R - 1](w + n * rb, nsb, &X, v);
        for (int r = 0; r < R; ++r) {
          if (bf16) ((uint16_t*)y)[(m0 + r) * ldy + n] = f2bf(v[r] + bn);
          else ((float*)y)[(m0 + r) * ldy + n] = v[r] + bn;
        }
      }
    }
  }
  free(xq);
  return 0;
}
