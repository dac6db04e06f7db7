/* Decode attention read straight from the paged KV cache (bf16/float32, or int8 with a scale
   per token and head), and the int8 cache's writer: engine/attention/cpu_kernel.py. */
#include "tessera_kernels.h"
#include "bf16_convert.h"
#include "int8_quant.h"
#include "avx512_math.h"

#include <stdint.h>
#include <string.h>
#include <math.h>
#include <omp.h>


#define PREFETCH_BLOCK(p, bytes) do { const char* _c = (const char*)(p); \
  for (int64_t _o = 0; _o < (bytes); _o += 64) __builtin_prefetch(_c + _o, 0, 1); } while (0)
/* Part `part` of `parts` of the `bytes` at p prefetched: a block's prefetches spread over the
   work of the block before it. Issued at once (a block's K and V are 192 lines at SmolLM2's
   shape) they filled the miss buffers and stalled the very loads they were to feed. Spread,
   32-128 rows of 140-500 tokens in scattered blocks on two Zen 5 cores: the AVX512-BF16
   kernel 1.6-1.75x faster, the generic one (built for AVX2) 1.5x, the int8 cache's
   1.2-1.5x. They go to L2 (prefetcht2), not L1: L1's few miss buffers were still the limit.
   128 rows of 64-320 tokens, 30 layers' caches on huge pages, two Zen 4 cores: 37.5-40 ->
   27-31 ms a step (15 -> 21 GB/s; the same rows from L3 take ~19 ms). */
static inline void prefetch_part(const void* p, int64_t bytes, int64_t part, int64_t parts) {
  const char* c = (const char*)p;
  for (int64_t o = (bytes * part / parts) & ~(int64_t)63; o < bytes * (part + 1) / parts; o += 64)
    __builtin_prefetch(c + o, 0, 1);
}
/* Each row r of s [H][L] becomes softmax(row) (plain loops; softmax512 below is the
   AVX-512 one). sinks (NULL: none): a logit per query head that joins each row's softmax
   with no value (gpt-oss's attention sinks): it only adds exp(sink) to the denominator. */
static inline void softmax_rows(float* s, int H, int64_t L, const float* sinks) {
  for (int r = 0; r < H; ++r) {
    float* sr = s + r * L; float m = sinks ? sinks[r] : -INFINITY, sum = 0.f;
    for (int64_t l = 0; l < L; ++l) m = sr[l] > m ? sr[l] : m;
    for (int64_t l = 0; l < L; ++l) { float e = expf(sr[l] - m); sr[l] = e; sum += e; }
    if (sinks) sum += expf(sinks[r] - m);
    const float inv = 1.f / sum;
    for (int64_t l = 0; l < L; ++l) sr[l] *= inv;
  }
}

/* The first `skip` keys of each row of s [H][stride] masked out before the softmax: the keys
   of a sliding window's first block that lie before the window (their weights become 0). */
static inline void mask_before_window(float* s, int H, int64_t stride, int64_t skip) {
  for (int r = 0; r < H; ++r)
    for (int64_t l = 0; l < skip; ++l) s[r * stride + l] = -INFINITY;
}

/* One sequence: q [H][D] -> out [H][D] over its L cached tokens, block by block.
   Pass 1: scores s[r][l] = q_r . k_l (all Hkv heads of a token are one contiguous row);
   softmax per row; pass 2: each row's accumulator stays in registers over a float V tile.
   The next block is prefetched: blocks are scattered, so the hardware prefetcher cannot.
   Scratch: H*D (q) + H*D (acc) + bs*Hkv*D (tile) + H*L (scores) floats. */
#define DEFINE_ONE(NAME, T, LOAD, STORE)                                                       \
static inline void NAME(T* out, const T* q, const T* kc, const T* vc, const float* ksc,       \
    const float* vsc, const int64_t* table, int64_t L, int64_t skip, int H, int Hkv,         \
    const int D, int bs, float scale, const float* sinks, float* scratch) {                  \
  const int G = H / Hkv;                                                                     \
  float* qf = scratch; float* acc = qf + H * D; float* tile = acc + H * D;                   \
  float* s = tile + (int64_t)bs * Hkv * D;                                                   \
  float row[ATTN_MAX_ROW];                                                                   \
  for (int i = 0; i < H * D; ++i) qf[i] = LOAD(q[i]) * scale;                                \
  const int64_t tok = (int64_t)Hkv * D;                                                      \
  const int64_t nblk = (L + bs - 1) / bs;                                                    \
  for (int64_t bi = 0; bi < nblk; ++bi) {                                                    \
    const int64_t l0 = bi * bs;                                                              \
    const T* kb = kc + table[bi] * bs * tok;                                                 \
    const T* pk = bi + 1 < nblk ? kc + table[bi + 1] * bs * tok : NULL;                      \
    const int64_t n = L - l0 < bs ? L - l0 : bs;                                             \
    for (int64_t j = 0; j < n; ++j) {                                                        \
      const T* k = kb + j * tok;                                                             \
      if (pk) prefetch_part(pk, bs * tok * (int64_t)sizeof(T), j, n);                        \
      _Pragma("omp simd")                                                                    \
      for (int i = 0; i < Hkv * D; ++i) row[i] = LOAD(k[i]);                                 \
      for (int h = 0; h < Hkv; ++h)                                                          \
        for (int g = 0; g < G; ++g) {                                                        \
          const int r = h * G + g; const float* qq = qf + r * D; const float* kk = row + h * D; \
          float dot = 0.f;                                                                   \
          _Pragma("omp simd reduction(+:dot)")                                               \
          for (int d = 0; d < D; ++d) dot += qq[d] * kk[d];                                  \
          s[r * L + l0 + j] = dot;                                                           \
        }                                                                                    \
    }                                                                                        \
  }                                                                                          \
  mask_before_window(s, H, L, skip);                                                         \
  softmax_rows(s, H, L, sinks);                                                              \
  memset(acc, 0, sizeof(float) * H * D);                                                     \
  for (int64_t bi = 0; bi < nblk; ++bi) {                                                    \
    const int64_t l0 = bi * bs;                                                              \
    const T* vb = vc + table[bi] * bs * tok;                                                 \
    const T* pv = bi + 1 < nblk ? vc + table[bi + 1] * bs * tok : NULL;                      \
    const int64_t n = L - l0 < bs ? L - l0 : bs;                                             \
    _Pragma("omp simd")                                                                      \
    for (int64_t i = 0; i < n * tok; ++i) tile[i] = LOAD(vb[i]);                             \
    for (int r = 0; r < H; ++r) {                                                            \
      if (pv) prefetch_part(pv, bs * tok * (int64_t)sizeof(T), r, H);                        \
      float a[D];                                                                            \
      _Pragma("omp simd")                                                                    \
      for (int d = 0; d < D; ++d) a[d] = acc[r * D + d];                                     \
      const float* vt = tile + (r / G) * D; const float* sr = s + r * L + l0;                \
      for (int64_t j = 0; j < n; ++j) {                                                      \
        const float p = sr[j]; const float* vv = vt + j * tok;                               \
        _Pragma("omp simd")                                                                  \
        for (int d = 0; d < D; ++d) a[d] += p * vv[d];                                       \
      }                                                                                      \
      _Pragma("omp simd")                                                                    \
      for (int d = 0; d < D; ++d) acc[r * D + d] = a[d];                                     \
    }                                                                                        \
  }                                                                                          \
  for (int i = 0; i < H * D; ++i) out[i] = STORE(acc[i]);                                    \
}

