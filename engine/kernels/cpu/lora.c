/* A step's LoRA deltas on one linear layer in one call (engine/kernels/cpu/lora.py).

   The rows of the step come grouped by adapter slot: segment g is rows[seg_start[g] ..
   + seg_len[g]), all of slot seg_slot[g]. Each slot holds A [n*R, K] (the slices' A stacked
   on rank, packed to the slot's width) and B^T [R, out] (each slice's B, transposed, in its
   output columns, rows 0..rank), float32 (or bf16 over bf16 rows: lora_apply_bf16w, below),
   scaling folded in (engine/lora/layers.py). Then

       s[t]                        = A_slot x[t]                     (width[slot] values)
       y[t, row_i : row_i + size_i] += B_slot[row_i.., :r_i] s[t, off_i : off_i + r_i]

   in float32, y rounded once per slice as the torch path's `y.add_(s @ B^T)` does. Two
   passes in one parallel region: the shrink split over (segment, rank row) pairs (each row
   of A read once for all of its segment's rows), the expand over blocks of 128 output
   columns (a multiply-add per rank from B^T's contiguous rows, which the segment's rows then
   find in L1). The torch path is the reference (tests). */
#include "tessera_kernels.h"
#include "bf16_convert.h"

#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

/* Multiply-adds from which a pass is split over threads: a decode row of a small adapter is
   a few microseconds of work, less than a fork-join. */
#define LORA_PAR_WORK (1 << 18)
#define LORA_COLS 128 /* output columns of an expand block: eight AVX-512 vectors */

#define DEFINE_LORA(NAME, T, LOAD, STORE, W, WLOAD)                                          \
int NAME(const T* x, int64_t ldx, T* y, int64_t ldy, int64_t K, const int32_t* rows,          \
    const int32_t* seg_start, const int32_t* seg_len, const int32_t* seg_slot, int64_t nseg,  \
    const W* a, int64_t a_rows, const int32_t* width, const W* bt, int64_t out,               \
    int64_t R, int64_t nslices, const int32_t* slice_row, const int32_t* slice_size,          \
    const int32_t* slice_off, const int32_t* slice_rank, int nthreads) {                      \
  int64_t total = 0, npairs = 0, work = 0;                                                    \
  for (int64_t g = 0; g < nseg; ++g) {                                                        \
    total += seg_len[g];                                                                      \
    npairs += width[seg_slot[g]];                                                             \
    work += (int64_t)seg_len[g] * width[seg_slot[g]] * (K + out);                            \
  }                                                                                           \
  if (total == 0 || work == 0) return 0;                                                      \
  /* s[i]: row i's shrink (i in the order of rows), a_rows wide; (segment, rank row) pairs */ \
  float* s = (float*)malloc(sizeof(float) * (size_t)(total * a_rows));                       \
  int32_t* pair = (int32_t*)malloc(sizeof(int32_t) * (size_t)(2 * npairs));                  \
  if (!s || !pair) { free(s); free(pair); return -1; }                                        \
  for (int64_t g = 0, p = 0; g < nseg; ++g)                                                   \
    for (int32_t j = 0; j < width[seg_slot[g]]; ++j, ++p) { pair[2 * p] = g; pair[2 * p + 1] = j; } \
  int par = work >= LORA_PAR_WORK && nthreads > 1;                                            \
  _Pragma("omp parallel num_threads(nthreads) if(par)")                                       \
  {                                                                                           \
    /* the shrink: each of A's rows read once for its segment's rows */                      \
    _Pragma("omp for schedule(static)")                                                       \
    for (int64_t p = 0; p < npairs; ++p) {                                                    \
      const int32_t g = pair[2 * p], j = pair[2 * p + 1];                                     \
      const W* ar = a + ((int64_t)seg_slot[g] * a_rows + j) * K;                              \
      for (int32_t i = seg_start[g]; i < seg_start[g] + seg_len[g]; ++i) {                    \
        const T* xr = x + (int64_t)rows[i] * ldx;                                             \
        float acc = 0.0f;                                                                     \
        _Pragma("omp simd reduction(+:acc)")                                                  \
        for (int64_t k = 0; k < K; ++k) acc += LOAD(xr[k]) * WLOAD(ar[k]);                    \
        s[(int64_t)i * a_rows + j] = acc;                                                     \
      }                                                                                       \
    }                                                                                         \
    /* the expand, a block of output columns at a time (blocks never straddle a slice): one  \
       vector of columns per row, a multiply-add per rank from B^T's contiguous rows */       \
    for (int64_t c = 0; c < nslices; ++c) {                                                   \
      const int64_t row0 = slice_row[c], size = slice_size[c];                                \
      const int64_t nblocks = (size + LORA_COLS - 1) / LORA_COLS;                             \
      _Pragma("omp for schedule(static) nowait")                                              \
      for (int64_t blk = 0; blk < nblocks; ++blk) {                                           \
        const int64_t o0 = row0 + blk * LORA_COLS;                                            \
        const int64_t n = o0 + LORA_COLS < row0 + size ? LORA_COLS : row0 + size - o0;        \
        for (int64_t g = 0; g < nseg; ++g) {                                                  \
          const int32_t slot = seg_slot[g];                                                   \
          const int32_t r = slice_rank[slot * nslices + c];                                   \
          if (!r) continue;                                                                   \
          const W* B = bt + (int64_t)slot * R * out + o0; /* B[q * out + o] */                \
          const int64_t off = slice_off[slot * nslices + c];                                  \
          for (int32_t i = seg_start[g]; i < seg_start[g] + seg_len[g]; ++i) {                \
            const float* si = s + (int64_t)i * a_rows + off;                                  \
            float acc[LORA_COLS] = {0};                                                       \
            if (n == LORA_COLS) {                                                             \
              for (int32_t q = 0; q < r; ++q) {                                               \
                const float sq = si[q]; const W* bq = B + (int64_t)q * out;                   \
                _Pragma("omp simd")                                                           \
                for (int64_t o = 0; o < LORA_COLS; ++o) acc[o] += sq * WLOAD(bq[o]);          \
              }                                                                               \
            } else {                                                                          \
              for (int32_t q = 0; q < r; ++q) {                                               \
                const float sq = si[q]; const W* bq = B + (int64_t)q * out;                   \
                for (int64_t o = 0; o < n; ++o) acc[o] += sq * WLOAD(bq[o]);                  \
              }                                                                               \
            }                                                                                 \
            T* yr = y + (int64_t)rows[i] * ldy + o0;                                          \
            for (int64_t o = 0; o < n; ++o) yr[o] = STORE(LOAD(yr[o]) + acc[o]);              \
          }                                                                                   \
        }                                                                                     \
      }                                                                                       \
    }                                                                                         \
  }                                                                                           \
  free(s);                                                                                    \
  free(pair);                                                                                 \
  return 0;                                                                                   \
}

