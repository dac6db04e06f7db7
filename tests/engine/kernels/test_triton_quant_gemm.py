"""The W4A16 / W8A16 Triton GEMM (engine/kernels/triton/quant_gemm.py) against a torch
reference written here: the canonical GPTQ-style layout (qweight int32 packed along K, the
lowest bits the lowest k; scales and unpacked zeros [K / group, N]; g_idx for act-order).

Without a GPU the kernel runs under Triton's interpreter on CPU tensors (tests/engine/
conftest.py), where bf16 takes fp32 dots and the output cast truncates; on a GPU the same
tests run it compiled, and the `cuda` tests add the Llama-3-8B shapes and the planned split-K.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels.triton import quant_gemm as qg  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
# worst max|y - ref| / max|ref|: the reference rounds W to x's dtype, the interpreter's bf16
# path does not (fp32 dot), and the output is rounded (truncated under the interpreter)
REL_TOL = {torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def _ref_unpack(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [K / P, N] -> [K, N], one k at a time: the layout as the format states it."""
    pack = 32 // bits
    k = qweight.shape[0] * pack
    words = qweight.to(torch.int64) & 0xFFFFFFFF  # the unsigned word
    rows = [(words[i // pack] >> ((i % pack) * bits)) & ((1 << bits) - 1) for i in range(k)]
    return torch.stack(rows).to(torch.int32)


def _ref_pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    pack = 32 // bits
    words = torch.zeros(q.shape[0] // pack, q.shape[1], dtype=torch.int64)
    for i in range(q.shape[0]):
        words[i // pack] |= q[i].to(torch.int64) << ((i % pack) * bits)
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)


def _ref_dequant(qweight, scales, zeros, g_idx, bits, group_size):
    k = qweight.shape[0] * (32 // bits)
    group_size = k if group_size <= 0 else group_size
    g = torch.arange(k) // group_size if g_idx is None else g_idx.long()
    q = _ref_unpack(qweight, bits)
    z = (1 << (bits - 1)) if zeros is None else zeros[g]
    return (q - z).double() * scales[g].double()


def _make(k, n, bits, group_size, sym, act_order, dtype, seed=0):
    """Random integers, scales and zeros (as CPU tensors) in the canonical layout."""
    g = torch.Generator().manual_seed(seed)
    groups = 1 if group_size <= 0 else k // group_size
    q = torch.randint(0, 1 << bits, (k, n), generator=g, dtype=torch.int32)
    scales = ((torch.rand(groups, n, generator=g) + 0.5) / (1 << bits)).to(dtype)
    zeros = (
        None if sym else torch.randint(0, 1 << bits, (groups, n), generator=g, dtype=torch.int32)
    )
    g_idx = None
    if act_order:
        plain = torch.arange(k, dtype=torch.int32) // (k if group_size <= 0 else group_size)
        g_idx = plain[torch.randperm(k, generator=g)].contiguous()
    return _ref_pack(q, bits), scales, zeros, g_idx


def _dev(*ts):
    return [None if t is None else t.to(DEVICE) for t in ts]


def _check_close(y, x, qweight, scales, zeros, g_idx, bits, group_size):
    w = _ref_dequant(qweight.cpu(), scales.cpu(), None if zeros is None else zeros.cpu(),
                     None if g_idx is None else g_idx.cpu(), bits, group_size)  # fmt: skip
    ref = x.cpu().double() @ w.to(x.dtype).double()
    assert y.dtype == x.dtype and y.shape == ref.shape
    err = (y.cpu().double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= REL_TOL[x.dtype] * scale, f"max err {err:.3g} against max |ref| {scale:.3g}"


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack_and_dequantize_match_the_format(bits):
    qweight, scales, zeros, g_idx = _make(64, 24, bits, 16, False, True, torch.float16)
    q = _ref_unpack(qweight, bits)
    assert torch.equal(qg.unpack_int(qweight, bits), q)
    assert torch.equal(qg.pack_int(q, bits), qweight)
    want = _ref_dequant(qweight, scales, zeros, g_idx, bits, 16)
    got = qg.dequantize_reference(qweight, scales, zeros, g_idx, bits, 16)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    "k,n,group_size",
    [(256, 72, 32), (192, 100, 64), (384, 40, 128), (200, 56, -1), (96, 24, 32)],
)
@pytest.mark.parametrize("unpack", ["reshape", "gather"])
def test_grouped_gemm_matches_the_reference(k, n, group_size, bits, sym, dtype, unpack):
    """Decode rows (1, 5: one 16-row tile) and prefill rows (70: two 64-row tiles), with N and
    K off the tile sizes, each K tile in one group (or, for 200 / -1, one group in all); the
    packed words unpacked either way."""
    qweight, scales, zeros, _ = _dev(*_make(k, n, bits, group_size, sym, False, dtype, seed=k))
    for m in (1, 5, 70):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEVICE)
        y = qg.w_int_gemm(x, qweight, scales, zeros, None, bits, group_size, unpack=unpack)
        _check_close(y, x, qweight, scales, zeros, None, bits, group_size)


@pytest.mark.parametrize("split_k", [2, 3])
@pytest.mark.parametrize("bits", [4, 8])
def test_split_k_sums_its_partials(bits, split_k):
    """K split across programs, the last split short (7 tiles in 3 splits) or past K."""
    k, n, group_size = 448, 40, 64
    qweight, scales, zeros, _ = _dev(*_make(k, n, bits, group_size, False, False, torch.float16))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1)).half().to(DEVICE)
    y = qg.w_int_gemm(x, qweight, scales, zeros, None, bits, group_size, split_k=split_k)
    _check_close(y, x, qweight, scales, zeros, None, bits, group_size)


def test_small_groups_gather_a_scale_row_per_k():
    """group 16 under BLOCK_K 64: the per-k scale gather without g_idx."""
    k, n, group_size = 128, 32, 16
    qweight, scales, zeros, _ = _dev(*_make(k, n, 4, group_size, False, False, torch.float16))
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(2)).half().to(DEVICE)
    launch = qg.GemmLaunch(16, 32, 64, 1, 4, 2)
    y = qg.w_int_gemm(x, qweight, scales, zeros, None, 4, group_size, launch=launch)
    _check_close(y, x, qweight, scales, zeros, None, 4, group_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 128])
