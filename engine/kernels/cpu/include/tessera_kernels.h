/* Every function and variable the CPU kernel library exports, the structs it shares with
   Python, and the compile-time constants Python also reads (engine/kernels/cpu/ops.py parses
   this file: its ctypes table must match these prototypes, tests/engine/kernels/
   test_bindings.py checks that it does). Every .c file includes this header first, so the
   compiler holds each definition to its prototype here.

   Types across the boundary: bf16 values travel as uint16_t; every pointer is a c_void_p
   on the Python side, int64_t a c_int64, int a c_int, float a c_float.

   Kept to one declaration per line, in `type name(args);` form, so that a small parser can
   read it (no macros in prototypes, no function pointers). */
#ifndef TESSERA_KERNELS_H
#define TESSERA_KERNELS_H
#include <stdint.h>

/* ---- constants shared with Python ---- */
#define ROWS_MAX_M 8          /* gemm: bf16 batches of up to this many rows stream the weights */
#define W4_MAX_ROWS 12        /* w4.c: rows of x its linear_q4_bf16 takes (w4_max_rows) */
#define W4_TILE 16            /* w4: output rows per tile, one per float lane */
#define W4_GROUP_BYTES 320    /* w4: a tile's group: 16 x 32 codes, 16 float16 scales, 16 minimums */
#define W8A8_BLOCK_COLS 48    /* w8a8: the packed GEMM's column blocks (16 * GEMM_NV) */
#define ATTN_MAX_ROW 1024     /* attention: floats in the per-token row buffer (Hkv * D) */
#define GGUF_Q4_0 2           /* gguf: ggml's type ids of the block formats gguf.c reads */
#define GGUF_Q4_1 3
#define GGUF_Q5_0 6
#define GGUF_Q5_1 7
#define GGUF_IQ4_NL 20        /* gguf: blocks of 32, codes index a fixed grid (iq4_values.h) */
#define GGUF_Q8_0 8
#define GGUF_MXFP4 39         /* gguf: blocks of 32 e2m1 codes, an E8M0 power of two (fp4_values.h) */
#define GGUF_NVFP4 40         /* gguf: superblocks of 64 e2m1 codes, a ue4m3 scale per 16 (fp4_values.h) */
#define GGUF_Q2_K 10          /* gguf: the K-quants gguf_k.c reads (superblocks of 256 weights) */
#define GGUF_Q3_K 11
#define GGUF_Q4_K 12
#define GGUF_Q5_K 13
#define GGUF_Q6_K 14
#define GGUF_IQ4_XS 23        /* gguf: IQ4_NL's codes in superblocks of 256 (gguf_k.c) */
#define GGUF_ISA_SCALAR 0     /* gguf: the kernel variants, gguf_isa's values */
#define GGUF_ISA_AVX2 1
#define GGUF_ISA_VNNI 2
#define LUT4_DOT_MAX_ROWS 8    /* lut4: rows the dot kernel takes (engine.kernels.cpu.lut4) */
#define LUT4_TILES_MAX_ROWS 32 /* lut4: rows of bf16 x the decoded tiles take, above the dot kernel's */
#define LUT4_ISA_SCALAR 0     /* lut4: the kernel variants, lut4_isa's values */
#define LUT4_ISA_AVX2 1
#define LUT4_ISA_AVX512 2
#define FP8_TILES_MAX_ROWS 32  /* fp8: rows of bf16 x the decoded tiles take, above the dot kernel's */
#define FP8_ISA_SCALAR 0      /* fp8: the kernel variants, fp8_isa's values */
#define FP8_ISA_AVX2 1
#define FP8_ISA_AVX512 2

