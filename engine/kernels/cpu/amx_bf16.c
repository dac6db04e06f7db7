/* y = x W^T (+ b) on AMX-bf16 tiles (tdpbf16ps), bf16 x, float32 sums, bf16 or float32 y; W
   from one of four sources: bf16 rows as they are, 4-bit w4 tiles, GGUF rows through
   gguf_dequant_row, or FP8 e4m3 rows through fp8_dequant_row_bf16. engine/kernels/cpu/amx_bf16.py says why and when. */
#include "tessera_kernels.h"
#include "bf16_convert.h"
#include "avx512_math.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>

/* A B tile: 16 pairs of k (32 k) x 16 columns, each pair two adjacent bf16 (64 bytes a pair
   row): 512 bf16. */
#define AMX_PANEL 16
#define AMX_KCHUNK 32
#define BTILE (AMX_PANEL * AMX_KCHUNK)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && \
    defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__F16C__)
#include <immintrin.h>
#include "amx_tiles.h"
#include <sys/syscall.h>
#include <unistd.h>

static int permitted = 0;  /* 0: not asked yet, 1: granted, -1: refused */
int amx_bf16_enabled(void) {
  if (!permitted)  /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA: Linux hands out the tiles on request */
    permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
  return permitted > 0;
}

/* The weight sources. */
typedef struct {
  int kind;
  const void* w;
  int64_t N, K, Kp, row_bytes;  /* row_bytes: GGUF rows' stride */
  int type;                     /* GGUF: ggml's type id */
  const float* scales;          /* FP8: scales [N, ceil(K / group)] */
  int64_t group;
} source;
enum { SRC_W4, SRC_GGUF, SRC_ROWS_BF16, SRC_FP8 };

/* The tiles (amx_tiles.h): sums C00 C01 C10 C11 in 0-3 (row tile, column panel), x's two row
   tiles in 4-5, the two panels' B tiles in 6-7. */

/* w4 tile p: per group of 32 k, 8 chunks of 32 bytes (chunk c: byte 2r + j = row r's code for
   k = 4c + j in its low nibble, 4c + 2 + j in its high one), then 16 float16 scales and 16
   minimums (w4.c). A chunk's low nibbles, in byte order, are B row 2c (pairs k = 4c, 4c + 1 of
   the 16 columns), its high nibbles B row 2c + 1: the codes are already in the tile's order. */
static void fill_w4(const uint8_t* tile, int64_t G, uint16_t* dst) {
  const __m512i pair_lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i pair_hi = _mm512_add_epi32(pair_lo, _mm512_set1_epi32(8));
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = tile + g * W4_GROUP_BYTES;
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(wg + 256)));
    const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(wg + 288)));
    const __m512 s0 = _mm512_permutexvar_ps(pair_lo, s), s1 = _mm512_permutexvar_ps(pair_hi, s);
    const __m512 m0 = _mm512_permutexvar_ps(pair_lo, mn), m1 = _mm512_permutexvar_ps(pair_hi, mn);
    uint16_t* d = dst + g * BTILE;
    for (int c = 0; c < 8; ++c) {
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(wg + 32 * c)));
      const __m512i q[2] = {_mm512_and_si512(v, low4), _mm512_srli_epi16(v, 4)};
      for (int h = 0; h < 2; ++h) {
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(q[h])));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(q[h], 1)));
        const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, s1, m1), _mm512_fmadd_ps(lo, s0, m0));
        _mm512_store_si512(d + (2 * c + h) * 32, (__m512i)w);
      }
    }
  }
}

/* A thread's share of a prefetch_ranges (lines [line, line + left) of them one after the
   other, from range idx), a few lines at each step of the tile loop: issued in one burst they
   filled the line buffers and stalled the tiles (measured: the GEMMs of a decode step 30%
   slower, against 11-18% spread out). */
typedef struct { const prefetch_ranges* r; int64_t idx, line, left, per; } prefetcher;
static inline int64_t lines_of(int64_t bytes) { return (bytes + 63) / 64; }
static void prefetcher_start(prefetcher* p, const prefetch_ranges* r, int64_t t, int64_t nt,
    int64_t steps) {
  *p = (prefetcher){r, 0, 0, 0, 0};
  if (!r || steps < 1) return;
  int64_t lines = 0;
  for (int64_t i = 0; i < r->n; ++i) lines += lines_of(r->bytes[i]);
  p->line = lines * t / nt;
  p->left = lines * (t + 1) / nt - p->line;
  p->per = (p->left + steps - 1) / steps;
  while (p->idx < r->n && p->line >= lines_of(r->bytes[p->idx])) p->line -= lines_of(r->bytes[p->idx++]);
}
static inline void prefetch_some(prefetcher* p) {
  for (int64_t k = p->per < p->left ? p->per : p->left; k > 0; --k, --p->left) {
    while (p->line == lines_of(p->r->bytes[p->idx])) { p->line = 0; ++p->idx; }  /* empty ranges */
    _mm_prefetch((const char*)p->r->ptr[p->idx] + 64 * p->line++, _MM_HINT_T0);
  }
}