#define ID(x) (x)
DEFINE_ONE(one_f32, float, ID, ID)
DEFINE_ONE(one_bf16_generic, uint16_t, bf2f, f2bf)

#if defined(__AVX512F__)
#include <immintrin.h>
/* 16 values as floats, by element type (LOAD16_##T) */
static inline __m512 load16_f32(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16_(const uint16_t* p) {
  return bf16x16_to_f32(_mm256_loadu_si256((const __m256i*)p));
}
#define LOAD16_float load16_f32
#define LOAD16_uint16_t load16_bf16_
#ifndef AHEAD
#define AHEAD 2  /* blocks prefetched ahead in the K pass */
#endif

/* The largest of sr[0..L). */
static inline float row_max512(const float* sr, int64_t L) {
  __m512 mv = _mm512_set1_ps(-INFINITY);
  int64_t l = 0;
  for (; l + 16 <= L; l += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sr + l));
  float m = _mm512_reduce_max_ps(mv);
  for (; l < L; ++l) m = sr[l] > m ? sr[l] : m;
  return m;
}

/* Each row r of s [H][L] (rows `stride` apart) becomes softmax(row), 16 scores at a time;
   sinks as softmax_rows'. */
static inline void softmax512(float* s, int H, int64_t L, int64_t stride, const float* sinks) {
  for (int r = 0; r < H; ++r) {
    float* sr = s + r * stride;
    float m = row_max512(sr, L);
    if (sinks && sinks[r] > m) m = sinks[r];
    const __m512 vm = _mm512_set1_ps(m);
    __m512 sv = _mm512_setzero_ps();
    for (int64_t l = 0; l < L; l += 16) {
      const __mmask16 k = L - l >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (L - l)) - 1);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sr + l), vm));
      sv = _mm512_add_ps(sv, _mm512_maskz_mov_ps(k, e));
      _mm512_mask_storeu_ps(sr + l, k, e);
    }
    const float sink = sinks ? expf(sinks[r] - m) : 0.f;
    const __m512 inv = _mm512_set1_ps(1.f / (_mm512_reduce_add_ps(sv) + sink));
    for (int64_t l = 0; l < L; l += 16) {
      const __mmask16 k = L - l >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (L - l)) - 1);
      _mm512_mask_storeu_ps(sr + l, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, sr + l), inv));
    }
  }
}

/* out[i] = bf16(acc[i]), rounded like f2bf (nearest even); n a multiple of 16. */
static inline void store512_bf16(uint16_t* out, const float* acc, int n) {
  for (int i = 0; i < n; i += 16)
    _mm256_storeu_si256((__m256i*)(out + i), f2bf512(_mm512_loadu_ps(acc + i)));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* bf16 on CPUs with AVX512-BF16 (Zen 4+, Sapphire Rapids+): the generic loops above spend
   most of their time in horizontal sums (one per token and head) and scalar expf. Here
   q . k runs on bf16 pairs (vdpbf16ps: exact products, float32 sums), 16 tokens' dot
   products are summed across lanes together (reduce16), softmax uses a vector exp, and the
   V pass runs on bf16 pairs too: two tokens' V rows interleaved (one unpack each half) meet
   their two weights in one vdpbf16ps, up to 4 heads' accumulators in registers per 32 dims.
   The weights are softmax's numerators exp(s - max) rounded to bf16, as torch's SDPA rounds
   them for a bf16 model before its V GEMM; the float sum of the unrounded ones divides at
   the end. (Float V tiles, one FMA per 16 products, took 2.5x the instructions.) */

/* Row r of s [H][L] -> p[r] (Lp = L rounded up to even apart; the pad 0) = bf16(exp(s - max))
   and inv[r] = 1 / the float sum of the unrounded exps (and exp(sink - max): sinks as
   softmax_rows'). */
static inline void softmax_numerators_bf16(const float* s, int H, int64_t L, uint16_t* p,
    int64_t Lp, float* inv, const float* sinks) {
  for (int r = 0; r < H; ++r) {
    const float* sr = s + r * L; uint16_t* pr = p + r * Lp;
    float m = row_max512(sr, L);
    if (sinks && sinks[r] > m) m = sinks[r];
    const __m512 vm = _mm512_set1_ps(m);
    __m512 sv = _mm512_setzero_ps();
    for (int64_t l = 0; l < L; l += 16) {
      const __mmask16 k = L - l >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (L - l)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sr + l), vm)));
      sv = _mm512_add_ps(sv, e);
      _mm256_mask_storeu_epi16(pr + l, k, f2bf512(e));
    }
    if (Lp > L) pr[L] = 0;
    inv[r] = 1.f / (_mm512_reduce_add_ps(sv) + (sinks ? expf(sinks[r] - m) : 0.f));
  }
}

