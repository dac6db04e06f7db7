"""The canonical packed form (engine.layers.quantization.packed) against plain loops."""

from __future__ import annotations

import pytest
import torch

from engine.layers.quantization.packed import (
    PackedWeight,
    dequantize,
    pack_rows,
    unpack_cols,
    unpack_rows,
)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_rows_puts_lowest_k_in_the_lowest_bits(bits):
    g = torch.Generator().manual_seed(0)
    k, n, per = 64, 5, 32 // bits
    codes = torch.randint(0, 1 << bits, (k, n), generator=g)
    packed = pack_rows(codes, bits)
    assert packed.dtype == torch.int32 and packed.shape == (k // per, n)
    for r in range(k // per):
        for c in range(n):
            word = int(packed[r, c]) & 0xFFFFFFFF
            for i in range(per):
                assert (word >> (bits * i)) & ((1 << bits) - 1) == int(codes[r * per + i, c])
    assert torch.equal(unpack_rows(packed, bits), codes.to(torch.int32))


@pytest.mark.parametrize("bits", [2, 3])
def test_narrow_codes_unpack_from_one_bit_stream_per_column(bits):
    """GPTQ's 2- and 3-bit layouts: per column, code k at bit k * bits of one little-endian
    stream over the words (a 3-bit code may straddle two), read here as one Python integer."""
    g = torch.Generator().manual_seed(bits)
    k, n = 64, 3
    codes = torch.randint(0, 1 << bits, (k, n), generator=g)
    words = k * bits // 32
    packed = torch.empty(words, n, dtype=torch.int32)
    for c in range(n):
        stream = sum(int(codes[i, c]) << (bits * i) for i in range(k))
        for w in range(words):
            word = (stream >> (32 * w)) & 0xFFFFFFFF
            packed[w, c] = word - (1 << 32) if word >= 1 << 31 else word
    assert torch.equal(unpack_rows(packed, bits), codes.to(torch.int32))
    assert torch.equal(unpack_cols(packed.t().contiguous(), bits), codes.t().to(torch.int32))
    if bits == 3:
        with pytest.raises(ValueError, match="3 words per 32 rows"):
            unpack_rows(packed[:4], bits)


def test_unpack_cols_follows_the_given_field_order():
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    cols = torch.arange(8)  # column j holds the value j
    word = 0
    for i in range(8):  # field i holds column order[i] (AWQ's packing loop)
        word |= int(cols[order[i]]) << (4 * i)
    packed = torch.tensor([[word - (1 << 32) if word >= 1 << 31 else word]], dtype=torch.int32)
    assert unpack_cols(packed, 4, order).tolist() == [list(range(8))]
    assert unpack_cols(packed, 4).tolist() == [order]


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("sym", [True, False])
def test_dequantize_is_q_minus_zero_times_scale_of_each_rows_group(sym, act_order):
    g = torch.Generator().manual_seed(1)
    k, n, group, bits = 64, 6, 16, 4
    codes = torch.randint(0, 16, (k, n), generator=g)
    scales = torch.rand(k // group, n, generator=g)
    zeros = None if sym else torch.randint(0, 16, (k // group, n), generator=g, dtype=torch.int32)
    g_idx = torch.randperm(k, generator=g).to(torch.int32) // group if act_order else None
    w = PackedWeight(bits, group, pack_rows(codes, bits), scales, zeros, g_idx)
    got = dequantize(w)
    for kk in range(k):
        grp = int(g_idx[kk]) if act_order else kk // group
        for c in range(n):
            z = 8 if sym else int(zeros[grp, c])
            assert got[kk, c] == pytest.approx((int(codes[kk, c]) - z) * float(scales[grp, c]))
    assert w.in_features == k and w.out_features == n