DEFINE_LORA(lora_apply_f32, float, f2f, f2f, float, f2f)
DEFINE_LORA(lora_apply_bf16, uint16_t, bf2f, f2bf, float, f2f)
/* bf16 slots over bf16 rows, portable: the AVX512-BF16 kernel's reference and fallback */
DEFINE_LORA(lora_apply_bf16w_portable, uint16_t, bf2f, f2bf, uint16_t, bf2f)

/* bf16 slots over bf16 rows on AVX512-BF16: half the bytes of float32 slots (with many
   adapters in a step their slots stream from memory, more bytes than the base's 4-bit
   weights), and the shrink on vdpbf16ps (32 products an instruction, float32 sums). The
   shrink takes tiles of up to 4 rows x 4 of A's rows (x and A read once a tile, 16 sums in
   registers); the expand takes 64 output columns x up to 4 rows, each of B's rows widened
   to float32 once for them, the multiply-adds on float32 s as the portable kernel's. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define LORA_EXPAND_COLS 64 /* four vectors */
/* Software prefetch distances: A's rows one tile (4 rows) ahead, B^T's rows two blocks
   ahead (measured, 8 adapters over 32 rows, SmolLM2's layers streaming from memory: 1.7x the
   speed without; 8 rows / 4 blocks ahead no better) */
#define LORA_PF_A 4
#define LORA_PF_B 2

