"""Q4_0/Q4_1 GGUF blocks as w4 tiles (engine.gguf.w4): the repack is lossless (the
tiles dequantize to exactly gguf-py's values), the w4 kernel on them matches F.linear on
those values, GGUFW4LinearMethod routes by rows, and the default --quantization for a GGUF
model (engine.layers.quantization.resolve_method)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine.gguf import w4 as gguf_w4
from engine.kernels.cpu import amx_bf16 as cpu_amx
from engine.kernels.cpu import gemm as cpu_gemm
from engine.kernels.cpu import gguf as cpu_gguf
from engine.kernels.cpu import isa as cpu_isa
from engine.kernels.cpu import w4 as cpu_w4
from engine.layers.quantization import gguf as gguf_method
from engine.layers.quantization.quantize import resolve_method
from tests.engine.kernels.w4_testing import x_as_the_kernel_reads_it, x_int8_per_group


def _blocks(type_name: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """(uint8 [n, row bytes] file rows, gguf-py's float32 dequantization of them)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * np.logspace(-3, 0, n)[:, None]
    w[1, :32] = 0.25  # a constant block: Q4_1 scale 0
    w[2, 40] = 7.0  # an outlier in one block
    q = quantize(w.astype(np.float32), GGMLQuantizationType[type_name])
    return torch.from_numpy(q), dequantize(q, GGMLQuantizationType[type_name])


@pytest.mark.parametrize("type_name", gguf_w4.TYPES)
@pytest.mark.parametrize("n, k", [(37, 192), (16, 64), (5, 576)])
def test_repacked_tiles_dequantize_to_exactly_the_file_values(type_name, n, k):
    blocks, ref = _blocks(type_name, n, k, seed=n + k)
    q4 = gguf_w4.repack(blocks, type_name, k)
    assert (q4.out_features, q4.in_features) == (n, k)
    assert q4.data.shape == (-(-n // cpu_w4.TILE), k // 32 * cpu_w4.GROUP_BYTES)
    assert np.array_equal(cpu_w4.dequantize(q4).numpy(), ref)  # bit for bit, padding cut
    # the file's float16 scale, and m (Q4_1) or -8d (Q4_0), are the tiles' own
    b = blocks.view(n, k // 32, -1)
    d = b[..., :2].contiguous().view(torch.float16).view(n, -1)
    m = b[..., 2:4].contiguous().view(torch.float16).view(n, -1) if type_name == "Q4_1" else -8 * d
    g = q4.data.view(q4.data.shape[0], k // 32, cpu_w4.GROUP_BYTES)
    scales = g[..., 256:288].contiguous().view(torch.float16).transpose(1, 2).reshape(-1, k // 32)
    mins = g[..., 288:].contiguous().view(torch.float16).transpose(1, 2).reshape(-1, k // 32)
    assert torch.equal(scales[:n], d) and torch.equal(mins[:n], m)
    assert not scales[n:].any() and not mins[n:].any()  # padded rows: zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpack_is_the_reference_dequantization(dtype):
    """cpu_w4.unpack (C, the large-batch path's weight) and the Python dequantize() both give
    the file's values exactly, padding rows cut."""
    blocks, ref = _blocks("Q4_1", 37, 192)
    q4 = gguf_w4.repack(blocks, "Q4_1", 192)
    assert torch.equal(cpu_w4.unpack(q4, dtype), torch.from_numpy(ref).to(dtype))
    assert torch.equal(cpu_w4.dequantize(q4).to(dtype), torch.from_numpy(ref).to(dtype))


def test_what_the_repack_refuses():
    assert gguf_w4.supports("Q4_1", 96) is not None  # K not a multiple of 64: the dot kernel
    assert gguf_w4.supports("Q8_0", 64) is not None
    blocks, _ = _blocks("Q4_1", 4, 96)
    with pytest.raises(ValueError, match="multiple of 64"):
        gguf_w4.repack(blocks, "Q4_1", 96)
    with pytest.raises(ValueError, match="bytes"):
        gguf_w4.repack(blocks[:, :30], "Q4_1", 64)
    big, _ = _blocks("Q4_0", 3, 64)
    big.view(3, 2, 18)[0, 0, :2] = torch.tensor([10000.0]).half().view(torch.uint8)
    with pytest.raises(ValueError, match="overflows"):  # -8d past float16: not lossless
        gguf_w4.repack(big, "Q4_0", 64)


@pytest.mark.parametrize("type_name", gguf_w4.TYPES)
@pytest.mark.parametrize("m, n, k", [(1, 70, 576), (5, 48, 128), (12, 33, 1536), (45, 20, 64)])
def test_w4_kernel_on_repacked_tiles_matches_f_linear_on_the_file_values(type_name, m, n, k):
    """The kernel's stated tolerance (bf16 output, x quantized to int16 per row, or with AVX2
    to int8 per group of 32: the reference rounds x the kernel's way)."""
    if not cpu_w4.available():
        pytest.skip("the 4-bit kernel needs a C compiler and AVX512-VNNI or AVX2")
    if m > cpu_w4.max_rows():
        pytest.skip(f"the kernel takes {cpu_w4.max_rows()} rows")
    blocks, ref_w = _blocks(type_name, n, k, seed=m)
    q4 = gguf_w4.repack(blocks, type_name, k)
    x = torch.randn(m, k).to(torch.bfloat16)
    y = cpu_w4.linear(x, q4)
    assert y is not None
    ref = F.linear(x_as_the_kernel_reads_it(x), torch.from_numpy(ref_w).double())
    torch.testing.assert_close(y.double(), ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())


def _layer(type_name: str, n: int, k: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """A layer holding the repacked tiles as apply_gguf_blocks leaves it, and its weight."""
    from engine.layers.linear import ReplicatedLinear

    blocks, ref = _blocks(type_name, n, k)
    layer = ReplicatedLinear(k, n, bias=True)
    layer.bias.data = torch.randn(n).bfloat16()
    layer.w4 = gguf_w4.repack(blocks, type_name, k)
    layer.weight = torch.nn.Parameter(layer.w4.data, requires_grad=False)
    layer.quant_method = gguf_method.GGUFW4LinearMethod()
    return layer, torch.from_numpy(ref)


def test_layers_take_the_w4_kernel_up_to_its_rows_and_the_large_batch_path_beyond(monkeypatch):
    if not cpu_w4.available():
        pytest.skip("the 4-bit kernel needs a C compiler and AVX512-VNNI or AVX2")
    layer, w = _layer("Q4_1", 40, 128)
    top = cpu_w4.max_rows()  # 12 (VNNI), or any batch (AVX2)
    # the decode plan's bound: where the w4 tiles' kernels stop (the batch kernel: never)
    batch = cpu_w4.batch_available() and not cpu_isa.plan().amx
    assert layer.quant_method.w8a8_min_rows(layer, 128) == (cpu_isa.ALWAYS if batch else top + 1)
    amx_top = cpu_isa.plan().amx_w4_max_rows
    for rows in (1, 12, 13, 40, 300, *((amx_top, amx_top + 1) if cpu_isa.plan().amx else ())):
        x = torch.randn(rows, 128).bfloat16()
        y = layer(x)
        if rows <= top:  # the kernel itself
            assert torch.equal(y, cpu_w4.linear(x, layer.w4, layer.bias))
        elif cpu_isa.plan().amx_w4_rows(rows):  # AMX-bf16 tiles reading the w4 tiles
            assert torch.equal(y, cpu_amx.linear_w4(x, layer.w4.data, 40, 128, layer.bias))
        elif cpu_isa.plan().amx:  # past AMX's rows: the tiles dequantized for oneDNN
            dense = cpu_gemm.dense_linear(x, cpu_w4.unpack(layer.w4, x.dtype), layer.bias)
            assert torch.equal(y, dense)
        elif cpu_w4.batch_available():  # the VNNI batch kernel
            assert torch.equal(y, cpu_w4.linear_batch(x, layer.w4, layer.bias))
        ref = F.linear(x_as_the_kernel_reads_it(x), w.double(), layer.bias.double())
        if rows > top and cpu_w4.batch_available():  # int8 x per group of 32 above 12 rows
            ref = F.linear(x_int8_per_group(x), w.double(), layer.bias.double())
        torch.testing.assert_close(y.double(), ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())
    # the large-batch path as a CPU whose kernel stops at 12 rows and has neither AMX nor the
    # batch kernel takes it: the tiles dequantized for the GEMM
    monkeypatch.setattr(cpu_w4, "_resolved", [(cpu_w4._kernel(), 12)])
    monkeypatch.setattr(cpu_isa, "plan", lambda: cpu_isa.PLANS["other"])
    monkeypatch.setattr(cpu_w4, "linear_batch", lambda *args: None)
    x = torch.randn(20, 128).bfloat16()
    ref = cpu_gemm.dense_linear(x, w.bfloat16(), layer.bias)  # the same bf16 weight and GEMM
    assert torch.equal(layer(x), ref)


def test_an_unset_quantization_serves_a_gguf_model_in_its_own_blocks_on_the_cpu(tmp_path):
    path = tmp_path / "m.gguf"
    if cpu_gguf.available():
        assert resolve_method(None, path, "cpu")[0] == "gguf"
    assert resolve_method(None, None, "cpu") == (None, "not a GGUF model")
    method, why = resolve_method(None, path, "cuda")
    assert method is None and "CPU" in why  # kept dequantized, said why
    assert resolve_method(None, path, "cpu", load_format="dummy")[0] is None
    assert resolve_method(None, path, "cpu", tp_size=2)[0] is None
    assert resolve_method("none", path, "cpu")[0] is None  # the override: float weights
    assert resolve_method("w4a8", path, "cpu")[0] == "w4a8"


def test_none_is_a_quantization_of_the_config_and_the_cli():
    from api.server.settings import Settings
    from engine.args import EngineArgs

    assert EngineArgs(quantization="none").create_engine_config().model.quantization == "none"
    assert EngineArgs().create_engine_config().model.quantization is None  # unset: resolved at load
    with pytest.raises(ValueError, match="none, int8, w8a8, w4a8, gguf"):
        EngineArgs(quantization="bf16").create_engine_config()
    settings = Settings.from_argv(["--quantization", "none"], {})
    assert settings.quantization == "none"
    assert Settings.from_argv([], {}).quantization is None