/* The next unit's w4 groups decoded a few at a time inside the tile loop of the current one:
   the vector units decode while the tile unit multiplies, instead of one after the other
   (decoding alone took about as long as the tiles' products at 128 rows). The groups come
   from src (`first` of them), then from src2: a unit's two tiles, apart in memory for a
   gated pair. pf: the thread's prefetcher (NULL: none), stepped with the decoding. */
typedef struct { const uint8_t* src; const uint8_t* src2; uint16_t* dst; int64_t left, first, per; prefetcher* pf; } w4_decoder;
static inline void decode_some(w4_decoder* d) {
  if (!d) return;
  if (d->pf && d->pf->left > 0) prefetch_some(d->pf);
  if (d->left <= 0) return;
  int64_t n = d->left < d->per ? d->left : d->per;
  if (n > d->first) n = d->first;
  fill_w4(d->src, n, d->dst);
  d->src += n * W4_GROUP_BYTES; d->dst += n * BTILE; d->left -= n; d->first -= n;
  if (d->first == 0) { d->src = d->src2; d->first = d->left; }
}

/* Up to 32 rows (a0, a1: two row tiles, lda apart) x up to 32 columns (b0, b1: two panels of
   KC B tiles) -> out [32][32] float32. TM, TN (1 or 2): constants after inlining. */
