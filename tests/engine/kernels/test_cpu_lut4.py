"""bitsandbytes' 4-bit weights on the CPU kernels (engine.kernels.cpu.lut4): pack against an
independent reading of bnb's byte order, the dequantizer bit for bit against torch's
table[code] * absmax (and bnb's own dequantize_4bit), and every kernel variant this build has
(the faster ones forced down to the slower) against F.linear on the float32 dequantized
weight, on the dot kernel's rows and the dense path's above them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu import gemm as cpu_gemm
from engine.kernels.cpu import lut4

pytestmark = pytest.mark.skipif(not lut4.available(), reason="needs the CPU kernels")

# bnb's quant maps (bitsandbytes.functional.get_4bit_type), written out: no bnb needed
NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]  # fmt: skip
FP4 = [
    0.0, 0.0052083333, 0.6666667, 1.0, 0.3333333, 0.5, 0.1666667, 0.25,
    0.0, -0.0052083333, -0.6666667, -1.0, -0.3333333, -0.5, -0.1666667, -0.25,
]  # fmt: skip
TABLES = {"nf4": torch.tensor(NF4), "fp4": torch.tensor(FP4)}


def _bnb_bytes(codes: torch.Tensor) -> torch.Tensor:
    """Codes [n, k] (0..15) in bnb's byte order, written independently of pack: the flattened
    weight's pairs, the first of each in the high nibble."""
    flat = codes.reshape(-1).tolist()
    return torch.tensor(
        [(flat[i] << 4) | flat[i + 1] for i in range(0, len(flat), 2)], dtype=torch.uint8
    )


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random codes [n, k], absmax per 64 weights (spread over magnitudes), and the packed
    (codes, scales) the kernels take."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    absmax = torch.rand(n * k // 64, generator=g) * torch.logspace(-2, 1, n * k // 64)
    packed, scales = lut4.pack(_bnb_bytes(codes), absmax, n, k)
    return codes, absmax, (packed, scales)


def _reference(codes: torch.Tensor, absmax: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The float32 weight as bnb dequantizes it: table[code] * absmax of its block."""
    n, k = codes.shape
    vals = table[codes.long()].view(n, k // 64, 64)
    return (vals * absmax.view(n, k // 64, 1)).view(n, k)


def test_pack_reads_bnb_byte_order_by_hand():
    # one row of 64 codes: weight i is code i % 16, so bnb's byte i = (2i % 16) << 4 | 2i+1
    codes = (torch.arange(64) % 16).to(torch.uint8).view(1, 64)
    raw = torch.tensor([((2 * i) % 16) << 4 | ((2 * i + 1) % 16) for i in range(32)])
    assert torch.equal(_bnb_bytes(codes), raw.to(torch.uint8))
    packed, scales = lut4.pack(raw.to(torch.uint8), torch.tensor([2.5]), 1, 64)
    assert packed.shape == (1, 32) and scales.shape == (1, 1) and scales.item() == 2.5
    # chunk 0 (weights 0..31), byte j: weight j's code low, weight j + 16's high
    assert packed[0, 0].item() == (0 | 0 << 4)  # weights 0 (code 0) and 16 (code 0)
    assert packed[0, 3].item() == (3 | 3 << 4)
    assert packed[0, 17].item() == (1 | 1 << 4)  # chunk 1, j = 1: weights 33 and 49
    one = torch.zeros(1, 64, dtype=torch.uint8)
    one[0, 40] = 9  # chunk 1, j = 8, the low nibble
    one[0, 57] = 5  # chunk 1, j = 9, the high nibble
    packed, _ = lut4.pack(_bnb_bytes(one), torch.ones(1), 1, 64)
    expect = torch.zeros(1, 32, dtype=torch.uint8)
    expect[0, 24], expect[0, 25] = 9, 5 << 4
    assert torch.equal(packed, expect)


def test_pack_unpacks_both_ways():
    codes, absmax, (packed, scales) = _weight(6, 320, seed=0)
    # the kernel's order read back: chunk c, byte j -> weights 32c + j and 32c + j + 16
    chunks = packed.view(6, 10, 16)
    back = torch.cat([chunks & 15, chunks >> 4], dim=-1).view(6, 320)
    assert torch.equal(back, codes)
    assert torch.equal(scales, absmax.view(6, 5))


@pytest.mark.parametrize("isa", lut4.isa_names())
@pytest.mark.parametrize("table", sorted(TABLES))
def test_dequantize_is_table_times_absmax(isa, table):
    codes, absmax, (packed, scales) = _weight(9, 192, seed=1)
    ref = _reference(codes, absmax, TABLES[table])
    with lut4.forced_isa(isa):
        f32 = lut4.dequantize(packed, scales, TABLES[table], 192, torch.float32)
        bf16 = lut4.dequantize(packed, scales, TABLES[table], 192, torch.bfloat16)
    assert torch.equal(f32, ref)  # bit for bit
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, ref.to(torch.bfloat16))
    out = torch.empty(9, 192)
    assert lut4.dequantize(packed, scales, TABLES[table], 192, torch.float32, out=out) is out


@pytest.mark.parametrize("isa", lut4.isa_names())
def test_dequantize_to_bf16_rounds_ties_to_even(isa):
    """Products exactly halfway between two bf16 values (1 + 2^-8: down to 1; 1 + 3 * 2^-8: up
    to 1 + 2^-6), negatives and a subnormal-free spread: torch's rounding, every variant."""
    table = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), -(1 + 3 * 2**-8)] * 4)
    table[8:] *= torch.tensor([3.0, 0.5, 1e-3, 7e3, 1.1, 2.2, 3.3, 4.4])
    codes, absmax, (packed, scales) = _weight(4, 128, seed=7)
    absmax = torch.tensor([1.0, 2.0, 0.25, 4.0] * 2)
    scales = absmax.view(4, 2).contiguous()
    ref = _reference(codes, absmax, table)
    with lut4.forced_isa(isa):
        got = lut4.dequantize(packed, scales, table, 128, torch.bfloat16)
    assert torch.equal(got, ref.to(torch.bfloat16))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_pack_and_dequantize_match_bitsandbytes(quant_type):
    bnbf = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(2)
    n, k = 24, 256
    w = torch.randn(n, k) * torch.logspace(-2, 0, n)[:, None]
    raw, state = bnbf.quantize_4bit(
        w, blocksize=64, quant_type=quant_type, compress_statistics=False
    )
    ref = bnbf.dequantize_4bit(raw, state).float()
    packed, scales = lut4.pack(raw, state.absmax, n, k)
    got = lut4.dequantize(packed, scales, state.code, k, torch.float32)
    assert torch.equal(got, ref.view(n, k))
    assert torch.allclose(state.code.float(), TABLES[quant_type], atol=1e-7)