/* Heads [0, GN) (rows Lp apart in pr, D apart in accr): accr[g][0..32) (pair order, see
   one_bf16_avx512) += sum_j pr[g][j] * v_j[0..32) over the block's n tokens (rows tok apart
   from vr). An odd last token pairs with a zero row (the slot after it may hold anything). */
#define V_PAIRS(GN) do {                                                                     \
    __m512 lo[4], hi[4];                                                                     \
    for (int g = 0; g < GN; ++g) {                                                           \
      lo[g] = _mm512_loadu_ps(accr + g * D); hi[g] = _mm512_loadu_ps(accr + g * D + 16);     \
    }                                                                                        \
    for (int64_t j = 0; j < n; j += 2) {                                                     \
      const __m512i a = _mm512_loadu_si512(vr + j * tok);                                    \
      const __m512i b = j + 1 < n ? _mm512_loadu_si512(vr + (j + 1) * tok) : _mm512_setzero_si512(); \
      const __m512bh vl = (__m512bh)_mm512_unpacklo_epi16(a, b);                             \
      const __m512bh vh = (__m512bh)_mm512_unpackhi_epi16(a, b);                             \
      for (int g = 0; g < GN; ++g) {                                                         \
        int32_t w2; memcpy(&w2, pr + g * Lp + j, sizeof w2);                                 \
        const __m512bh w = (__m512bh)_mm512_set1_epi32(w2);                                  \
        lo[g] = _mm512_dpbf16_ps(lo[g], vl, w);                                              \
        hi[g] = _mm512_dpbf16_ps(hi[g], vh, w);                                              \
      }                                                                                      \
    }                                                                                        \
    for (int g = 0; g < GN; ++g) {                                                           \
      _mm512_storeu_ps(accr + g * D, lo[g]); _mm512_storeu_ps(accr + g * D + 16, hi[g]);     \
    }                                                                                        \
  } while (0)

static inline void one_bf16_avx512(uint16_t* out, const uint16_t* q, const uint16_t* kc,
    const uint16_t* vc, const float* ksc, const float* vsc, const int64_t* table, int64_t L,
    int64_t skip, int H, int Hkv, const int D, int bs,
    float scale, const float* sinks, float* scratch) {
  const int G = H / Hkv;
  const int64_t Lp = (L + 1) & ~(int64_t)1;
  float* acc = scratch; float* s = acc + H * D;
  uint16_t* p = (uint16_t*)(s + H * L); float* inv = (float*)(p + H * Lp);
  const int64_t tok = (int64_t)Hkv * D;
  const int64_t nblk = (L + bs - 1) / bs;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t bi = 0; bi < nblk; ++bi) {
    const int64_t l0 = bi * bs;
    const uint16_t* kb = kc + table[bi] * bs * tok;
    if (bi == 0)
      for (int64_t a = 0; a < AHEAD && a < nblk; ++a) {
        PREFETCH_BLOCK(kc + table[a] * bs * tok, bs * tok * (int64_t)sizeof(uint16_t));
        PREFETCH_BLOCK(vc + table[a] * bs * tok, bs * tok * (int64_t)sizeof(uint16_t));
      }
    /* block bi + AHEAD's K and V (the V pass then reads them from L2), a part per head */
    const uint16_t* pk = bi + AHEAD < nblk ? kc + table[bi + AHEAD] * bs * tok : NULL;
    const uint16_t* pv = bi + AHEAD < nblk ? vc + table[bi + AHEAD] * bs * tok : NULL;
    const int64_t nb = L - l0 < bs ? L - l0 : bs, bytes = bs * tok * (int64_t)sizeof(uint16_t);
    const int64_t parts = H * ((nb + 15) / 16);
    int64_t part = 0;
    for (int64_t j0 = 0; j0 < nb; j0 += 16) {
      const int m = nb - j0 < 16 ? (int)(nb - j0) : 16;
      for (int r = 0; r < H; ++r, ++part) {
        if (pk) { prefetch_part(pk, bytes, part, parts); prefetch_part(pv, bytes, part, parts); }
        const uint16_t* qr = q + r * D; const uint16_t* kr = kb + j0 * tok + (r / G) * D;
        __m512 d[16];
        for (int j = 0; j < 16; ++j) d[j] = _mm512_setzero_ps();
        for (int c = 0; c < D; c += 32) {
          const __m512bh qv = (__m512bh)_mm512_loadu_si512(qr + c);
          for (int j = 0; j < m; ++j)
            d[j] = _mm512_dpbf16_ps(d[j], qv, (__m512bh)_mm512_loadu_si512(kr + j * tok + c));
        }
        _mm512_mask_storeu_ps(s + r * L + l0 + j0, (__mmask16)((1u << m) - 1),
                              _mm512_mul_ps(reduce16(d), vscale));
      }
    }
  }
  mask_before_window(s, H, L, skip);
  softmax_numerators_bf16(s, H, L, p, Lp, inv, sinks);
  for (int r = 0; r < H; ++r)  /* exp512 stops at e^-87: those weights exactly 0 */
    for (int64_t l = 0; l < skip; ++l) p[r * Lp + l] = 0;
  /* acc keeps each 32 dims in pair order: unpacklo's lanes (dims 8k..8k+3 in 128-bit lane k)
     then unpackhi's (8k+4..8k+7); put back in order as the rows are stored */
  memset(acc, 0, sizeof(float) * H * D);
  for (int64_t bi = 0; bi < nblk; ++bi) {
    const int64_t l0 = bi * bs;
    const uint16_t* vb = vc + table[bi] * bs * tok;
    const int64_t n = L - l0 < bs ? L - l0 : bs;
    for (int h = 0; h < Hkv; ++h)
      for (int c = 0; c < D; c += 32)
        for (int g0 = 0; g0 < G; g0 += 4) {
          const int r0 = h * G + g0;
          float* accr = acc + r0 * D + c; const uint16_t* pr = p + r0 * Lp + l0;
          const uint16_t* vr = vb + h * D + c;
          switch (G - g0 < 4 ? G - g0 : 4) {
            case 1: V_PAIRS(1); break;
            case 2: V_PAIRS(2); break;
            case 3: V_PAIRS(3); break;
            default: V_PAIRS(4);
          }
        }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int r = 0; r < H; ++r) {
    const __m512 w = _mm512_set1_ps(inv[r]);
    for (int c = 0; c < D; c += 32) {
      const __m512 lo = _mm512_loadu_ps(acc + r * D + c), hi = _mm512_loadu_ps(acc + r * D + c + 16);
      _mm256_storeu_si256((__m256i*)(out + r * D + c),
                          f2bf512(_mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), w)));
      _mm256_storeu_si256((__m256i*)(out + r * D + c + 16),
                          f2bf512(_mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), w)));
    }
  }
}

