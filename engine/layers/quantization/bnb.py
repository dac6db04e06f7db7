"""bitsandbytes checkpoints (`quant_method: "bitsandbytes"`): what transformers saves for a
model loaded with its BitsAndBytesConfig (`load_in_4bit`, `load_in_8bit`), unsloth's
`-bnb-4bit` uploads among them; and `--quantization bitsandbytes` on a float checkpoint
(NF4 at load, as vLLM's in-flight bitsandbytes).

4-bit (NF4 or bnb's FP4) layers hold `weight` uint8 [N * K / 2, 1] (the row-major [N, K]
weight two codes a byte, the even one in the high nibble), `weight.absmax` (one per
`blocksize` weights of that flat order: float32, or with double quantization uint8 codes of
`weight.nested_quant_map` scaled by `weight.nested_absmax` per `nested_blocksize` of them plus
`nested_offset`), `weight.quant_map` (the 16 levels) and `weight.quant_state.bitsandbytes__nf4`
(JSON bytes: quant_type, blocksize, shape, the nested settings): W = quant_map[code] * absmax
in float32, as bitsandbytes' dequantize_4bit computes it. Those statistics are read together,
so a layer keeps its checkpoint tensors as they arrive (PartsLoader) and decodes them once all
have loaded.

8-bit (LLM.int8) layers hold `weight` int8 [N, K] and `SCB` float32 [N] (each row's absmax):
W = q * SCB / 127. bitsandbytes' outlier threshold (llm_int8_threshold) is about its int8
activations; Tessera keeps activations in the model dtype (more exact) and says so at start-up.

After loading:
- 4-bit on a CPU with the kernels: the codes and one float32 scale per 64 weights (4.5 bits a
  weight; a larger blocksize's absmax repeated per 64) on the LUT4 kernel
  (engine/kernels/cpu/lut4.c: each block's 16 levels times its scale, looked up by code, in
  float32; exact); on CUDA (and the tests' Triton interpreter) the same codes and absmax
  (0.56 bytes a weight) on the FP4 Triton GEMM's LUT4 kind (engine/kernels/triton/
  nvfp4_gemm.py), dequantized in its inner loop; where K (or a row-parallel rank's share of
  it) is not a multiple of 64 or the blocks straddle rows, and without either kernel,
  dequantized at load into the model dtype (its float weight's bytes; named in the start-up
  log).
- 8-bit: the integer formats' 8-bit per-channel path (GPTQ 8-bit's): int8 rows with float32
  row scales SCB / 127 on the int8 C GEMM (`--quantization int8`'s kernel) on the CPU, the
  Triton W8A16 GEMM on CUDA.

Mixtures of experts: transformers 5 quantizes nn.Linear layers only, so its checkpoints keep
the experts and routers float (they load as ever); transformers 4 held each expert's
projections as nn.Linear layers and bitsandbytes quantized them one by one (BnbExpertsMethod:
one small layer per expert and projection, on the paths above); a quantized router or
Qwen2-MoE's shared_expert_gate is decoded to float at load (prepare_model / finish_model).
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from engine.kernels.cpu import lut4 as cpu_lut4
from engine.layers.quantization.base import (
    LinearMethodBase,
    triton_linear,
    triton_weight,
    wants_triton,
)
from engine.layers.quantization.checkpoint import QuantizationConfig, kept_float, unsupported
from engine.layers.quantization.int_weight import finish_int_layer, register, register_bias
from engine.layers.quantization.unquantized import linear_by_rows

QUANT_TYPES = ("nf4", "fp4")
# the dtype the packed codes are stored in (FSDP-QLoRA's checkpoints: bfloat16); the bytes are
# the same codes whatever the dtype
QUANT_STORAGE = ("uint8", "bfloat16", "float16", "float32")
LUT_BLOCK = 64  # weights a LUT4 scale covers (engine.kernels.cpu.lut4)
# NF4's 16 levels as bitsandbytes writes them (its quant_map): `--quantization bitsandbytes` on a
# float checkpoint rounds each weight / its block's absmax to the nearest
NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
ONLINE_BLOCK = 64  # bitsandbytes' default blocksize


class BitsAndBytesConfig(QuantizationConfig):
    name = "bitsandbytes"

    def __init__(self, bits: int, quant_type: str, skip: list[str], checkpoint: bool = True,
                 double_quant: bool = False):  # fmt: skip
        self.bits, self.quant_type, self.skip = bits, quant_type, skip
        self.checkpoint, self.double_quant = checkpoint, double_quant

    @classmethod
    def from_checkpoint(cls, qcfg: dict[str, Any]) -> BitsAndBytesConfig:
        four = bool(qcfg.get("load_in_4bit", qcfg.get("_load_in_4bit", False)))
        eight = bool(qcfg.get("load_in_8bit", qcfg.get("_load_in_8bit", False)))
        if four == eight:
            raise unsupported(
                "load_in_4bit / load_in_8bit", (four, eight), "exactly one of them true"
            )
        skip = list(qcfg.get("llm_int8_skip_modules") or [])
        if eight:
            if qcfg.get("llm_int8_has_fp16_weight"):
                raise unsupported("llm_int8_has_fp16_weight", True, "false (int8 weights)")
            return cls(8, "int8", skip)
        quant_type = qcfg.get("bnb_4bit_quant_type", "fp4")
        if quant_type not in QUANT_TYPES:
            raise unsupported("bnb_4bit_quant_type", quant_type, ", ".join(QUANT_TYPES))
        storage = qcfg.get("bnb_4bit_quant_storage", "uint8")
        if storage not in QUANT_STORAGE:
            raise unsupported("bnb_4bit_quant_storage", storage, ", ".join(QUANT_STORAGE))
        return cls(4, quant_type, skip, double_quant=bool(qcfg.get("bnb_4bit_use_double_quant")))

    @classmethod
    def online(cls) -> BitsAndBytesConfig:
        return cls(4, "nf4", [], checkpoint=False)

    def linear_method(self, prefix: str, sources: list[str]) -> LinearMethodBase | None:
        if kept_float(sources, self.skip, "llm_int8_skip_modules"):
            return None
        if self.bits == 8:
            return BnbInt8LinearMethod()
        return Bnb4bitLinearMethod(self.checkpoint)

    def checkpoint_name(self, name: str) -> str:
        return checkpoint_name(name)

    def prepare_model(self, model: nn.Module, dtype: torch.dtype) -> None:
        """Routers and shared-expert gates (ReplicatedGate: no linear method) take whatever the
        checkpoint holds, a float weight or bitsandbytes' parts (transformers quantizes Qwen2-MoE's
        shared_expert_gate, an nn.Linear), decoded to float at load: they are small."""
        from engine.layers.moe import ReplicatedGate

        for module in model.modules():
            if isinstance(module, ReplicatedGate):
                device = module.weight.device
                del module.weight
                module.model_dtype = dtype
                with torch.device(device):
                    _register_parts(module, ALL_PARTS, tuple(p for p in ALL_PARTS if p != "weight"))

    def finish_model(self, model: nn.Module) -> None:
        from engine.layers.moe import ReplicatedGate

        for name, module in model.named_modules():
            if isinstance(module, ReplicatedGate) and hasattr(module, "bnb_parts"):
                dtype = module.bias.dtype if module.bias is not None else module.model_dtype
                w = _gate_weight(module, name)
                module.weight = nn.Parameter(w.to(dtype), requires_grad=False)

    def experts_method(self, prefix: str, sources: list[str]):
        """Experts as the checkpoint holds them: float (transformers 5 quantizes nn.Linear
        layers only, not its stacked experts) or quantized one by one (transformers 4's
        per-expert nn.Linear layers): BnbExpertsMethod takes either."""
        if self.linear_method(prefix, sources) is None:
            return None
        return BnbExpertsMethod(self.bits)

    def describe(self) -> str:
        if not self.checkpoint:
            return f"NF4 quantized at load, absmax per {ONLINE_BLOCK} weights"
        if self.bits == 8:
            return "LLM.int8 weights (int8 rows, absmax scales), activations in the model dtype"
        nested = ", double-quantized absmax" if self.double_quant else ""
        return f"4-bit {self.quant_type.upper()}{nested}"


# -- loading ----------------------------------------------------------------------------------

# a layer's checkpoint tensors, by the suffix after the layer's name -> the part's key
PARTS_4BIT = {
    "weight": "weight",
    "weight.absmax": "absmax",
    "weight.quant_map": "quant_map",
    "weight.nested_absmax": "nested_absmax",
    "weight.nested_quant_map": "nested_quant_map",
    "weight.quant_state.bitsandbytes__nf4": "quant_state",
    "weight.quant_state.bitsandbytes__fp4": "quant_state",
}
NESTED_PARTS = ("nested_absmax", "nested_quant_map")  # double quantization's
PARTS_8BIT = {"weight": "weight", "SCB": "scb", "weight_format": "weight_format"}
ALL_PARTS = sorted({*PARTS_4BIT.values(), *PARTS_8BIT.values()})


def _gate_weight(module: nn.Module, name: str) -> torch.Tensor:
    """A ReplicatedGate's float32 weight from its loaded parts: as stored, or bitsandbytes'
    4-bit / 8-bit weight decoded."""
    (parts,) = _take_parts(module).values()
    if "quant_state" in parts:
        codes, absmax, state = decode_4bit(parts, name)
        levels = _need(parts, "quant_map", name, None).float()
        return dequantized_4bit_weight(codes, absmax, levels, int(state["blocksize"]))
    w = _need(parts, "weight", name, None)
    if "scb" in parts:
        return w.float() * (parts["scb"].float().reshape(-1, 1) / 127.0)
    return w.float()


def checkpoint_name(name: str) -> str:
    """A checkpoint tensor's name as the layer registers it: bitsandbytes' statistics
    (`q_proj.weight.absmax`, `q_proj.weight.quant_state.bitsandbytes__nf4`, `q_proj.SCB`) under
    one parameter name each (`q_proj.bnb_absmax`, `q_proj.bnb_quant_state`, `q_proj.bnb_scb`);
    other names unchanged."""
    for suffix, part in (*PARTS_4BIT.items(), *PARTS_8BIT.items()):
        if part != "weight" and name.endswith(f".{suffix}"):
            return f"{name[: -len(suffix)]}bnb_{part}"
    return name


class PartsLoader:
    """A parameter's weight_loader that keeps the checkpoint tensor, whole, by (part, shard):
    a layer's statistics decode together after loading (module docstring)."""

    def __init__(self, layer: nn.Module, part: str):
        self.layer, self.part = layer, part

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        self.layer.bnb_parts[(self.part, shard_id)] = loaded


