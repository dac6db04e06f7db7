"""Writers of quantized checkpoints in the layouts people download, for the tests.

Each writer takes a float model folder (tests.conftest.build_tiny_model), quantizes its
decoder layers' linear weights into a format's tensors and config.json quantization_config,
and returns the folder plus the exact dequantized weight of every quantized layer (float32
[N, K], by its checkpoint name): the reference HF model runs on those. GPTQ and AWQ are packed
here by hand, with explicit bit loops independent of engine.layers.quantization.packed;
compressed-tensors' tensors come from the `compressed-tensors` package itself.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch

# Mixtral's experts are w1 (gate), w3 (up), w2 (down); the routers (mlp.gate, block_sparse_moe.gate)
# stay float, as llm-compressor's MoE recipes leave them
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "w1", "w2", "w3")  # fmt: skip
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _state(src: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(src / "model.safetensors"))


def _write(src: Path, dst: Path, tensors: dict[str, torch.Tensor], qcfg: dict | None,
           dtype: str | None = None) -> Path:  # fmt: skip
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    if qcfg is not None:
        cfg["quantization_config"] = qcfg
    if dtype is not None:
        cfg["dtype"] = cfg["torch_dtype"] = dtype
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def _linear_names(state: dict[str, torch.Tensor], skip: tuple[str, ...] = ()) -> list[str]:
    """The decoder layers' linear layers to quantize (those whose kind is in skip stay float)."""
    return [k[: -len(".weight")] for k in state if k.endswith(".weight")
            and k.rsplit(".", 2)[-2] in LINEARS and k.rsplit(".", 2)[-2] not in skip]  # fmt: skip


# -- GPTQ -----------------------------------------------------------------------------------


