"""The CUDA path of integer checkpoints: finish_int_layer gives a layer the Triton W4A16 /
W8A16 GEMM (engine/kernels/triton/quant_gemm.py), run here under TRITON_INTERPRET=1 on CPU
tensors (tests/engine/conftest.py), against the torch dequantize-per-call fallback."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("triton")

from engine.layers.quantization.int_weight import (  # noqa: E402
    DequantLinearMethod,
    TritonIntLinearMethod,
    finish_int_layer,
)
from engine.layers.quantization.packed import from_loading_layout  # noqa: E402


def _layer(dtype: torch.dtype) -> nn.Module:
    layer = nn.Module()
    layer.register_parameter("bias", None)
    layer.model_dtype = dtype
    return layer


@pytest.mark.parametrize(
    ("bits", "group", "asym", "act_order"),
    [(4, 32, False, False), (4, 64, True, False), (4, 32, True, True), (8, 128, False, False)],
)
def test_the_triton_gemm_serves_a_checkpoint_layer(bits, group, asym, act_order):
    n, k, dtype = 48, 256, torch.float16
    g = torch.Generator().manual_seed(bits + group)
    codes = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 1 << bits, (n, k // group), generator=g, dtype=torch.int32)
    g_idx = None
    if act_order:
        g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=g)].to(torch.int32)
    zeros = zeros if asym else None
    kernel = _layer(dtype)
    path = finish_int_layer(kernel, codes, scales, zeros, g_idx, bits, group, triton=True)
    assert isinstance(kernel.quant_method, TritonIntLinearMethod) and "Triton" in path
    reference = _layer(dtype)  # the torch reference: the canonical form dequantized per call
    reference.packed = from_loading_layout(codes, scales, zeros, g_idx, bits, group, dtype)
    x = torch.randn(5, k, generator=g).to(dtype)
    got = kernel.quant_method.apply(kernel, x)
    want = DequantLinearMethod().apply(reference, x)
    tolerance = 2e-2 * want.abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=0)