/* ---- gemm.c: y = x W^T (+ b), bf16 / float32 / int8 weights (engine.kernels.cpu.gemm) ---- */
int linear_bf16(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w, const float* wscale, int64_t N, const uint16_t* bias, uint16_t* y, int64_t ldy, int nthreads);
int linear_f32(const float* x, int64_t ldx, int64_t M, int64_t K, const float* w, const float* wscale, int64_t N, const float* bias, float* y, int64_t ldy, int nthreads);
int linear_i8_bf16(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const int8_t* w, const float* wscale, int64_t N, const uint16_t* bias, uint16_t* y, int64_t ldy, int nthreads);
int linear_i8_f32(const float* x, int64_t ldx, int64_t M, int64_t K, const int8_t* w, const float* wscale, int64_t N, const float* bias, float* y, int64_t ldy, int nthreads);
/* only where the CPU has AVX512-F, -BW and -BF16 (absent from the library elsewhere) */
int linear_bf16_dp(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w, const float* wscale, int64_t N, const uint16_t* bias, uint16_t* y, int64_t ldy, int nthreads);
int linear_i8_bf16_dp(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const int8_t* w, const float* wscale, int64_t N, const uint16_t* bias, uint16_t* y, int64_t ldy, int nthreads);

/* ---- w4.c (AVX512-F, -BW, -VNNI and F16C: x as int16 per row, up to W4_MAX_ROWS rows) or
   w4_avx2.c (AVX2, FMA and F16C without the former: x as int8 per group of 32, any rows):
   4-bit weight tiles (engine.kernels.cpu.w4); absent on other CPUs ---- */
int linear_q4_bf16(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int64_t N, const uint16_t* bias, uint16_t* y, int64_t ldy, int nthreads);
int w4_max_rows(void);
/* w4_vnni_batch.c (as w4.c's CPUs): the same tiles at any batch, x as int8 per group of 32;
   Q8_0 rows as 16-row tiles of that kernel's layout (cpu_w4.pack_q8_0), float32 out */
int linear_q4_bf16_batch(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int64_t N, const uint16_t* bias, uint16_t* y, int64_t ldy, int nthreads);
int linear_q8_vnni_f32(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y, int64_t ldy, int nthreads);
int linear_q8_vnni_argmax(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t* token, int nthreads);
/* w4_avx2.c only: Q8_0 rows as two planes of w4 tiles (cpu_w4.pack_q8_0), float32 out */
int linear_q8w4_f32(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y, int64_t ldy, int nthreads);

/* ---- w4_tiles.c: w4 tiles back to bf16 / float32 rows, any CPU (engine.kernels.cpu.w4.unpack) ---- */
int w4_dequantize(const uint8_t* w, int64_t N, int64_t K, void* out, int bf16, int nthreads);

/* ---- gguf.c: GGUF blocks as in the file, int8 activations per block (engine.layers.quantization.gguf) ---- */
int gguf_linear(const void* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int type, int64_t N, const void* bias, void* y, int64_t ldy, int bf16, int nthreads);
int gguf_dequantize(const uint8_t* w, int type, int64_t N, int64_t K, void* out, int bf16, int nthreads);
int gguf_dequant_row(int type, const uint8_t* row, int64_t K, float* out);
int gguf_gather_rows(const uint8_t* w, int type, int64_t N, int64_t K, const int64_t* ids, int64_t n, void* out, int bf16);
int gguf_block_bytes(int type);
int gguf_isa_max(void);
extern int gguf_isa;  /* the variant gguf_linear runs, capped at gguf_isa_max() (set from Python) */
/* ---- gguf_k.c: the K-quants (Q4_K, Q5_K, Q6_K; K % 256 == 0), reached through gguf.c's entry points ---- */
int gguf_k_linear(const void* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* w, int type, int64_t N, const void* bias, void* y, int64_t ldy, int bf16, int nthreads);
int gguf_k_dequantize(const uint8_t* w, int type, int64_t N, int64_t K, void* out, int bf16, int nthreads);
/* one row of K weights (K / 256 superblocks) to float32 / bf16: the large-batch path's panels */
int gguf_k_dequant_row(int type, const uint8_t* row, int64_t K, float* out);
int gguf_k_dequant_row_bf16(int type, const uint8_t* row, int64_t K, uint16_t* out);
/* ---- lut4.c: 4-bit codes into a float table per call, a float32 scale per 64 weights
   (bitsandbytes' NF4 / FP4; engine.kernels.cpu.lut4); K % 64 == 0, else -1 ---- */
