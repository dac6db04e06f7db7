"""NVFP4 checkpoints (compressed-tensors' nvfp4-pack-quantized: engine.layers.quantization.nvfp4),
written by the compressed-tensors package itself on the CPU: NVFP4A16 (weight-only) and W4A4
(NVFP4's fp4 activation scheme and an input_global_scale, served weight-only).

The reference is HF transformers on the same tiny model with every quantized weight its exact
dequantized value (the package's own fake_quantize). Checked: the repack into ggml's NVFP4 blocks
holds the same values bit for bit (gguf-py decodes them); each loaded layer holds the
checkpoint's values (the blocks times 1 / global scale per row; the dequantized fallback rounded
once) and multiplies as F.linear on them; greedy tokens follow the reference (near ties of the
int8 activations per 32 allowed), also at TP=2 (row shards of K=32 dequantized, of K=64 on the
blocks); the CUDA path (the NVFP4 Triton GEMM, under the interpreter without a GPU, and through
the engine on one); start-up errors naming the field.
"""

from __future__ import annotations

import functools
import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu import gguf as cpu_gguf
from engine.layers.quantization.checkpoint import build_config, resolve_checkpoint
from engine.layers.quantization.nvfp4 import NvFp4LinearMethod, dequantize_nvfp4, to_gguf_nvfp4
from tests.engine.layers.quantization import quant_writers as qw
from tests.engine.layers.quantization.test_quant_checkpoints import (
    GAP_TOL,
    MERGED,
    PROMPTS,
    _assert_greedy_agrees,
    _hf_greedy,
    _load,
    _tp2,
    _tp_logits,
)

pytest.importorskip("compressed_tensors")

FMT = "nvfp4-pack-quantized"
# llm-compressor's NVFP4A16 / NVFP4 presets (compressed_tensors.quantization.quant_scheme)
WEIGHTS = dict(num_bits=4, type="float", strategy="tensor_group", symmetric=True, dynamic=False,
               group_size=16, scale_dtype=torch.float8_e4m3fn)  # fmt: skip
ACTS = dict(num_bits=4, type="float", strategy="tensor_group", symmetric=True, dynamic="local",
            group_size=16, observer="static_minmax", scale_dtype=torch.float8_e4m3fn)  # fmt: skip
WRITERS = {
    "nvfp4a16": functools.partial(qw.write_compressed_tensors, fmt=FMT, weights=WEIGHTS),
    "nvfp4-w4a4": functools.partial(
        qw.write_compressed_tensors, fmt=FMT, weights=WEIGHTS, input_activations=ACTS
    ),
}
KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# x as int8 per 32 on the block path: near ties of the reference may flip (test_quant_moe's W8A8)
INT8_ACTS_GAP_TOL = 0.1


@pytest.fixture(scope="module")
def written(tiny_llama_dir, tmp_path_factory):
    """format id -> (float folder, NVFP4 folder, {layer: dequantized weight}), written once."""
    return qw.written_once(WRITERS, tiny_llama_dir, tmp_path_factory)


def _package_tensors(n: int, k: int, seed: int = 0) -> tuple[dict, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 0, n)[:, None]
    return qw.ct_compress(w, FMT, WEIGHTS)


def test_the_package_layout_and_its_dequantized_values():
    """weight_packed uint8 [N, K/2] (low nibble first), weight_scale e4m3 [N, K/16],
    weight_global_scale [1]; W = value * (scale / global scale): ours equals the package's
    fake_quantize exactly and its decompressor's bf16 result."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    t, deq = _package_tensors(24, 128)
    assert t["weight_packed"].dtype == torch.uint8 and t["weight_packed"].shape == (24, 64)
    assert t["weight_scale"].dtype == torch.float8_e4m3fn and t["weight_scale"].shape == (24, 8)
    assert t["weight_global_scale"].shape == (1,)
    g = t["weight_global_scale"].expand(24)
    ours = dequantize_nvfp4(t["weight_packed"], t["weight_scale"], g, torch.float32)
    assert torch.equal(ours, deq)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**WEIGHTS))
    theirs = NVFP4PackedCompressor.decompress(dict(t), scheme)["weight"]
    assert torch.equal(ours.to(theirs.dtype), theirs)


@pytest.mark.skipif(not cpu_gguf.available(), reason="needs the CPU kernels")
def test_the_repack_holds_the_same_values_in_ggml_blocks():
    """ggml's NVFP4 rows of the package's bytes: gguf-py and the C dequantizer both read value
    * scale exactly (the global scale apart)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    t, _ = _package_tensors(24, 192, seed=1)
    raw = to_gguf_nvfp4(t["weight_packed"], t["weight_scale"])
    assert raw.shape == (24, cpu_gguf.row_bytes(cpu_gguf.TYPES["NVFP4"], 192))
    want = dequantize_nvfp4(t["weight_packed"], t["weight_scale"], torch.ones(24), torch.float32)
    ref = dequantize(raw.numpy(), GGMLQuantizationType.NVFP4).reshape(24, 192)
    assert torch.equal(torch.from_numpy(np.ascontiguousarray(ref)), want)
    assert torch.equal(cpu_gguf.dequantize(raw, cpu_gguf.TYPES["NVFP4"], 192, torch.float32), want)


