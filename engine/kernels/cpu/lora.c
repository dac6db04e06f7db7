/* A step's LoRA deltas on one linear layer in one call (engine/kernels/cpu/lora.py).

   The rows of the step come grouped by adapter slot: segment g is rows[seg_start[g] ..
   + seg_len[g]), all of slot seg_slot[g]. Each slot holds A [n*R, K] (the slices' A stacked
   on rank, packed to the slot's width) and B [out, R] (each slice's B in its output rows,
   columns 0..rank), float32, scaling folded in (engine/lora/layers.py). Then

       s[t]                        = A_slot x[t]                     (width[slot] values)
       y[t, row_i : row_i + size_i] += B_slot[row_i.., :r_i] s[t, off_i : off_i + r_i]

   in float32, y rounded once per slice as the torch path's `y.add_(s @ B^T)` does. Two
   passes, one fork-join each: the shrink split over rows (each reads its slot's A, which
   stays in L2 between rows of one adapter), the expand over blocks of output columns (each
   reads a block of every slot's B once). The torch path is the reference (tests). */
#include "tessera_kernels.h"
#include "bf16_convert.h"

#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

/* Multiply-adds from which a pass is split over threads: a decode row of a small adapter is
   a few microseconds of work, less than a fork-join. */
#define LORA_PAR_WORK (1 << 18)
#define LORA_COLS 16 /* output columns of an expand block */

#define DEFINE_LORA(NAME, T, LOAD, STORE)                                                     \
int NAME(const T* x, int64_t ldx, T* y, int64_t ldy, int64_t K, const int32_t* rows,          \
    const int32_t* seg_start, const int32_t* seg_len, const int32_t* seg_slot, int64_t nseg,  \
    const float* a, int64_t a_rows, const int32_t* width, const float* b, int64_t out,        \
    int64_t R, int64_t nslices, const int32_t* slice_row, const int32_t* slice_size,          \
    const int32_t* slice_off, const int32_t* slice_rank, int nthreads) {                      \
  int64_t total = 0, work = 0;                                                                \
  for (int64_t g = 0; g < nseg; ++g) {                                                        \
    total += seg_len[g];                                                                      \
    work += (int64_t)seg_len[g] * width[seg_slot[g]] * (K + out);                            \
  }                                                                                           \
  if (total == 0 || work == 0) return 0;                                                      \
  /* s[i]: row i's shrink (i in the order of rows), a_rows wide */                            \
  float* s = (float*)malloc(sizeof(float) * (size_t)(total * a_rows));                       \
  int32_t* slot_of = (int32_t*)malloc(sizeof(int32_t) * (size_t)total);                      \
  if (!s || !slot_of) { free(s); free(slot_of); return -1; }                                  \
  for (int64_t g = 0; g < nseg; ++g)                                                          \
    for (int32_t i = 0; i < seg_len[g]; ++i) slot_of[seg_start[g] + i] = seg_slot[g];         \
  int par = work >= LORA_PAR_WORK && nthreads > 1;                                            \
  _Pragma("omp parallel num_threads(nthreads) if(par)")                                       \
  {                                                                                           \
    _Pragma("omp for schedule(static)")                                                       \
    for (int64_t i = 0; i < total; ++i) {                                                     \
      const int32_t slot = slot_of[i];                                                        \
      const T* xr = x + (int64_t)rows[i] * ldx;                                               \
      const float* A = a + (int64_t)slot * a_rows * K;                                        \
      float* si = s + i * a_rows;                                                             \
      for (int32_t j = 0; j < width[slot]; ++j) {                                             \
        const float* ar = A + (int64_t)j * K;                                                 \
        float acc = 0.0f;                                                                     \
        _Pragma("omp simd reduction(+:acc)")                                                  \
        for (int64_t k = 0; k < K; ++k) acc += LOAD(xr[k]) * ar[k];                           \
        si[j] = acc;                                                                          \
      }                                                                                       \
    }                                                                                         \
    /* the expand: each block of output columns lies in one slice (blocks never straddle) */ \
    for (int64_t c = 0; c < nslices; ++c) {                                                   \
      const int64_t row0 = slice_row[c], size = slice_size[c];                                \
      const int64_t nblocks = (size + LORA_COLS - 1) / LORA_COLS;                             \
      _Pragma("omp for schedule(static) nowait")                                              \
      for (int64_t blk = 0; blk < nblocks; ++blk) {                                           \
        const int64_t o0 = row0 + blk * LORA_COLS;                                            \
        const int64_t o1 = o0 + LORA_COLS < row0 + size ? o0 + LORA_COLS : row0 + size;       \
        for (int64_t i = 0; i < total; ++i) {                                                 \
          const int32_t slot = slot_of[i];                                                    \
          const int32_t r = slice_rank[slot * nslices + c];                                   \
          if (!r) continue;                                                                   \
          const float* si = s + i * a_rows + slice_off[slot * nslices + c];                   \
          const float* B = b + (int64_t)slot * out * R;                                       \
          T* yr = y + (int64_t)rows[i] * ldy;                                                 \
          for (int64_t o = o0; o < o1; ++o) {                                                 \
            const float* br = B + o * R;                                                      \
            float acc = 0.0f;                                                                 \
            _Pragma("omp simd reduction(+:acc)")                                              \
            for (int32_t q = 0; q < r; ++q) acc += si[q] * br[q];                             \
            yr[o] = STORE(LOAD(yr[o]) + acc);                                                 \
          }                                                                                   \
        }                                                                                     \
      }                                                                                       \
    }                                                                                         \
  }                                                                                           \
  free(s);                                                                                    \
  free(slot_of);                                                                              \
  return 0;                                                                                   \
}

DEFINE_LORA(lora_apply_f32, float, f2f, f2f)
DEFINE_LORA(lora_apply_bf16, uint16_t, bf2f, f2bf)
