"""MXFP4 checkpoints (compressed-tensors' mxfp4-pack-quantized:
engine.layers.quantization.mxfp4_linear), written by the compressed-tensors package itself:
MXFP4A16 (weight-only) and MXFP4 (its fp4 activation scheme, served weight-only).

The reference is HF transformers on the same tiny model with every quantized weight its exact
dequantized value (the package's own fake_quantize). Checked: the package's layout and values;
the repack into ggml's MXFP4 blocks holds the same values bit for bit (gguf-py decodes them);
each loaded layer holds the checkpoint's values; greedy tokens follow the reference with every
row on the decoded weights' exact path (token for token but near ties) and with every row on
the dot kernels (x as int8 per 32: the same sums on any CPU); the dequantized fallback; TP=2;
the CUDA path (the FP4 Triton GEMM with E8M0 scales, under the interpreter without a GPU, and
through the engine on one); start-up errors naming the field.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu import gguf as cpu_gguf
from engine.layers.quantization.checkpoint import build_config
from engine.layers.quantization.mxfp4_blocks import dequantize_mxfp4
from engine.layers.quantization.mxfp4_linear import MxFp4LinearMethod
from tests.engine.layers.quantization import quant_writers as qw
from tests.engine.layers.quantization.test_nvfp4 import (
    check_cuda_greedy,
    check_scale_refusals,
    check_triton_layers,
)
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

FMT = "mxfp4-pack-quantized"
# llm-compressor's MXFP4A16 / MXFP4 presets (compressed_tensors.quantization.quant_scheme)
WEIGHTS = dict(num_bits=4, type="float", strategy="group", symmetric=True, dynamic=False,
               group_size=32, scale_dtype=torch.uint8, zp_dtype=torch.uint8)  # fmt: skip
ACTS = dict(num_bits=4, type="float", strategy="group", symmetric=True, dynamic=True,
            group_size=32, scale_dtype=torch.uint8, zp_dtype=torch.uint8)  # fmt: skip
WRITERS = {
    "mxfp4a16": functools.partial(qw.write_compressed_tensors, fmt=FMT, weights=WEIGHTS),
    "mxfp4-w4a4": functools.partial(
        qw.write_compressed_tensors, fmt=FMT, weights=WEIGHTS, input_activations=ACTS
    ),
}
KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# every row on the dot kernels (x as int8 per 32): near ties of the reference may flip (the
# gpt-oss GGUF tests' bound for the same kernels)
DOT_GAP_TOL = 0.15


@pytest.fixture(scope="module")
def written(tiny_llama_dir, tmp_path_factory):
    """format id -> (float folder, MXFP4 folder, {layer: dequantized weight}), written once."""
    return qw.written_once(WRITERS, tiny_llama_dir, tmp_path_factory)


def _package_tensors(n: int, k: int, seed: int = 0) -> tuple[dict, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 1, n)[:, None]
    return qw.ct_compress(w, FMT, WEIGHTS)


def _dequantize(t: dict) -> torch.Tensor:
    packed = t["weight_packed"]
    return dequantize_mxfp4(packed.view(packed.shape[0], -1, 16), t["weight_scale"],
                            torch.float32).reshape(packed.shape[0], -1)  # fmt: skip


def test_the_package_layout_and_its_dequantized_values():
    """weight_packed uint8 [N, K/2] (low nibble first), weight_scale uint8 E8M0 [N, K/32];
    W = value * 2 ** (scale - 127): ours equals the package's fake_quantize exactly and its
    decompressor's bf16 result."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    t, deq = _package_tensors(24, 128)
    assert set(t) == {"weight_packed", "weight_scale"}
    assert t["weight_packed"].dtype == torch.uint8 and t["weight_packed"].shape == (24, 64)
    assert t["weight_scale"].dtype == torch.uint8 and t["weight_scale"].shape == (24, 4)
    assert len(t["weight_scale"].unique()) > 4  # rows of 10^-3 .. 10: many exponents
    ours = _dequantize(t)
    assert torch.equal(ours, deq)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**WEIGHTS))
    theirs = MXFP4PackedCompressor.decompress(dict(t), scheme)["weight"]
    assert torch.equal(ours.to(theirs.dtype), theirs)