def _register_parts(layer: nn.Module, parts: list[str], optional: tuple[str, ...] = ()) -> None:
    layer.bnb_parts = {}
    layer.bnb_names = []
    layer.bnb_device = torch.empty(0).device  # the model's (create_weights runs under it)
    for part in parts:
        name = "weight" if part == "weight" else f"bnb_{part}"
        register(layer, name, torch.empty(0), PartsLoader(layer, part))
        getattr(layer, name).optional = part in optional
        layer.bnb_names.append(name)


def _take_parts(layer: nn.Module) -> dict:
    """The layer's loaded parts {shard: {part: tensor}} in the merged layer's row order; the
    placeholders dropped."""
    by_shard: dict = {}
    for (part, shard), t in layer.bnb_parts.items():
        by_shard.setdefault(shard, {})[part] = t.to(layer.bnb_device)
    for name in layer.bnb_names:
        delattr(layer, name)
    del layer.bnb_parts, layer.bnb_names, layer.bnb_device
    return dict(sorted(by_shard.items(), key=lambda kv: _shard_rank(kv[0])))


def _shard_rank(shard) -> int:
    """Where a merged shard's rows sit: q, k, v; gate (0), up (1); None alone."""
    return -1 if shard is None else {"q": 0, "k": 1, "v": 2}.get(shard, shard)