def test_act_order_raw_and_repacked(group_size, bits, sym, dtype):
    """g_idx (a shuffled k // group) taken as it is (a scale row gathered per k), and after
    repack_for_kernel (rows sorted by group, g_idx dropped, x read through perm)."""
    k, n = 256, 48
    qweight, scales, zeros, g_idx = _dev(*_make(k, n, bits, group_size, sym, True, dtype, seed=7))
    repacked = qg.repack_for_kernel(qweight, scales, zeros, g_idx, bits, group_size)
    assert repacked.g_idx is None and repacked.perm is not None
    # the repacked weight is the same matrix with its rows permuted
    want = _ref_dequant(qweight.cpu(), scales.cpu(), None if zeros is None else zeros.cpu(),
                        g_idx.cpu(), bits, group_size)  # fmt: skip
    got = _ref_dequant(repacked.qweight.cpu(), scales.cpu(),
                       None if zeros is None else zeros.cpu(), None, bits, group_size)  # fmt: skip
    assert torch.equal(got, want[repacked.perm.cpu().long()])
    for m in (1, 33):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEVICE)
        y = qg.w_int_gemm(x, qweight, scales, zeros, g_idx, bits, group_size, unpack="gather")
        _check_close(y, x, qweight, scales, zeros, g_idx, bits, group_size)
        y = qg.w_int_gemm(x, qweight, scales, zeros, g_idx, bits, group_size, unpack="reshape")
        _check_close(y, x, qweight, scales, zeros, g_idx, bits, group_size)
        y2 = qg.quant_gemm(x, repacked)
        _check_close(y2, x, qweight, scales, zeros, g_idx, bits, group_size)