int lut4_linear(const void* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* codes, const float* scales, const float* table, int64_t N, const void* bias, void* y, int64_t ldy, int bf16, int nthreads);
int lut4_dequantize(const uint8_t* codes, const float* scales, const float* table, int64_t N, int64_t K, void* out, int bf16, int nthreads);
int lut4_tiles_max_rows(void);  /* rows lut4_linear_bf16_tiles takes: LUT4_TILES_MAX_ROWS, or 0 without AVX512-BF16 */
int lut4_linear_bf16_tiles(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* codes, const float* scales, const float* table, int64_t N, const uint16_t* bias, uint16_t* y, int64_t ldy, int nthreads);
int lut4_isa_max(void);
extern int lut4_isa;  /* the variant lut4_linear and lut4_dequantize run, capped at lut4_isa_max() (set from Python) */

/* ---- fp8.c: float8 e4m3 codes [N, K] as the checkpoint holds them, a float32 scale per
   group of G inputs of a row ([N, ceil(K / G)]; G = K: one a row); K % 32 == 0 and G % 32 ==
   0 or G >= K, else -1 (engine.kernels.cpu.fp8) ---- */
int fp8_linear(const void* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* codes, const float* scales, int64_t G, int64_t N, const void* bias, void* y, int64_t ldy, int bf16, int nthreads);
int fp8_dequantize(const uint8_t* codes, const float* scales, int64_t G, int64_t N, int64_t K, void* out, int bf16, int nthreads);
int fp8_dequant_row_bf16(const uint8_t* codes, const float* scales, int64_t G, int64_t K, uint16_t* out);  /* scales NULL: the exact e4m3 values */
int fp8_tiles_max_rows(void);  /* rows fp8_linear_bf16_tiles takes: FP8_TILES_MAX_ROWS, or 0 without AVX512-BF16 */
int fp8_linear_bf16_tiles(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* codes, const float* scales, int64_t G, int64_t N, const uint16_t* bias, uint16_t* y, int64_t ldy, int nthreads);
int fp8_isa_max(void);
extern int fp8_isa;  /* the variant fp8_linear and fp8_dequantize run, capped at fp8_isa_max() (set from Python) */

/* ---- w8a8.c: int8 activations (engine.kernels.cpu.w8a8) ---- */
void quantize_rows_f32(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* q, float* s, int nthreads);
void quantize_rows_bf16(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, int8_t* q, float* s, int nthreads);
void dequant_f32(const int32_t* acc, int64_t M, int64_t N, const float* s, const float* wscale, const float* bias, float* y, int nthreads);
void dequant_bf16(const int32_t* acc, int64_t M, int64_t N, const float* s, const float* wscale, const uint16_t* bias, uint16_t* y, int nthreads);
void silu_quant_f32(const int32_t* acc, int64_t M, int64_t I, const float* s, const float* wscale, const float* bias, int8_t* q, float* qs, float* tmp, int nthreads);
void silu_quant_bf16(const int32_t* acc, int64_t M, int64_t I, const float* s, const float* wscale, const uint16_t* bias, int8_t* q, float* qs, float* tmp, int nthreads);
/* the packed GEMMs: only with AVX512-F and -VNNI (absent from the library elsewhere) */
void pack_i8(const int8_t* w, int64_t N, int64_t K, uint8_t* out);
int gemm_i8(const int8_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* wp, int64_t N, int32_t* y, int64_t ldy, int nthreads);
int gemm_i8_scaled(const int8_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* wp, int64_t N, const float* xs, const float* ws, const void* bias, void* y, int bf16, int nthreads);
int gemm_i8_argmax(const int8_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* wp, int64_t N, const float* xs, const float* ws, float* val, int32_t* col, int64_t* token, int nthreads);
int gemm_i8_silu_quant(const int8_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* wp, int64_t I, const float* xs, const float* ws, const void* bias, int bias_bf16, float* h, float* hmax, int8_t* q, float* qs, int nthreads);
int amx_enabled(void);
extern int use_amx;  /* 0: the packed GEMMs keep to VNNI tiles (set from Python) */