def _need(parts: dict, part: str, name: str, shard) -> torch.Tensor:
    if part not in parts:
        where = "" if shard is None else f" (shard {shard!r})"
        raise ValueError(f"{name}{where}: the checkpoint has no {part} tensor")
    return parts[part]


def decode_4bit(parts: dict[str, torch.Tensor], name: str = "", shard=None
                ) -> tuple[torch.Tensor, torch.Tensor, dict]:  # fmt: skip
    """One checkpoint layer's 4-bit parts -> (codes uint8 [N, K] in 0..15, absmax float32 over
    the flat weight's blocks, its quant state): W = levels[codes] * absmax block by block."""
    raw = _need(parts, "quant_state", name, shard)
    state = json.loads(bytes(raw.tolist()).decode())
    n, k = (int(d) for d in state["shape"])
    stored = _need(parts, "weight", name, shard)
    if stored.dtype == torch.int8 or not stored.is_contiguous():
        raise ValueError(f"{name}: weight {tuple(stored.shape)} {stored.dtype} is not 4-bit codes")
    packed = stored.reshape(-1).view(torch.uint8)  # bnb_4bit_quant_storage: the codes' bytes
    if packed.numel() * 2 != n * k:
        raise ValueError(
            f"{name}: weight {tuple(stored.shape)} {stored.dtype} holds {packed.numel()} bytes, "
            f"not the {n * k // 2} of {n}x{k} 4-bit codes"
        )
    codes = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(n, k)
    absmax = _need(parts, "absmax", name, shard)
    if "nested_blocksize" in state:  # double quantization: absmax's own codes and scales
        nested = _need(parts, "nested_absmax", name, shard).float()
        levels = _need(parts, "nested_quant_map", name, shard).float()
        idx = torch.arange(absmax.numel(), device=absmax.device) // int(state["nested_blocksize"])
        absmax = levels[absmax.long()] * nested[idx] + float(state["nested_offset"])
    return codes, absmax.float().reshape(-1), state