def _effective_weight(layer) -> torch.Tensor:
    """The float32 [N, K] a loaded layer multiplies by."""
    if layer.row_scale is None:
        return layer.weight.float()
    w = cpu_gguf.dequantize(layer.weight, layer.gguf_type, layer.in_features, torch.float32)
    return w * layer.row_scale[:, None]


@pytest.mark.skipif(not cpu_gguf.available(), reason="needs the CPU kernels")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", list(WRITERS))
def test_each_layer_holds_the_checkpoint_on_the_blocks(written, fmt, dtype):
    _, folder, deq = written(fmt)
    model, paths = _load(folder, dtype)
    checked = 0
    gen = torch.Generator().manual_seed(0)
    for name, layer in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind not in KINDS:
            continue
        assert isinstance(layer.quant_method, NvFp4LinearMethod), name
        assert layer.weight.dtype == torch.uint8 and layer.row_scale is not None, name  # no floats
        parts = [name[: -len(kind)] + p for p in MERGED.get(kind, (kind,))]
        want = torch.cat([deq[p] for p in parts])
        got = _effective_weight(layer)
        # (value * scale) / global vs the package's value * (scale / global): float32 rounding
        assert (got - want).abs().max() <= 1e-6 * want.abs().max(), name
        x = torch.randn(5, want.shape[1], generator=gen).to(getattr(torch, dtype))
        y = layer.quant_method.apply(layer, x)
        ref = F.linear(x.float(), want)
        assert y.dtype == x.dtype
        assert (y.float() - ref).norm() / ref.norm() < 2.5e-2, name  # int8 x per 32
        checked += 1
    assert checked == 4 * model.config.num_hidden_layers
    assert all("GGUF NVFP4 blocks" in why for why in paths["qkv_proj"]), paths
    assert all("model dtype" in why for why in paths["down_proj"]), paths


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_without_the_kernels_each_layer_is_dequantized_once(written, monkeypatch, dtype):
    """The fallback (CUDA's, and a CPU without the kernels): value * (scale / global scale) in
    float32 rounded once to the model dtype, the package's own dequantized values."""
    monkeypatch.setattr(cpu_gguf, "available", lambda: False)
    _, folder, deq = written("nvfp4a16")
    model, paths = _load(folder, dtype)
    for name, layer in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind in KINDS:
            parts = [name[: -len(kind)] + p for p in MERGED.get(kind, (kind,))]
            want = torch.cat([deq[p] for p in parts]).to(getattr(torch, dtype))
            assert layer.row_scale is None and torch.equal(layer.weight.data, want), name
    assert all(f"dequantized at load into {dtype}" in why for why in paths["o_proj"]), paths


@pytest.mark.parametrize(
    ("fmt", "dtype"),
    [("nvfp4a16", "float32"), ("nvfp4a16", "bfloat16"), ("nvfp4-w4a4", "float32")],
)
def test_greedy_tokens_follow_the_dequantized_reference(written, fmt, dtype):
    from engine import LLM, SamplingParams

    src, folder, deq = written(fmt)
    ref = qw.reference_model(src, deq)
    llm = LLM(str(folder), dtype=dtype, seed=0, num_kv_blocks=64, max_model_len=256)
    try:
        assert llm.engine.executor.runner.quantization == "compressed-tensors"  # no flag
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    tol = INT8_ACTS_GAP_TOL if cpu_gguf.available() else GAP_TOL[dtype]
    for prompt, out in zip(PROMPTS, outs, strict=True):
        theirs, gaps = _hf_greedy(ref, prompt)
        _assert_greedy_agrees(list(out.outputs[0].token_ids), theirs, gaps, tol)