/* ---- amx_bf16.c: y = x W^T on AMX-bf16 tiles, W bf16 rows, w4 tiles or GGUF rows (engine.kernels.cpu.amx_bf16) ----
   Everywhere: without AMX-bf16 amx_bf16_enabled() is 0 and the GEMMs return -1. */
int amx_bf16_enabled(void);
int amx_bf16_linear(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w, int64_t N, const uint16_t* bias, void* y, int64_t ldy, int out_f32, int nthreads);
int amx_bf16_linear_argmax(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w, int64_t N, int64_t* argmax, int nthreads);
int amx_bf16_linear_w4(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* tiles, int64_t N, const uint16_t* bias, void* y, int64_t ldy, int out_f32, int nthreads);
/* Bytes a GEMM brings into cache while its tiles compute: what the kernel after it will read
   (a LoRA step's slots, decode_plan.c), which would otherwise stream from memory then. The
   threads split the ranges' lines in order, the ranges one after the other. */
#define PREFETCH_MAX_RANGES 64
typedef struct {  /* PREFETCH_MAX_RANGES of each */
  const void* ptr[64];
  int64_t bytes[64];
  int64_t n;
} prefetch_ranges;
int amx_bf16_linear_w4_prefetch(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* tiles, int64_t N, const uint16_t* bias, void* y, int64_t ldy, int out_f32, const prefetch_ranges* pf, int nthreads);
int amx_bf16_gated_w4(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* tiles, int64_t I, uint16_t* y, int64_t ldy, int nthreads);
int amx_bf16_linear_gguf(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* rows, int64_t row_bytes, int type, int64_t N, const uint16_t* bias, void* y, int64_t ldy, int out_f32, int nthreads);
int amx_bf16_linear_fp8(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* codes, const float* scales, int64_t G, int64_t N, const uint16_t* bias, void* y, int64_t ldy, int out_f32, int nthreads);

/* ---- fused_ops.c: RMSNorm (+ residual), SiLU-and-mul, rotary (engine.kernels.cpu.fused_ops) ---- */
void rmsnorm_f32(const float* x, int64_t ldx, float* residual, int64_t ldr, const float* w, float* out, int64_t ldo, int64_t rows, int64_t H, float eps, int nthreads);
void rmsnorm_bf16(const uint16_t* x, int64_t ldx, uint16_t* residual, int64_t ldr, const uint16_t* w, uint16_t* out, int64_t ldo, int64_t rows, int64_t H, float eps, int nthreads);
void silu_mul_f32(const float* x, int64_t ldx, float* out, int64_t ldo, int64_t rows, int64_t I, int nthreads);
void silu_mul_bf16(const uint16_t* x, int64_t ldx, uint16_t* out, int64_t ldo, int64_t rows, int64_t I, int nthreads);
void rope_f32(const float* x, int64_t ldx, const float* cos, const float* sin, float* out, int64_t rows, int64_t heads, int64_t D, int nthreads);
void rope_bf16(const uint16_t* x, int64_t ldx, const uint16_t* cos, const uint16_t* sin, uint16_t* out, int64_t rows, int64_t heads, int64_t D, int nthreads);

/* ---- lora.c: a step's LoRA deltas on one linear layer, rows grouped by adapter slot (engine.kernels.cpu.lora) ----
   0, or -1 where its scratch could not be allocated (y untouched). Ranks up to LORA_MAX_RANK. */