static inline void one_bf16(uint16_t* out, const uint16_t* q, const uint16_t* kc,
    const uint16_t* vc, const float* ksc, const float* vsc, const int64_t* table, int64_t L,
    int64_t skip, int H, int Hkv, const int D, int bs,
    float scale, const float* sinks, float* scratch) {
  if (D % 32 == 0) one_bf16_avx512(out, q, kc, vc, ksc, vsc, table, L, skip, H, Hkv, D, bs, scale, sinks, scratch);
  else one_bf16_generic(out, q, kc, vc, ksc, vsc, table, L, skip, H, Hkv, D, bs, scale, sinks, scratch);
}
#else
#define one_bf16 one_bf16_generic
#endif

/* ---- int8 KV cache (--kv-cache-dtype int8) ----
   K and V are int8 with one float scale per token and KV head in ks / vs [blocks][Hkv][bs]
   (a head's token scales side by side). Each token's row of a head is quantized on its own:
   scale = max|x| / 127, x ~ scale * round(x / scale). The decode step reads half the bytes of
   a bf16 cache. Inside a block each head's tokens are tiled (engine.attention.kv_int8):
     K: [Hkv][D/2][bs][2]: K8(t, h, d) = h*bs*D + (d/2)*bs*2 + t*2 + d%2
     V: [Hkv][bs/2][D][2]: V8(t, h, d) = h*bs*D + (t/2)*D*2 + d*2 + t%2
   so 32 bytes hold a dimension pair of 16 tokens (K) or a token pair of 16 dimensions (V):
   exactly the int16 pairs vpdpwssd multiplies. */
#define K8(t, h, d) ((int64_t)(h) * bs * D + (int64_t)((d) >> 1) * bs * 2 + (t) * 2 + ((d) & 1))
#define V8(t, h, d) ((int64_t)(h) * bs * D + (int64_t)((t) >> 1) * D * 2 + (d) * 2 + ((t) & 1))

/* One head's row x [D] -> int8 at its tiled K (is_v 0) or V positions; returns max|x|. */
#define DEFINE_KV8_ROW(NAME, T, LOAD)                                                         \
static inline float NAME(int8_t* dst, const T* x, int D, int bs, int64_t off, int is_v) {    \
  float amax = 0.f;                                                                          \
  _Pragma("omp simd reduction(max:amax)")                                                    \
  for (int d = 0; d < D; ++d) amax = fmaxf(amax, fabsf(LOAD(x[d])));                         \
  const float inv = q8_inv(amax);                                                           \
  KV8_ROW_VECTOR(T)                                                                          \
  for (int d = 0; d < D; ++d) {  /* |x * inv| <= 127 already; the clamp guards NaN */        \
    const float r = nearbyintf(LOAD(x[d]) * inv);                                            \
    const int8_t b = (int8_t)(r > 127.f ? 127.f : r < -127.f ? -127.f : r);                  \
    dst[is_v ? V8(off, 0, d) : K8(off, 0, d)] = b;                                          \
  }                                                                                          \
  return amax;                                                                               \
}
#if defined(__AVX512BW__) && defined(__AVX512VL__)
/* 16 values at a time in registers (a round trip through a byte buffer stalls store
   forwarding): round half to even like nearbyintf, clamp, then V's bytes blended into every
   other byte of the token pair's row, K's dimension pairs stored 2 bytes each. */