def test_qwen2_biases_and_tied_embeddings(tiny_qwen2_dir, tmp_path):
    """q/k/v biases added after the row scales, on a model whose LM head is its embedding."""
    from engine import LLM, SamplingParams

    folder, deq = WRITERS["nvfp4a16"](tiny_qwen2_dir, tmp_path / "q")
    ref = qw.reference_model(tiny_qwen2_dir, deq)
    llm = LLM(str(folder), dtype="float32", seed=0, num_kv_blocks=64, max_model_len=256)
    try:
        layer = llm.engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
        assert layer.bias is not None and isinstance(layer.quant_method, NvFp4LinearMethod)
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    tol = INT8_ACTS_GAP_TOL if cpu_gguf.available() else GAP_TOL["float32"]
    for prompt, out in zip(PROMPTS, outs, strict=True):
        theirs, gaps = _hf_greedy(ref, prompt)
        _assert_greedy_agrees(list(out.outputs[0].token_ids), theirs, gaps, tol)


@pytest.mark.slow
def test_tp2_shards_give_the_logits_of_one_process(written, tmp_path):
    """Column shards split N (each part's global scale on its rows), row shards split K on
    groups of 16: o_proj's 32 inputs a rank are dequantized, down_proj's 64 stay blocks."""
    torch.set_num_threads(1)
    folders = [written(f)[1] for f in WRITERS]
    expected = [_tp_logits(f) for f in folders]
    logits, paths0, paths1 = _tp2(folders, tmp_path, "float32")
    for folder, got, want in zip(folders, logits, expected, strict=True):
        # the blocks' x is quantized per 32 of each rank's K: not one process's int8 sums
        assert (got - want).abs().max() <= 0.02 * want.abs().max(), str(folder)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8, str(folder)
    assert paths0 == paths1
    if cpu_gguf.available():
        assert all("K 32 is not a multiple" in why for why in paths0[0]["o_proj"]), paths0
        assert all("GGUF NVFP4 blocks" in why for why in paths0[0]["down_proj"]), paths0


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # else the interpreter


def check_triton_layers(folder, deq: dict, dtype: str, method_cls, kernel_weight: str) -> None:
    """The checkpoint loaded for the FP4 Triton GEMM (method_cls's triton forced: the CUDA
    path, under the interpreter without a GPU): each layer holds the checkpoint's bytes in
    layer.<kernel_weight>, no float copy, and multiplies as F.linear on the dequantized weight
    rounded to the model dtype."""
    pytest.importorskip("triton")
    from engine.layers.quantization.checkpoint import (
        apply_checkpoint_methods,
        finish_checkpoint_methods,
    )
    from engine.models.loader import load_model

    qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    config = build_config(resolve_checkpoint(None, qcfg)[0], qcfg)
    model = load_model(folder, dtype=dtype, device=DEVICE,
                       prepare=functools.partial(apply_checkpoint_methods, config=config))  # fmt: skip
    for m in model.modules():
        if isinstance(getattr(m, "quant_method", None), method_cls):
            m.quant_method.triton = True
    paths = finish_checkpoint_methods(model, config)
    assert all("Triton GEMM" in why for why in paths["qkv_proj"]), paths
    torch_dtype = getattr(torch, dtype)
    checked = 0
    for name, layer in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind not in KINDS:
            continue
        assert layer.weight is None, name
        assert getattr(layer, kernel_weight).packed.dtype == torch.uint8, name
        parts = [name[: -len(kind)] + p for p in MERGED.get(kind, (kind,))]
        want_w = torch.cat([deq[p] for p in parts]).to(torch_dtype).float()
        for rows in (1, 9):
            x = torch.randn(rows, want_w.shape[1], generator=torch.Generator().manual_seed(rows))
            x = x.to(torch_dtype)
            got = layer.quant_method.apply(layer, x.to(DEVICE)).float().cpu()
            want = F.linear(x.float(), want_w)
            tol = 1e-5 if dtype == "float32" else 1.5e-2
            assert (got - want).abs().max() <= tol * want.abs().max(), name
        checked += 1
    assert checked == 4 * model.config.num_hidden_layers


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_triton_gemm_serves_the_loaded_layers(written, dtype):
    _, folder, deq = written("nvfp4-w4a4")
    check_triton_layers(folder, deq, dtype, NvFp4LinearMethod, "nvfp4")