#define LORA_MAX_RANK 512
int lora_apply_f32(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t K, const int32_t* rows, const int32_t* seg_start, const int32_t* seg_len, const int32_t* seg_slot, int64_t nseg, const float* a, int64_t a_rows, const int32_t* width, const float* bt, int64_t out, int64_t R, int64_t nslices, const int32_t* slice_row, const int32_t* slice_size, const int32_t* slice_off, const int32_t* slice_rank, int nthreads);
int lora_apply_bf16(const uint16_t* x, int64_t ldx, uint16_t* y, int64_t ldy, int64_t K, const int32_t* rows, const int32_t* seg_start, const int32_t* seg_len, const int32_t* seg_slot, int64_t nseg, const float* a, int64_t a_rows, const int32_t* width, const float* bt, int64_t out, int64_t R, int64_t nslices, const int32_t* slice_row, const int32_t* slice_size, const int32_t* slice_off, const int32_t* slice_rank, int nthreads);
/* bf16 slots (a, bt) over bf16 rows: AVX512-BF16 where built, else the portable kernel */
int lora_apply_bf16w(const uint16_t* x, int64_t ldx, uint16_t* y, int64_t ldy, int64_t K, const int32_t* rows, const int32_t* seg_start, const int32_t* seg_len, const int32_t* seg_slot, int64_t nseg, const uint16_t* a, int64_t a_rows, const int32_t* width, const uint16_t* bt, int64_t out, int64_t R, int64_t nslices, const int32_t* slice_row, const int32_t* slice_size, const int32_t* slice_off, const int32_t* slice_rank, int nthreads);
int lora_apply_bf16w_portable(const uint16_t* x, int64_t ldx, uint16_t* y, int64_t ldy, int64_t K, const int32_t* rows, const int32_t* seg_start, const int32_t* seg_len, const int32_t* seg_slot, int64_t nseg, const uint16_t* a, int64_t a_rows, const int32_t* width, const uint16_t* bt, int64_t out, int64_t R, int64_t nslices, const int32_t* slice_row, const int32_t* slice_size, const int32_t* slice_off, const int32_t* slice_rank, int nthreads);
/* lora_amx.c: lora_apply_bf16w on AMX-bf16 tiles; 1 (y untouched) where it cannot take the call
   (no AMX-bf16 here, K % 32): the caller runs lora_apply_bf16w. */
int lora_apply_bf16w_amx(const uint16_t* x, int64_t ldx, uint16_t* y, int64_t ldy, int64_t K, const int32_t* rows, const int32_t* seg_start, const int32_t* seg_len, const int32_t* seg_slot, int64_t nseg, const uint16_t* a, int64_t a_rows, const int32_t* width, const uint16_t* bt, int64_t out, int64_t R, int64_t nslices, const int32_t* slice_row, const int32_t* slice_size, const int32_t* slice_off, const int32_t* slice_rank, int nthreads);

