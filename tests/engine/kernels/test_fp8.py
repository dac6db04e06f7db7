"""FP8 linear layers (engine/kernels/fp8.py) and the per-token activation quantization kernel
(engine/kernels/triton/fp8.py).

On CPU: the weight quantization's round trip, the per-token quantization (torch, and the
Triton kernel under the interpreter, byte for byte), and the weight-only fallback against a
torch reference. The _scaled_mm path needs CUDA capability >= 8.9 and is skipped elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import fp8

HAS_CUDA = torch.cuda.is_available()
HAS_FP8_MM = HAS_CUDA and fp8.supports_fp8_matmul("cuda")
E4M3 = torch.float8_e4m3fn


def _rows(m, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]  # rows of all sizes
    x[0] = 0.0  # an all-zero row: the scale's floor
    return x.to(dtype)


def _round_trip_bound(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3: 3 mantissa bits, so a normal value is within 2^-4 of itself; below 2^-6 (in
    units of the scale) the step is 2^-9, half of it the error."""
    return torch.maximum(w.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weight_quantization_round_trip(dtype):
    w = _rows(24, 136, dtype, seed=1)
    q, scale = fp8.quantize_weight_fp8(w)
    assert q.dtype == E4M3 and q.shape == w.shape and scale.shape == (24,)
    assert scale.dtype == torch.float32 and scale[0] == fp8.MIN_SCALE and (q[0].float() == 0).all()
    # every row's largest magnitude lands on 448 exactly
    assert torch.equal(q[1:].float().abs().amax(1), torch.full((23,), 448.0))
    back = fp8.dequantize_fp8(q, scale, torch.float32)
    err = (back - w.float()).abs()
    assert (err <= _round_trip_bound(w.float(), scale[:, None])).all()
    # a per-tensor scale dequantizes the same way
    one = fp8.dequantize_fp8(q[1:2], scale[1], torch.float32)
    assert torch.equal(one, back[1:2])


def test_per_token_quant_torch_round_trip():
    x = _rows(9, 200, torch.bfloat16)
    q, s = fp8.per_token_quant_fp8_torch(x)
    assert q.dtype == E4M3 and s.shape == (9, 1) and s.dtype == torch.float32
    want = (x.float().abs().amax(1, keepdim=True) / 448.0).clamp(min=fp8.MIN_SCALE)
    torch.testing.assert_close(s, want, rtol=2**-23, atol=0)  # within an ulp of the quotient
    err = (q.float() * s - x.float()).abs()
    assert (err <= _round_trip_bound(x.float(), s)).all()
    # the CPU dispatch is the torch form
    q2, s2 = fp8.per_token_quant_fp8(x)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,block", [(100, None), (100, 32), (256, 64), (8, None)])
def test_triton_per_token_quant_bytes_equal_torch(dtype, k, block):
    """The kernel (interpreted here, compiled on a GPU), one pass over a short row or several
    chunks of it, against torch: the same scales and the same bytes, ties rounded to even."""
    pytest.importorskip("triton")
    from engine.kernels.triton import fp8 as triton_fp8

    device = "cuda" if HAS_CUDA else "cpu"
    x = _rows(7, k, dtype, seed=k)
    x[1, :3] = torch.tensor([448.0, -0.5, 1.0]).to(dtype)  # with the max at 448: exact ties
    x = x.to(device)
    q, s = triton_fp8.per_token_quant_fp8(x, block=block)
    want_q, want_s = fp8.per_token_quant_fp8_torch(x)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_triton_per_token_quant_reads_strided_rows_and_no_rows():
    pytest.importorskip("triton")
    from engine.kernels.triton import fp8 as triton_fp8

    device = "cuda" if HAS_CUDA else "cpu"
    wide = _rows(5, 80, torch.float16, seed=3).to(device)
    q, s = triton_fp8.per_token_quant_fp8(wide[:, :64])
    want_q, want_s = fp8.per_token_quant_fp8_torch(wide[:, :64])
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    q, s = triton_fp8.per_token_quant_fp8(wide[:0])
    assert q.shape == (0, 80) and s.shape == (0, 1)


def _weights(n, k, per_channel, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    q, scale = fp8.quantize_weight_fp8(w)
    if not per_channel:
        scale = scale.max()
        q = (w / scale).clamp(-448, 448).to(E4M3)
    return w, q, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_channel", [True, False], ids=["channel", "tensor"])
def test_fallback_on_cpu_is_the_dequantized_matmul(per_channel, dtype):
    """Weight-only on CPU: x @ dequantize(W).T (+ bias), the input scale unused; close to the
    unquantized product within e4m3's rounding of W."""
    n, k = 40, 72
    w, q, scale = _weights(n, k, per_channel)
    x = torch.randn(2, 3, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    y = fp8.fp8_linear(x, q, scale, input_scale=0.02, bias=bias)
    want = torch.nn.functional.linear(x, fp8.dequantize_fp8(q, scale, dtype), bias)
    assert y.shape == (2, 3, n) and y.dtype == dtype
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    exact = x.double() @ w.double().t() + bias.double()
    assert (y.double() - exact).abs().max() <= 0.1 * exact.abs().max()
    layer = fp8.Fp8Linear.prepare(q, scale, bias=bias, dtype=dtype)
    assert layer.path == "dequantized" and layer.weight.dtype == dtype
    assert torch.equal(layer(x), y)


def test_reference_is_w8a8_in_fp32():
    """fp8_linear_reference: the activations quantized (per token, or static) and both sides
    dequantized, against the same steps spelled out."""
    n, k = 16, 32
    _, q, scale = _weights(n, k, True)
    x = torch.randn(5, k)
    xq, xs = fp8.per_token_quant_fp8_torch(x)
    want = (xq.float() * xs) @ (q.float() * scale[:, None]).t()
    torch.testing.assert_close(fp8.fp8_linear_reference(x, q, scale), want)
    xq = (x / 0.01).clamp(-448, 448).to(E4M3)
    want = (xq.float() * 0.01) @ (q.float() * scale[:, None]).t()
    torch.testing.assert_close(fp8.fp8_linear_reference(x, q, scale, 0.01), want)


def test_no_fp8_matmul_off_cuda():
    assert not fp8.supports_fp8_matmul("cpu")
    with pytest.raises(ValueError, match="input features"):
        fp8.fp8_linear(torch.randn(2, 8), torch.zeros(4, 16, dtype=E4M3), 1.0)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_FP8_MM, reason="needs CUDA capability >= 8.9 (FP8 matmuls)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_channel", [True, False], ids=["channel", "tensor"])
@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
@pytest.mark.parametrize("m", [1, 33, 256])
def test_scaled_mm_matches_the_w8a8_reference(m, static, per_channel, dtype):
    """_scaled_mm (tensorwise or rowwise) against the same W8A8 math in fp32: only the
    accumulation order and the output's rounding differ."""
    n, k = 256, 512
    _, q, scale = _weights(n, k, per_channel)
    q, scale = q.cuda(), scale.cuda()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).cuda()
    bias = torch.randn(n).to(dtype).cuda()
    input_scale = (x.float().abs().max() / 448.0).item() if static else None
    y = fp8.fp8_linear(x, q, scale, input_scale, bias)
    want = fp8.fp8_linear_reference(x, q, scale, input_scale, bias)
    assert y.dtype == dtype and y.shape == (m, n)
    err = (y.float() - want.float()).abs().max()
    assert err <= 1e-2 * want.float().abs().max()
    layer = fp8.Fp8Linear.prepare(q, scale, input_scale, bias, dtype)
    assert layer.path == "fp8"
    assert torch.equal(layer(x), y)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_FP8_MM, reason="needs CUDA capability >= 8.9 (FP8 matmuls)")
def test_scaled_mm_refuses_odd_shapes_into_the_fallback():
    _, q, scale = _weights(40, 72, True)
    q, scale = q.cuda(), scale.cuda()
    x = torch.randn(3, 72, dtype=torch.bfloat16, device="cuda")
    want = torch.nn.functional.linear(x, fp8.dequantize_fp8(q, scale, torch.bfloat16))
    assert torch.equal(fp8.fp8_linear(x, q, scale), want)
    assert fp8.Fp8Linear.prepare(q, scale).path == "dequantized"
