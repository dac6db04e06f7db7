/* A step's LoRA deltas on one linear layer in one call (engine/kernels/cpu/lora.py).

   The rows of the step come grouped by adapter slot: segment g is rows[seg_start[g] ..
   + seg_len[g]), all of slot seg_slot[g]. Each slot holds A [n*R, K] (the slices' A stacked
   on rank, packed to the slot's width) and B^T [R, out] (each slice's B, transposed, in its
   output columns, rows 0..rank), float32, scaling folded in (engine/lora/layers.py). Then

       s[t]                        = A_slot x[t]                     (width[slot] values)
       y[t, row_i : row_i + size_i] += B_slot[row_i.., :r_i] s[t, off_i : off_i + r_i]

   in float32, y rounded once per slice as the torch path's `y.add_(s @ B^T)` does. Two
   passes in one parallel region: the shrink split over (segment, rank row) pairs (each row
   of A read once for all of its segment's rows), the expand over blocks of 16 output columns
   (one vector: a multiply-add per rank from B^T's contiguous rows, which the segment's rows
   then find in L1). The torch path is the reference (tests). */
#include "tessera_kernels.h"
#include "bf16_convert.h"

#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

/* Multiply-adds from which a pass is split over threads: a decode row of a small adapter is
   a few microseconds of work, less than a fork-join. */
#define LORA_PAR_WORK (1 << 18)
#define LORA_COLS 128 /* output columns of an expand block: eight AVX-512 vectors */

#define DEFINE_LORA(NAME, T, LOAD, STORE)                                                     \
int NAME(const T* x, int64_t ldx, T* y, int64_t ldy, int64_t K, const int32_t* rows,          \
    const int32_t* seg_start, const int32_t* seg_len, const int32_t* seg_slot, int64_t nseg,  \
    const float* a, int64_t a_rows, const int32_t* width, const float* bt, int64_t out,       \
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
      const float* ar = a + ((int64_t)seg_slot[g] * a_rows + j) * K;                          \
      for (int32_t i = seg_start[g]; i < seg_start[g] + seg_len[g]; ++i) {                    \
        const T* xr = x + (int64_t)rows[i] * ldx;                                             \
        float acc = 0.0f;                                                                     \
        _Pragma("omp simd reduction(+:acc)")                                                  \
        for (int64_t k = 0; k < K; ++k) acc += LOAD(xr[k]) * ar[k];                           \
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
          const float* B = bt + (int64_t)slot * R * out + o0; /* B[q * out + o] */            \
          const int64_t off = slice_off[slot * nslices + c];                                  \
          for (int32_t i = seg_start[g]; i < seg_start[g] + seg_len[g]; ++i) {                \
            const float* si = s + (int64_t)i * a_rows + off;                                  \
            float acc[LORA_COLS] = {0};                                                       \
            if (n == LORA_COLS) {                                                             \
              for (int32_t q = 0; q < r; ++q) {                                               \
                const float sq = si[q]; const float* bq = B + (int64_t)q * out;               \
                _Pragma("omp simd")                                                           \
                for (int64_t o = 0; o < LORA_COLS; ++o) acc[o] += sq * bq[o];                 \
              }                                                                               \
            } else {                                                                          \
              for (int32_t q = 0; q < r; ++q) {                                               \
                const float sq = si[q]; const float* bq = B + (int64_t)q * out;               \
                for (int64_t o = 0; o < n; ++o) acc[o] += sq * bq[o];                         \
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

DEFINE_LORA(lora_apply_f32, float, f2f, f2f)
DEFINE_LORA(lora_apply_bf16, uint16_t, bf2f, f2bf)