def test_repack_keeps_an_uneven_g_idx_and_drops_a_plain_one():
    k, n, bits = 128, 16, 4
    qweight, scales, zeros, _ = _make(k, n, bits, 32, False, False, torch.float16)
    plain = torch.arange(k, dtype=torch.int32) // 32
    r = qg.repack_for_kernel(qweight, scales, zeros, plain, bits, 32)
    assert r.g_idx is None and r.perm is None and torch.equal(r.qweight, qweight)
    # groups of unequal sizes (not what GPTQ writes, but the format allows it)
    uneven = torch.tensor([3] * 8 + [0] * 40 + [2] * 48 + [1] * 32, dtype=torch.int32)
    uneven = uneven[torch.randperm(k, generator=torch.Generator().manual_seed(3))]
    r = qg.repack_for_kernel(qweight, scales, zeros, uneven, bits, 32)
    assert r.perm is not None and r.g_idx is not None
    assert torch.equal(r.g_idx, torch.sort(uneven).values)
    x = torch.randn(2, k).half()
    qweight, scales, zeros, uneven = _dev(qweight, scales, zeros, uneven)
    r = qg.repack_for_kernel(qweight, scales, zeros, uneven, bits, 32)
    _check_close(qg.quant_gemm(x.to(DEVICE), r), x, qweight, scales, zeros, uneven, bits, 32)


def test_leading_dims_empty_rows_and_bad_layouts():
    qweight, scales, zeros, _ = _dev(*_make(64, 16, 4, 32, False, False, torch.float16))
    x = torch.randn(2, 3, 64).half().to(DEVICE)
    y = qg.w_int_gemm(x, qweight, scales, zeros, None, 4, 32)
    assert y.shape == (2, 3, 16)
    _check_close(y.reshape(6, 16), x.reshape(6, 64), qweight, scales, zeros, None, 4, 32)
    assert qg.w_int_gemm(x[:0, 0], qweight, scales, zeros, None, 4, 32).shape == (0, 16)
    with pytest.raises(ValueError, match="bits"):
        qg.w_int_gemm(x, qweight, scales, zeros, None, 3, 32)
    with pytest.raises(ValueError, match="scales"):
        qg.w_int_gemm(x, qweight, scales, zeros, None, 4, 16)
    with pytest.raises(ValueError, match="input features"):
        qg.w_int_gemm(x[..., :32], qweight, scales, zeros, None, 4, 32)


def test_plan_splits_decode_but_not_prefill():
    sms = 132
    decode = qg.plan_launch(1, 4096, 4096, 128, False, sms)
    assert decode.block_m == 16 and decode.split_k > 1 and 128 % decode.block_k == 0
    prefill = qg.plan_launch(2048, 4096, 4096, 128, False, sms)
    assert prefill.split_k == 1 and prefill.block_m == 64
    assert qg.plan_launch(1, 64, 64, 32, False, 1).split_k == 1


LLAMA3_8B = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # qkv, o, gate_up, down


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("k,n", LLAMA3_8B)
@pytest.mark.parametrize("m", [1, 16, 64, 300])
def test_compiled_on_llama_shapes(k, n, m):
    """The planned launch (split-K for decode) at full size, group 128 4-bit asym, bf16, and
    act-order through the repack."""
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    qweight = qg.pack_int(q, 4).cuda()
    scales = ((torch.rand(k // 128, n, generator=g) + 0.5) / 16).to(dtype).cuda()
    zeros = torch.randint(0, 16, (k // 128, n), generator=g, dtype=torch.int32).cuda()
    x = torch.randn(m, k, generator=g).to(dtype).cuda()
    w = qg.dequantize_reference(qweight, scales, zeros, None, 4, 128).to(dtype)
    ref = (x.float() @ w.float()).double()
    y = qg.w_int_gemm(x, qweight, scales, zeros, None, 4, 128)
    assert (y.double() - ref).abs().max() <= REL_TOL[dtype] * ref.abs().max()
    g_idx = (torch.arange(k, dtype=torch.int32) // 128)[torch.randperm(k, generator=g)].cuda()
    w = qg.dequantize_reference(qweight, scales, zeros, g_idx, 4, 128).to(dtype)
    ref = (x.float() @ w.float()).double()
    r = qg.repack_for_kernel(qweight, scales, zeros, g_idx, 4, 128)
    y = qg.quant_gemm(x, r)
    assert (y.double() - ref).abs().max() <= REL_TOL[dtype] * ref.abs().max()
