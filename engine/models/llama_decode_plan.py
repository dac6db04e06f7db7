"""A Llama decode step of up to 12 rows as one C call (the CPU's answer to CUDA graphs).

At one stream a decode step is ~330 small calls (per layer: two norms, four 4-bit GEMMs,
rotary, the KV write, attention, SiLU), each a few microseconds of Python, torch and ctypes
around a few microseconds of work: on a Zen 4 core ~2.5 ms of a ~10 ms step. The plan runs
the same kernels in the same order from C, through their function pointers, on buffers it
keeps per row count: every byte they write is what the module path writes (tested). In the
server it saves more than the Python: after each of those calls the engine thread had to win
the GIL back from the HTTP thread's per-token work; now it does once a step (one stream on
Zen 4: TPOT 14-14.5 -> 7-8.3 ms).

It takes the steps the w4a8 small-batch path runs (`--quantization w4a8`, one tensor-parallel
rank, every linear layer with its 4-bit copy, the compiled norm/rotary/attention kernels,
bf16) where every row is a decode on the attention kernel; any other step, or a model it does
not fit, runs the modules. TESSERA_DECODE_PLAN=0 turns it off.
"""

from __future__ import annotations

import ctypes
import os

import torch

from engine.attention import cpu_kernel
from engine.attention.metadata import AttentionMetadata
from engine.cpu_build import load_library
from engine.layers import cpu_fused, cpu_w4

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
typedef uint16_t bf16;
typedef void (*norm_fn)(const bf16*, int64_t, bf16*, int64_t, const bf16*, bf16*, int64_t,
    int64_t, int64_t, float, int);
typedef int (*q4_fn)(const bf16*, int64_t, int64_t, int64_t, const uint8_t*, int64_t,
    const bf16*, bf16*, int64_t, int);
typedef void (*rope_fn)(const bf16*, int64_t, const bf16*, const bf16*, bf16*, int64_t,
    int64_t, int64_t, int);
typedef void (*silu_fn)(const bf16*, int64_t, bf16*, int64_t, int64_t, int64_t, int);
typedef void (*kv8_write_fn)(int8_t*, int8_t*, float*, float*, const int64_t*, int64_t,
    const bf16*, int64_t, const bf16*, int64_t, int, int, int);
typedef void (*decode_fn)(bf16*, int64_t, const bf16*, int64_t, const void*, const void*,
    const float*, const float*, const int64_t*, int64_t, const int64_t*, int64_t, int, int,
    int, int, float, float*, int64_t, int);

typedef struct { void *norm, *q4, *rope, *silu, *kv8_write, *decode; } Kernels;
typedef struct {
  int64_t hidden, heads, kv_heads, head_dim, inter, block_size, kv_int8;
  float eps, scale;
} Shape;
typedef struct {
  const bf16 *in_norm, *post_norm;
  const uint8_t *qkv, *o, *gate_up, *down;
  const bf16 *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
  void *k_cache, *v_cache;
  float *k_scales, *v_scales;
} Layer;
typedef struct {
  int64_t rows, max_blocks, scratch_size;
  bf16 *hidden, *residual, *normed, *qkv, *qk, *attn, *gate_up, *act;
  const bf16 *cos, *sin;
  const int64_t *slots, *block_tables, *context_lens;
  float* scratch;
  int threads, decode_threads;  /* torch's intra-op threads; the attention scratch's rows */
} Step;

/* hidden: the step's embeddings in, the last layer's output out (residual: its stream, for
   the final norm). 0, or -1 when a GEMM could not allocate. */