static inline __attribute__((always_inline)) void block(const int TM, const int TN,
    const uint16_t* a0, const uint16_t* a1, int64_t lda, const uint16_t* b0,
    const uint16_t* b1, int64_t KC, float* out, w4_decoder* dec) {
  _tile_zero(0);
  if (TN > 1) _tile_zero(1);
  if (TM > 1) { _tile_zero(2); if (TN > 1) _tile_zero(3); }
  for (int64_t kc = 0; kc < KC; ++kc) {
    decode_some(dec);
    _tile_loadd(4, a0 + kc * AMX_KCHUNK, lda * 2);
    _tile_loadd(6, b0 + kc * BTILE, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (TN > 1) { _tile_loadd(7, b1 + kc * BTILE, 64); _tile_dpbf16ps(1, 4, 7); }
    if (TM > 1) {
      _tile_loadd(5, a1 + kc * AMX_KCHUNK, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
      if (TN > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out, 128);
  if (TN > 1) _tile_stored(1, out + 16, 128);
  if (TM > 1) { _tile_stored(2, out + 16 * 32, 128); if (TN > 1) _tile_stored(3, out + 16 * 32 + 16, 128); }
}

/* out's rows [0, mr) and columns [0, nc) (+ bias) -> y at (m0, n0). */
static void epilogue(const float* out, int mr, int nc, int64_t m0, int64_t n0,
    const uint16_t* bias, void* y, int64_t ldy, int out_f32) {
  for (int h = 0; h < nc; h += 16) {
    const int cnt = nc - h < 16 ? nc - h : 16;
    const __mmask16 keep = (__mmask16)((1u << cnt) - 1);
    __m512 b = _mm512_setzero_ps();
    if (bias)
      b = bf16x16_to_f32(_mm256_maskz_loadu_epi16(keep, bias + n0 + h));
    for (int i = 0; i < mr; ++i) {
      const __m512 v = _mm512_add_ps(_mm512_loadu_ps(out + i * 32 + h), b);
      const int64_t at = (m0 + i) * ldy + n0 + h;
      if (out_f32) _mm512_mask_storeu_ps((float*)y + at, keep, v);
      else _mm256_mask_storeu_epi16((uint16_t*)y + at, keep, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

/* The gated MLP's epilogue: out's columns 0-15 are gate outputs, 16-31 the up outputs of the
   same 16 units; rows [0, mr) -> silu(gate) * up at y's columns [n0, n0 + 16), with the
   roundings of the unfused path (gate_up's outputs to bf16, then SiluAndMul). */
static void epilogue_gated(const float* out, int mr, int64_t m0, int64_t n0, uint16_t* y,
    int64_t ldy) {
  for (int i = 0; i < mr; ++i) {
    const __m512 g = bf16x16_to_f32(f2bf512(_mm512_loadu_ps(out + i * 32)));
    const __m512 u = bf16x16_to_f32(f2bf512(_mm512_loadu_ps(out + i * 32 + 16)));
    _mm256_storeu_si256((__m256i*)(y + (m0 + i) * ldy + n0), silu_mul_bf16x16(g, u));
  }
}

/* x as the A tiles read it: rows of a whole number of k chunks, 16 rows a tile. Full row tiles
   read x itself where K % 32 == 0; otherwise (and for the last, partial row tile) a zero-padded
   copy. */
typedef struct { const uint16_t* x; int64_t ldx; const uint16_t* tail; int64_t full; uint16_t* buf; } x_tiles;
static int x_prepare(x_tiles* t, const uint16_t* x, int64_t ldx, int64_t M, int64_t K, int64_t Kp) {
  const int64_t Mp = (M + 15) / 16 * 16;
  const int copy_all = K != Kp;
  t->full = copy_all ? 0 : M / 16 * 16;
  const int64_t rows = Mp - t->full;
  t->buf = NULL;
  if (rows) {
    t->buf = (uint16_t*)aligned_alloc(64, (size_t)(rows * Kp * 2 + 63) / 64 * 64);
    if (!t->buf) return -1;
    memset(t->buf, 0, (size_t)rows * Kp * 2);
    for (int64_t m = t->full; m < M; ++m)
      memcpy(t->buf + (m - t->full) * Kp, x + m * ldx, (size_t)K * 2);
  }
  t->x = x; t->ldx = ldx; t->tail = t->buf;
  return 0;
}
static inline const uint16_t* x_rows(const x_tiles* t, int64_t m0, int64_t Kp, int64_t* ld) {
  if (m0 < t->full) { *ld = t->ldx; return t->x + m0 * t->ldx; }
  *ld = Kp;
  return t->tail + (m0 - t->full) * Kp;
}

/* Rows [m_begin, M) of x (m_begin a multiple of 32) against the column pair at b0 (and b1
   when nc > 16): out -> y (gated: silu(b0's) * b1's, 16 columns at n0); dec (or NULL): the
   next pair's decoding, spread over the tile loop and finished here. */
static void rows_against(const x_tiles* xt, int64_t m_begin, int64_t M, int64_t Kp,
    const uint16_t* b0, const uint16_t* b1, int nc, int64_t n0, const uint16_t* bias, void* y,
    int64_t ldy, int out_f32, int gated, w4_decoder* dec) {
  float out[32 * 32] __attribute__((aligned(64)));
  const int64_t KC = Kp / AMX_KCHUNK;
  if (dec) {  /* groups per k chunk of the loop, so that the decoding ends with it */
    const int64_t steps = (M - m_begin + 31) / 32 * KC;
    dec->per = (dec->left + steps - 1) / steps;
  }
  for (int64_t m0 = m_begin; m0 < M; m0 += 32) {
    const int mr = M - m0 < 32 ? (int)(M - m0) : 32;
    int64_t lda0, lda1 = 0;
    const uint16_t* a0 = x_rows(xt, m0, Kp, &lda0);
    const uint16_t* a1 = mr > 16 ? x_rows(xt, m0 + 16, Kp, &lda1) : NULL;
    if (a1 && lda1 != lda0) {  /* the two tiles come from x and the tail copy: one at a time */
      for (int h = 0; h < 2; ++h) {
        const uint16_t* a = h ? a1 : a0;
        const int64_t lda = h ? lda1 : lda0;
        if (nc > 16) block(1, 2, a, a, lda, b0, b1, KC, out, dec);
        else block(1, 1, a, a, lda, b0, b0, KC, out, dec);
        if (gated) epilogue_gated(out, h ? mr - 16 : 16, m0 + 16 * h, n0, (uint16_t*)y, ldy);
        else epilogue(out, h ? mr - 16 : 16, nc, m0 + 16 * h, n0, bias, y, ldy, out_f32);
      }
      continue;
    }
    if (a1) {
      if (nc > 16) block(2, 2, a0, a1, lda0, b0, b1, KC, out, dec);
      else block(2, 1, a0, a1, lda0, b0, b0, KC, out, dec);
    } else {
      if (nc > 16) block(1, 2, a0, a0, lda0, b0, b1, KC, out, dec);
      else block(1, 1, a0, a0, lda0, b0, b0, KC, out, dec);
    }
    if (gated) epilogue_gated(out, mr, m0, n0, (uint16_t*)y, ldy);
    else epilogue(out, mr, nc, m0, n0, bias, y, ldy, out_f32);
  }
  while (dec && dec->left > 0) decode_some(dec);
}

/* Bytes of x per pass over the w4 weights (a multiple of 32 rows, at least 32): the block stays
   in L2 while every column pair runs over it. A prefill chunk of 1,024-2,048 rows x K = 576
   (1.2-2.4 MB) read whole for each pair was streamed again from L3 96 times for gate_up;
   blocked, each pair is decoded once per block instead (~10% of the block's tile work at
   K = 1,536 and 160 rows). */
#ifndef AMX_W4_BLOCK_BYTES
#define AMX_W4_BLOCK_BYTES (512 * 1024)
#endif

/* w4 tiles as B, a unit of two tiles at a time: a column pair (tiles 2p and 2p + 1: 32
   outputs), or, gated (N = 2 I, gate rows then up rows, I % 16 == 0), gate tile p with up
   tile I / 16 + p: 16 outputs silu(gate) * up. Units are split over the threads in runs; per
   block of x's rows each thread decodes its first unit's B tiles into a buffer (K * 64 bytes:
   in L2), then runs the block's row tiles over each unit while it decodes the next one into
   the other buffer. Decode batches (up to a few hundred rows) are one block. */
/* Unit p's first (h = 0) and second (h = 1) tile. */
static inline int64_t unit_tile(int64_t p, int h, int gated, int64_t panels) {
  return gated ? h * (panels / 2) + p : 2 * p + h;
}

static int amx_run_w4(const source* s, const uint16_t* x, int64_t ldx, int64_t M,
    const uint16_t* bias, void* y, int64_t ldy, int out_f32, int gated,
    const prefetch_ranges* pf, int nthreads) {
  if (M < 1) return 0;
  if (!amx_bf16_enabled()) return -1;
  const int64_t N = s->N, Kp = s->Kp, KC = Kp / AMX_KCHUNK;
  x_tiles xt;
  if (x_prepare(&xt, x, ldx, M, s->K, Kp)) return -1;
  const int64_t panels = (N + 15) / 16, units = gated ? panels / 2 : (panels + 1) / 2;
  int64_t mblock = AMX_W4_BLOCK_BYTES / (Kp * 2) / 32 * 32;
  if (mblock < 32) mblock = 32;
  const uint8_t* w = (const uint8_t*)s->w;
  const int64_t tile_bytes = KC * W4_GROUP_BYTES;
  int failed = 0;
  _Pragma("omp parallel num_threads(nthreads) if(nthreads > 1 && units > 1) reduction(|:failed)")
  {
    const int64_t pair_elems = 2 * KC * BTILE;
    uint16_t* bufs = (uint16_t*)aligned_alloc(64, (size_t)2 * pair_elems * 2);
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t p_begin = units * t / nt, p_end = units * (t + 1) / nt;
    if (!bufs) failed = 1;
    else {
      tiles_begin();
      prefetcher pfr;  /* one step per k chunk of each unit's row tiles (block) */
      prefetcher_start(&pfr, pf, t, nt, (p_end - p_begin) * ((M + 31) / 32) * KC);
      for (int64_t mb = 0; mb < M && p_begin < p_end; mb += mblock) {
        const int64_t mb_end = M - mb < mblock ? M : mb + mblock;
        uint16_t* cur = bufs; uint16_t* nxt = bufs + pair_elems;
        for (int64_t p = p_begin; p < p_end; ++p) {
          /* the columns of its blocks: 32 (gated: 16 gate, 16 up), or the last pair's fewer */
          const int nc = gated ? 32 : (N - 32 * p < 32 ? (int)(N - 32 * p) : 32);
          if (p == p_begin) {
            fill_w4(w + unit_tile(p, 0, gated, panels) * tile_bytes, KC, cur);
            if (nc > 16) fill_w4(w + unit_tile(p, 1, gated, panels) * tile_bytes, KC, cur + KC * BTILE);
          }
          w4_decoder dec = {.pf = pfr.left > 0 ? &pfr : NULL};
          if (p + 1 < p_end) {  /* the next unit's tiles: 2, or the last pair's 1 */
            const int64_t q = p + 1, tiles = gated || N - 32 * q > 16 ? 2 : 1;
            dec = (w4_decoder){w + unit_tile(q, 0, gated, panels) * tile_bytes,
                               w + unit_tile(q, 1, gated, panels) * tile_bytes, nxt, tiles * KC, KC, 1,
                               dec.pf};
          }
          rows_against(&xt, mb, mb_end, Kp, cur, cur + KC * BTILE, nc,
                       gated ? 16 * p : 32 * p, bias, y, ldy, out_f32, gated,
                       p + 1 < p_end || dec.pf ? &dec : NULL);
          uint16_t* tmp = cur; cur = nxt; nxt = tmp;
        }
      }
      _tile_release();
    }
    free(bufs);
  }
  free(xt.buf);
  return failed ? -1 : 0;
}


/* ---- W as the A operand: row-major weights (bf16 as they are, GGUF or FP8 rows decoded) ----
   tdpbf16ps's A tiles are 16 rows of 32 k as they lie in memory, so 16 weight rows load
   straight from W; x (small at these batches) is the one rearranged, once per call, into B
   tiles (16 pairs of k x 16 rows of x). The sums come out transposed (16 outputs x 16 rows of
   x) and are turned back on the way out. */

/* x [M][K] -> xb: per 16 rows of x, K / 32 B tiles (pair p of row m at dword p * 16 + m);
   rows past M and k past K zero. */
static void x_to_b(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, int64_t Kp, uint16_t* xb) {
  const int64_t KC = Kp / AMX_KCHUNK;
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    for (int64_t kc = 0; kc < KC; ++kc) {
      const int64_t k0 = kc * AMX_KCHUNK;
      const __mmask32 kmask = K - k0 >= 32 ? (__mmask32)~0u : (__mmask32)((1ull << (K - k0)) - 1);
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = m0 + i < M ? _mm512_maskz_loadu_epi16(kmask, x + (m0 + i) * ldx + k0) : _mm512_setzero_si512();
      transpose16(r);
      uint16_t* d = xb + ((m0 / 16) * KC + kc) * BTILE;
      for (int p = 0; p < 16; ++p) _mm512_store_si512(d + p * 32, r[p]);
    }
  }
}

/* Weight row n (zero past N) into d [Kp] bf16: copied (bf16 weights) or decoded (FP8 rows
   straight to bf16; GGUF rows through row: Kp floats). */
static int row_to_buf(const source* s, int64_t n, float* row, uint16_t* d) {
  if (n >= s->N) { memset(d, 0, (size_t)s->Kp * 2); return 0; }
  if (s->kind == SRC_ROWS_BF16) {
    memcpy(d, (const uint16_t*)s->w + n * s->K, (size_t)s->K * 2);
    memset(d + s->K, 0, (size_t)(s->Kp - s->K) * 2);
    return 0;
  }
  if (s->kind == SRC_FP8) {  /* K % 32 == 0: no padding */
    const int64_t ng = (s->K + s->group - 1) / s->group;
    /* one scale a row: the exact values (the epilogue scales the sums) */
    const float* scales = s->group >= s->K ? NULL : s->scales + n * ng;
    return fp8_dequant_row_bf16((const uint8_t*)s->w + n * s->K, scales, s->group, s->K, d);
  }
  if (gguf_dequant_row(s->type, (const uint8_t*)s->w + n * s->row_bytes, s->K, row)) return -1;
  int64_t k = 0;
  for (; k + 32 <= s->K; k += 32)
    _mm512_storeu_si512(d + k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + k + 16), _mm512_loadu_ps(row + k)));
  for (; k < s->K; ++k) d[k] = f2bf(row[k]);
  for (; k < s->Kp; ++k) d[k] = 0;
  return 0;
}

/* Weight rows n0.. (up to 16; the rest zero) into buf [16][Kp] bf16 (row_to_buf). */
static int rows_to_buf(const source* s, int64_t n0, float* row, uint16_t* buf) {
  for (int r = 0; r < AMX_PANEL; ++r)
    if (row_to_buf(s, n0 + r, row, buf + r * s->Kp)) return -1;
  return 0;
}

/* FP8 with one scale a row: the next pair's weight rows decoded a piece at a time inside the
   tile loop of the current pair, as w4_decoder does for w4 tiles: the vector units decode
   while the tile unit multiplies, instead of one after the other (one Xeon core, 40 layers of
   2048 x 5632 past L3: 4-32-row calls 45-57 ms against 49-62). Pieces of FP8_PIECE inputs: a
   whole row a k chunk (thousands of values between two tile products) left the tile unit
   idle, 60-71 ms. per: pieces a call, so that the pair's rows are done within its loop. Other
   sources, block scales (their scaled decoding interleaved: 63-75 ms against 53-64) and K not
   a multiple of FP8_PIECE decode each pair whole before its loop. */
#define FP8_PIECE 256
typedef struct {
  const source* s; uint16_t* dst;
  int64_t n, left, k, per;  /* left: rows; k: the next piece's first input */
  int failed;
} rows_decoder;
static inline int decodes_in_pieces(const source* s) {
  return s->kind == SRC_FP8 && s->group >= s->K && s->K % FP8_PIECE == 0;
}
static inline void rows_decode_some(rows_decoder* d) {
  if (!d) return;
  for (int64_t i = 0; i < d->per && d->left > 0; ++i) {
    const source* s = d->s;
    if (d->n >= s->N) {  /* past the weight: a row of zeros */
      if (row_to_buf(s, d->n, NULL, d->dst)) d->failed = 1;
      d->k = s->Kp;
    } else {  /* the exact values (the epilogue scales the sums) */
      if (fp8_dequant_row_bf16((const uint8_t*)s->w + d->n * s->K + d->k, NULL, FP8_PIECE,
                               FP8_PIECE, d->dst + d->k))
        d->failed = 1;
      d->k += FP8_PIECE;
    }
    if (d->k >= s->Kp) { d->k = 0; ++d->n; d->dst += s->Kp; --d->left; }
  }
}

/* C tiles as A0/A1 (weight rows n0.., n0 + 16..) x B0/B1 (x rows m0.., m0 + 16..); a row of
   dec's decoded at each k chunk. */
static inline __attribute__((always_inline)) void block_t(const int TN, const int TM,
    const uint16_t* a0, const uint16_t* a1, int64_t lda, const uint16_t* b0,
    const uint16_t* b1, int64_t KC, float* out, rows_decoder* dec) {
  _tile_zero(0);
  if (TM > 1) _tile_zero(1);
  if (TN > 1) { _tile_zero(2); if (TM > 1) _tile_zero(3); }
  for (int64_t kc = 0; kc < KC; ++kc) {
    rows_decode_some(dec);
    _tile_loadd(6, b0 + kc * BTILE, 64);
    if (TM > 1) _tile_loadd(7, b1 + kc * BTILE, 64);
    _tile_loadd(4, a0 + kc * AMX_KCHUNK, lda * 2);
    _tile_dpbf16ps(0, 4, 6);
    if (TM > 1) _tile_dpbf16ps(1, 4, 7);
    if (TN > 1) {
      _tile_loadd(5, a1 + kc * AMX_KCHUNK, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
      if (TM > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out, 128);
  if (TM > 1) _tile_stored(1, out + 16, 128);
  if (TN > 1) { _tile_stored(2, out + 16 * 32, 128); if (TM > 1) _tile_stored(3, out + 16 * 32 + 16, 128); }
}

/* out [32 outputs][32 rows of x] -> y rows m0.. (mr), columns n0.. (nc) (times wscale, a
   float32 per output, where not NULL; + bias). */
static void epilogue_t(const float* out, int mr, int nc, int64_t m0, int64_t n0,
    const float* wscale, const uint16_t* bias, void* y, int64_t ldy, int out_f32) {
  for (int hn = 0; hn < nc; hn += 16) {
    const int cnt = nc - hn < 16 ? nc - hn : 16;
    const __mmask16 keep = (__mmask16)((1u << cnt) - 1);
    __m512 b = _mm512_setzero_ps();
    if (bias)
      b = bf16x16_to_f32(_mm256_maskz_loadu_epi16(keep, bias + n0 + hn));
    const __m512 ws = wscale ? _mm512_maskz_loadu_ps(keep, wscale + n0 + hn) : _mm512_set1_ps(1.f);
    for (int hm = 0; hm < mr; hm += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(out + (hn + i) * 32 + hm);
      transpose16(r);
      const int rows = mr - hm < 16 ? mr - hm : 16;
      for (int i = 0; i < rows; ++i) {
        const __m512 v = _mm512_fmadd_ps(_mm512_castsi512_ps(r[i]), ws, b);
        const int64_t at = (m0 + hm + i) * ldy + n0 + hn;
        if (out_f32) _mm512_mask_storeu_ps((float*)y + at, keep, v);
        else _mm256_mask_storeu_epi16((uint16_t*)y + at, keep, (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
}

/* out [32 outputs][32 rows of x] folded into each row's running argmax over columns n0..
   (nc): best / at, this thread's, rows m0.. (mr). The sums are rounded to bf16 first, as the
   epilogue stores them (the logits a bf16 LM head returns, whose ties the first column wins).
   Columns come in increasing order and only a strictly larger value replaces the best: the
   first maximum wins, as torch.argmax. */
static void argmax_fold_t(const float* out, int mr, int nc, int64_t m0, int64_t n0, float* best,
    int64_t* at) {
  for (int hm = 0; hm < mr; hm += 16) {
    const __mmask16 rows = mr - hm >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (mr - hm)) - 1);
    __m512 b = _mm512_maskz_loadu_ps(rows, best + m0 + hm);
    __m512i a = _mm512_maskz_loadu_epi64((__mmask8)rows, at + m0 + hm);
    __m512i a2 = _mm512_maskz_loadu_epi64((__mmask8)(rows >> 8), at + m0 + hm + 8);
    for (int n = 0; n < nc; ++n) {
      const __m512 v =
          bf16x16_to_f32((__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(out + n * 32 + hm)));
      const __mmask16 gt = _mm512_cmp_ps_mask(v, b, _CMP_GT_OQ);
      b = _mm512_mask_mov_ps(b, gt, v);
      const __m512i col = _mm512_set1_epi64(n0 + n);
      a = _mm512_mask_mov_epi64(a, (__mmask8)gt, col);
      a2 = _mm512_mask_mov_epi64(a2, (__mmask8)(gt >> 8), col);
    }
    _mm512_mask_storeu_ps(best + m0 + hm, rows, b);
    _mm512_mask_storeu_epi64(at + m0 + hm, (__mmask8)rows, a);
    _mm512_mask_storeu_epi64(at + m0 + hm + 8, (__mmask8)(rows >> 8), a2);
  }
}

/* Rows of x per pass over the weights: their B tiles (AMX_M_BLOCK x K bf16) stay in L2 while
   every weight pair runs over them; a prefill chunk of 2,048 rows x K = 1,536 would not. */
#define AMX_M_BLOCK 256
/* argmax (or NULL): y is not written; each row's first maximum's column goes there instead
   (the LM head's greedy tokens without the logits in memory). */
static int amx_run_t(const source* s, const uint16_t* x, int64_t ldx, int64_t M,
    const uint16_t* bias, void* y, int64_t ldy, int out_f32, int nthreads, int64_t* argmax) {
  if (M < 1) return 0;
  if (!amx_bf16_enabled()) return -1;
  const int64_t N = s->N, K = s->K, Kp = s->Kp, KC = Kp / AMX_KCHUNK, Mp = (M + 15) / 16 * 16;
  uint16_t* xb = (uint16_t*)aligned_alloc(64, (size_t)Mp * Kp * 2);
  if (!xb) return -1;
  /* per thread: each row's best value and its column over the thread's columns */
  float* best = NULL; int64_t* at = NULL;
  if (argmax) {
    best = (float*)malloc(sizeof(float) * nthreads * M);
    at = (int64_t*)malloc(sizeof(int64_t) * nthreads * M);
    if (!best || !at) { free(best); free(at); free(xb); return -1; }
    for (int64_t i = 0; i < nthreads * M; ++i) { best[i] = -INFINITY; at[i] = 0; }
  }
  x_to_b(x, ldx, M, K, Kp, xb);
  const int64_t tiles = (N + 15) / 16, pairs = (tiles + 1) / 2;
  /* bf16 rows are read in place where whole tiles of 16 rows and 32 k exist */
  const int direct = s->kind == SRC_ROWS_BF16 && K == Kp;
  /* FP8 with one scale a row: its rows decode to the exact values, the scale on each sum */
  const float* wscale = s->kind == SRC_FP8 && s->group >= K ? s->scales : NULL;
  const int pieces = decodes_in_pieces(s);
  int failed = 0;
  _Pragma("omp parallel num_threads(nthreads) if(nthreads > 1 && pairs > 1) reduction(|:failed)")
  {
    float out[32 * 32] __attribute__((aligned(64)));
    /* two pairs' rows: the current pair's, and the next one's being decoded */
    uint16_t* buf = (uint16_t*)aligned_alloc(64, (size_t)2 * 32 * Kp * 2);
    float* row = s->kind == SRC_GGUF ? (float*)aligned_alloc(64, (size_t)(Kp * 4 + 63) / 64 * 64) : NULL;
    if (!buf || (s->kind == SRC_GGUF && !row)) failed = 1;
    /* each thread a run of pairs, in increasing order (the argmax's merge relies on it) */
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t p_begin = pairs * t / nt, p_end = failed ? p_begin : pairs * (t + 1) / nt;
    tiles_begin();
    for (int64_t mb = 0; mb < M && !failed; mb += AMX_M_BLOCK) {
      const int64_t mb_end = M - mb < AMX_M_BLOCK ? M : mb + AMX_M_BLOCK;
      uint16_t* cur = buf;
      uint16_t* nxt = buf + 32 * Kp;
      int ready = 0;  /* cur holds this pair's rows, decoded during the pair before */
      for (int64_t p = p_begin; p < p_end && !failed; ++p) {
        const int64_t n0 = p * 32;
        const int nc = N - n0 < 32 ? (int)(N - n0) : 32;
        const uint16_t* a[2];
        int64_t lda = Kp;
        if (direct && nc == 32) {
          a[0] = (const uint16_t*)s->w + n0 * K; a[1] = a[0] + 16 * K; lda = K;
        } else {
          if (!ready)
            for (int h = 0; h < 2 && 16 * h < nc; ++h)
              if (rows_to_buf(s, n0 + 16 * h, row, cur + h * 16 * Kp)) failed = 1;
          a[0] = cur; a[1] = cur + 16 * Kp;
        }
        if (failed) break;
        rows_decoder dec = {0};
        ready = pieces && p + 1 < p_end;
        if (ready) {  /* the next pair's 16 or 32 rows (past N: zeros) */
          const int64_t next = n0 + 32, rows = N - next > 16 ? 32 : 16;
          const int64_t count = rows * (K / FP8_PIECE), calls = KC * ((mb_end - mb + 31) / 32);
          dec = (rows_decoder){s, nxt, next, rows, 0, (count + calls - 1) / calls, 0};
        }
        rows_decoder* dp = ready ? &dec : NULL;
        for (int64_t m0 = mb; m0 < mb_end; m0 += 32) {
          const int mr = mb_end - m0 < 32 ? (int)(mb_end - m0) : 32;
          const uint16_t* b0 = xb + (m0 / 16) * KC * BTILE, *b1 = b0 + KC * BTILE;
          if (nc > 16) {
            if (mr > 16) block_t(2, 2, a[0], a[1], lda, b0, b1, KC, out, dp);
            else block_t(2, 1, a[0], a[1], lda, b0, b0, KC, out, dp);
          } else {
            if (mr > 16) block_t(1, 2, a[0], a[0], lda, b0, b1, KC, out, dp);
            else block_t(1, 1, a[0], a[0], lda, b0, b0, KC, out, dp);
          }
          if (argmax)
            argmax_fold_t(out, mr, nc, m0, n0, best + t * M, at + t * M);
          else
            epilogue_t(out, mr, nc, m0, n0, wscale, bias, y, ldy, out_f32);
        }
        while (dp && dec.left > 0) rows_decode_some(dp);
        if (dec.failed) failed = 1;
        if (ready) { uint16_t* tmp = cur; cur = nxt; nxt = tmp; }
      }
    }
    _tile_release();
    free(buf);
    free(row);
  }
  free(xb);
  if (argmax) {  /* threads hold increasing column ranges (static): a later one wins only if larger */
    for (int64_t m = 0; m < M; ++m) {
      float b = best[m]; int64_t a = at[m];
      for (int t = 1; t < nthreads; ++t)
        if (best[t * M + m] > b) { b = best[t * M + m]; a = at[t * M + m]; }
      argmax[m] = a;
    }
    free(best); free(at);
  }
  return failed ? -1 : 0;
}

int amx_bf16_linear(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w,
    int64_t N, const uint16_t* bias, void* y, int64_t ldy, int out_f32, int nthreads) {
  const source s = {SRC_ROWS_BF16, w, N, K, (K + 31) / 32 * 32, 0, 0, NULL, 0};
  return amx_run_t(&s, x, ldx, M, bias, y, ldy, out_f32, nthreads, NULL);
}

int amx_bf16_linear_argmax(const uint16_t* x, int64_t ldx, int64_t M, int64_t K,
    const uint16_t* w, int64_t N, int64_t* argmax, int nthreads) {
  const source s = {SRC_ROWS_BF16, w, N, K, (K + 31) / 32 * 32, 0, 0, NULL, 0};
  return amx_run_t(&s, x, ldx, M, NULL, NULL, 0, 1, nthreads, argmax);
}

int amx_bf16_linear_w4(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* tiles,
    int64_t N, const uint16_t* bias, void* y, int64_t ldy, int out_f32, int nthreads) {
  return amx_bf16_linear_w4_prefetch(x, ldx, M, K, tiles, N, bias, y, ldy, out_f32, NULL, nthreads);
}

int amx_bf16_linear_w4_prefetch(const uint16_t* x, int64_t ldx, int64_t M, int64_t K,
    const uint8_t* tiles, int64_t N, const uint16_t* bias, void* y, int64_t ldy, int out_f32,
    const prefetch_ranges* pf, int nthreads) {
  if (K % 32) return -1;
  const source s = {SRC_W4, tiles, N, K, K, 0, 0, NULL, 0};
  return amx_run_w4(&s, x, ldx, M, bias, y, ldy, out_f32, 0, pf, nthreads);
}

int amx_bf16_gated_w4(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* tiles,
    int64_t I, uint16_t* y, int64_t ldy, int nthreads) {
  if (K % 32 || I % 16 || I < 16) return -1;
  const source s = {SRC_W4, tiles, 2 * I, K, K, 0, 0, NULL, 0};
  return amx_run_w4(&s, x, ldx, M, NULL, y, ldy, 0, 1, NULL, nthreads);
}

int amx_bf16_linear_gguf(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* rows,
    int64_t row_bytes, int type, int64_t N, const uint16_t* bias, void* y, int64_t ldy,
    int out_f32, int nthreads) {
  const source s = {SRC_GGUF, rows, N, K, (K + 31) / 32 * 32, row_bytes, type, NULL, 0};
  return amx_run_t(&s, x, ldx, M, bias, y, ldy, out_f32, nthreads, NULL);
}

int amx_bf16_linear_fp8(const uint16_t* x, int64_t ldx, int64_t M, int64_t K,
    const uint8_t* codes, const float* scales, int64_t G, int64_t N, const uint16_t* bias,
    void* y, int64_t ldy, int out_f32, int nthreads) {
  if (K <= 0 || K % 32 || G <= 0 || (G % 32 && G < K)) return -1;
  const source s = {SRC_FP8, codes, N, K, K, 0, 0, scales, G};
  return amx_run_t(&s, x, ldx, M, bias, y, ldy, out_f32, nthreads, NULL);
}
#else
/* Built without AMX-bf16: nothing runs here, the callers keep their other paths. */
int amx_bf16_enabled(void) { return 0; }
int amx_bf16_linear(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w,
    int64_t N, const uint16_t* bias, void* y, int64_t ldy, int out_f32, int nthreads) { return -1; }
int amx_bf16_linear_argmax(const uint16_t* x, int64_t ldx, int64_t M, int64_t K,
    const uint16_t* w, int64_t N, int64_t* argmax, int nthreads) { return -1; }
int amx_bf16_linear_w4(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* tiles,
    int64_t N, const uint16_t* bias, void* y, int64_t ldy, int out_f32, int nthreads) { return -1; }
int amx_bf16_linear_w4_prefetch(const uint16_t* x, int64_t ldx, int64_t M, int64_t K,
    const uint8_t* tiles, int64_t N, const uint16_t* bias, void* y, int64_t ldy, int out_f32,
    const prefetch_ranges* pf, int nthreads) { return -1; }
int amx_bf16_linear_gguf(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* rows,
    int64_t row_bytes, int type, int64_t N, const uint16_t* bias, void* y, int64_t ldy,
    int out_f32, int nthreads) { return -1; }
int amx_bf16_gated_w4(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* tiles,
    int64_t I, uint16_t* y, int64_t ldy, int nthreads) { return -1; }
int amx_bf16_linear_fp8(const uint16_t* x, int64_t ldx, int64_t M, int64_t K,
    const uint8_t* codes, const float* scales, int64_t G, int64_t N, const uint16_t* bias,
    void* y, int64_t ldy, int out_f32, int nthreads) { return -1; }
#endif
