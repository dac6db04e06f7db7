/* A step's LoRA deltas on AMX-bf16 tiles: lora.c's lora_apply_bf16w (bf16 rows, bf16 slots,
   the same arguments) with its products on tdpbf16ps (engine/kernels/cpu/lora.py).

   Why: on vdpbf16ps and float32 FMAs the kernel ran at ~80 GFLOP/s, 4 ms of a 32-stream
   decode step of 16.6 ms on a 2-core Sapphire Rapids slice (SmolLM2-135M, one rank-16 adapter
   on all seven projections); one tile product is 8,192 multiply-adds.

   The segments (rows grouped by slot) are cut into row tiles of 16 (a segment's last tile
   padded with zero rows), a tile a task for the threads, each task three steps:
   1. pack: the tile's rows of x as a tile's B operand, chunk kc (32 k) row kk holding the 16
      rows' pairs (k = 32 kc + 2 kk, + 1): a transpose of 32-bit pairs;
   2. shrink, S^T = A X^T: 16 of the slot's A rows as they lie in memory are the A operand,
      the packed tile the B operand, four blocks of 16 at once; the sums go to the tile's s
      rows in bf16, as a bf16 model's peft rounds lora_A(x) (the float32 and vector kernels
      keep them float32);
   3. expand, Y += S B: the tile's s rows (32 ranks a chunk) are the A operand, B^T's rows
      paired into the B operand 64 output columns at a time (ranks past the slice's zero),
      the sums added to the tile's y rows, each rounded to bf16 once.
   No task reads another's s rows or writes its y rows: no barrier but the region's end (two
   passes with a barrier between them: 0.6-0.8 ms more a step over its 120 calls, measured
   on the kernel alone).
   1 (not taken) where the CPU or the OS gives no AMX-bf16 or K % 32: the caller runs the
   vector kernel. The torch path is the reference (tests). */
#include "tessera_kernels.h"
#include "bf16_convert.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && \
    defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#define HAVE_AMX_LORA 1
#else
#define HAVE_AMX_LORA 0
#endif

#if HAVE_AMX_LORA
#include <omp.h>
#include "amx_tiles.h"

#define RT 16       /* rows of a row tile; columns of a panel */
#define KCH 32      /* k (or ranks) of one tile product */
#define CHUNK 512   /* bf16 of one B tile: 16 pairs x 16 columns x 2 */
#define COLS 64     /* output columns of an expand block: four panels */
/* Multiply-adds from which a call is split over threads (lora.c's LORA_PAR_WORK) */
#define PAR_WORK (1 << 18)
/* B^T's rows prefetched this many columns ahead of the block being paired (a block) */
#define PF_COLS COLS

/* x's rows r[0..n) (n <= 16; rows past n zero) as KC B tiles. */
static void pack_rows(const uint16_t* x, int64_t ldx, const int32_t* r, int n, int64_t KC,
    uint16_t* dst) {
  for (int64_t kc = 0; kc < KC; ++kc) {
    __m512i v[16];
    for (int t = 0; t < RT; ++t)
      v[t] = t < n ? _mm512_loadu_si512(x + (int64_t)r[t] * ldx + kc * KCH) : _mm512_setzero_si512();
    transpose16(v);
    for (int kk = 0; kk < RT; ++kk) _mm512_store_si512(dst + kc * CHUNK + kk * KCH, v[kk]);
  }
}

/* B^T's rows q0 .. q0 + 32 (those below r) over columns [o0, o0 + n), paired as the B tiles
   of one rank chunk, one per panel of 16 columns (np of them; zero past n). Pair rows past r
   must be zero (s's columns there hold the next slice's sums): *zero_from is the first pair
   row of this chunk's buffer known zero in every panel, kept across calls. */
