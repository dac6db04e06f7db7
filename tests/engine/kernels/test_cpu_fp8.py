"""FP8 e4m3 weights on the CPU kernels (engine.kernels.cpu.fp8): the dequantizer bit for bit
against torch's own float8_e4m3fn conversion times the scales (all 256 codes, subnormals
included), and every path a call can take (the dot kernel in each variant this build has, the
faster forced down to the slower; the bf16-x dot kernel; AMX or the AVX512-BF16 tiles on rows
decoded in cache; the dequantized slices) against F.linear on the float32 dequantized weight,
with per-row and block scales, odd N and a last partial block of K."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu import amx_bf16 as cpu_amx
from engine.kernels.cpu import fp8, ops

pytestmark = pytest.mark.skipif(not fp8.available(), reason="needs the CPU kernels")

# (N, K, group): one scale a row; blocks of 128 with a last partial block (K = 320); blocks of
# 32; N not a multiple of the kernels' 16 / 32 row tiles; K a multiple of 256, which AMX's
# rows decode in pieces (several pairs of 32 rows a thread)
SHAPES = [(48, 96, None), (33, 320, 128), (100, 512, 64), (17, 64, 32), (150, 256, None)]


def _weight(n: int, k: int, group: int | None, seed: int):
    """Random e4m3 codes over every magnitude (every byte but NaN), scales spread over
    magnitudes, and their float32 dequantized weight (torch's own e4m3 conversion)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN (0x7F / 0xFF): checkpoints hold none
    q = codes.view(torch.float8_e4m3fn)
    cols = 1 if group is None else -(-k // group)
    scales = torch.rand(n, cols, generator=g) * torch.logspace(-3, 0, n * cols).view(n, cols)
    per_col = scales.repeat_interleave(k if group is None else group, dim=1)[:, :k]
    return q, scales, q.float() * per_col


def test_every_code_widens_to_torchs_value():
    """All 256 bytes (NaN aside), subnormals and -0 included, through each variant."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    k = 32 * (-(-codes.numel() // 32))
    row = torch.zeros(1, k, dtype=torch.uint8)
    row[0, : codes.numel()] = codes
    q = row.view(torch.float8_e4m3fn)
    w = fp8.Fp8Weight.prepare(q, torch.ones(1))
    exact_row = ops.function("fp8_dequant_row_bf16")  # scales NULL: the values, unscaled
    for isa in fp8.isa_names():
        with fp8.forced_isa(isa):
            got = w.dequantize(torch.float32)
            bf16 = torch.empty(1, k, dtype=torch.bfloat16)
            assert exact_row(w.codes.data_ptr(), None, k, k, bf16.data_ptr()) == 0
        assert torch.equal(got, q.float()), isa
        assert torch.equal(got.signbit(), q.float().signbit()), isa  # -0 stays -0
        assert torch.equal(bf16.view(torch.int16), q.to(torch.bfloat16).view(torch.int16)), isa


@pytest.mark.parametrize(("n", "k", "group"), SHAPES)
def test_dequantize_is_exact_then_rounded_once(n, k, group):
    q, scales, want = _weight(n, k, group, seed=n)
    w = fp8.Fp8Weight.prepare(q, scales, group)
    for isa in fp8.isa_names():
        with fp8.forced_isa(isa):
            assert torch.equal(w.dequantize(torch.float32), want), isa
            assert torch.equal(w.dequantize(torch.bfloat16), want.to(torch.bfloat16)), isa
            rows = w.dequantize(torch.bfloat16, slice(5, 11))
            assert torch.equal(rows, want[5:11].to(torch.bfloat16)), isa


def _check(y: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what) -> None:
    # float32 x on the dot kernel: float32 sums; bf16: the output's rounding (and on the
    # decoded paths the weight's)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = (y.float() - want).abs().max().item()
    assert err <= tol * want.abs().max().item(), (what, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k", "group"), SHAPES)
def test_dot_kernel_matches_dequantize_then_matmul(n, k, group, dtype, monkeypatch):
    monkeypatch.setattr(fp8, "dot_max_rows", lambda: 64)  # every row count on the dot kernel
    q, scales, w_f32 = _weight(n, k, group, seed=k)
    w = fp8.Fp8Weight.prepare(q, scales, group)
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(n, generator=g)
    for isa in fp8.isa_names():
        with fp8.forced_isa(isa):
            for rows in (1, 2, 3, 4, 5, 9):
                x = torch.randn(rows, k, generator=g).to(dtype)
                want = F.linear(x.float(), w_f32, bias.to(dtype).float())
                _check(fp8.linear(x, w, bias), want, dtype, (isa, rows))


@pytest.mark.parametrize(("n", "k", "group"), SHAPES)
def test_decoded_rows_and_slices_match_dequantize_then_matmul(n, k, group, monkeypatch):
    """Above the dot kernel's rows: AMX on rows decoded in cache where the CPU has it, else the
    AVX512-BF16 tiles (AMX turned off to reach them too), and past those the dequantized
    slices (float32 x always, and bf16 x past the tiles' rows)."""
    q, scales, w_f32 = _weight(n, k, group, seed=7)
    w = fp8.Fp8Weight.prepare(q, scales, group)
    g = torch.Generator().manual_seed(2)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    amx_states = [True, False] if cpu_amx.available() else [False]
    for amx, isa in ((a, i) for a in amx_states for i in fp8.isa_names()):
        monkeypatch.setattr(cpu_amx, "available", lambda amx=amx: amx)
        for rows in (fp8.dot_max_rows() + 1, 16, 33, 70):
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
            want = F.linear(x.float(), w_f32.to(torch.bfloat16).float(), bias.float())
            x32 = x.float()
            with fp8.forced_isa(isa):
                _check(fp8.linear(x, w, bias), want, torch.bfloat16, (amx, isa, rows))
                _check(fp8.linear(x32, w, bias.float()), F.linear(x32, w_f32, bias.float()),
                       torch.float32, (amx, isa, rows, "float32"))  # fmt: skip


def test_the_decoded_paths_take_the_rows_they_claim(monkeypatch):
    """The dispatch: a kernel that declines (-1) would fall back to the slices silently, so
    count which C function each row count reaches."""
    q, scales, _ = _weight(64, 128, None, seed=3)
    w = fp8.Fp8Weight.prepare(q, scales)
    seen: list[str] = []
    real = ops.function

    def spy(name):
        fn = real(name)
        if name.startswith(("fp8_", "amx_bf16_linear_fp8")) and fn is not None:
            return lambda *a: (seen.append(name), fn(*a))[1]
        return fn

    monkeypatch.setattr(ops, "function", spy)
    x = torch.randn(1, 128).to(torch.bfloat16)
    fp8.linear(x, w)
    assert seen == ["fp8_linear"]
    seen.clear()
    fp8.linear(torch.randn(fp8.dot_max_rows() + 1, 128).to(torch.bfloat16), w)
    if cpu_amx.available():
        assert seen == ["amx_bf16_linear_fp8"]
    elif fp8.tiles_max_rows():
        assert seen == ["fp8_linear_bf16_tiles"]
    else:
        assert seen == ["fp8_dequantize"]


def test_shapes_the_kernels_refuse():
    q = torch.zeros(4, 48).to(torch.float8_e4m3fn)
    assert not fp8.fits(4, 48, 48)  # K not a multiple of 32
    assert not fp8.fits(4, 128, 48)  # a block of K not a multiple of 32
    assert fp8.fits(4, 128, 128) and fp8.fits(4, 96, 200)  # one group a row
    with pytest.raises(ValueError, match="a scale per 48 inputs"):
        fp8.Fp8Weight.prepare(q, torch.ones(4))
    with pytest.raises(ValueError, match="2 scales a row for K=128, group 32"):
        fp8.Fp8Weight.prepare(torch.zeros(4, 128).to(torch.float8_e4m3fn), torch.ones(4, 2), 32)