#define KV8_ROW_VECTOR(T)                                                                    \
  if (D % 16 == 0) {                                                                         \
    const __m512 vinv = _mm512_set1_ps(inv);                                                 \
    const __mmask32 keep = (off & 1) ? 0xAAAAAAAAu : 0x55555555u;                            \
    for (int d = 0; d < D; d += 16) {                                                        \
      __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(LOAD16_##T(x + d), vinv),                \
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);        \
      r = _mm512_max_ps(_mm512_min_ps(r, _mm512_set1_ps(127.f)), _mm512_set1_ps(-127.f));   \
      const __m512i i32 = _mm512_cvtps_epi32(r);                                             \
      if (is_v) {                                                                            \
        __m256i w = _mm512_cvtepi32_epi16(i32);                                              \
        if (off & 1) w = _mm256_slli_epi16(w, 8);                                            \
        int8_t* p = dst + V8(off & ~1, 0, d);                                                \
        _mm256_storeu_si256((__m256i*)p, _mm256_mask_blend_epi8(keep,                        \
            _mm256_loadu_si256((const __m256i*)p), w));                                      \
      } else {                                                                               \
        int16_t pairs[8];                                                                    \
        _mm_storeu_si128((__m128i*)pairs, _mm512_cvtepi32_epi8(i32));                        \
        for (int c = 0; c < 8; ++c)                                                          \
          memcpy(dst + K8(off, 0, d + 2 * c), pairs + c, 2);                                 \
      }                                                                                      \
    }                                                                                        \
    return amax;                                                                             \
  }
#else
#define KV8_ROW_VECTOR(T)
#endif
DEFINE_KV8_ROW(kv8_row_f32, float, f2f)
DEFINE_KV8_ROW(kv8_row_bf16, uint16_t, bf2f)

/* Writes n tokens' K and V rows (k, v: [n][Hkv][D], rows k_stride / v_stride apart) at their
   slots, quantized: the same bytes as engine.attention.kv_int8.write (q8_inv, q8_scale). */
#define DEFINE_KV8_WRITE(NAME, T, ROW)                                                        \
void NAME(int8_t* kc, int8_t* vc, float* ks, float* vs, const int64_t* slots, int64_t n,     \
    const T* k, int64_t k_stride, const T* v, int64_t v_stride, int Hkv, int D, int bs) {    \
  for (int64_t t = 0; t < n; ++t) {                                                          \
    const int64_t slot = slots[t], blk = slot / bs, off = slot % bs;                         \
    for (int w = 0; w < 2; ++w) {                                                            \
      const T* src = w ? v + t * v_stride : k + t * k_stride;                                \
      int8_t* dst = (w ? vc : kc) + blk * bs * Hkv * D;                                      \
      float* sc = (w ? vs : ks) + blk * Hkv * bs + off;                                      \
      for (int h = 0; h < Hkv; ++h)                                                          \
        sc[h * bs] = q8_scale(ROW(dst + (int64_t)h * bs * D, src + h * D, D, bs, off, w));   \
    }                                                                                        \
  }                                                                                          \
}
DEFINE_KV8_WRITE(kv8_write_f32, float, kv8_row_f32)
DEFINE_KV8_WRITE(kv8_write_bf16, uint16_t, kv8_row_bf16)

/* Writes n tokens' K and V rows (k, v: [n][Hkv * D] of `bytes` each, rows k_stride / v_stride
   elements of `elem` bytes apart) at their slots of a cache in the model's dtype ([slots][Hkv
   * D]). torch's index_copy_ from the strided q/k/v views took ~40 us a call at 128 rows
   (element by element); these are row copies. */
void kv_write(char* kc, char* vc, const int64_t* slots, int64_t n, const char* k,
    int64_t k_stride, const char* v, int64_t v_stride, int64_t bytes, int elem) {
  for (int64_t t = 0; t < n; ++t) {
    memcpy(kc + slots[t] * bytes, k + t * k_stride * elem, (size_t)bytes);
    memcpy(vc + slots[t] * bytes, v + t * v_stride * elem, (size_t)bytes);
  }
}

/* Decode attention over the int8 cache, plain loops: DEFINE_ONE with dequantized K and V.
   Scratch: H*D (q) + H*D (acc) + H*L (scores) floats. */