int run_decode(const Kernels* kn, const Shape* s, const Layer* layers, int64_t n_layers,
    const Step* st) {
  const norm_fn norm = (norm_fn)kn->norm; const q4_fn q4 = (q4_fn)kn->q4;
  const rope_fn rope = (rope_fn)kn->rope; const silu_fn silu = (silu_fn)kn->silu;
  const int64_t M = st->rows, Hd = s->hidden, D = s->head_dim, H = s->heads, Hkv = s->kv_heads;
  const int64_t qkv_n = (H + 2 * Hkv) * D, qk_n = (H + Hkv) * D, T = st->threads;
  for (int64_t l = 0; l < n_layers; ++l) {
    const Layer* L = layers + l;
    if (l == 0) {  /* the residual stream starts as the embeddings */
      memcpy(st->residual, st->hidden, sizeof(bf16) * M * Hd);
      norm(st->hidden, Hd, NULL, 0, L->in_norm, st->normed, Hd, M, Hd, s->eps, T);
    } else {
      norm(st->hidden, Hd, st->residual, Hd, L->in_norm, st->normed, Hd, M, Hd, s->eps, T);
    }
    if (q4(st->normed, Hd, M, Hd, L->qkv, qkv_n, L->qkv_bias, st->qkv, qkv_n, T)) return -1;
    rope(st->qkv, qkv_n, st->cos, st->sin, st->qk, M, H + Hkv, D, T);
    const bf16* k = st->qk + H * D; const bf16* v = st->qkv + qk_n;
    if (s->kv_int8) {
      ((kv8_write_fn)kn->kv8_write)((int8_t*)L->k_cache, (int8_t*)L->v_cache, L->k_scales,
          L->v_scales, st->slots, M, k, qk_n, v, qkv_n, (int)Hkv, (int)D, (int)s->block_size);
    } else {  /* [blocks, block_size, Hkv, D]: a token's heads are one row at its slot */
      for (int64_t t = 0; t < M; ++t) {
        memcpy((bf16*)L->k_cache + st->slots[t] * Hkv * D, k + t * qk_n, sizeof(bf16) * Hkv * D);
        memcpy((bf16*)L->v_cache + st->slots[t] * Hkv * D, v + t * qkv_n, sizeof(bf16) * Hkv * D);
      }
    }
    ((decode_fn)kn->decode)(st->attn, H * D, st->qk, qk_n, L->k_cache, L->v_cache, L->k_scales,
        L->v_scales, st->block_tables, st->max_blocks, st->context_lens, M, (int)H, (int)Hkv,
        (int)D, (int)s->block_size, s->scale, st->scratch, st->scratch_size, st->decode_threads);
    if (q4(st->attn, H * D, M, H * D, L->o, Hd, L->o_bias, st->hidden, Hd, T)) return -1;
    norm(st->hidden, Hd, st->residual, Hd, L->post_norm, st->normed, Hd, M, Hd, s->eps, T);
    const int64_t I = s->inter;
    if (q4(st->normed, Hd, M, Hd, L->gate_up, 2 * I, L->gate_up_bias, st->gate_up, 2 * I, T))
      return -1;
    silu(st->gate_up, 2 * I, st->act, I, M, I, T);
    if (q4(st->act, I, M, I, L->down, Hd, L->down_bias, st->hidden, Hd, T)) return -1;
  }
  return 0;
}
"""

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Kernels(ctypes.Structure):
    _fields_ = [(n, _P) for n in ("norm", "q4", "rope", "silu", "kv8_write", "decode")]


class _Shape(ctypes.Structure):
    _fields_ = [
        (n, _I64)
        for n in ("hidden", "heads", "kv_heads", "head_dim", "inter", "block_size", "kv_int8")
    ] + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class _Layer(ctypes.Structure):
    _fields_ = [
        (n, _P)
        for n in (
            "in_norm",
            "post_norm",
            "qkv",
            "o",
            "gate_up",
            "down",
            "qkv_bias",
            "o_bias",
            "gate_up_bias",
            "down_bias",
            "k_cache",
            "v_cache",
            "k_scales",
            "v_scales",
        )  # fmt: skip
    ]


_BUFFERS = ("hidden", "residual", "normed", "qkv", "qk", "attn", "gate_up", "act")


class _Step(ctypes.Structure):
    _fields_ = (
        [(n, _I64) for n in ("rows", "max_blocks", "scratch_size")]
        + [(n, _P) for n in _BUFFERS]
        + [(n, _P) for n in ("cos", "sin", "slots", "block_tables", "context_lens", "scratch")]
        + [("threads", ctypes.c_int), ("decode_threads", ctypes.c_int)]
    )


def _run_fn():
    lib = load_library("decode_plan", _SOURCE, "the one-call decode step", {})
    fn = getattr(lib, "run_decode", None) if lib is not None else None
    if fn is not None:
        fn.argtypes = [
            ctypes.POINTER(_Kernels),
            ctypes.POINTER(_Shape),
            _P,
            _I64,
            ctypes.POINTER(_Step),
        ]
        fn.restype = ctypes.c_int
    return fn


def _address(lib: ctypes.CDLL | None, name: str) -> int | None:
    return _fn_address(getattr(lib, name, None) if lib is not None else None)


def _fn_address(fn) -> int | None:
    return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value


def enabled() -> bool:
    return os.environ.get("TESSERA_DECODE_PLAN", "1") != "0"


class DecodePlan:
    """The layers' weights and caches as C structs, built once; run() takes a step."""

    def __init__(self, model: torch.nn.Module, run_fn, kernels: _Kernels):
        layers = model.layers
        a0 = layers[0].self_attn
        self._run_fn, self._kernels = run_fn, kernels
        self._shape = _Shape(
            hidden=model.norm.weight.shape[0], heads=a0.num_heads, kv_heads=a0.num_kv_heads,
            head_dim=a0.head_dim, inter=layers[0].mlp.down_proj.w4.in_features,
            block_size=a0.attn.kv_cache.shape[2], kv_int8=int(a0.attn.kv_scales is not None),
            eps=layers[0].input_layernorm.eps, scale=a0.attn.scale,
        )  # fmt: skip
        self._final_norm = model.norm
        self._layers = (_Layer * len(layers))()
        self._tensors: list[torch.Tensor] = []  # what _layers points into, kept alive with it
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            cache, scales = attn.attn.kv_cache, attn.attn.kv_scales
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            self._tensors += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            self._tensors += [m.w4.data for m in linears] + [
                m.bias for m in linears if m.bias is not None
            ]
            self._tensors += [cache] + ([] if scales is None else [scales])
            self._layers[i] = _Layer(
                layer.input_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.weight.data_ptr(),
                *(m.w4.data.data_ptr() for m in linears),
                *(None if m.bias is None else m.bias.data_ptr() for m in linears),
                cache[0].data_ptr(), cache[1].data_ptr(),
                None if scales is None else scales[0].data_ptr(),
                None if scales is None else scales[1].data_ptr(),
            )  # fmt: skip
        self._buffers: dict[int, tuple[dict[str, torch.Tensor], _Step]] = {}
        self.runs: dict[int, int] = {}  # steps run, by row count

    @classmethod
    def build(cls, model: torch.nn.Module) -> DecodePlan | None:
        """The plan for a LlamaModel, or None where it does not fit (see the module doc)."""
        if not enabled() or not len(model.layers):
            return None
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            cache = attn.attn.kv_cache
            if (
                any(m.w4 is None or m.tp_size != 1 for m in linears)
                or any(m.bias is not None and m.bias.dtype != torch.bfloat16 for m in linears)
                or cache is None
                or cache.device.type != "cpu"
                or not cache.is_contiguous()
                or cache.dtype not in (torch.bfloat16, torch.int8)
                or layer.input_layernorm.weight.dtype != torch.bfloat16
                or layer.post_attention_layernorm.weight.dtype != torch.bfloat16
            ):
                return None
        a0 = model.layers[0].self_attn
        if not cpu_kernel.kernel_supports(
            torch.bfloat16, torch.device("cpu"), a0.num_kv_heads, a0.head_dim
        ):
            return None
        fused, attention = cpu_fused._load(), cpu_kernel.load_kernel()
        addresses = {
            "norm": _address(fused, "rmsnorm_bf16"),
            "q4": _fn_address(cpu_w4._kernel()),
            "rope": _address(fused, "rope_bf16"),
            "silu": _address(fused, "silu_mul_bf16"),
            "kv8_write": _address(attention, "kv8_write_bf16"),
            "decode": _address(
                attention,
                "paged_decode_kv8_bf16" if a0.attn.kv_scales is not None else "paged_decode_bf16",
            ),
        }
        run_fn = _run_fn()
        if run_fn is None or None in addresses.values():
            return None
        return cls(model, run_fn, _Kernels(**addresses))

    def takes(self, rows: int, meta: AttentionMetadata) -> bool:
        kd = meta.kernel_decode
        return (
            1 <= rows <= cpu_w4.MAX_ROWS
            and kd is not None
            and kd.num_rows == rows
            and not meta.decode_groups
            and not meta.prefills
        )

    def _step_buffers(self, rows: int) -> tuple[dict[str, torch.Tensor], _Step]:
        if rows not in self._buffers:
            s = self._shape
            h, qkv = s.heads * s.head_dim, (s.heads + 2 * s.kv_heads) * s.head_dim
            widths = {
                "hidden": s.hidden, "residual": s.hidden, "normed": s.hidden, "qkv": qkv,
                "qk": qkv - s.kv_heads * s.head_dim, "attn": h, "gate_up": 2 * s.inter,
                "act": s.inter,
            }  # fmt: skip
            bufs = {n: torch.empty(rows, w, dtype=torch.bfloat16) for n, w in widths.items()}
            step = _Step(rows=rows, **{n: t.data_ptr() for n, t in bufs.items()})
            self._buffers[rows] = (bufs, step)
        return self._buffers[rows]

    def run(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """The final norm's output [rows, hidden] for the embeddings hidden; None if the C call
        failed (the caller reruns the step on the modules, whose KV writes land on the same
        slots with the same bytes)."""
        rows = hidden.shape[0]
        kd = meta.kernel_decode
        assert kd is not None
        bufs, step = self._step_buffers(rows)
        bufs["hidden"].copy_(hidden)
        for x in (cos, sin, meta.slot_mapping, kd.block_tables, kd.context_lens, kd.scratch):
            assert x.is_contiguous()
        step.cos, step.sin = cos.data_ptr(), sin.data_ptr()
        step.slots = meta.slot_mapping.data_ptr()
        step.block_tables, step.max_blocks = kd.block_tables.data_ptr(), kd.block_tables.shape[1]
        step.context_lens = kd.context_lens.data_ptr()
        step.scratch, step.scratch_size = kd.scratch.data_ptr(), kd.scratch.shape[1]
        step.threads, step.decode_threads = torch.get_num_threads(), kd.scratch.shape[0]
        rc = self._run_fn(
            ctypes.byref(self._kernels), ctypes.byref(self._shape), ctypes.addressof(self._layers),
            len(self._layers), ctypes.byref(step),
        )  # fmt: skip
        if rc != 0:
            return None
        self.runs[rows] = self.runs.get(rows, 0) + 1
        norm = self._final_norm
        return cpu_fused.rms_norm(bufs["hidden"], norm.weight, norm.eps, bufs["residual"])