def _pack_3bit(codes: np.ndarray) -> np.ndarray:
    """uint 3-bit codes [K, N] -> int32 [K * 3 / 32, N], AutoGPTQ's 3-bit pack loop: per 32
    rows, 10 codes in a word, the 11th split over its top 2 bits and the next word's bit 0, 10
    more, the 22nd over the top bit and 2 bits of the third word, then 10."""
    k, n = codes.shape
    c = codes.astype(np.uint32)
    out = np.zeros((k // 32 * 3, n), dtype=np.uint32)
    i = row = 0
    while row < out.shape[0]:
        for j in range(10):
            out[row] |= c[i + j] << np.uint32(3 * j)
        i += 10
        out[row] |= c[i] << np.uint32(30)
        row += 1
        out[row] |= (c[i] >> np.uint32(2)) & np.uint32(1)
        i += 1
        for j in range(10):
            out[row] |= c[i + j] << np.uint32(3 * j + 1)
        i += 10
        out[row] |= c[i] << np.uint32(31)
        row += 1
        out[row] |= (c[i] >> np.uint32(1)) & np.uint32(3)
        i += 1
        for j in range(10):
            out[row] |= c[i + j] << np.uint32(3 * j + 2)
        i += 10
        row += 1
    return out.view(np.int32)


def _pack_along_rows(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint codes [K, N] -> int32 [K * bits / 32, N]: row k in word k // per at bit
    (k % per) * bits (AutoGPTQ's pack loop)."""
    if bits == 3:
        return _pack_3bit(codes)
    per = 32 // bits
    k, n = codes.shape
    out = np.zeros((k // per, n), dtype=np.uint32)
    for r in range(k // per):
        for i in range(per):
            out[r] |= codes[r * per + i].astype(np.uint32) << np.uint32(bits * i)
    return out.view(np.int32)


def _pack_along_cols(codes: np.ndarray, bits: int, order: list[int] | None = None) -> np.ndarray:
    """uint codes [R, C] -> int32 [R, C * bits / 32]: field i of word c holds column
    c * per + order[i]. 3-bit: AutoGPTQ's 3-bit loop along the columns."""
    if bits == 3:
        return np.ascontiguousarray(_pack_3bit(np.ascontiguousarray(codes.T & 7)).T)
    per = 32 // bits
    r, c = codes.shape
    order = order or list(range(per))
    out = np.zeros((r, c // per), dtype=np.uint32)
    for w in range(c // per):
        for i in range(per):
            out[:, w] |= (codes[:, w * per + order[i]].astype(np.uint32) & ((1 << bits) - 1)) << (
                np.uint32(bits * i)
            )
    return out.view(np.int32)


def _int_quantize(w: torch.Tensor, bits: int, group: int, sym: bool, g_idx: torch.Tensor,
                  min_zero: int = 0):  # fmt: skip
    """w [N, K] -> (codes [K, N] unsigned, scales fp16 [G, N], zeros [G, N], dequant [N, K]),
    groups by g_idx (GPTQ's quantizer: sym zero = 2**(bits-1), scales 2 max|w| / maxq)."""
    n, k = w.shape
    maxq = (1 << bits) - 1
    groups = int(g_idx.max()) + 1
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n)
    for j in range(groups):
        rows = w[:, g_idx == j]
        lo = rows.amin(1).clamp(max=0)
        hi = rows.amax(1).clamp(min=0)
        if sym:
            s = torch.maximum(hi, -lo) * 2 / maxq
            z = torch.full_like(s, (maxq + 1) / 2)
        else:
            s = (hi - lo) / maxq
            z = torch.round(-lo / s).clamp(min_zero, maxq)
        scales[j], zeros[j] = s.half().float(), z
    s_k, z_k = scales[g_idx.long()], zeros[g_idx.long()]  # [K, N]
    codes = torch.clamp(torch.round(w.t() / s_k) + z_k, 0, maxq)
    deq = ((codes - z_k) * s_k).t().contiguous()
    return codes.to(torch.int32), scales.half(), zeros.to(torch.int32), deq


# the projections that share their input (merged on load): one act-order for them, as GPTQ's
# Hessian gives them (Mixtral's experts: w1 gate, w3 up)
SHARED_INPUT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3")


def act_order_g_idx(k: int, group: int, gen: torch.Generator) -> torch.Tensor:
    """A random act-order: row perm[i] is the i-th quantized, groups of `group` in that order."""
    perm = torch.randperm(k, generator=gen)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = torch.arange(k, dtype=torch.int32) // group
    return g_idx


class ActOrders:
    """The g_idx of each layer name: the trivial order, or with `desc_act` a random act-order
    shared by the projections of one input."""

    def __init__(self, desc_act: bool, group: int, seed: int):
        self.desc_act, self.group = desc_act, group
        self.gen = torch.Generator().manual_seed(seed)
        self.orders: dict[tuple, torch.Tensor] = {}

    def __call__(self, name: str, k: int) -> torch.Tensor:
        g = k if self.group == -1 else self.group
        if not self.desc_act:
            return torch.arange(k, dtype=torch.int32) // g
        prefix, kind = name.rsplit(".", 1)
        shared = (prefix, kind in SHARED_INPUT)
        if shared not in self.orders:
            self.orders[shared] = act_order_g_idx(k, g, self.gen)
        return self.orders[shared].clone()


def gptq_tensors(w: torch.Tensor, bits: int, group: int, sym: bool, g_idx: torch.Tensor,
                 v2: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor]:  # fmt: skip
    """One float weight [N, K] as GPTQ's tensors (by suffix) and its exact dequantized value."""
    g = w.shape[1] if group == -1 else group
    # v1 stores zero - 1: a zero point of 0 would not survive it (real v1 files have none)
    min_zero = 0 if v2 else 1
    codes, scales, zeros, deq = _int_quantize(w.float(), bits, g, sym, g_idx, min_zero)
    stored = zeros.numpy() if v2 else zeros.numpy() - 1  # v1: zero points minus 1
    tensors = {
        "qweight": torch.from_numpy(_pack_along_rows(codes.numpy(), bits)),
        "qzeros": torch.from_numpy(_pack_along_cols(stored, bits)),
        "scales": scales,
        "g_idx": g_idx,
    }
    return tensors, deq


def write_gptq(src: Path, dst: Path, bits=4, group=32, sym=True, desc_act=False, v2=False,
               seed=0) -> tuple[Path, dict]:  # fmt: skip
    state = _state(src)
    out, deq = dict(state), {}
    orders = ActOrders(desc_act, group, seed)
    for name in _linear_names(state):
        w = out.pop(f"{name}.weight").float()
        tensors, deq[name] = gptq_tensors(w, bits, group, sym, orders(name, w.shape[1]), v2)
        out.update({f"{name}.{key}": t for key, t in tensors.items()})
    qcfg = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act,
            "sym": sym, "checkpoint_format": "gptq_v2" if v2 else "gptq"}  # fmt: skip
    return _write(src, dst, out, qcfg, "float16"), deq


def write_awq(src: Path, dst: Path, group=32, skip: tuple[str, ...] = ()) -> tuple[Path, dict]:
    state = _state(src)
    out, deq = dict(state), {}
    for name in _linear_names(state, skip):
        w = out.pop(f"{name}.weight").float()
        g_idx = torch.arange(w.shape[1], dtype=torch.int32) // group
        codes, scales, zeros, deq[name] = _int_quantize(w, 4, group, False, g_idx)
        out[f"{name}.qweight"] = torch.from_numpy(_pack_along_cols(codes.numpy(), 4, AWQ_ORDER))
        out[f"{name}.qzeros"] = torch.from_numpy(_pack_along_cols(zeros.numpy(), 4, AWQ_ORDER))
        out[f"{name}.scales"] = scales
    qcfg = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": list(skip) or None}  # fmt: skip
    return _write(src, dst, out, qcfg, "float16"), deq


# -- FP8 (quant_method "fp8") ---------------------------------------------------------------


def write_fp8(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> tuple[Path, dict]:
    state = _state(src)
    out, deq = dict(state), {}
    for name in _linear_names(state, skip):
        w = out.pop(f"{name}.weight").float()
        s = w.abs().max() / 448.0
        q = (w / s).to(torch.float8_e4m3fn)
        out[f"{name}.weight"] = q
        out[f"{name}.weight_scale"] = s.reshape(())
        out[f"{name}.input_scale"] = torch.tensor(0.05)
        deq[name] = q.float() * s
    qcfg = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": list(skip)}
    return _write(src, dst, out, qcfg, "bfloat16"), deq


def quantize_blocks_fp8(w: torch.Tensor, block: tuple[int, int]):
    """w [N, K] -> (float8_e4m3fn [N, K], float32 scales [ceil(N/bn), ceil(K/bk)], the exact
    dequantized weight): one scale max|w| / 448 per block (DeepSeek-V3's recipe), block by
    block, the last ones partial."""
    bn, bk = block
    n, k = w.shape
    w = w.float()
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scales = torch.empty(-(-n // bn), -(-k // bk))
    deq = torch.empty(n, k)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            s = w[rows, cols].abs().max().clamp_min(1e-12) / 448.0
            q[rows, cols] = (w[rows, cols] / s).to(torch.float8_e4m3fn)
            scales[i, j] = s
            deq[rows, cols] = q[rows, cols].float() * s
    return q, scales, deq


def write_fp8_block(src: Path, dst: Path, block=(128, 128), skip: tuple[str, ...] = ()
                    ) -> tuple[Path, dict]:  # fmt: skip
    """quant_method "fp8" with weight_block_size, as Qwen3-*-FP8 and DeepSeek-V3 ship it:
    `weight` e4m3 and `weight_scale_inv` per block (multiplied, despite its name)."""
    state = _state(src)
    out, deq = dict(state), {}
    for name in _linear_names(state, skip):
        q, scales, deq[name] = quantize_blocks_fp8(out.pop(f"{name}.weight"), block)
        out[f"{name}.weight"] = q
        out[f"{name}.weight_scale_inv"] = scales
    qcfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(block), "modules_to_not_convert": list(skip) or None}  # fmt: skip
    return _write(src, dst, out, qcfg, "bfloat16"), deq


# -- compressed-tensors (the package's own compressors) -------------------------------------


def ct_compress(w: torch.Tensor, fmt: str, weights: dict, input_activations: dict | None = None
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:  # fmt: skip
    """One float weight [N, K] through the compressed-tensors package: (its checkpoint tensors,
    by suffix: weight_packed, weight_scale, ...; the exact dequantized weight, float32)."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(**weights)
    acts = None if input_activations is None else QuantizationArgs(**input_activations)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=acts)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    w = w.float()
    gscale = None
    if args.strategy == "tensor_group":  # NVFP4: a global scale over the tensor, as the
        from compressed_tensors.quantization.utils import generate_gparam  # package's observer

        gscale = generate_gparam(w.min(), w.max())
        g = w.view(w.shape[0], -1, args.group_size)
        lo, hi = g.amin(-1), g.amax(-1)
    elif args.strategy == "group":
        g = w.view(w.shape[0], -1, args.group_size)
        lo, hi = g.amin(-1), g.amax(-1)
    elif args.strategy == "block":  # padded to whole blocks, as the package's observer does
        (bn, bk), (n, k) = args.block_structure, w.shape
        padded = torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn))
        b = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
        lo, hi = b.amin((1, 3)), b.amax((1, 3))
    elif args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    else:
        lo, hi = w.min().reshape(1), w.max().reshape(1)
    s, z = calculate_qparams(lo.clamp(max=0), hi.clamp(min=0), args, global_scale=gscale)
    deq = fake_quantize(w, s, z, args, global_scale=gscale).float()
    sd = {"weight": w, "weight_scale": s, "weight_zero_point": z}
    if gscale is not None:
        sd["weight_global_scale"] = gscale
    if acts is not None and not acts.dynamic:
        sd["input_scale"] = torch.tensor([0.05])
    out = dict(compressor.compress(sd, scheme))
    if acts is not None and acts.strategy == "tensor_group":  # W4A4 NVFP4: llm-compressor's
        out["input_global_scale"] = torch.tensor([448.0 * 6.0 / 4.0])  # calibrated input scale
    return out, deq


def write_compressed_tensors(src: Path, dst: Path, fmt: str, weights: dict,
                             input_activations: dict | None = None,
                             skip: tuple[str, ...] = ()) -> tuple[Path, dict]:  # fmt: skip
    from compressed_tensors.quantization import QuantizationArgs

    args = QuantizationArgs(**weights)
    acts = None if input_activations is None else QuantizationArgs(**input_activations)
    state = _state(src)
    out, deq = dict(state), {}
    for name in _linear_names(state, skip):
        tensors, deq[name] = ct_compress(out.pop(f"{name}.weight"), fmt, weights,
                                         input_activations)  # fmt: skip
        for key, t in tensors.items():
            out[f"{name}.{key}"] = t
    group = {"targets": ["Linear"], "weights": args.model_dump(),
             "input_activations": None if acts is None else acts.model_dump(),
             "output_activations": None, "format": fmt}  # fmt: skip
    qcfg = {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": group},
            "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$",
                       *(f"re:.*{kind}$" for kind in skip)],
            "quantization_status": "compressed", "kv_cache_scheme": None}  # fmt: skip
    return _write(src, dst, out, json.loads(json.dumps(qcfg, default=str)), "bfloat16"), deq


def written_once(writers: dict, src: Path, tmp_path_factory):
    """A module fixture's getter: format id -> (src, its checkpoint folder, {layer: dequantized
    weight}), each of `writers` run on src at most once."""
    cache: dict = {}

    def get(fmt: str):
        if fmt not in cache:
            folder, deq = writers[fmt](src, tmp_path_factory.mktemp(fmt))
            cache[fmt] = (src, folder, deq)
        return cache[fmt]

    return get


def reference_model(src: Path, deq: dict[str, torch.Tensor]):
    """The HF float32 model of src with every quantized layer's weight its exact dequantized
    value."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in deq.items():
            expert = _EXPERT.match(name)
            if expert is None:
                params[f"{name}.weight"].copy_(w)
                continue
            # transformers stacks the experts: gate_up_proj [E, 2I, H] (gate | up), down_proj
            # [E, H, I], under mlp. for Mixtral's block_sparse_moe too
            prefix = expert["prefix"].replace(".block_sparse_moe", ".mlp")
            e, proj = int(expert["e"]), EXPERT_PROJ[expert["proj"]]
            if proj == "down":
                params[f"{prefix}.experts.down_proj"][e].copy_(w)
            else:
                half = w.shape[0]
                rows = slice(0, half) if proj == "gate" else slice(half, 2 * half)
                params[f"{prefix}.experts.gate_up_proj"][e, rows].copy_(w)
    return model


_EXPERT = re.compile(r"^(?P<prefix>.+)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)$")
EXPERT_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate",
               "w3": "up", "w2": "down"}  # fmt: skip


def ct_actorder_tensors(w: torch.Tensor, group: int, g_idx: torch.Tensor
                        ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:  # fmt: skip
    """One float weight [N, K] as compressed-tensors' symmetric W4A16 with act-order (codes
    packed by the package's pack_to_int32, weight_g_idx) and its exact dequantized value."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    codes, scales, _, deq = _int_quantize(w.float(), 4, group, True, g_idx)
    signed = (codes.t() - 8).to(torch.int8).contiguous()  # [N, K] in -8..7
    tensors = {
        "weight_packed": pack_to_int32(signed, 4),
        "weight_scale": scales.t().contiguous(),
        "weight_shape": torch.tensor(list(w.shape)),
        "weight_g_idx": g_idx,
    }
    return tensors, deq


def write_ct_actorder(src: Path, dst: Path, group=32, seed=0) -> tuple[Path, dict]:
    """compressed-tensors' older W4A16 with `actorder: "group"` (the package's own writer has
    dropped it): weight_g_idx beside codes packed by the package's pack_to_int32."""
    state = _state(src)
    out, deq = dict(state), {}
    orders = ActOrders(True, group, seed)
    for name in _linear_names(state):
        w = out.pop(f"{name}.weight").float()
        tensors, deq[name] = ct_actorder_tensors(w, group, orders(name, w.shape[1]))
        out.update({f"{name}.{key}": t for key, t in tensors.items()})
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": group, "actorder": "group", "dynamic": False}  # fmt: skip
    qcfg = {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None}},
            "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"],
            "quantization_status": "compressed"}  # fmt: skip
    return _write(src, dst, out, qcfg, "float16"), deq


# -- bitsandbytes -----------------------------------------------------------------------------

BNB_FORMATS = {  # format id -> transformers' BitsAndBytesConfig arguments
    "bnb-nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "bnb-nf4-dq": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                       bnb_4bit_use_double_quant=True),
    "bnb-fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "bnb-int8": dict(load_in_8bit=True),
    # FSDP-QLoRA's checkpoints: the packed codes stored as bfloat16 (their bytes unchanged)
    "bnb-nf4-bf16-storage": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                 bnb_4bit_quant_storage=torch.bfloat16),
}  # fmt: skip


def write_bnb(src: Path, dst: Path, fmt: str, blocksize: int | None = None) -> tuple[Path, dict]:
    """src quantized by transformers with bitsandbytes (the package's own quantizers) and saved
    as it saves: {layer: float32 weight, bitsandbytes' own dequantization (of src's dtype)}
    beside. blocksize: the 4-bit layers requantized by bitsandbytes.functional at that
    blocksize (transformers always uses 64), their parts under the names transformers gives
    them."""
    import bitsandbytes as bnb
    from bitsandbytes import functional as bnbf
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    qcfg = BitsAndBytesConfig(**BNB_FORMATS[fmt], bnb_4bit_compute_dtype=torch.float32)
    # the float tensors it leaves (embedding, norms) stay in src's dtype, as uploads keep them
    model = AutoModelForCausalLM.from_pretrained(
        str(src), quantization_config=qcfg, device_map="cpu", dtype="auto"
    )
    deq, four_bit = {}, {}
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            four_bit[name] = (module.weight.data, module.weight.quant_state)
        elif isinstance(module, bnb.nn.Linear8bitLt):
            deq[name] = bnbf.int8_vectorwise_dequant(module.weight.data, module.weight.SCB).float()
    model.save_pretrained(str(dst))
    for f in src.iterdir():  # the tokenizer
        if not (dst / f.name).exists():
            shutil.copy(f, dst / f.name)
    state, floats = _state(dst), _state(src)
    kind = BNB_FORMATS[fmt].get("bnb_4bit_quant_type")
    double = bool(BNB_FORMATS[fmt].get("bnb_4bit_use_double_quant"))
    for name, (q, qs) in four_bit.items():
        w = floats[f"{name}.weight"].to(model.dtype)
        if blocksize is not None:
            for key in [k for k in state if k.startswith(f"{name}.weight")]:
                del state[key]
            q, qs = bnbf.quantize_4bit(w, blocksize=blocksize, compress_statistics=double,
                                       quant_type=kind)  # fmt: skip
            state[f"{name}.weight"] = q
            state.update({f"{name}.weight.{k}": v for k, v in qs.as_dict(packed=True).items()})
        # bitsandbytes 0.50's CPU dequantize_4bit misreads blocks that straddle rows (K not a
        # multiple of the blocksize: quantize_4bit's blocks run over the flat weight); the same
        # blocks laid one to a row read right
        rows = w.reshape(-1, qs.blocksize)
        q2, qs2 = bnbf.quantize_4bit(rows, blocksize=qs.blocksize, compress_statistics=double,
                                     quant_type=kind)  # fmt: skip
        codes = q.reshape(-1).view(torch.uint8)  # bnb_4bit_quant_storage's dtype: its bytes
        assert torch.equal(q2.reshape(-1), codes) and torch.equal(qs2.absmax, qs.absmax)
        deq[name] = bnbf.dequantize_4bit(q2, qs2).float().reshape(w.shape)
    if blocksize is not None:
        save_file(state, str(dst / "model.safetensors"))
    return dst, deq


def write_bnb_experts(src: Path, dst: Path, fmt: str) -> tuple[Path, dict]:
    """write_bnb's checkpoint of a MoE model with its experts quantized one by one too, as
    transformers 4 saved them (each expert's gate / up / down an nn.Linear that bitsandbytes
    quantized: `experts.E.gate_proj.weight` codes with its parts beside; transformers 5 leaves
    the experts float), by bitsandbytes.functional; {layer: dequantized weight} for every
    quantized layer, the experts' included."""
    from bitsandbytes import functional as bnbf
    from safetensors.torch import save_file

    folder, deq = write_bnb(src, dst, fmt)
    state = _state(folder)
    layers = [k.removesuffix(".weight") for k in state if k.endswith(".weight")]
    experts = [name for name in layers if _EXPERT.match(name)]
    kind = BNB_FORMATS[fmt].get("bnb_4bit_quant_type")
    double = bool(BNB_FORMATS[fmt].get("bnb_4bit_use_double_quant"))
    for name in experts:
        w = state.pop(f"{name}.weight")
        if kind is None:  # LLM.int8: int8 rows, their absmax, the row-major format (0)
            q, scb, _ = bnbf.int8_vectorwise_quant(w.half())  # as transformers 4's Int8Params
            state[f"{name}.weight"], state[f"{name}.SCB"] = q, scb
            state[f"{name}.weight_format"] = torch.tensor(0, dtype=torch.uint8)
            deq[name] = bnbf.int8_vectorwise_dequant(q, scb).float()
            continue
        q, qs = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=double, quant_type=kind)
        state[f"{name}.weight"] = q
        state.update({f"{name}.weight.{k}": v for k, v in qs.as_dict(packed=True).items()})
        q2, qs2 = bnbf.quantize_4bit(
            w.reshape(-1, 64), blocksize=64, compress_statistics=double, quant_type=kind
        )  # fmt: skip (blocks one to a row: write_bnb)
        assert torch.equal(q2.reshape(-1), q.reshape(-1))
        deq[name] = bnbf.dequantize_4bit(q2, qs2).float().reshape(w.shape)
    assert experts, "no per-expert weights in this checkpoint"
    save_file(state, str(folder / "model.safetensors"))
    return folder, deq