#define DEFINE_ONE_KV8(NAME, T, LOAD, STORE)                                                  \
static inline void NAME(T* out, const T* q, const int8_t* kc, const int8_t* vc,              \
    const float* ksc, const float* vsc, const int64_t* table, int64_t L, int64_t skip,      \
    int H, int Hkv, const int D, int bs, float scale, const float* sinks, float* scratch) {  \
  const int G = H / Hkv;                                                                     \
  float* qf = scratch; float* acc = qf + H * D; float* s = acc + H * D;                      \
  for (int i = 0; i < H * D; ++i) qf[i] = LOAD(q[i]) * scale;                                \
  const int64_t tok = (int64_t)Hkv * D;                                                      \
  const int64_t nblk = (L + bs - 1) / bs;                                                    \
  for (int64_t bi = 0; bi < nblk; ++bi) {                                                    \
    const int64_t l0 = bi * bs, n = L - l0 < bs ? L - l0 : bs;                               \
    const int8_t* kb = kc + table[bi] * bs * tok; const float* ksb = ksc + table[bi] * Hkv * bs; \
    for (int64_t j = 0; j < n; ++j)                                                          \
      for (int r = 0; r < H; ++r) {                                                          \
        const int h = r / G; const float* qq = qf + r * D;                                   \
        float dot = 0.f;                                                                     \
        for (int d = 0; d < D; ++d) dot += qq[d] * (float)kb[K8(j, h, d)];                   \
        s[r * L + l0 + j] = dot * ksb[h * bs + j];                                           \
      }                                                                                      \
  }                                                                                          \
  mask_before_window(s, H, L, skip);                                                         \
  softmax_rows(s, H, L, sinks);                                                              \
  memset(acc, 0, sizeof(float) * H * D);                                                     \
  for (int64_t bi = 0; bi < nblk; ++bi) {                                                    \
    const int64_t l0 = bi * bs, n = L - l0 < bs ? L - l0 : bs;                               \
    const int8_t* vb = vc + table[bi] * bs * tok; const float* vsb = vsc + table[bi] * Hkv * bs; \
    for (int r = 0; r < H; ++r) {                                                            \
      const int h = r / G; float* a = acc + r * D; const float* sr = s + r * L + l0;         \
      for (int64_t j = 0; j < n; ++j) {                                                      \
        const float p = sr[j] * vsb[h * bs + j];                                             \
        for (int d = 0; d < D; ++d) a[d] += p * (float)vb[V8(j, h, d)];                      \
      }                                                                                      \
    }                                                                                        \
  }                                                                                          \
  for (int i = 0; i < H * D; ++i) out[i] = STORE(acc[i]);                                    \
}
DEFINE_ONE_KV8(one_kv8_f32_generic, float, f2f, f2f)
DEFINE_ONE_KV8(one_kv8_bf16_generic, uint16_t, bf2f, f2bf)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* With AVX512-VNNI, on the tiled cache: q is quantized to int16 per row (error ~1e-5 of its
   largest value: as accurate as the torch path), and both passes run vpdpwssd on int16 pairs
   (exact products, int32 sums), one 32-byte load widened per instruction group and shared by
   the query heads of a KV head:
   - scores: a K load holds one dimension pair of 16 tokens; each lane sums one token's
     q . k over the dimension pairs (q's pair broadcast), so no horizontal sums are needed;
   - output: softmax weights times V's token scales are quantized to int16 per row (w16);
     a V load holds a token pair of 16 dimensions, multiplied by the pair's two weights.
   The int32 output sums are moved to floats every FLUSH tokens (|sum| < 2^31). Needs D % 32
   == 0, D <= 256 (int32 scores cannot overflow) and bs % 16 == 0.
   Scratch (floats): H*D acc, H*Lp scores, H*D/2 q16, H qmul, H*Lp/2 w16, H*D acc32, H wmul;
   Lp = L rounded up to 16. */
#define FLUSH 256
static inline __attribute__((always_inline)) void k_tile(const int GN, float* s,
    const int8_t* kh, const int16_t* q16, const float* qmul, const float* ksh, int r0,
    int64_t j, int m, int bs, int D, int64_t Lp) {
  __m512i a[4];
  for (int g = 0; g < GN; ++g) a[g] = _mm512_setzero_si512();
  for (int c = 0; c < D / 2; ++c) {
    const __m512i kv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(kh + c * bs * 2)));
    for (int g = 0; g < GN; ++g)
      a[g] = _mm512_dpwssd_epi32(a[g], kv, _mm512_set1_epi32(((const int32_t*)(q16 + (r0 + g) * D))[c]));
  }
  const __mmask16 mask = (__mmask16)((1u << m) - 1);
  const __m512 ksv = _mm512_maskz_loadu_ps(mask, ksh);
  for (int g = 0; g < GN; ++g)
    _mm512_mask_storeu_ps(s + (r0 + g) * Lp + j, mask, _mm512_mul_ps(
        _mm512_mul_ps(_mm512_cvtepi32_ps(a[g]), ksv), _mm512_set1_ps(qmul[r0 + g])));
}

/* acc32 rows r0..r0+GN, dims c0..c0+16*CN += sum over the block's np token pairs of
   w16 pair . V pair. */
static inline __attribute__((always_inline)) void v_tile(const int GN, const int CN,
    int32_t* acc32, const int8_t* vh, const int16_t* w16, int r0, int c0, int64_t l0,
    int64_t np, int D, int64_t Lp) {
  __m512i a[4][4];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < CN; ++c) a[g][c] = _mm512_loadu_si512(acc32 + (r0 + g) * D + c0 + 16 * c);
  for (int64_t p = 0; p < np; ++p) {
    __m512i w[4];
    for (int g = 0; g < GN; ++g) w[g] = _mm512_set1_epi32(((const int32_t*)(w16 + (r0 + g) * Lp + l0))[p]);
    for (int c = 0; c < CN; ++c) {
      const __m512i vv = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256((const __m256i*)(vh + p * 2 * D + (c0 + 16 * c) * 2)));
      for (int g = 0; g < GN; ++g) a[g][c] = _mm512_dpwssd_epi32(a[g][c], vv, w[g]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < CN; ++c) _mm512_storeu_si512(acc32 + (r0 + g) * D + c0 + 16 * c, a[g][c]);
}

#define V_TILE_CN(GN) do { if (cn == 4) v_tile(GN, 4, acc32, vh, w16, r0, c0, l0, np, D, Lp); \
    else v_tile(GN, 2, acc32, vh, w16, r0, c0, l0, np, D, Lp); } while (0)