@pytest.mark.skipif(not cpu_gguf.available(), reason="needs the CPU kernels")
def test_the_repack_holds_the_same_values_in_ggml_blocks():
    """ggml's MXFP4 rows of the package's bytes: gguf-py and the C dequantizer both read
    value * 2 ** (scale - 127) exactly."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from engine.layers.quantization.mxfp4_blocks import to_gguf_mxfp4

    t, _ = _package_tensors(24, 192, seed=1)
    packed = t["weight_packed"]
    raw = to_gguf_mxfp4(packed.view(1, 24, -1, 16), t["weight_scale"].unsqueeze(0))[0]
    assert raw.shape == (24, cpu_gguf.row_bytes(cpu_gguf.TYPES["MXFP4"], 192))
    want = _dequantize(t)
    ref = dequantize(raw.numpy(), GGMLQuantizationType.MXFP4).reshape(24, 192)
    assert torch.equal(torch.from_numpy(np.ascontiguousarray(ref)), want)
    assert torch.equal(cpu_gguf.dequantize(raw, cpu_gguf.TYPES["MXFP4"], 192, torch.float32), want)


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
        assert isinstance(layer.quant_method, MxFp4LinearMethod), name
        assert layer.weight.dtype == torch.uint8, name  # the blocks alone, no float copy
        parts = [name[: -len(kind)] + p for p in MERGED.get(kind, (kind,))]
        want = torch.cat([deq[p] for p in parts])
        got = cpu_gguf.dequantize(layer.weight, layer.gguf_type, layer.in_features, torch.float32)
        assert torch.equal(got, want), name
        x = torch.randn(5, want.shape[1], generator=gen).to(getattr(torch, dtype))
        y = layer.quant_method.apply(layer, x)
        ref = F.linear(x.float(), want)
        assert y.dtype == x.dtype
        assert (y.float() - ref).norm() / ref.norm() < 2.5e-2, name  # int8 x per 32
        checked += 1
    assert checked == 4 * model.config.num_hidden_layers
    assert all("GGUF MXFP4 blocks" in why for why in paths["qkv_proj"]), paths
    served = "fp4 activations served in the model dtype"
    assert all((served in why) == (fmt == "mxfp4-w4a4") for why in paths["down_proj"]), paths


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_without_the_kernels_each_layer_is_dequantized_once(written, monkeypatch, dtype):
    """The fallback (a CPU without the kernels): value * 2 ** (scale - 127) in
    the model dtype, exactly the package's values (a power of two times e2m1 fits bf16)."""
    monkeypatch.setattr(cpu_gguf, "available", lambda: False)
    _, folder, deq = written("mxfp4a16")
    model, paths = _load(folder, dtype)
    for name, layer in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind in KINDS:
            parts = [name[: -len(kind)] + p for p in MERGED.get(kind, (kind,))]
            want = torch.cat([deq[p] for p in parts])
            assert layer.gguf_type is None and torch.equal(layer.weight.data.float(), want), name
    assert all(f"dequantized at load into {dtype}" in why for why in paths["o_proj"]), paths


def _greedy(folder, dtype: str, dot_rows: int) -> list[list[int]]:
    """Greedy tokens with the dot kernels taking up to dot_rows rows (0: none)."""
    from engine import LLM, SamplingParams

    with cpu_gguf.forced_dot_rows(dot_rows):
        llm = LLM(str(folder), dtype=dtype, seed=0, num_kv_blocks=64, max_model_len=256)
        try:
            assert llm.engine.executor.runner.quantization == "compressed-tensors"  # no flag
            params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
        finally:
            llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize(
    ("fmt", "dtype", "path"),
    [
        ("mxfp4a16", "float32", "exact"),
        ("mxfp4a16", "bfloat16", "exact"),
        ("mxfp4a16", "float32", "dot"),
        ("mxfp4-w4a4", "bfloat16", "dot"),
    ],
)
def test_greedy_tokens_follow_the_dequantized_reference(written, fmt, dtype, path):
    """Each path pinned (not this CPU's row plan): every row on the decoded blocks' exact GEMM,
    or every row on the dot kernels."""
    if not cpu_gguf.available():
        pytest.skip("the block paths need the CPU kernels")
    src, folder, deq = written(fmt)
    ref = qw.reference_model(src, deq)
    ours = _greedy(folder, dtype, 0 if path == "exact" else 16)
    tol = GAP_TOL[dtype] if path == "exact" else DOT_GAP_TOL
    for prompt, got in zip(PROMPTS, ours, strict=True):
        theirs, gaps = _hf_greedy(ref, prompt)
        _assert_greedy_agrees(got, theirs, gaps, tol)


