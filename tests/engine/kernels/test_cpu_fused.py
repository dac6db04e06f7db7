"""The fused CPU kernels (engine.kernels.cpu.fused_ops: RMSNorm, SiLU-and-mul) against the torch path."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu import fused_ops as cpu_fused
from engine.layers.norm import RMSNorm


def _require(x: torch.Tensor) -> None:
    if not cpu_fused.supports(x):
        pytest.skip("no C compiler for the CPU kernels")


def _torch_norm(norm: RMSNorm, x, residual=None):
    """The reference: RMSNorm's torch path."""
    return norm.forward_native(x, residual)


def _on_cpu(op):
    """op bound to the CPU's kernels, as the loader binds a model's (engine.layers.ops)."""
    op.bind("cpu")
    return op


# bf16: the torch path and the kernel round at the same steps; only the order of the sum of
# squares differs, which can move a result by one bf16 step.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 80])  # 80: over the rows split across threads
def test_rms_norm_with_and_without_residual(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    h = 72
    x = (torch.randn(rows, h, generator=g) * 3).to(dtype)
    _require(x)
    norm = _on_cpu(RMSNorm(h, eps=1e-5).to(dtype))
    norm.weight.data = (torch.rand(h, generator=g) + 0.5).to(dtype)
    res = torch.randn(rows, h, generator=g).to(dtype)

    torch.testing.assert_close(norm(x), _torch_norm(norm, x), **TOL[dtype])
    got, got_res = norm(x, res.clone())
    want, want_res = _torch_norm(norm, x, res.clone())
    torch.testing.assert_close(got_res, want_res, rtol=0, atol=0)  # the add rounds the same
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_rms_norm_on_a_strided_view():
    """Rows that are slices of a wider tensor (unit last stride, larger row stride)."""
    wide = torch.randn(6, 100)
    x = wide[:, 10:74]
    _require(x)
    norm = _on_cpu(RMSNorm(64))
    torch.testing.assert_close(norm(x), _torch_norm(norm, x.contiguous()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 80])  # 80: over the rows split across threads
def test_silu_and_mul_matches_torch(dtype, rows):
    """Same rounding steps as F.silu(gate).mul_(up); exp's last bits may differ from torch's,
    which can move a bf16 silu by one step before the product (so: two steps at most, and
    almost every value exact)."""
    from engine.layers.activation import SiluAndMul

    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * 100, generator=g) * 4).to(dtype)
    _require(x)
    gate, up = x.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = cpu_fused.silu_and_mul(x)
    assert got.shape == (rows, 100) and got.dtype == dtype
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=2**-6, atol=1e-2)
        assert (got == want).float().mean() > 0.99
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(_on_cpu(SiluAndMul())(x), got, rtol=0, atol=0)  # the layer uses it
    strided = torch.cat([x, x[:, :8]], dim=1)[:, : 2 * 100]  # rows of a wider tensor
    torch.testing.assert_close(cpu_fused.silu_and_mul(strided), got, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 9, 300])  # 300: over the rows split across threads
def test_rope_matches_torch_exactly(dtype, rows):
    """q and k heads of a qkv projection (a strided view), rotated in one call: bf16 rounds
    where the torch ops do, so the values are the same; float32 may fuse a multiply-add."""
    from engine.layers.rotary import ApplyRotary, RotaryEmbedding

    g = torch.Generator().manual_seed(rows)
    heads, kv_heads, d = 6, 2, 32
    qkv = torch.randn(rows, heads + 2 * kv_heads, d, generator=g).to(dtype)
    _require(qkv.view(rows, -1))
    rotary = RotaryEmbedding(d, max_position=4096, base=10000.0)
    positions = torch.randint(0, 4096, (rows,), generator=g)
    cos, sin = rotary.lookup(positions, dtype)
    qk = qkv[:, : heads + kv_heads]  # not contiguous: rows are (heads + 2 kv_heads) * d apart
    got = cpu_fused.rope(qk, cos, sin)
    assert got is not None and got.is_contiguous()
    exact = {"rtol": 0, "atol": 0} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(got, RotaryEmbedding.apply_torch(qk, cos, sin), **exact)
    torch.testing.assert_close(_on_cpu(ApplyRotary())(qk, cos, sin), got, rtol=0, atol=0)
    assert cpu_fused.rope(qk.transpose(0, 1), cos, sin) is None  # heads not D apart: torch