def _rows_cases():
    return [1, 3, 4, 5, 8, 16, lut4.DOT_MAX_ROWS + 5]


@pytest.mark.parametrize("isa", lut4.isa_names())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("table", sorted(TABLES))
def test_linear_matches_f_linear_on_the_dequantized_weight(isa, dtype, table, monkeypatch):
    """Every remainder of the 4-row passes, the dot kernel forced up to 16 rows and the dense
    path above; odd N, K of 1, 3 and 16 blocks. Tolerances relative to the magnitudes summed
    (|x| @ |W|^T + |b|): float32 1e-5 (float32 accumulation); bf16 2^-8 more (the output's
    rounding, 2^-9 relative, and on the dense path the weight's, 2^-9 each)."""
    monkeypatch.setattr(lut4, "DOT_MAX_ROWS", 16)
    for n, k in [(1, 64), (7, 192), (33, 1024), (130, 64)]:
        codes, absmax, (packed, scales) = _weight(n, k, seed=n + k)
        w = _reference(codes, absmax, TABLES[table])
        for bias in (None, torch.randn(n)):
            for m in (1, 3, 4, 5, 8, 16, 21):
                x = torch.randn(m, k).to(dtype)
                b = None if bias is None else bias.to(dtype)
                with lut4.forced_isa(isa):
                    y = lut4.linear(x, packed, scales, TABLES[table], k, b)
                assert y.dtype == dtype and y.shape == (m, n)
                ref = F.linear(x.float(), w, None if b is None else b.float())
                scale = F.linear(x.float().abs(), w.abs()) + (0 if b is None else b.float().abs())
                tol = 1e-5 if dtype == torch.float32 else 1e-5 + 2**-8
                err = (y.float() - ref).abs()
                assert (err <= tol * scale + 1e-6).all(), (n, k, m, float(err.max()))