def dequantized_4bit_weight(codes: torch.Tensor, absmax: torch.Tensor, levels: torch.Tensor,
                            blocksize: int) -> torch.Tensor:  # fmt: skip
    """float32 [N, K]: levels[codes] * absmax over the flat weight's blocks (bitsandbytes'
    dequantize_4bit, in float32)."""
    flat = levels[codes.reshape(-1).long()]
    return (flat * absmax.repeat_interleave(blocksize)[: flat.numel()]).view(codes.shape)


def quantize_nf4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] (K % 64 == 0) -> (NF4 codes uint8 [N, K], absmax float32
    [N, K / 64]): each weight / its block's absmax rounded to the nearest level."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // ONLINE_BLOCK, ONLINE_BLOCK)
    absmax = blocks.abs().amax(-1).clamp_min(1e-12)
    levels = torch.tensor(NF4_LEVELS, device=w.device)
    codes = torch.empty(blocks.shape, dtype=torch.uint8, device=w.device)
    for r0 in range(0, n, 256):  # bounded transient: [rows, K, 16] distances
        scaled = (blocks[r0 : r0 + 256] / absmax[r0 : r0 + 256, :, None]).unsqueeze(-1)
        codes[r0 : r0 + 256] = (scaled - levels).abs().argmin(-1).to(torch.uint8)
    return codes.reshape(n, k), absmax


