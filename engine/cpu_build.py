"""Build a small C library once per machine and load it with ctypes.

The CPU kernels (decode attention, the linear-layer GEMM) are plain C: no torch headers, so
they compile in about a second with the system compiler. Each is built with -march=native
into the cache dir under a key that covers the source, the compiler, the flags and the CPU,
so a shared cache never runs code built for another machine. ctypes drops the GIL around
each call. OpenMP loops run on torch's own thread pool: the library links libgomp.so.1,
which resolves to the copy torch already loaded.

TESSERA_CPU_KERNELS=0 disables every kernel (the torch paths run).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

from engine.paths import default_cache_dir

logger = logging.getLogger("tessera.engine")

# C shared by the kernels' sources (prepended to them): bf16 <-> float32 conversions that
# round like torch (to nearest even), f2f for the float32 variants of the same macros, and
# AVX-512 helpers, compiled only where the CPU has AVX-512.
C_BF16_HELPERS = r"""
#include <stdint.h>
static inline float bf2f(uint16_t x) { union { uint32_t u; float f; } v; v.u = (uint32_t)x << 16; return v.f; }
static inline uint16_t f2bf(float f) {
  union { uint32_t u; float f; } v; v.f = f;
  return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}
static inline float f2f(float x) { return x; }
"""
# The two divisions of a symmetric int8 quantizer (x -> round(x * (127 / amax)), scale
# amax / 127), IEEE-exact whatever -ffast-math would rewrite (a reciprocal then a multiply):
# with them C quantizers store the bytes their torch references do (which must divide the
# same way: torch's `127.0 / tensor` is itself reciprocal-then-multiply).
# <math.h> comes first: the pragma clears __FAST_MATH__, and math.h read without it declares
# no vector expf, so every later SiLU or softmax loop would call the scalar one (5x slower).
C_INT8_QUANT_HELPERS = r"""
#include <math.h>
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
__attribute__((noinline)) static float q8_inv(float amax) { return amax > 0.f ? 127.f / amax : 0.f; }
__attribute__((noinline)) static float q8_scale(float amax) { return amax / 127.f; }
#pragma GCC pop_options
"""
C_AVX512_HELPERS = r"""
#if defined(__AVX512F__)
#include <immintrin.h>
/* 16 floats -> 16 bf16, rounded like f2bf (to nearest even). */
static inline __m256i f2bf512(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16));
}
/* e^x as 2^n * p(f), |rel err| < 2e-7; x clamped to [-87, 88], where e^x stays a normal
   float (softmax's scores after the max, SiLU's -x). */
static inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718f));
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
/* lane j of the result = sum of v[j]'s lanes (a transpose-and-add tree, then one permute). */
static inline __m512 reduce16(const __m512 v[16]) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_ps(_mm512_unpacklo_ps(y[2 * i], y[2 * i + 1]),
                         _mm512_unpackhi_ps(y[2 * i], y[2 * i + 1]));
  const __m512 w = _mm512_add_ps(_mm512_unpacklo_ps(z[0], z[1]), _mm512_unpackhi_ps(z[0], z[1]));
  /* w holds v[k], v[8+k], v[4+k], v[12+k] in its 128-bit lane k (element 4k..4k+3): put v[j]'s sum at lane j. */
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, w);
}
#endif
"""

FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def cpu_flags() -> str:
    """The "flags" line of /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def kernels_enabled() -> bool:
    return os.environ.get("TESSERA_CPU_KERNELS", "1") != "0"


def _build(name: str, source: str, cache_dir: Path, what: str) -> Path | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        logger.info("No C compiler found: %s uses the torch path", what)
        return None
    key = hashlib.sha256("\0".join([source, cc, *FLAGS, cpu_flags()]).encode()).hexdigest()
    so = cache_dir / "kernels" / f"{name}-{key[:16]}.so"
    if so.is_file():
        return so
    so.parent.mkdir(parents=True, exist_ok=True)
    logger.info("Compiling the CPU kernel for %s once; cached at %s", what, so)
    with tempfile.TemporaryDirectory(dir=so.parent) as tmp:
        src = Path(tmp) / f"{name}.c"
        src.write_text(source)
        out = Path(tmp) / so.name
        proc = subprocess.run(
            [cc, *FLAGS, str(src), "-o", str(out), "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode != 0:
            logger.warning(
                "Building the CPU kernel for %s failed; using the torch path:\n%s",
                what,
                proc.stderr[-2000:],
            )
            return None
        os.replace(out, so)  # atomic: concurrent builders never load a half-written file
    return so


Signatures = dict[str, tuple[list[Any], Any]]  # C function -> (argtypes, restype)


def load_library(name: str, source: str, what: str, signatures: Signatures) -> ctypes.CDLL | None:
    """The compiled library with its functions' signatures set (built on first use), or None:
    disabled, no compiler, failure. The answer is remembered for the process (so a failure is
    logged once, and later calls on the hot path cost one dict lookup)."""
    if name in _loaded:
        return _loaded[name]
    with _lock:
        if name in _loaded:
            return _loaded[name]
        lib = None
        if kernels_enabled():
            try:
                path = _build(name, source, default_cache_dir(), what)
                if path is not None:
                    lib = ctypes.CDLL(str(path))
                    for fn_name, (argtypes, restype) in signatures.items():
                        fn = getattr(lib, fn_name)
                        fn.argtypes, fn.restype = argtypes, restype
            except (OSError, AttributeError, subprocess.SubprocessError) as e:
                logger.warning("Loading the CPU kernel for %s failed (%s); torch path", what, e)
                lib = None
        _loaded[name] = lib
        return lib