#define DEFINE_ONE_KV8_AVX512(NAME, T, LOAD, STORE_ROW)                                       \
static inline void NAME(T* out, const T* q, const int8_t* kc, const int8_t* vc,              \
    const float* ksc, const float* vsc, const int64_t* table, int64_t L, int64_t skip,      \
    int H, int Hkv, const int D, int bs, float scale, const float* sinks, float* scratch) {  \
  const int G = H / Hkv;                                                                     \
  const int64_t Lp = (L + 15) & ~(int64_t)15;                                                \
  float* acc = scratch; float* s = acc + H * D;                                              \
  int16_t* q16 = (int16_t*)(s + H * Lp); float* qmul = (float*)(q16 + H * D);               \
  int16_t* w16 = (int16_t*)(qmul + H); int32_t* acc32 = (int32_t*)(w16 + H * Lp);           \
  float* wmul = (float*)(acc32 + H * D);                                                     \
  for (int r = 0; r < H; ++r) {  /* q row -> int16; its scale absorbs the softmax scale */   \
    __m512 mx = _mm512_setzero_ps();                                                         \
    for (int d = 0; d < D; d += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(LOAD16_##T(q + r * D + d))); \
    const float amax = _mm512_reduce_max_ps(mx);                                             \
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);                    \
    for (int d = 0; d < D; d += 16)                                                          \
      _mm256_storeu_si256((__m256i*)(q16 + r * D + d), _mm512_cvtepi32_epi16(                \
          _mm512_cvtps_epi32(_mm512_mul_ps(LOAD16_##T(q + r * D + d), inv))));               \
    qmul[r] = amax / 32767.f * scale;                                                        \
  }                                                                                          \
  const int64_t blk = (int64_t)bs * Hkv * D, nblk = (L + bs - 1) / bs;                       \
  const int64_t sc_bytes = (int64_t)Hkv * bs * sizeof(float);                                \
  for (int64_t bi = 0; bi < nblk; ++bi) {  /* scores */                                      \
    const int64_t l0 = bi * bs;                                                              \
    const int8_t* kb = kc + table[bi] * blk; const float* ksb = ksc + table[bi] * Hkv * bs;  \
    for (int64_t a = 0; bi == 0 && a < AHEAD && a < nblk; ++a) {                            \
      const int64_t b = table[a];                                                            \
      PREFETCH_BLOCK(kc + b * blk, blk); PREFETCH_BLOCK(vc + b * blk, blk);                  \
      PREFETCH_BLOCK(ksc + b * Hkv * bs, sc_bytes); PREFETCH_BLOCK(vsc + b * Hkv * bs, sc_bytes); \
    }                                                                                        \
    const int64_t nx = bi + AHEAD < nblk ? table[bi + AHEAD] : -1;                           \
    if (nx >= 0) {                                                                           \
      PREFETCH_BLOCK(ksc + nx * Hkv * bs, sc_bytes); PREFETCH_BLOCK(vsc + nx * Hkv * bs, sc_bytes); \
    }                                                                                        \
    for (int h = 0; h < Hkv; ++h)                                                            \
      for (int j0 = 0; j0 < bs && l0 + j0 < L; j0 += 16) {                                   \
        if (nx >= 0 && j0 == 0) {  /* block bi + AHEAD's K and V, a part per KV head */      \
          prefetch_part(kc + nx * blk, blk, h, Hkv); prefetch_part(vc + nx * blk, blk, h, Hkv); \
        }                                                                                    \
        const int m = L - l0 - j0 < 16 ? (int)(L - l0 - j0) : 16;                            \
        const int8_t* kh = kb + (int64_t)h * bs * D + j0 * 2;                                \
        const float* ksh = ksb + h * bs + j0;                                                \
        for (int g0 = 0; g0 < G; g0 += 4) {                                                  \
          const int r0 = h * G + g0;                                                         \
          switch (G - g0 < 4 ? G - g0 : 4) {                                                 \
            case 1: k_tile(1, s, kh, q16, qmul, ksh, r0, l0 + j0, m, bs, D, Lp); break;      \
            case 2: k_tile(2, s, kh, q16, qmul, ksh, r0, l0 + j0, m, bs, D, Lp); break;      \
            case 3: k_tile(3, s, kh, q16, qmul, ksh, r0, l0 + j0, m, bs, D, Lp); break;      \
            default: k_tile(4, s, kh, q16, qmul, ksh, r0, l0 + j0, m, bs, D, Lp);            \
          }                                                                                  \
        }                                                                                    \
      }                                                                                      \
  }                                                                                          \
  mask_before_window(s, H, Lp, skip);  /* e^-87 at most: quantized to 0 below */           \
  softmax512(s, H, L, Lp, sinks);                                                            \
  for (int r = 0; r < H; ++r) {  /* w = p * V's token scale -> int16, zero past L */          \
    const int h = r / G; float* sr = s + r * Lp;                                             \
    __m512 mx = _mm512_setzero_ps();                                                         \
    for (int64_t l = 0; l < Lp; l += 16) {                                                   \
      const int64_t bi = l / bs, j = l % bs;                                                 \
      const __mmask16 k = L - l >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (L - l)) - 1); \
      const __m512 w = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, sr + l),                       \
          _mm512_maskz_loadu_ps(k, vsc + table[bi] * Hkv * bs + h * bs + j));                \
      _mm512_storeu_ps(sr + l, w); mx = _mm512_max_ps(mx, w);                                \
    }                                                                                        \
    const float wmax = _mm512_reduce_max_ps(mx);                                             \
    const __m512 inv = _mm512_set1_ps(wmax > 0.f ? 32767.f / wmax : 0.f);                    \
    for (int64_t l = 0; l < Lp; l += 16)                                                     \
      _mm256_storeu_si256((__m256i*)(w16 + r * Lp + l), _mm512_cvtepi32_epi16(               \
          _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(sr + l), inv))));                 \
    wmul[r] = wmax / 32767.f;                                                                \
  }                                                                                          \
  memset(acc, 0, sizeof(float) * H * D); memset(acc32, 0, sizeof(int32_t) * H * D);          \
  for (int64_t bi = 0; bi < nblk; ++bi) {  /* output */                                      \
    const int64_t l0 = bi * bs, n = L - l0 < bs ? L - l0 : bs, np = (n + 1) / 2;             \
    const int8_t* vb = vc + table[bi] * blk;                                                 \
    for (int h = 0; h < Hkv; ++h) {                                                          \
      const int8_t* vh = vb + (int64_t)h * bs * D;                                           \
      for (int c0 = 0; c0 < D; c0 += 64) {                                                   \
        const int cn = D - c0 >= 64 ? 4 : 2;                                                 \
        for (int g0 = 0; g0 < G; g0 += 4) {                                                  \
          const int r0 = h * G + g0;                                                         \
          switch (G - g0 < 4 ? G - g0 : 4) {                                                 \
            case 1: V_TILE_CN(1); break;                                                     \
            case 2: V_TILE_CN(2); break;                                                     \
            case 3: V_TILE_CN(3); break;                                                     \
            default: V_TILE_CN(4);                                                           \
          }                                                                                  \
        }                                                                                    \
      }                                                                                      \
    }                                                                                        \
    if ((l0 + bs) % FLUSH == 0 || bi == nblk - 1)  /* int32 sums -> floats */                \
      for (int r = 0; r < H; ++r) {                                                          \
        const __m512 wm = _mm512_set1_ps(wmul[r]);                                           \
        for (int d = 0; d < D; d += 16) {                                                    \
          float* ar = acc + r * D + d; int32_t* ir = acc32 + r * D + d;                      \
          _mm512_storeu_ps(ar, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(ir)), wm, \
                                               _mm512_loadu_ps(ar)));                        \
          _mm512_storeu_si512(ir, _mm512_setzero_si512());                                   \
        }                                                                                    \
      }                                                                                      \
  }                                                                                          \
  STORE_ROW(out, acc, H * D);                                                                \
}
static inline void store512_f32(float* out, const float* acc, int n) { memcpy(out, acc, sizeof(float) * n); }
DEFINE_ONE_KV8_AVX512(one_kv8_f32_avx512, float, f2f, store512_f32)
DEFINE_ONE_KV8_AVX512(one_kv8_bf16_avx512, uint16_t, bf2f, store512_bf16)
#define KV8_VNNI(D, bs) ((D) % 32 == 0 && (D) <= 256 && (bs) % 16 == 0)
#else
#define KV8_VNNI(D, bs) 0
#define one_kv8_f32_avx512 one_kv8_f32_generic
#define one_kv8_bf16_avx512 one_kv8_bf16_generic
#endif

