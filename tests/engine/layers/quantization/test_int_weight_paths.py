"""Each CPU path an integer checkpoint layer can take, called at decode and prefill sizes,
against x @ W of the exactly dequantized weight."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu import w4 as cpu_w4
from engine.layers.linear import ReplicatedLinear
from engine.layers.quantization.int_weight import (
    DequantLinearMethod,
    GroupedDequantLinearMethod,
    PackedQ8LinearMethod,
    PackedW4LinearMethod,
    PermutedW4LinearMethod,
    finish_int_layer,
)

K, N, GROUP = 128, 48, 32


def _case(bits: int, sym: bool, act_order: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    groups = K // GROUP
    codes = torch.randint(0, 1 << bits, (N, K), generator=g, dtype=torch.uint8)
    scales = (torch.rand(N, groups, generator=g) * 0.02 + 0.001).half().float()
    zeros = None if sym else torch.randint(0, 1 << bits, (N, groups), generator=g).int()
    g_idx = None
    if act_order:
        g_idx = torch.empty(K, dtype=torch.int32)
        g_idx[torch.randperm(K, generator=g)] = torch.arange(K, dtype=torch.int32) // GROUP
    grp = g_idx.long() if act_order else torch.arange(K) // GROUP
    z = torch.full((N, groups), 1 << (bits - 1)) if sym else zeros
    w = (codes.float() - z.float()[:, grp]) * scales[:, grp]  # [N, K]
    return codes, scales, zeros, g_idx, w


def _layer(dtype: torch.dtype, bias: bool):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = ReplicatedLinear(K, N, bias=bias)
    finally:
        torch.set_default_dtype(old)
    layer.model_dtype = dtype
    if bias:
        layer.bias.data.normal_()
    del layer.weight
    return layer


CASES = [  # bits, sym, act-order, dtype -> the method expected
    (4, True, False, torch.bfloat16, PackedW4LinearMethod),
    (4, False, False, torch.bfloat16, PackedW4LinearMethod),
    (4, True, True, torch.bfloat16, PermutedW4LinearMethod),
    (8, True, False, torch.bfloat16, PackedQ8LinearMethod),
    (8, False, True, torch.bfloat16, PackedQ8LinearMethod),
    (4, False, True, torch.float32, GroupedDequantLinearMethod),
    (8, False, False, torch.float32, GroupedDequantLinearMethod),
]


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize(("bits", "sym", "act_order", "dtype", "method"), CASES)
def test_each_path_multiplies_by_the_dequantized_weight(bits, sym, act_order, dtype, method, rows):
    if method in (PackedW4LinearMethod, PermutedW4LinearMethod) and not cpu_w4.available():
        method = GroupedDequantLinearMethod
    if method is PackedQ8LinearMethod and not cpu_w4.q8_available():
        method = GroupedDequantLinearMethod
    codes, scales, zeros, g_idx, w = _case(bits, sym, act_order)
    layer = _layer(dtype, bias=True)
    path = finish_int_layer(layer, codes, scales, zeros, g_idx, bits, GROUP)
    assert isinstance(layer.quant_method, method), path
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = layer(x).float()
    want = x.float() @ w.t() + layer.bias.float()
    # float32: exact to rounding; bf16: the kernels' x quantization and bf16 outputs
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (got - want).abs().max() <= tol * want.abs().max(), path


def test_cuda_tensors_keep_the_canonical_packed_form():
    """Off the CPU a layer keeps packed.PackedWeight (the GPU kernels' input), here emulated
    through the dequantizing reference method on a meta-free CPU copy."""
    codes, scales, zeros, g_idx, w = _case(4, False, True)
    from engine.layers.quantization.packed import dequantize, from_loading_layout

    packed = from_loading_layout(codes, scales, zeros, g_idx, 4, GROUP, torch.float32)
    assert torch.allclose(dequantize(packed).t(), w, atol=1e-6)
    layer = _layer(torch.float32, bias=False)
    layer.packed = packed
    layer.quant_method = DequantLinearMethod()
    x = torch.randn(3, K)
    assert torch.allclose(layer(x), x @ w.t(), atol=1e-4)