/* ---- paged_attention.c: decode attention on the paged cache, the int8 KV writer (engine.attention.cpu_kernel) ---- */
void paged_decode_f32(float* out, int64_t out_stride, const float* q, int64_t q_stride, const float* kc, const float* vc, const float* ks, const float* vs, const int64_t* bt, int64_t max_nb, const int64_t* ctx, int64_t n, int H, int Hkv, int D, int bs, int window, float scale, const float* sinks, float* scratch, int64_t scratch_size, int nthreads);
void paged_decode_bf16(uint16_t* out, int64_t out_stride, const uint16_t* q, int64_t q_stride, const uint16_t* kc, const uint16_t* vc, const float* ks, const float* vs, const int64_t* bt, int64_t max_nb, const int64_t* ctx, int64_t n, int H, int Hkv, int D, int bs, int window, float scale, const float* sinks, float* scratch, int64_t scratch_size, int nthreads);
void paged_decode_kv8_f32(float* out, int64_t out_stride, const float* q, int64_t q_stride, const int8_t* kc, const int8_t* vc, const float* ks, const float* vs, const int64_t* bt, int64_t max_nb, const int64_t* ctx, int64_t n, int H, int Hkv, int D, int bs, int window, float scale, const float* sinks, float* scratch, int64_t scratch_size, int nthreads);
void paged_decode_kv8_bf16(uint16_t* out, int64_t out_stride, const uint16_t* q, int64_t q_stride, const int8_t* kc, const int8_t* vc, const float* ks, const float* vs, const int64_t* bt, int64_t max_nb, const int64_t* ctx, int64_t n, int H, int Hkv, int D, int bs, int window, float scale, const float* sinks, float* scratch, int64_t scratch_size, int nthreads);
void kv8_write_f32(int8_t* kc, int8_t* vc, float* ks, float* vs, const int64_t* slots, int64_t n, const float* k, int64_t k_stride, const float* v, int64_t v_stride, int Hkv, int D, int bs);
void kv8_write_bf16(int8_t* kc, int8_t* vc, float* ks, float* vs, const int64_t* slots, int64_t n, const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride, int Hkv, int D, int bs);
void kv_write(char* kc, char* vc, const int64_t* slots, int64_t n, const char* k, int64_t k_stride, const char* v, int64_t v_stride, int64_t bytes, int elem);

/* ---- decode_plan.c: a Llama decode step as one call (engine.models.llama_decode_plan) ----
   The structs are mirrored field for field by ctypes.Structure classes in Python. */
typedef struct {
  int64_t hidden, heads, kv_heads, head_dim, inter, block_size, kv_int8;
  float eps, scale;
} Shape;
typedef struct {  /* a linear layer's LoRA slots (engine.lora.layers.LoRALayer): lora.c's */
  const void *a, *bt;         /* float32, or bf16 where bf16_slots (lora_apply_bf16w) */
  const int32_t *width, *slice_row, *slice_size, *slice_off, *slice_rank;
  int64_t a_rows, out, rank, nslices, bf16_slots;
  int64_t amx;                /* bf16 slots: lora_apply_bf16w_amx first (lora_amx.c) */
} LoraLayer;
typedef struct {
  const uint16_t *in_norm, *post_norm;
  const uint8_t* w4[4];      /* 4-bit tiles (w4.c) of qkv, o, gate_up, down, or NULL */
  const uint16_t* bias[4];
  const uint8_t* packed[4];  /* w8a8: int8 weights packed for the GEMM, and their row scales */
  const float* wscale[4];
  void *k_cache, *v_cache;
  float *k_scales, *v_scales;
  const LoraLayer* lora[4];  /* qkv, o, gate_up, down's LoRA slots, or NULL */
  const uint8_t* lut4[4];    /* bitsandbytes 4-bit (lut4.c): codes, scales, levels, or NULL */
  const float *lut4_scales[4], *lut4_levels[4];
} Layer;
typedef struct {
  int64_t rows, max_blocks, scratch_size;
  uint16_t *hidden, *residual, *normed, *qkv, *qk, *attn, *gate_up, *act;
  const uint16_t *cos, *sin;
  const int64_t *slots, *block_tables, *context_lens;
  float* scratch;
  int threads, decode_threads;  /* torch's intra-op threads; the attention scratch's rows */
  int w8a8;                     /* the GEMMs: 4-bit (0) or int8 activations (1) */
  int8_t* xq;                   /* w8a8: a row-quantized input, its scales */
  float* xs;
  float *h, *hmax;              /* w8a8 MLP: silu(gate) * up, down's input */
  int8_t* hq;
  float* hs;
  int amx;                      /* 4-bit steps above w4.c's rows: the tiles on AMX-bf16 */
  const int32_t *lora_rows, *lora_seg_start, *lora_seg_len, *lora_seg_slot;
  int64_t lora_nseg;            /* the step's rows of each adapter slot (0: no adapter) */
} Step;
int run_decode(const Shape* s, const Layer* layers, int64_t n_layers, const Step* st);

#endif