#define DEFINE_ONE_KV8_DISPATCH(NAME, T, SUFFIX)                                              \
static inline void NAME(T* out, const T* q, const int8_t* kc, const int8_t* vc,              \
    const float* ksc, const float* vsc, const int64_t* table, int64_t L, int64_t skip,      \
    int H, int Hkv, const int D, int bs, float scale, const float* sinks, float* scratch) {  \
  if (KV8_VNNI(D, bs)) one_kv8_##SUFFIX##_avx512(out, q, kc, vc, ksc, vsc, table, L, skip, H, Hkv, D, bs, scale, sinks, scratch); \
  else one_kv8_##SUFFIX##_generic(out, q, kc, vc, ksc, vsc, table, L, skip, H, Hkv, D, bs, scale, sinks, scratch); \
}
DEFINE_ONE_KV8_DISPATCH(one_kv8_f32, float, f32)
DEFINE_ONE_KV8_DISPATCH(one_kv8_bf16, uint16_t, bf16)

/* A decode batch of n rows on OpenMP threads: this links torch's own libgomp (same soname,
   already loaded), so it shares torch's thread pool instead of competing with it. Longest
   rows (they come sorted by context) are handed out first. scratch: one slice per thread.
   ks / vs: the int8 cache's scales (unused, may be NULL, for a cache in the model's dtype).
   window > 0: a sliding window, each row attending only its last `window` keys (positions
   ctx - window .. ctx - 1): its table read from the block holding the first of them, the
   keys before it in that block masked; blocks before it are never read (they may be freed).
   sinks: NULL, or a logit per query head (float32 [H]) in every row's softmax (softmax_rows). */
#define DEFINE_BATCH(NAME, ONE, T, CT)                                                        \
void NAME(T* out, int64_t out_stride, const T* q, int64_t q_stride, const CT* kc, const CT* vc, \
    const float* ks, const float* vs, const int64_t* bt, int64_t max_nb, const int64_t* ctx,  \
    int64_t n, int H, int Hkv, int D, int bs, int window, float scale, const float* sinks,   \
    float* scratch,                                                                          \
    int64_t scratch_size, int nthreads) {                                                    \
  _Pragma("omp parallel for schedule(dynamic, 1) num_threads(nthreads)")                    \
  for (int64_t i = 0; i < n; ++i) {                                                          \
    const int64_t b = n - 1 - i;                                                             \
    float* sc = scratch + omp_get_thread_num() * scratch_size;                               \
    const int64_t lo = window > 0 && ctx[b] > window ? ctx[b] - window : 0;                  \
    const int64_t b0 = lo / bs, skip = lo - b0 * bs, L = ctx[b] - b0 * bs;                   \
    T* o = out + b * out_stride; const T* qq = q + b * q_stride;                             \
    const int64_t* t = bt + b * max_nb + b0;                                                 \
    switch (D) {                                                                             \
      case 16: ONE(o, qq, kc, vc, ks, vs, t, L, skip, H, Hkv, 16, bs, scale, sinks, sc); break;      \
      case 32: ONE(o, qq, kc, vc, ks, vs, t, L, skip, H, Hkv, 32, bs, scale, sinks, sc); break;      \
      case 64: ONE(o, qq, kc, vc, ks, vs, t, L, skip, H, Hkv, 64, bs, scale, sinks, sc); break;      \
      case 128: ONE(o, qq, kc, vc, ks, vs, t, L, skip, H, Hkv, 128, bs, scale, sinks, sc); break;    \
      default: ONE(o, qq, kc, vc, ks, vs, t, L, skip, H, Hkv, D, bs, scale, sinks, sc);              \
    }                                                                                        \
  }                                                                                          \
}
DEFINE_BATCH(paged_decode_f32, one_f32, float, float)
DEFINE_BATCH(paged_decode_bf16, one_bf16, uint16_t, uint16_t)
DEFINE_BATCH(paged_decode_kv8_f32, one_kv8_f32, float, int8_t)
DEFINE_BATCH(paged_decode_kv8_bf16, one_kv8_bf16, uint16_t, int8_t)