def test_the_dot_kernel_and_the_dense_path_split_at_dot_max_rows(monkeypatch):
    """linear's own DOT_MAX_ROWS, and the dense path dequantizing by slices (64 rows at a time
    over 200, a partial last one) for any leading shape of x."""
    codes, absmax, (packed, scales) = _weight(200, 128, seed=3)
    w = _reference(codes, absmax, TABLES["nf4"])
    bias = torch.randn(200)
    for m in (lut4.DOT_MAX_ROWS, lut4.DOT_MAX_ROWS + 1):
        x = torch.randn(m, 128)
        y = lut4.linear(x, packed, scales, TABLES["nf4"], 128, bias)
        torch.testing.assert_close(y, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(lut4, "DEQUANT_SLICE_BYTES", 64 * 128 * 4)
    x = torch.randn(2, 9, 128)
    y = lut4.linear(x, packed, scales, TABLES["nf4"], 128, bias)
    assert y.shape == (2, 9, 200)
    torch.testing.assert_close(y, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(lut4.tiles_max_rows() == 0, reason="the decoded tiles need AVX512-BF16")
def test_the_decoded_tiles_write_what_the_dense_path_writes():
    """bf16 x of DOT_MAX_ROWS + 1 to tiles_max_rows() rows: each 32 weight rows decoded to bf16
    in cache and the AVX512-BF16 dot kernel on them give the bytes of the whole weight
    dequantized and that kernel on it (the same rounding, the same kernel: cpu_gemm.linear,
    not dense_linear, which on AMX machines hands these rows to oneDNN's tiles, whose sums
    come in another order); 1 and 2 threads."""
    table = TABLES["nf4"]
    for n, k in [(7, 64), (33, 1024), (130, 192)]:
        _, _, (packed, scales) = _weight(n, k, seed=n)
        w = lut4.dequantize(packed, scales, table, k, torch.bfloat16)
        for bias in (None, torch.randn(n).bfloat16()):
            for m in (lut4.DOT_MAX_ROWS + 1, 17, lut4.tiles_max_rows()):
                x = torch.randn(m, k).bfloat16()
                want = cpu_gemm.linear(x, w, bias)
                threads = torch.get_num_threads()
                try:
                    for t in (1, 2):
                        torch.set_num_threads(t)
                        got = lut4._tiles(x, packed, scales, table, k, bias)
                        assert got is not None and torch.equal(got, want), (n, k, m, t)
                finally:
                    torch.set_num_threads(threads)
                assert torch.equal(lut4.linear(x, packed, scales, table, k, bias), want)
    # a forced lower variant declines (the dense path runs)
    with lut4.forced_isa("avx2"):
        assert lut4._tiles(x, packed, scales, table, k, bias) is None


@pytest.mark.parametrize("isa", lut4.isa_names())
def test_one_and_two_threads_agree(isa):
    _, _, (packed, scales) = _weight(130, 1024, seed=4)
    x = torch.randn(5, 1024)
    threads = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            with lut4.forced_isa(isa):
                outs.append(
                    (
                        lut4.linear(x, packed, scales, TABLES["fp4"], 1024),
                        lut4.linear(x.bfloat16(), packed, scales, TABLES["fp4"], 1024),
                        lut4.dequantize(packed, scales, TABLES["fp4"], 1024, torch.bfloat16),
                    )
                )
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(outs[0], outs[1], strict=True):
        assert torch.equal(a, b)


def test_strided_rows_of_x_and_no_rows():
    """x a column slice of a wider tensor: its rows read through the row stride; no rows: an
    empty output."""
    codes, absmax, (packed, scales) = _weight(7, 128, seed=5)
    wide = torch.randn(3, 200)
    x = wide[:, 10:138]
    y = lut4.linear(x, packed, scales, TABLES["nf4"], 128)
    w = _reference(codes, absmax, TABLES["nf4"])
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)
    empty = lut4.linear(torch.randn(2, 0, 128).bfloat16(), packed, scales, TABLES["nf4"], 128)
    assert empty.shape == (2, 0, 7) and empty.dtype == torch.bfloat16


def test_refuses_k_not_a_multiple_of_64():
    raw = torch.zeros(4 * 96 // 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="K=96"):
        lut4.pack(raw, torch.ones(6), 4, 96)
    codes = torch.zeros(4, 48, dtype=torch.uint8)
    scales = torch.ones(4, 1)
    with pytest.raises(ValueError, match="K=96"):
        lut4.linear(torch.randn(1, 96), codes, scales, TABLES["nf4"], 96)
    with pytest.raises(ValueError, match="K=96"):
        lut4.dequantize(codes, scales, TABLES["nf4"], 96, torch.float32)