def _rank_rows(layer: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """A column-parallel rank's share of one merged shard's rows."""
    if layer.tp_dim != 0 or layer.tp_size == 1:
        return t
    rows = t.shape[0] // layer.tp_size
    return t.narrow(0, layer.tp_rank * rows, rows)


def _rank_cols(layer: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """A row-parallel rank's share of the columns (of codes, or of their scales per 64)."""
    if layer.tp_dim != 1 or layer.tp_size == 1:
        return t
    cols = t.shape[1] // layer.tp_size
    return t.narrow(1, layer.tp_rank * cols, cols)


# -- 4-bit ------------------------------------------------------------------------------------


class Bnb4bitLinearMethod(LinearMethodBase):
    """A bitsandbytes 4-bit layer (module docstring). On the CPU's LUT4 kernel layer.weight is
    the kernel's codes (uint8 [N, K / 2]), layer.lut4_scales and layer.lut4_levels its scales
    and levels; on the Triton GEMM layer.weight is None and layer.lut4 the kernel's weight;
    dequantized, layer.weight is the float weight and layer.lut4_levels None. triton: the
    Triton GEMM (None: on CUDA; True: also for CPU tensors, the tests' way under
    TRITON_INTERPRET=1)."""

    def __init__(self, checkpoint: bool = True, triton: bool | None = None):
        self.checkpoint, self.triton = checkpoint, triton

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool):
        if not self.checkpoint:  # a float checkpoint: quantized after loading
            return super().create_weights(layer, input_size, output_size, bias)
        _register_parts(layer, sorted(set(PARTS_4BIT.values())), NESTED_PARTS)
        register_bias(layer, output_size, bias)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        dtype = getattr(layer, "model_dtype", torch.get_default_dtype())
        layer.lut4_levels = None
        if self.checkpoint:
            codes, scales, levels, what = self._from_checkpoint(layer)
            self._finish(layer, codes, scales, levels, dtype, what)
            return
        w = layer.weight.data
        if w.shape[1] % ONLINE_BLOCK:
            layer.quant_path = f"unquantized (K={w.shape[1]} is not a multiple of {ONLINE_BLOCK})"
            return
        codes, scales = quantize_nf4(w)
        del layer.weight
        levels = torch.tensor(NF4_LEVELS, device=codes.device)
        self._finish(layer, codes, scales, levels, dtype, "NF4 quantized at load")

    @staticmethod
    def _from_checkpoint(layer: nn.Module):
        """(codes uint8 [N, K], scales float32 [N, K / 64], levels, what) of this rank's share,
        or (its float32 weight, None, levels, what) where the blocks do not map onto the
        kernel's 64s (blocks straddling rows, a rank's columns off the 64s)."""
        name = getattr(layer, "prefix", type(layer).__name__)
        codes, blocks, levels, kinds = [], [], None, set()
        for shard, parts in _take_parts(layer).items():
            c, absmax, state = decode_4bit(parts, name, shard)
            lv = _need(parts, "quant_map", name, shard).float().reshape(-1)
            if lv.numel() != 16 or (levels is not None and not torch.equal(levels, lv)):
                raise ValueError(f"{name}: quant_map of {lv.numel()} levels, or the merged "
                                 "projections' quant_map differ")  # fmt: skip
            levels = lv
            kinds.add(state["quant_type"])
            codes.append(c)
            blocks.append((absmax, int(state["blocksize"])))
        what = f"bitsandbytes {'/'.join(sorted(kinds)).upper()}"
        k = codes[0].shape[1]
        rank_k = k // layer.tp_size if layer.tp_dim == 1 else k
        if rank_k % LUT_BLOCK == 0 and all(bs % LUT_BLOCK == 0 and k % bs == 0 for _, bs in blocks):
            scales = [_rank_rows(layer, a.view(c.shape[0], -1).repeat_interleave(bs // LUT_BLOCK, 1))
                      for c, (a, bs) in zip(codes, blocks, strict=True)]  # fmt: skip
            c = torch.cat([_rank_rows(layer, c) for c in codes])
            return _rank_cols(layer, c), _rank_cols(layer, torch.cat(scales)), levels, what
        w = torch.cat([_rank_rows(layer, dequantized_4bit_weight(c, a, levels, bs))
                       for c, (a, bs) in zip(codes, blocks, strict=True)])  # fmt: skip
        return _rank_cols(layer, w), None, levels, what

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if layer.weight is None:  # the Triton GEMM (_finish)
            return triton_linear("nvfp4_gemm", "nvfp4_gemm", x, layer.lut4, bias)
        if layer.lut4_levels is None:
            return linear_by_rows(layer, x, layer.weight, bias)
        return cpu_lut4.linear(
            x, layer.weight, layer.lut4_scales, layer.lut4_levels, layer.in_features, bias
        )

    def _finish(self, layer, codes, scales, levels, dtype, what: str) -> None:
        """The layer's kernel form: LUT4 codes and scales (the CPU kernel's, or the Triton
        GEMM's), or the float weight (scales None: codes is already the float32 weight)."""
        triton_why = ""
        if scales is not None and wants_triton(self.triton, codes.device):
            weight, triton_why = triton_weight("nvfp4_gemm", "Lut4Weight",
                                               lambda cls: cls.prepare(codes, scales, levels))  # fmt: skip
            if weight is not None:
                layer.register_parameter("weight", None)
                layer.lut4 = weight
                layer.quant_path = (
                    f"{what} codes and float32 absmax per 64 (0.56 bytes a weight) on the LUT4 "
                    "Triton GEMM (engine/kernels/triton/nvfp4_gemm.py), dequantized in its inner "
                    "loop"
                )
                return
        _finish_cpu(layer, codes, scales, levels, dtype, what, triton_why)


def _finish_cpu(layer, codes, scales, levels, dtype, what: str, triton_why: str = "") -> None:
    """The CPU's LUT4 kernel, or the float weight."""
    if scales is None:
        why, w = "its blocks do not map onto scales per 64 along this rank's K", codes
    else:
        if codes.device.type != "cpu":
            why = f"on {codes.device.type}: the LUT4 kernel runs on the CPU{triton_why}"
        elif not cpu_lut4.available():
            why = "the CPU kernels are not built"
        else:
            layer.weight = nn.Parameter(cpu_lut4.pack_codes(codes), requires_grad=False)
            layer.lut4_scales = scales.float().contiguous()
            layer.lut4_levels = levels.float().contiguous()
            layer.in_features = codes.shape[1]
            layer.quant_path = (
                f"{what} as LUT4 codes with float32 scales per 64 (4.5 bits a weight) on the "
                "LUT4 kernel (its 16 levels times each block's scale, exact in float32)"
            )
            return
        n, k = codes.shape
        w = levels[codes.long()].view(n, k // LUT_BLOCK, LUT_BLOCK) * scales.unsqueeze(-1)
        w = w.view(n, k)
    layer.weight = nn.Parameter(w.to(dtype).contiguous(), requires_grad=False)
    layer.quant_path = (
        f"{what} dequantized at load into {str(dtype).removeprefix('torch.')} ({why}; the "
        "float weight's bytes, C GEMM / AMX-bf16 / oneDNN / cuBLAS)"
    )


# -- 8-bit ------------------------------------------------------------------------------------


class BnbInt8LinearMethod(LinearMethodBase):
    """An LLM.int8 layer, given after loading to the integer formats' 8-bit per-channel path
    (int_weight.finish_int_layer): int8 rows with float32 scales SCB / 127 on the int8 C GEMM
    on the CPU, the Triton W8A16 GEMM on CUDA. triton: as Bnb4bitLinearMethod's."""

    def __init__(self, triton: bool | None = None):
        self.triton = triton

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool):
        _register_parts(layer, list(PARTS_8BIT.values()), ("weight_format",))
        register_bias(layer, output_size, bias)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        name = getattr(layer, "prefix", type(layer).__name__)
        rows, scb = [], []
        for shard, parts in _take_parts(layer).items():
            q, s = _need(parts, "weight", name, shard), _need(parts, "scb", name, shard)
            fmt = parts.get("weight_format")
            if fmt is not None and int(fmt.reshape(-1)[0]) != 0:
                raise ValueError(f"{name}: weight_format {int(fmt.reshape(-1)[0])} is not "
                                 "supported; supported: 0 (row-major int8)")  # fmt: skip
            if q.dtype != torch.int8 or q.dim() != 2 or s.numel() != q.shape[0]:
                raise ValueError(f"{name}: weight {tuple(q.shape)} {q.dtype} with SCB "
                                 f"{tuple(s.shape)} is not int8 rows and their scales")  # fmt: skip
            rows.append(_rank_rows(layer, q))
            scb.append(_rank_rows(layer, s.float().reshape(-1, 1)))
        q = _rank_cols(layer, torch.cat(rows))
        codes = (q.to(torch.int16) + 128).to(torch.uint8)  # unsigned, zero 128: symmetric
        path = finish_int_layer(layer, codes, torch.cat(scb) / 127.0, None, None, 8, q.shape[1],
                                triton=self.triton)  # fmt: skip
        layer.quant_path = f"LLM.int8 as {path}, activations in the model dtype"

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        raise RuntimeError("process_weights_after_loading gives the layer its method")


# -- MoE experts ------------------------------------------------------------------------------


class ExpertPartsLoader:
    """A stacked expert parameter's weight_loader for bitsandbytes' parts: each checkpoint
    tensor kept by (part, expert, projection) for this rank's experts; a float `weight` (the
    experts transformers 5 leaves float) goes on to FusedMoE's own loader (`float_loader`)."""

    def __init__(self, moe: nn.Module, part: str, float_loader=None):
        self.moe, self.part, self.float_loader = moe, part, float_loader

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        expert, which = shard_id
        if self.float_loader is not None and loaded.is_floating_point():
            self.float_loader(param, loaded, shard_id)
            return
        if self.moe.local_expert(expert) is not None:
            self.moe.bnb_parts[(self.part, expert, which)] = loaded


class BnbExpertsMethod:
    """A FusedMoE's experts from a bitsandbytes checkpoint (engine.layers.quantization.experts'
    interface). Float experts load into the stacked weights as ever; experts quantized one by
    one (4-bit or LLM.int8 parts per expert and projection) become one small layer per expert
    and projection after loading, decoded and sliced for this rank as a dense layer of the
    format is (Bnb4bitLinearMethod: LUT4 on the CPU, the Triton GEMM on CUDA, else float;
    BnbInt8LinearMethod: int8 rows or the Triton W8A16 GEMM), run by FusedMoE.expert_linear
    over the tokens routed to each expert."""

    def __init__(self, bits: int):
        self.bits = bits

    def create_weights(self, moe: nn.Module) -> None:
        from engine.layers.quantization.experts import _register

        moe.bnb_parts = {}
        for side in ("w13", "w2"):
            weight = getattr(moe, f"{side}_weight")
            weight.weight_loader = ExpertPartsLoader(moe, "weight", moe.weight_loader)
            for part in ALL_PARTS:
                if part != "weight":
                    _register(moe, f"{side}_bnb_{part}", torch.empty(0),
                              ExpertPartsLoader(moe, part), optional=True)  # fmt: skip

    def process_weights_after_loading(self, moe: nn.Module) -> str:
        from engine.layers.moe import DOWN, GATE, UP
        from engine.layers.quantization.experts import ExpertLayers, ExpertProjection

        stash = moe.bnb_parts
        del moe.bnb_parts
        for side in ("w13", "w2"):
            for part in ALL_PARTS:
                if part != "weight":
                    delattr(moe, f"{side}_bnb_{part}")
        if not stash:
            return "float (not quantized in the checkpoint)"
        device = moe.w13_weight.device
        name = getattr(moe, "prefix", "experts")
        layers, paths = ExpertLayers(), set()
        local = [e for e in range(moe.num_experts) if moe.local_expert(e) is not None]
        by_expert: dict[int, dict] = {}  # expert -> {(part, projection): tensor}
        for (part, e, which), t in stash.items():
            by_expert.setdefault(e, {})[(part, which)] = t
        for side, projs in (("w13", (GATE, UP)), ("w2", (DOWN,))):
            for e in local:
                layer = ExpertProjection(moe.model_dtype)
                layer.prefix = f"{name}.{e}.{'gate_up' if side == 'w13' else 'down'}"
                layer.tp_dim, layer.tp_size = (0 if side == "w13" else 1), moe.inter_slices
                layer.tp_rank = moe.slice_rank
                layer.bnb_parts = {(part, None if side == "w2" else which): t
                                   for (part, which), t in by_expert.get(e, {}).items()
                                   if which in projs}  # fmt: skip
                if not layer.bnb_parts:
                    raise ValueError(f"{layer.prefix}: the checkpoint quantizes some experts "
                                     "and not this one")  # fmt: skip
                layer.bnb_names, layer.bnb_device = [], device
                method = Bnb4bitLinearMethod() if self.bits == 4 else BnbInt8LinearMethod()
                layer.quant_method = method
                method.process_weights_after_loading(layer)
                paths.add(layer.quant_path)
                layers.append(layer)
        layers.num_experts = len(local)
        layers.path = "; ".join(sorted(paths))
        for side in ("w13", "w2"):  # the float stacks: never filled, dropped
            moe.register_parameter(f"{side}_weight", None)
        moe.expert_layers = layers  # a submodule: the kernels' tensors are the model's
        moe.expert_linear = layers.linear
        return f"bitsandbytes experts one by one: {layers.path}"