static void pack_bt(const uint16_t* bt, int64_t out, int32_t q0, int32_t r, int64_t n, int np,
    uint16_t* dst, int* zero_from) {
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
      9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const int rows = r - q0 >= KCH ? RT : (r - q0 + 1) / 2;  /* pair rows holding ranks < r */
  for (int p = 0; p < 4; ++p) {
    const int64_t left = n - RT * p;
    const __mmask16 m = left >= RT ? (__mmask16)0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
    for (int kk = 0; kk < (p < np ? rows : 0); ++kk) {
      const int32_t q = q0 + 2 * kk;
      const __m256i lo = _mm256_maskz_loadu_epi16(m, bt + (int64_t)q * out + RT * p);
      const __m256i hi = q + 1 < r ? _mm256_maskz_loadu_epi16(m, bt + (int64_t)(q + 1) * out + RT * p) : _mm256_setzero_si256();
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      _mm512_store_si512(dst + p * CHUNK + kk * KCH, _mm512_permutexvar_epi16(pairs, both));
    }
    for (int kk = rows; kk < *zero_from; ++kk) _mm512_store_si512(dst + p * CHUNK + kk * KCH, _mm512_setzero_si512());
  }
  *zero_from = rows;
}

/* The shrink of one row tile (its rows packed in xt) against NB (1-4) blocks of 16 of A's rows
   (ar[b], K apart): sums[b][j][t], rank row 16 b + j of the blocks, the tile's row t. Four
   independent sums: one tile product's latency is several of its issue intervals. */
static inline __attribute__((always_inline)) void shrink_blocks(const uint16_t* xt,
    const uint16_t* const* ar, int64_t K, int64_t KC, const char* next, int64_t next_lines,
    float* sums, const int NB) {
  _tile_zero(0);
  if (NB > 1) _tile_zero(1);
  if (NB > 2) _tile_zero(2);
  if (NB > 3) _tile_zero(3);
  const int64_t per = (next_lines + KC - 1) / KC;
  for (int64_t kc = 0; kc < KC; ++kc) {
    for (int64_t l = kc * per; l < (kc + 1) * per && l < next_lines; ++l)
      _mm_prefetch(next + l * 64, _MM_HINT_T0);
    _tile_loadd(6, xt + kc * CHUNK, 64);
    _tile_loadd(4, ar[0] + kc * KCH, K * 2);
    _tile_dpbf16ps(0, 4, 6);
    if (NB > 1) { _tile_loadd(5, ar[1] + kc * KCH, K * 2); _tile_dpbf16ps(1, 5, 6); }
    if (NB > 2) { _tile_loadd(4, ar[2] + kc * KCH, K * 2); _tile_dpbf16ps(2, 4, 6); }
    if (NB > 3) { _tile_loadd(5, ar[3] + kc * KCH, K * 2); _tile_dpbf16ps(3, 5, 6); }
  }
  _tile_stored(0, sums, 64);
  if (NB > 1) _tile_stored(1, sums + RT * RT, 64);
  if (NB > 2) _tile_stored(2, sums + 2 * RT * RT, 64);
  if (NB > 3) _tile_stored(3, sums + 3 * RT * RT, 64);
}

/* The expand of one row tile (16 of s's rows from si, ld apart) against NP (1-4) panels of
   B tiles (bp, nq rank chunks): sums[t][16 p + o]. */
static inline __attribute__((always_inline)) void expand_panels(const uint16_t* si, int64_t ld,
    const uint16_t* bp, int64_t nq, float* sums, const int NP) {
  _tile_zero(0);
  if (NP > 1) _tile_zero(1);
  if (NP > 2) _tile_zero(2);
  if (NP > 3) _tile_zero(3);
  for (int64_t cq = 0; cq < nq; ++cq) {
    const uint16_t* b = bp + cq * 4 * CHUNK;
    _tile_loadd(4, si + cq * KCH, ld * 2);
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (NP > 1) { _tile_loadd(6, b + CHUNK, 64); _tile_dpbf16ps(1, 4, 6); }
    if (NP > 2) { _tile_loadd(7, b + 2 * CHUNK, 64); _tile_dpbf16ps(2, 4, 7); }
    if (NP > 3) { _tile_loadd(5, b + 3 * CHUNK, 64); _tile_dpbf16ps(3, 4, 5); }
  }
  _tile_stored(0, sums, COLS * 4);
  if (NP > 1) _tile_stored(1, sums + RT, COLS * 4);
  if (NP > 2) _tile_stored(2, sums + 2 * RT, COLS * 4);
  if (NP > 3) _tile_stored(3, sums + 3 * RT, COLS * 4);
}

#endif