@pytest.mark.slow
def test_tp2_shards_give_the_logits_of_one_process(written, tmp_path):
    """Column shards split N, row shards split K on whole blocks of 32 (o_proj: 32 inputs a
    rank, down_proj: 64)."""
    torch.set_num_threads(1)
    folder = written("mxfp4a16")[1]
    want = _tp_logits(folder)
    (got,), paths0, paths1 = _tp2([folder], tmp_path, "float32")
    # the blocks' x is quantized per 32 of each rank's K as of one process's: the same groups
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8
    assert paths0 == paths1
    if cpu_gguf.available():
        assert all("GGUF MXFP4 blocks" in why for why in paths0[0]["o_proj"]), paths0


# -- start-up refusals --------------------------------------------------------------------------


def _config(weights: dict | None = None, acts: dict | None = None) -> dict:
    group = {"targets": ["Linear"], "format": FMT,
             "weights": {**json.loads(json.dumps(WEIGHTS, default=str)), **(weights or {})},
             "input_activations": acts}  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": FMT,
            "config_groups": {"g": group}, "ignore": ["lm_head"]}  # fmt: skip


@pytest.mark.parametrize(
    ("weights", "acts", "field"),
    [
        ({"group_size": 16}, None, "weights.group_size = 16.*32"),
        ({"strategy": "tensor_group"}, None, "weights.strategy = 'tensor_group'.*group"),
        ({"num_bits": 8}, None, "weights.num_bits = 8"),
        ({"scale_dtype": "torch.float8_e4m3fn"}, None, "weights.scale_dtype.*torch.uint8"),
        ({}, {**json.loads(json.dumps(ACTS, default=str)), "group_size": 16},
         "input_activations.group_size = 16"),
    ],
)  # fmt: skip
def test_unsupported_schemes_name_the_field(weights, acts, field):
    with pytest.raises(ValueError, match=f"quantization_config.config_groups.g.{field}"):
        build_config("compressed-tensors", _config(weights, acts))


def test_moe_experts_are_refused_naming_the_format():
    config = build_config("compressed-tensors", {
        **_config(), "ignore": ["lm_head", "re:.*mlp.gate$"]})  # fmt: skip
    with pytest.raises(ValueError, match="format = 'mxfp4-pack-quantized'.*MoE experts"):
        config.experts_method("model.layers.0.mlp.experts",
                              ["model.layers.0.mlp.experts.0.gate_proj"])  # fmt: skip


# -- the CUDA path: the FP4 Triton GEMM with E8M0 scales ------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_triton_gemm_serves_the_loaded_layers(written, dtype):
    _, folder, deq = written("mxfp4-w4a4")
    check_triton_layers(folder, deq, dtype, MxFp4LinearMethod, "mxfp4")


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", list(WRITERS))
def test_cuda_greedy_tokens_follow_the_dequantized_reference(written, fmt):
    check_cuda_greedy(*written(fmt))


def test_scales_of_another_dtype_or_nan_fail_naming_the_layer(written, tmp_path):
    def nan(scale):  # E8M0's NaN: 0xFF
        scale = scale.clone()
        scale[0, 0] = 0xFF
        return scale

    check_scale_refusals(
        written("mxfp4a16")[1], tmp_path,
        r"down_proj: checkpoint tensor \(64, 4\): weight_scale is bfloat16; MXFP4 .* uint8 scales",
        nan,
    )  # fmt: skip