/* 16 bf16 widened to float32 (masked: the tail of a block; a full mask loads plainly) */
static inline __m512 bf16x16(const uint16_t* p, __mmask16 m) {
  const __m256i v = m == 0xFFFF ? _mm256_loadu_si256((const __m256i*)p) : _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
static inline __m512i load32(const uint16_t* p, __mmask32 m) {
  return m == (__mmask32)~0u ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(m, p);
}

/* s[row r][j0 + j] = A[j] . x[r] for NR rows (always inlined: NR is a constant) and four of
   A's rows (ar[j]: a repeat of a real row past the slot's width, its sums dropped). */
static inline __attribute__((always_inline)) void shrink_tile(const uint16_t* const* xr,
    const uint16_t* const* ar, int64_t K, float* const* sr, int nj, const int NR) {
  __m512 acc[4][4];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 m = K - k >= 32 ? (__mmask32)~0u : (__mmask32)((1u << (K - k)) - 1);
    /* the next four of A's rows (contiguous after these), a quarter-row ahead per step:
       the hardware's prefetch alone left the shrink well below the memory's speed */
    for (int l = 0; l < 4; ++l) _mm_prefetch((const char*)(ar[0] + LORA_PF_A * K + 4 * k + 32 * l), _MM_HINT_T0);
    __m512bh av[4];
    for (int j = 0; j < 4; ++j) av[j] = (__m512bh)load32(ar[j] + k, m);
    for (int r = 0; r < NR; ++r) {
      const __m512bh xv = (__m512bh)load32(xr[r] + k, m);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, av[j]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < nj; ++j) sr[r][j] = _mm512_reduce_add_ps(acc[r][j]);
}

/* y[row r][0..n) += sum_q s[r][q] B[q][0..n) for NR rows, n <= 64 columns (B: B^T's rows,
   `out` apart), y rounded to bf16 once. */
static inline __attribute__((always_inline)) void expand_tile(const float* const* sr,
    const uint16_t* B, int64_t out, int32_t rank, uint16_t* const* yr, int64_t n, const int NR) {
  __mmask16 m[4];
  for (int v = 0; v < 4; ++v) {
    const int64_t left = n - 16 * v;
    m[v] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
  }
  __m512 acc[4][4];
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int32_t q = 0; q < rank; ++q) {
    /* this row of B^T two blocks on (sixteen rows, `out` apart, outrun the hardware's) */
    _mm_prefetch((const char*)(B + (int64_t)q * out + LORA_PF_B * LORA_EXPAND_COLS), _MM_HINT_T0);
    _mm_prefetch((const char*)(B + (int64_t)q * out + LORA_PF_B * LORA_EXPAND_COLS + 32), _MM_HINT_T0);
    __m512 b[4];
    for (int v = 0; v < 4; ++v) b[v] = bf16x16(B + (int64_t)q * out + 16 * v, m[v]);
    for (int r = 0; r < NR; ++r) {
      const __m512 sq = _mm512_set1_ps(sr[r][q]);
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(sq, b[v], acc[r][v]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < 4; ++v) {
      if (!m[v]) continue;
      const __m512 sum = _mm512_add_ps(bf16x16(yr[r] + 16 * v, m[v]), acc[r][v]);
      const __m256i out16 = (__m256i)_mm512_cvtneps_pbh(sum);
      if (m[v] == 0xFFFF) _mm256_storeu_si256((__m256i*)(yr[r] + 16 * v), out16);
      else _mm256_mask_storeu_epi16(yr[r] + 16 * v, m[v], out16);
    }
}

int lora_apply_bf16w(const uint16_t* x, int64_t ldx, uint16_t* y, int64_t ldy, int64_t K,
    const int32_t* rows, const int32_t* seg_start, const int32_t* seg_len,
    const int32_t* seg_slot, int64_t nseg, const uint16_t* a, int64_t a_rows,
    const int32_t* width, const uint16_t* bt, int64_t out, int64_t R, int64_t nslices,
    const int32_t* slice_row, const int32_t* slice_size, const int32_t* slice_off,
    const int32_t* slice_rank, int nthreads) {
  int64_t total = 0, ntiles = 0, work = 0;
  for (int64_t g = 0; g < nseg; ++g) {
    total += seg_len[g];
    ntiles += (width[seg_slot[g]] + 3) / 4;
    work += (int64_t)seg_len[g] * width[seg_slot[g]] * (K + out);
  }
  if (total == 0 || work == 0) return 0;
  float* s = (float*)malloc(sizeof(float) * (size_t)(total * a_rows));
  int32_t* tile = (int32_t*)malloc(sizeof(int32_t) * (size_t)(2 * ntiles));
  if (!s || !tile) { free(s); free(tile); return -1; }
  for (int64_t g = 0, p = 0; g < nseg; ++g)
    for (int32_t j = 0; j < width[seg_slot[g]]; j += 4, ++p) { tile[2 * p] = g; tile[2 * p + 1] = j; }
  int par = work >= LORA_PAR_WORK && nthreads > 1;
#pragma omp parallel num_threads(nthreads) if(par)
  {
    /* the shrink: (segment, four of A's rows) per task, A read once for the segment's rows */
#pragma omp for schedule(static)
    for (int64_t p = 0; p < ntiles; ++p) {
      const int32_t g = tile[2 * p], j0 = tile[2 * p + 1], w = width[seg_slot[g]];
      const int nj = w - j0 < 4 ? w - j0 : 4;
      const uint16_t* ar[4];
      for (int j = 0; j < 4; ++j) ar[j] = a + ((int64_t)seg_slot[g] * a_rows + j0 + (j < nj ? j : 0)) * K;
      for (int32_t i = seg_start[g]; i < seg_start[g] + seg_len[g]; i += 4) {
        const int nr = seg_start[g] + seg_len[g] - i < 4 ? seg_start[g] + seg_len[g] - i : 4;
        const uint16_t* xr[4];
        float* sr[4];
        for (int r = 0; r < nr; ++r) {
          xr[r] = x + (int64_t)rows[i + r] * ldx;
          sr[r] = s + (int64_t)(i + r) * a_rows + j0;
        }
        switch (nr) {
          case 4: shrink_tile(xr, ar, K, sr, nj, 4); break;
          case 3: shrink_tile(xr, ar, K, sr, nj, 3); break;
          case 2: shrink_tile(xr, ar, K, sr, nj, 2); break;
          default: shrink_tile(xr, ar, K, sr, nj, 1); break;
        }
      }
    }
    /* the expand: each thread a run of 64-column blocks of each slice (never straddling
       it), a segment at a time over the run (B^T's rows then stream on, a few rows each,
       rather than a few lines of every slot's rows per block), its rows four at a time */
    const int64_t nth = omp_get_num_threads(), th = omp_get_thread_num();
    for (int64_t c = 0; c < nslices; ++c) {
      const int64_t row0 = slice_row[c], size = slice_size[c];
      const int64_t nblocks = (size + LORA_EXPAND_COLS - 1) / LORA_EXPAND_COLS;
      const int64_t b0 = nblocks * th / nth, b1 = nblocks * (th + 1) / nth;
      for (int64_t g = 0; g < nseg; ++g) {
        const int32_t slot = seg_slot[g];
        const int32_t r = slice_rank[slot * nslices + c];
        if (!r) continue;
        const int64_t off = slice_off[slot * nslices + c];
        for (int64_t blk = b0; blk < b1; ++blk) {
          const int64_t o0 = row0 + blk * LORA_EXPAND_COLS;
          const int64_t n = o0 + LORA_EXPAND_COLS < row0 + size ? LORA_EXPAND_COLS : row0 + size - o0;
          const uint16_t* B = bt + (int64_t)slot * R * out + o0;
          for (int32_t i = seg_start[g]; i < seg_start[g] + seg_len[g]; i += 4) {
            const int nr = seg_start[g] + seg_len[g] - i < 4 ? seg_start[g] + seg_len[g] - i : 4;
            const float* sr[4];
            uint16_t* yr[4];
            for (int k = 0; k < nr; ++k) {
              sr[k] = s + (int64_t)(i + k) * a_rows + off;
              yr[k] = y + (int64_t)rows[i + k] * ldy + o0;
            }
            switch (nr) {
              case 4: expand_tile(sr, B, out, r, yr, n, 4); break;
              case 3: expand_tile(sr, B, out, r, yr, n, 3); break;
              case 2: expand_tile(sr, B, out, r, yr, n, 2); break;
              default: expand_tile(sr, B, out, r, yr, n, 1); break;
            }
          }
        }
      }
    }
  }
  free(s);
  free(tile);
  return 0;
}
#else
int lora_apply_bf16w(const uint16_t* x, int64_t ldx, uint16_t* y, int64_t ldy, int64_t K,
    const int32_t* rows, const int32_t* seg_start, const int32_t* seg_len,
    const int32_t* seg_slot, int64_t nseg, const uint16_t* a, int64_t a_rows,
    const int32_t* width, const uint16_t* bt, int64_t out, int64_t R, int64_t nslices,
    const int32_t* slice_row, const int32_t* slice_size, const int32_t* slice_off,
    const int32_t* slice_rank, int nthreads) {
  return lora_apply_bf16w_portable(x, ldx, y, ldy, K, rows, seg_start, seg_len, seg_slot, nseg,
      a, a_rows, width, bt, out, R, nslices, slice_row, slice_size, slice_off, slice_rank,
      nthreads);
}
#endif