int lora_apply_bf16w_amx(const uint16_t* x, int64_t ldx, uint16_t* y, int64_t ldy, int64_t K,
    const int32_t* rows, const int32_t* seg_start, const int32_t* seg_len,
    const int32_t* seg_slot, int64_t nseg, const uint16_t* a, int64_t a_rows,
    const int32_t* width, const uint16_t* bt, int64_t out, int64_t R, int64_t nslices,
    const int32_t* slice_row, const int32_t* slice_size, const int32_t* slice_off,
    const int32_t* slice_rank, int nthreads) {
#if HAVE_AMX_LORA
  if (K % KCH || !amx_bf16_enabled()) return 1;
  const int64_t KC = K / KCH;
  int64_t ntiles = 0, work = 0;
  for (int64_t g = 0; g < nseg; ++g) {
    ntiles += (seg_len[g] + RT - 1) / RT;
    work += (int64_t)seg_len[g] * width[seg_slot[g]] * (K + out);
  }
  if (work == 0) return 0;  /* (no rows, or only slots without this layer) */
  /* each thread's scratch: a packed row tile; its s rows (bf16, ld wide: a_rows and a rank
     chunk past it, as an expand chunk reads up to 32 ranks on from a slice's offset, where B's
     zero rows meet them; zeroed per tile, so all it holds is finite); 16 of A's rows past a
     slot's end (a_rows % 16 rows left at its end, zero rows after them); a block of B^T
     paired (every rank chunk) */
  const int64_t ld = (a_rows + KCH + 31) / 32 * 32;
  const int64_t xt_n = KC * CHUNK, st_n = RT * ld, arows_n = RT * K;
  const int64_t bp_n = (R + KCH - 1) / KCH * 4 * CHUNK;
  const int64_t per_thread = xt_n + st_n + arows_n + bp_n;
  int32_t* tile = (int32_t*)malloc(sizeof(int32_t) * (size_t)(2 * ntiles));  /* (segment, row) */
  uint16_t* scratch = (uint16_t*)aligned_alloc(64, sizeof(uint16_t) * (size_t)(nthreads * per_thread));
  if (!tile || !scratch) { free(tile); free(scratch); return -1; }
  for (int64_t g = 0, p = 0; g < nseg; ++g)
    for (int32_t i = 0; i < seg_len[g]; i += RT, ++p) { tile[2 * p] = (int32_t)g; tile[2 * p + 1] = i; }
  const int par = work >= PAR_WORK && nthreads > 1;
#pragma omp parallel num_threads(nthreads) if(par)
  {
    tiles_begin();
    uint16_t* xt = scratch + omp_get_thread_num() * per_thread;
    uint16_t* st = xt + xt_n;
    uint16_t* arows = st + st_n;
    uint16_t* bp = arows + arows_n;
    float sums[RT * COLS] __attribute__((aligned(64)));
    int zero_from[LORA_MAX_RANK / KCH];  /* pack_bt's, per rank chunk: nothing known zero yet */
    for (int i = 0; i < LORA_MAX_RANK / KCH; ++i) zero_from[i] = RT;
    /* a row tile a task, its shrink then its expand (no other task reads its s rows, nor
       writes its y rows: no barrier between the two). The shrink: the tile's rows packed,
       then its slot's A rows four blocks of 16 at a time, the next task's A rows prefetched
       meanwhile (the tile loads' strided streams alone left the slots' bytes well below the
       memory's speed). */
#pragma omp for schedule(static)
    for (int64_t p = 0; p < ntiles; ++p) {
      const int32_t g = tile[2 * p], slot = seg_slot[g], w = width[slot];
      const int32_t i0 = seg_start[g] + tile[2 * p + 1];
      const int n = seg_start[g] + seg_len[g] - i0 < RT ? seg_start[g] + seg_len[g] - i0 : RT;
      pack_rows(x, ldx, rows + i0, n, KC, xt);
      memset(st, 0, sizeof(uint16_t) * (size_t)st_n);
      const char* next = NULL;
      int64_t next_lines = 0;
      if (p + 1 < ntiles && seg_slot[tile[2 * (p + 1)]] != slot) {
        const int32_t slot1 = seg_slot[tile[2 * (p + 1)]];
        next = (const char*)(a + (int64_t)slot1 * a_rows * K);
        next_lines = (int64_t)width[slot1] * K * 2 / 64;
      }
      for (int32_t j0 = 0; j0 < w; j0 += 4 * RT) {
        const int nb = (w - j0 + RT - 1) / RT < 4 ? (w - j0 + RT - 1) / RT : 4;
        const uint16_t* ar[4];
        for (int b = 0; b < nb; ++b) {
          const int32_t j = j0 + b * RT;
          ar[b] = a + ((int64_t)slot * a_rows + j) * K;
          if (j + RT > a_rows) {  /* the slot's last rows */
            memset(arows, 0, sizeof(uint16_t) * RT * K);
            memcpy(arows, ar[b], sizeof(uint16_t) * (size_t)((a_rows - j) * K));
            ar[b] = arows;
          }
        }
        switch (nb) {
          case 4: shrink_blocks(xt, ar, K, KC, next, next_lines, sums, 4); break;
          case 3: shrink_blocks(xt, ar, K, KC, next, next_lines, sums, 3); break;
          case 2: shrink_blocks(xt, ar, K, KC, next, next_lines, sums, 2); break;
          default: shrink_blocks(xt, ar, K, KC, next, next_lines, sums, 1); break;
        }
        next_lines = 0;  /* prefetched with the first blocks */
        const int nj = w - j0 < 4 * RT ? w - j0 : 4 * RT;
        for (int j = 0; j < nj; ++j)
          for (int t = 0; t < n; ++t)
            st[(int64_t)t * ld + j0 + j] = f2bf(sums[(j / RT) * RT * RT + (j % RT) * RT + t]);
      }
      /* the expand: every slice's B^T paired 64 columns at a time (its rows read on in
         order, prefetched a block ahead), against the tile's s rows */
      for (int64_t c = 0; c < nslices; ++c) {
        const int32_t r = slice_rank[slot * nslices + c];
        if (!r) continue;
        const int64_t row0 = slice_row[c], size = slice_size[c];
        const int64_t off = slice_off[slot * nslices + c], nq = (r + KCH - 1) / KCH;
        for (int64_t o0 = row0; o0 < row0 + size; o0 += COLS) {
          const int64_t cols = o0 + COLS < row0 + size ? COLS : row0 + size - o0;
          const int np = (int)((cols + RT - 1) / RT);
          const uint16_t* B = bt + (int64_t)slot * R * out + o0;
          if (o0 + PF_COLS + COLS <= out)  /* (the next slice's rows too) */
            for (int32_t q = 0; q < r; ++q) {
              _mm_prefetch((const char*)(B + (int64_t)q * out + PF_COLS), _MM_HINT_T0);
              _mm_prefetch((const char*)(B + (int64_t)q * out + PF_COLS + 32), _MM_HINT_T0);
            }
          for (int64_t cq = 0; cq < nq; ++cq)
            pack_bt(B, out, (int32_t)(cq * KCH), r, cols, np, bp + cq * 4 * CHUNK, zero_from + cq);
          switch (np) {
            case 4: expand_panels(st + off, ld, bp, nq, sums, 4); break;
            case 3: expand_panels(st + off, ld, bp, nq, sums, 3); break;
            case 2: expand_panels(st + off, ld, bp, nq, sums, 2); break;
            default: expand_panels(st + off, ld, bp, nq, sums, 1); break;
          }
          for (int t = 0; t < n; ++t) {
            uint16_t* yr = y + (int64_t)rows[i0 + t] * ldy + o0;
            for (int h = 0; h < cols; h += RT) {
              const int64_t left = cols - h;
              const __mmask16 m = left >= RT ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
              const __m512 old = _mm512_castsi512_ps(_mm512_slli_epi32(
                  _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, yr + h)), 16));
              const __m512 sum = _mm512_add_ps(old, _mm512_load_ps(sums + t * COLS + h));
              _mm256_mask_storeu_epi16(yr + h, m, (__m256i)_mm512_cvtneps_pbh(sum));
            }
          }
        }
      }
    }
  }
  free(scratch);
  free(tile);
  return 0;
#else
  return 1;  /* no AMX-bf16 in this build: the vector kernel runs */
#endif
}
