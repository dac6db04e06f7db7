/* A Llama decode step as one call: the same kernels in the same order as the modules, on
   buffers the plan keeps (engine/models/llama_decode_plan.py). The kernels are called by name:
   they are in this library. */
#include "tessera_kernels.h"
#include <string.h>
typedef uint16_t bf16;

/* Built only where the CPU has the instructions they need (w4.c, w8a8.c): weak references
   are NULL where they are absent, and a step that needs one fails (Python checks first). */
#pragma weak linear_q4_bf16
#pragma weak w4_max_rows
#pragma weak linear_q4_bf16_batch
#pragma weak gemm_i8_scaled
#pragma weak gemm_i8_silu_quant

enum { QKV, O, GATE_UP, DOWN };

/* y += the step's LoRA deltas, as the layer's LoRALayer.apply would (lora.c). */
static int lora(const Layer* L, int which, const Step* st, const bf16* x, int64_t ldx,
    int64_t K, bf16* y, int64_t N) {
  const LoraLayer* A = L->lora[which];
  if (!st->lora_nseg || !A) return 0;
  if (A->bf16_slots) {  /* the tiles where they take the call (1: they cannot), else the vector kernel */
    int rc = 1;
    for (int vector = !A->amx; rc == 1 && vector < 2; ++vector)
      rc = (vector ? lora_apply_bf16w : lora_apply_bf16w_amx)(x, ldx, y, N, K, st->lora_rows,
          st->lora_seg_start, st->lora_seg_len, st->lora_seg_slot, st->lora_nseg, A->a,
          A->a_rows, A->width, A->bt, A->out, A->rank, A->nslices, A->slice_row,
          A->slice_size, A->slice_off, A->slice_rank, st->threads);
    return rc;
  }
  return lora_apply_bf16(x, ldx, y, N, K, st->lora_rows, st->lora_seg_start, st->lora_seg_len,
      st->lora_seg_slot, st->lora_nseg, A->a, A->a_rows, A->width, A->bt, A->out, A->rank,
      A->nslices, A->slice_row, A->slice_size, A->slice_off, A->slice_rank, st->threads);
}

/* The bytes the step's LoRA call on this layer will read, for the GEMM before it to bring
   into cache while its tiles compute: each segment's slot, A's rows then B^T's, in segment
   order (lora_amx.c's threads split the segments in the same order). Measured (machine F, 32
   rows over 8 rank-16 adapters): the LoRA calls 5.3 -> 3.0-3.2 ms a step, the GEMMs 1.1-1.7
   ms slower (the bytes are the memory's either way); one adapter's slots are few bytes,
   left to the kernel's own prefetching. */
static const prefetch_ranges* lora_prefetch(const Layer* L, int which, const Step* st,
    int64_t K, prefetch_ranges* pf) {
  const LoraLayer* A = L->lora[which];
  if (st->lora_nseg < 2 || !A || !A->bf16_slots) return NULL;
  pf->n = 0;
  for (int64_t g = 0; g < st->lora_nseg && pf->n + 2 <= PREFETCH_MAX_RANGES; ++g) {
    const int64_t slot = st->lora_seg_slot[g];
    int64_t rank = 0;
    for (int64_t c = 0; c < A->nslices; ++c)
      if (A->slice_rank[slot * A->nslices + c] > rank) rank = A->slice_rank[slot * A->nslices + c];
    pf->ptr[pf->n] = (const bf16*)A->a + slot * A->a_rows * K;
    pf->bytes[pf->n++] = (int64_t)A->width[slot] * K * 2;
    pf->ptr[pf->n] = (const bf16*)A->bt + slot * A->rank * A->out;
    pf->bytes[pf->n++] = rank * A->out * 2;
  }
  return pf;
}

/* y [M][N] (bf16, N apart) = x [M][K] (ldx apart) . W^T + bias, as the layer's module would. */
static int gemm(const Layer* L, int which, const Step* st, const bf16* x, int64_t ldx,
    int64_t K, bf16* y, int64_t N) {
  const int64_t M = st->rows; const int T = st->threads;
  if (L->lut4[which]) {  /* bitsandbytes 4-bit: the LUT4 dot kernel, above its rows the tiles */
    if (M <= LUT4_DOT_MAX_ROWS)
      return lut4_linear(x, ldx, M, K, L->lut4[which], L->lut4_scales[which],
          L->lut4_levels[which], N, L->bias[which], y, N, 1, T);
    return lut4_linear_bf16_tiles(x, ldx, M, K, L->lut4[which], L->lut4_scales[which],
        L->lut4_levels[which], N, L->bias[which], y, N, T);
  }
  if (!st->w8a8) {  /* above w4.c's rows, AMX-bf16 on the tiles or the batch kernel */
    if (st->amx) {
      prefetch_ranges pf;
      return amx_bf16_linear_w4_prefetch(x, ldx, M, K, L->w4[which], N, L->bias[which], y, N,
          0, lora_prefetch(L, which, st, K, &pf), T);
    }
    if (M > w4_max_rows() && linear_q4_bf16_batch)
      return linear_q4_bf16_batch(x, ldx, M, K, L->w4[which], N, L->bias[which], y, N, T);
    return linear_q4_bf16(x, ldx, M, K, L->w4[which], N, L->bias[which], y, N, T);
  }
  quantize_rows_bf16(x, ldx, M, K, st->xq, st->xs, T);
  return gemm_i8_scaled(st->xq, K, M, K, L->packed[which], N, st->xs, L->wscale[which],
      L->bias[which], y, 1, T);
}