def check_cuda_greedy(src, folder, deq: dict) -> None:
    """On a GPU, with no flag: the FP4 Triton GEMM compiled, through the engine; greedy tokens
    follow the dequantized reference."""
    from engine import LLM, SamplingParams

    ref = qw.reference_model(src, deq)
    llm = LLM(str(folder), dtype="bfloat16", seed=0, num_kv_blocks=64, max_model_len=256,
              device="cuda")  # fmt: skip
    try:
        layer = llm.engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
        assert layer.weight is None and "Triton GEMM" in layer.quant_path
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        theirs, gaps = _hf_greedy(ref, prompt)
        _assert_greedy_agrees(list(out.outputs[0].token_ids), theirs, gaps, GAP_TOL["bfloat16"])


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", list(WRITERS))
def test_cuda_greedy_tokens_follow_the_dequantized_reference(written, fmt):
    check_cuda_greedy(*written(fmt))


# -- start-up refusals --------------------------------------------------------------------------


def _config(weights: dict | None = None, acts: dict | None = None) -> dict:
    group = {"targets": ["Linear"], "format": FMT,
             "weights": {**json.loads(json.dumps(WEIGHTS, default=str)), **(weights or {})},
             "input_activations": acts}  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": FMT, "config_groups": {"g": group}}


@pytest.mark.parametrize(
    ("change", "field"),
    [({"group_size": 32}, "weights.group_size = 32"), ({"num_bits": 8}, "weights.num_bits = 8"),
     ({"strategy": "group"}, "weights.strategy = 'group'"),
     ({"type": "int"}, "weights.type = 'int'"), ({"symmetric": False}, "weights.symmetric")],
)  # fmt: skip
def test_other_nvfp4_weight_schemes_are_refused_naming_the_field(change, field):
    with pytest.raises(
        ValueError, match=rf"quantization_config.config_groups.g.{field}.*supported"
    ):
        build_config("compressed-tensors", _config(change))


def test_other_activation_schemes_are_refused_and_w4a4_is_accepted():
    acts = json.loads(json.dumps(ACTS, default=str))
    cfg = build_config("compressed-tensors", _config(acts=acts))
    assert "fp4 activations served in the model dtype" in cfg.describe()
    with pytest.raises(ValueError, match=r"g.input_activations.num_bits = 8 .*supported: 4"):
        build_config("compressed-tensors", _config(acts={**acts, "num_bits": 8, "type": "float"}))


def test_nvfp4_experts_are_refused_naming_the_format():
    cfg = build_config("compressed-tensors", {**_config(), "ignore": ["re:.*mlp.gate$"]})
    with pytest.raises(ValueError, match=r"config_groups.g.format = 'nvfp4-pack-quantized'.*"
                       r"for MoE experts"):  # fmt: skip
        cfg.experts_method("model.layers.0.mlp.experts",
                           ["model.layers.0.mlp.experts.0.gate_proj"])  # fmt: skip


def test_a_tp_shard_that_splits_a_group_is_named():
    from torch import nn

    layer = nn.Module()
    layer.prefix, layer.tp_dim, layer.tp_size, layer.tp_rank = "model.layers.0.o_proj", 1, 2, 0
    with pytest.raises(ValueError, match=r"o_proj: NVFP4 scales cover groups of 16.*shard has 8 "
                       r"\(of 16\)"):  # fmt: skip
        NvFp4LinearMethod().create_weights(layer, 8, 32, False)


def check_scale_refusals(folder, tmp_path, dtype_match: str, nan_scale) -> None:
    """A copy of an FP4 checkpoint with one layer's weight_scale in bfloat16 fails at load with
    dtype_match; one with a NaN scale (nan_scale(scale) -> the scale with one NaN byte) naming
    the layer's NaN."""
    from safetensors.torch import load_file, save_file

    for bad_kind in ("bf16", "nan"):
        bad = tmp_path / bad_kind
        shutil.copytree(folder, bad)
        state = load_file(str(bad / "model.safetensors"))
        key = "model.layers.1.mlp.down_proj.weight_scale"
        if bad_kind == "bf16":
            state[key] = state[key].to(torch.bfloat16)
            match = dtype_match
        else:
            state[key] = nan_scale(state[key])
            match = r"down_proj: weight_scale holds NaN"
        save_file(state, str(bad / "model.safetensors"))
        with pytest.raises(ValueError, match=match):
            _load(bad, "float32")


def test_scales_of_another_dtype_or_nan_fail_naming_the_layer(written, tmp_path):
    def nan(scale):  # e4m3's NaN: 0x7F
        b = scale.view(torch.uint8).clone()
        b[0, 0] = 0x7F
        return b.view(torch.float8_e4m3fn)

    check_scale_refusals(
        written("nvfp4a16")[1], tmp_path,
        r"down_proj: checkpoint tensor \(64, 8\): weight_scale is bfloat16; .* float8_e4m3fn", nan,
    )  # fmt: skip
