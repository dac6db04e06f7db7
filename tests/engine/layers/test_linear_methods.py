"""Linear methods (engine.layers.quantization): each against its float reference, the LM
head's greedy hook against the argmax of its logits, the fused gated MLP against its three
modules, and the choice of method for --quantization with its errors."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu import amx_bf16 as cpu_amx
from engine.kernels.cpu import gemm as cpu_gemm
from engine.kernels.cpu import isa as cpu_isa
from engine.kernels.cpu import w4 as cpu_w4
from engine.kernels.cpu import w8a8 as cpu_w8a8
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    ReplicatedLinear,
    RowParallelLinear,
)
from engine.layers.mlp import GatedMLP
from engine.layers.quantization.int8 import Int8LinearMethod, Int8LMHeadMethod
from engine.layers.quantization.quantize import quantize_layer, quantize_model
from engine.layers.quantization.unquantized import UnquantizedLinearMethod, UnquantizedLMHeadMethod
from engine.layers.quantization.w4a8 import W4A8LinearMethod
from engine.layers.quantization.w8a8 import (
    AMX_W8A8_MIN_ROWS,
    W8A8_MIN_ROWS,
    W8A8LinearMethod,
    W8A8LMHeadMethod,
    w8a8_min_rows,
)


@pytest.fixture(autouse=True)
def _require_kernels():
    if not cpu_gemm.available(torch.float32, torch.int8) or cpu_w8a8._load() is None:
        pytest.skip("no C compiler for the CPU kernels")


def _packed_gemm() -> bool:
    return cpu_w8a8.pack_weight(torch.zeros(16, 4, dtype=torch.int8)) is not None


def _layer(cls=ReplicatedLinear, k=64, n=48, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    layer = cls(k, n, bias=bias)
    layer.weight.data.normal_(0, 0.05)
    if bias:
        layer.bias.data.normal_()
    return layer.to(dtype)


def _double(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.double()


def _within_one_rounding(got: torch.Tensor, want: torch.Tensor) -> bool:
    """got (float32 or bf16) is want (float64) rounded once to got's dtype, up to float32
    accumulation order (the tolerance of tests/engine/test_cpu_gemm.py's int8 test)."""
    rel = 2.0**-7 if got.dtype == torch.bfloat16 else 1e-5
    return bool(((got.double() - want).abs() <= want.abs() * rel + 1e-3).all())


# --- unquantized ---


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", [ReplicatedLinear, ColumnParallelLinear, RowParallelLinear])
def test_unquantized_layers_run_the_c_gemm_or_onednn_by_rows(dtype, cls):
    """Up to cpu_gemm_max_rows rows the C GEMM, beyond it AMX-bf16 tiles (bf16 on a CPU with
    AMX) or F.linear (oneDNN): each equal to its own kernel's output, and all the float product
    rounded once."""
    layer = _layer(cls, dtype=dtype)
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    layer.cpu_gemm_max_rows = 4
    for rows in (1, 4, 5, 40):
        x = torch.randn(rows, 64).to(dtype)
        y = layer(x)
        if rows <= 4:
            assert torch.equal(y, cpu_gemm.linear(x, layer.weight, layer.bias)), rows
        elif layer.cpu_amx:
            assert dtype == torch.bfloat16 and cpu_amx.available()
            assert torch.equal(y, cpu_amx.linear(x, layer.weight, layer.bias)), rows
        else:
            assert torch.equal(y, F.linear(x, layer.weight, layer.bias)), rows
        want = F.linear(x.double(), layer.weight.double(), layer.bias.double())
        assert y.dtype == dtype and _within_one_rounding(y, want), rows


def test_unquantized_row_limit_is_the_policy_of_the_loaded_weight(monkeypatch):
    """Decided once, at the first call, by cpu_gemm.max_rows_for on the layer's weight."""
    monkeypatch.setenv("TESSERA_CPU_GEMM", "1")
    layer = _layer(dtype=torch.bfloat16)
    layer(torch.randn(2, 64).bfloat16())
    assert layer.cpu_gemm_max_rows == cpu_gemm.max_rows_for(layer.weight) == sys.maxsize
    monkeypatch.setenv("TESSERA_CPU_GEMM", "0")
    fresh = _layer()
    fresh(torch.randn(1, 64))
    assert fresh.cpu_gemm_max_rows == 0


# --- int8 (weight-only) ---


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_matches_the_dequantized_weight(dtype, bias):
    layer = _layer(bias=bias, dtype=dtype, n=37, k=70)
    w = layer.weight.detach().float().clone()
    quantize_layer(layer, "int8")
    assert isinstance(layer.quant_method, Int8LinearMethod)
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.shape == (37,)
    deq = layer.weight.double() * layer.weight_scale.double()[:, None]
    assert (deq - w.double()).abs().max() <= layer.weight_scale.max() / 2 + 1e-6
    for rows in (1, 3, 20, 60):  # weight-only at every batch: never int8 activations
        x = torch.randn(rows, 70).to(dtype)
        y = layer(x)
        assert y.dtype == dtype and y.shape == (rows, 37)
        assert _within_one_rounding(y, F.linear(x.double(), deq, _double(layer.bias))), rows


# --- w8a8 ---


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_below_its_threshold_is_weight_only_and_above_it_int8_math(dtype, bias, tiles):
    """Fewer than w8a8_min_rows rows (13; 8 where the packed GEMM runs on AMX tiles): the
    int8 weights alone, as the int8 method computes; from it x quantized per row and the
    exact int32 GEMM, then the two scales (one rounding to the output type)."""
    layer = _layer(bias=bias, dtype=dtype)
    quantize_layer(layer, "w8a8")
    assert isinstance(layer.quant_method, W8A8LinearMethod)
    first = layer.quant_method.w8a8_min_rows(layer, 64)
    amx = tiles == "amx" and layer.packed_int8 is not None
    assert first == (AMX_W8A8_MIN_ROWS if amx else W8A8_MIN_ROWS)
    w, ws, b = layer.weight, layer.weight_scale, layer.bias
    deq = w.double() * ws.double()[:, None]
    for rows in (1, first - 1, first, 64, 300):
        x = torch.randn(rows, 64).to(dtype)
        y = layer(x)
        if rows < first:
            assert torch.equal(y, Int8LinearMethod().apply(layer, x, b)), rows
            continue
        q, s = cpu_w8a8.quantize_rows_reference(x)
        ref = (q.double() @ w.double().T) * s.double()[:, None] * ws.double()
        if b is not None:
            ref = ref + b.double()
        tol = 2**-7 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
        exact = F.linear(x.double(), deq, _double(b))  # and near the float product
        assert (y.double() - exact).abs().max() < 0.05 * exact.abs().max(), rows


# --- w4a8 ---


def test_w4a8_reads_its_4_bit_groups_below_the_threshold_and_int8_above(tiles):
    """Below w8a8_min_rows rows the 4-bit kernel, against F.linear on the dequantized groups
    (up to bf16 rounding and x's int16 quantization); from it w8a8's int8 path exactly. A
    layer whose K is not a multiple of 64 keeps no 4-bit copy: w8a8 at every batch."""
    if not cpu_w4.available():
        pytest.skip("the 4-bit kernel needs a C compiler and AVX512-VNNI")
    layer = _layer(k=128, dtype=torch.bfloat16)
    quantize_layer(layer, "w4a8")
    assert isinstance(layer.quant_method, W4A8LinearMethod) and layer.w4 is not None
    assert layer.weight.dtype == torch.int8  # the int8 rows stay, for larger batches
    first = layer.quant_method.w8a8_min_rows(layer, 128)
    deq4 = cpu_w4.dequantize(layer.w4).double()
    for rows in (1, 2, first - 1, first, 40):
        x = torch.randn(rows, 128).to(torch.bfloat16)
        y = layer(x)
        if rows < first:
            ref = F.linear(x.double(), deq4, layer.bias.double())
            scale = ref.abs().max().item()
            torch.testing.assert_close(y.double(), ref, rtol=2**-7, atol=2**-7 * scale)
        else:
            assert torch.equal(y, W8A8LinearMethod().apply(layer, x, layer.bias)), rows

    odd = _layer(k=96, dtype=torch.bfloat16)
    quantize_layer(odd, "w4a8")
    assert odd.w4 is None
    x = torch.randn(2, 96).bfloat16()
    assert torch.equal(odd(x), W8A8LinearMethod().apply(odd, x, odd.bias))


# --- the LM head ---


def _head(vocab=500, hidden=64, dtype=torch.float32, tied=False):
    torch.manual_seed(3)
    embedding = VocabParallelEmbedding(vocab, hidden)
    head = ParallelLMHead(vocab, hidden)
    if tied:
        head.tie_to(embedding)
    head.weight.data.normal_(0, 0.05)
    return embedding.to(dtype), head.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_methods_against_their_float_logits(dtype):
    """Unquantized: the float product; int8: the dequantized rows' product (float32 logits
    either way); a tied head's embedding keeps its float rows, an untied head drops them."""
    _, head = _head(dtype=dtype)
    assert isinstance(head.quant_method, UnquantizedLMHeadMethod)
    x = torch.randn(5, 64).to(dtype)
    logits = head(x)
    assert logits.dtype == torch.float32
    assert _within_one_rounding(logits.to(dtype), F.linear(x.double(), head.weight.double()))
    greedy = head.greedy(x)
    if dtype == torch.bfloat16 and cpu_isa.plan().amx:  # AMX's argmax epilogue
        assert torch.equal(greedy, logits.argmax(-1))
    else:  # no argmax epilogue: the sampler takes the logits
        assert greedy is None

    quantize_layer(head, "int8")
    assert isinstance(head.quant_method, Int8LMHeadMethod) and head.weight.numel() == 0
    deq = head.qweight.double() * head.weight_scale.double()[:, None]
    logits = head(x)
    assert logits.dtype == torch.float32
    assert _within_one_rounding(logits.to(dtype), F.linear(x.double(), deq))
    assert head.greedy(x) is None

    embedding, tied = _head(dtype=dtype, tied=True)
    quantize_layer(tied, "int8")
    assert tied.weight is embedding.weight and embedding.weight.dtype == dtype
    assert tied.qweight.dtype == torch.int8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_lm_head_greedy_hook_is_the_argmax_of_its_logits(dtype, tiles):
    """From w8a8_min_rows rows the GEMM's argmax epilogue picks each row's token as the
    argmax of the float32 logits forward returns; below it (no int8 activations) no hook."""
    if not _packed_gemm():
        pytest.skip("no AVX512-VNNI (or no compiler) for the packed int8 GEMM")
    _, head = _head(vocab=4096, dtype=dtype)
    quantize_layer(head, "w8a8")
    assert isinstance(head.quant_method, W8A8LMHeadMethod) and head.packed_int8 is not None
    first = w8a8_min_rows(head, 64)
    for rows in (first, 33, 128):
        x = torch.randn(rows, 64).to(dtype)
        logits = head(x)
        q, s = cpu_w8a8.quantize_rows_reference(x)
        ref = (q.double() @ head.qweight.double().T) * s.double()[:, None]
        ref = ref * head.weight_scale.double()
        scale = ref.abs().max().item()
        torch.testing.assert_close(logits.double(), ref, rtol=1e-6, atol=1e-6 * scale)
        assert torch.equal(head.greedy(x), logits.argmax(-1)), rows
    assert head.greedy(torch.randn(first - 1, 64).to(dtype)) is None


# --- the fused gated MLP ---


def _mlp(dtype, bias, hidden=64, inter=128):  # K % 64 == 0: one threshold for both GEMMs
    torch.manual_seed(4)
    mlp = GatedMLP(hidden, inter, bias=bias)
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.weight.data.normal_(0, 0.1)
        if bias:
            layer.bias.data.normal_(0, 0.5)
    return mlp.to(dtype)


def _three_modules(mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(mlp.act(mlp.gate_up_proj(x)))


@pytest.mark.parametrize(
    "method, dtype",
    [("w8a8", torch.float32), ("w8a8", torch.bfloat16), ("w4a8", torch.bfloat16)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_gated_mlp_fuses_only_where_its_layers_take_int8_activations(method, dtype, bias, tiles):
    """From gate_up's w8a8_min_rows rows the MLP is one fused call (cpu_w8a8.mlp_w8a8) that
    computes what its three modules compute, up to the rounding the fusion skips (an int8 value
    may flip at a .5 tie); below them it is the three modules, exactly. Unquantized and int8
    layers never fuse."""
    if method == "w4a8" and not cpu_w4.available():
        pytest.skip("the 4-bit kernel needs a C compiler and AVX512-VNNI")
    mlp = _mlp(dtype, bias)
    x = torch.randn(300, 64).to(dtype)
    assert torch.equal(mlp(x), _three_modules(mlp, x))  # unquantized
    float_y = mlp(x).double()
    quantize_layer(mlp.gate_up_proj, "int8")
    quantize_layer(mlp.down_proj, "int8")
    assert torch.equal(mlp(x), _three_modules(mlp, x))

    mlp = _mlp(dtype, bias)
    quantize_layer(mlp.gate_up_proj, method)
    quantize_layer(mlp.down_proj, method)
    gate_up = mlp.gate_up_proj
    first = gate_up.quant_method.w8a8_min_rows(gate_up, 64)
    scale = float_y.abs().max().item()
    for rows in (1, first - 1, first, 40, 300):
        xr = x[:rows]
        y, layered = mlp(xr), _three_modules(mlp, xr)
        assert y.dtype == dtype and y.shape == (rows, 64)
        if rows < first:
            assert torch.equal(y, layered), rows
            continue
        assert torch.equal(y, cpu_w8a8.mlp_w8a8(xr, gate_up, mlp.down_proj)), rows
        tol = 0.02 if dtype == torch.bfloat16 else 0.002  # bf16: two more roundings of h
        torch.testing.assert_close(y.double(), layered.double(), rtol=0, atol=tol * scale)
        assert (y.double() - float_y[:rows]).abs().max() < 0.05 * scale, rows


# --- the choice of method ---


def _tiny_model(make_tiny_model, dtype: str, **overrides):
    from engine.models.loader import load_model

    name = "tiny-llama-methods-" + "-".join(f"{k}{v}" for k, v in overrides.items())
    return load_model(make_tiny_model(name, **overrides), dtype=dtype)


@pytest.mark.parametrize(
    "method, linear_cls, head_cls",
    [
        (None, UnquantizedLinearMethod, UnquantizedLMHeadMethod),
        ("int8", Int8LinearMethod, Int8LMHeadMethod),
        ("w8a8", W8A8LinearMethod, W8A8LMHeadMethod),
        ("w4a8", W4A8LinearMethod, W8A8LMHeadMethod),  # the LM head stays int8
    ],
)
def test_quantize_model_gives_every_layer_the_configured_method(
    make_tiny_model, method, linear_cls, head_cls
):
    if method == "w4a8" and not cpu_w4.available():
        pytest.skip("the 4-bit kernel needs a C compiler and AVX512-VNNI")
    model = _tiny_model(make_tiny_model, "bfloat16")
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    count = quantize_model(model, method)
    assert count == (0 if method is None else len(linears) + 1)
    assert linears and all(type(m.quant_method) is linear_cls for m in linears)
    assert type(model.lm_head.quant_method) is head_cls
    if method is not None:
        assert all(m.weight.dtype == torch.int8 for m in linears)
    if method == "w4a8":
        assert all(m.w4 is not None for m in linears)  # hidden 64, intermediate 128


def test_quantize_model_refuses_what_the_kernels_cannot_take(make_tiny_model):
    with pytest.raises(ValueError, match="quantization must be one of int8, w8a8, w4a8"):
        quantize_model(_tiny_model(make_tiny_model, "float32"), "int4")
    model = _tiny_model(make_tiny_model, "float32").to("meta")
    with pytest.raises(ValueError, match="use it with --device cpu"):
        quantize_model(model, "int8")
    with pytest.raises(ValueError, match="bfloat16 or float32 model; got torch.float16"):
        quantize_model(_tiny_model(make_tiny_model, "float16"), "w8a8")
    model = _tiny_model(make_tiny_model, "float32")
    with pytest.raises(ValueError, match="w4a8 needs a bfloat16 model"):
        quantize_model(model, "w4a8")
    # refused before any layer changed
    assert all(
        type(m.quant_method) is UnquantizedLinearMethod
        for m in model.modules()
        if isinstance(m, LinearBase)
    )
    with pytest.raises(TypeError, match="holds no linear method"):
        quantize_layer(torch.nn.Linear(4, 4), "int8")


def test_every_registry_entry_names_its_two_methods():
    """The registry (the --quantization choices) names importable classes: a linear method and
    an LM head method for each per-layer format; gguf is per model; a checkpoint format names
    its QuantizationConfig class."""
    from engine.layers.quantization import (
        CHECKPOINT_METHODS,
        LAYER_METHODS,
        METHODS,
        checkpoint_config_class,
        method_classes,
    )
    from engine.layers.quantization.base import LinearMethodBase, LMHeadMethodBase
    from engine.layers.quantization.checkpoint import QuantizationConfig

    assert set(LAYER_METHODS) == set(METHODS) - {"gguf", *CHECKPOINT_METHODS}
    for name in LAYER_METHODS:
        linear, head = method_classes(name)
        assert issubclass(linear, LinearMethodBase) and issubclass(head, LMHeadMethodBase)
    for name in CHECKPOINT_METHODS:
        cls = checkpoint_config_class(name)
        assert issubclass(cls, QuantizationConfig) and cls.name == name
    with pytest.raises(KeyError):
        method_classes("gguf")
    with pytest.raises(KeyError):
        method_classes("gptq")
