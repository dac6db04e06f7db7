/* The two divisions of a symmetric int8 quantizer (x -> round(x * (127 / amax)), scale
   amax / 127), IEEE-exact whatever -ffast-math would rewrite (a reciprocal then a multiply):
   with them C quantizers store the bytes their torch references do (which must divide the
   same way: torch's `127.0 / tensor` is itself reciprocal-then-multiply).
   <math.h> comes first: the pragma clears __FAST_MATH__, and math.h read without it declares
   no vector expf, so every later SiLU or softmax loop would call the scalar one (5x slower). */
#ifndef TESSERA_INT8_QUANT_H
#define TESSERA_INT8_QUANT_H

#include <math.h>
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
__attribute__((noinline)) static float q8_inv(float amax) { return amax > 0.f ? 127.f / amax : 0.f; }
__attribute__((noinline)) static float q8_scale(float amax) { return amax / 127.f; }
#pragma GCC pop_options
#endif