/* The layer's output: its GEMM, then its LoRA deltas. */
static int linear(const Layer* L, int which, const Step* st, const bf16* x, int64_t ldx,
    int64_t K, bf16* y, int64_t N) {
  return gemm(L, which, st, x, ldx, K, y, N) || lora(L, which, st, x, ldx, K, y, N) ? -1 : 0;
}

/* down(silu(gate) * up), [gate | up] = gate_up(x): w8a8 as cpu_w8a8.mlp_w8a8 (two int8 GEMMs,
   the SiLU pass in the first one's tiles), 4-bit as the modules (SiLU-mul in the model dtype;
   on AMX in gate_up's epilogue where the halves are whole tiles, as GGUFW4LinearMethod's
   apply_gated_mlp). A step with adapters runs the two GEMMs apart on either kind, as the
   modules do (engine.layers.mlp): the deltas go between the GEMM and the SiLU. */
static int mlp(const Layer* L, const Shape* s, const Step* st) {
  const int64_t M = st->rows, Hd = s->hidden, I = s->inter; const int T = st->threads;
  if (!st->w8a8 || st->lora_nseg) {
    if (!st->w8a8 && !st->lora_nseg && st->amx && I % 16 == 0 && !L->bias[GATE_UP]) {
      if (amx_bf16_gated_w4(st->normed, Hd, M, Hd, L->w4[GATE_UP], I, st->act, I, T)) return -1;
    } else {
      if (linear(L, GATE_UP, st, st->normed, Hd, Hd, st->gate_up, 2 * I)) return -1;
      silu_mul_bf16(st->gate_up, 2 * I, st->act, I, M, I, T);
    }
    return linear(L, DOWN, st, st->act, I, I, st->hidden, Hd);
  }
  quantize_rows_bf16(st->normed, Hd, M, Hd, st->xq, st->xs, T);
  if (gemm_i8_silu_quant(st->xq, Hd, M, Hd, L->packed[GATE_UP], I, st->xs,
      L->wscale[GATE_UP], L->bias[GATE_UP], 1, st->h, st->hmax, st->hq, st->hs, T))
    return -1;
  return gemm_i8_scaled(st->hq, I, M, I, L->packed[DOWN], Hd, st->hs, L->wscale[DOWN],
      L->bias[DOWN], st->hidden, 1, T);
}

/* hidden: the step's embeddings in, the last layer's output out (residual: its stream, for
   the final norm). 0, or -1 when a GEMM could not allocate (or is not in this library). */
int run_decode(const Shape* s, const Layer* layers, int64_t n_layers, const Step* st) {
  if (st->w8a8 ? !gemm_i8_scaled || !gemm_i8_silu_quant : !linear_q4_bf16) return -1;
  const int64_t M = st->rows, Hd = s->hidden, D = s->head_dim, H = s->heads, Hkv = s->kv_heads;
  const int64_t qkv_n = (H + 2 * Hkv) * D, qk_n = (H + Hkv) * D, T = st->threads;
  for (int64_t l = 0; l < n_layers; ++l) {
    const Layer* L = layers + l;
    if (l == 0) {  /* the residual stream starts as the embeddings */
      memcpy(st->residual, st->hidden, sizeof(bf16) * M * Hd);
      rmsnorm_bf16(st->hidden, Hd, NULL, 0, L->in_norm, st->normed, Hd, M, Hd, s->eps, T);
    } else {
      rmsnorm_bf16(st->hidden, Hd, st->residual, Hd, L->in_norm, st->normed, Hd, M, Hd, s->eps, T);
    }
    if (linear(L, QKV, st, st->normed, Hd, Hd, st->qkv, qkv_n)) return -1;
    rope_bf16(st->qkv, qkv_n, st->cos, st->sin, st->qk, M, H + Hkv, D, T);
    const bf16* k = st->qk + H * D; const bf16* v = st->qkv + qk_n;
    if (s->kv_int8) {
      kv8_write_bf16((int8_t*)L->k_cache, (int8_t*)L->v_cache, L->k_scales, L->v_scales,
          st->slots, M, k, qk_n, v, qkv_n, (int)Hkv, (int)D, (int)s->block_size);
      paged_decode_kv8_bf16(st->attn, H * D, st->qk, qk_n, (const int8_t*)L->k_cache,
          (const int8_t*)L->v_cache, L->k_scales, L->v_scales, st->block_tables, st->max_blocks,
          st->context_lens, M, (int)H, (int)Hkv, (int)D, (int)s->block_size, 0, s->scale,
          NULL, st->scratch, st->scratch_size, st->decode_threads);
    } else {  /* [blocks, block_size, Hkv, D]: a token's heads are one row at its slot */
      for (int64_t t = 0; t < M; ++t) {
        memcpy((bf16*)L->k_cache + st->slots[t] * Hkv * D, k + t * qk_n, sizeof(bf16) * Hkv * D);
        memcpy((bf16*)L->v_cache + st->slots[t] * Hkv * D, v + t * qkv_n, sizeof(bf16) * Hkv * D);
      }
      paged_decode_bf16(st->attn, H * D, st->qk, qk_n, (const bf16*)L->k_cache,
          (const bf16*)L->v_cache, L->k_scales, L->v_scales, st->block_tables, st->max_blocks,
          st->context_lens, M, (int)H, (int)Hkv, (int)D, (int)s->block_size, 0, s->scale,
          NULL, st->scratch, st->scratch_size, st->decode_threads);
    }
    if (linear(L, O, st, st->attn, H * D, H * D, st->hidden, Hd)) return -1;
    rmsnorm_bf16(st->hidden, Hd, st->residual, Hd, L->post_norm, st->normed, Hd, M, Hd, s->eps, T);
    if (mlp(L, s, st)) return -1;
  }
  return 0;
}
