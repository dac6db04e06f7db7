"""The compiled CPU GEMM (engine.layers.cpu_gemm) against torch's F.linear, and the whole
engine through it against HF transformers, token for token."""

from __future__ import annotations

import pytest
import torch

from engine.layers import cpu_gemm
from tests.engine.test_llm_exactness import engine_greedy, hf_greedy, make_prompts


def _require(dtype: torch.dtype) -> None:
    if not cpu_gemm.available(dtype):
        pytest.skip("no C compiler for the CPU kernels")


# Shapes: remainders of every tile dimension (4 input rows, 3 weight rows, 48-row blocks,
# 8-wide K vectors), a decode GEMV, and a prefill-sized GEMM.
SHAPES = [(1, 7, 5), (5, 13, 19), (3, 96, 64), (4, 49, 24), (1, 2000, 576), (67, 300, 136)]


@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_float32_matches_f_linear(m, n, k, bias):
    _require(torch.float32)
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    torch.testing.assert_close(
        cpu_gemm.linear(x, w, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4
    )


@pytest.mark.parametrize("m, n, k", SHAPES)
def test_bfloat16_within_one_rounding_of_float32_math(m, n, k):
    """bf16 in, bf16 out, float32 in between: the result is the float32 product rounded once,
    so it is within one bf16 ulp of the exact product of the bf16 inputs."""
    _require(torch.bfloat16)
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double())
    got = cpu_gemm.linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    ulp = exact.abs().clamp_min(1e-3) * 2.0**-7  # bf16 keeps 8 significant bits
    assert ((got.double() - exact).abs() <= ulp + 1e-4).all()


def test_batched_and_strided_inputs():
    """[batch, seq, K] inputs, and rows that are a strided view (a slice of a wider tensor)."""
    _require(torch.float32)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(40, 24, generator=g)
    x3 = torch.randn(2, 5, 24, generator=g)
    torch.testing.assert_close(cpu_gemm.linear(x3, w), torch.nn.functional.linear(x3, w))
    wide = torch.randn(9, 64, generator=g)
    view = wide[:, 8:32]  # row stride 64, unit column stride
    torch.testing.assert_close(cpu_gemm.linear(view, w), torch.nn.functional.linear(view, w))
    empty = torch.empty(0, 24)
    assert cpu_gemm.linear(empty, w).shape == (0, 40)


def test_policy(monkeypatch):
    _require(torch.float32)
    w32, w16 = torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.bfloat16)
    monkeypatch.setenv("TESSERA_CPU_GEMM", "1")
    assert cpu_gemm.enabled_for(w32) and cpu_gemm.enabled_for(w16)
    assert not cpu_gemm.enabled_for(torch.zeros(8, 4).t())  # not contiguous
    monkeypatch.setenv("TESSERA_CPU_GEMM", "0")
    assert not cpu_gemm.enabled_for(w32) and not cpu_gemm.enabled_for(w16)
    monkeypatch.setenv("TESSERA_CPU_GEMM", "auto")
    assert not cpu_gemm.enabled_for(w32)  # float32 stays with MKL / oneDNN
    assert cpu_gemm.enabled_for(w16) == (not cpu_gemm._native_bf16())
    monkeypatch.setenv("TESSERA_CPU_GEMM", "fast")
    with pytest.raises(ValueError, match="TESSERA_CPU_GEMM"):
        cpu_gemm.enabled_for(w32)


def test_engine_through_the_kernel_matches_hf(tiny_llama_dir, monkeypatch):
    """Every linear layer and the LM head on the kernel (float32): greedy tokens equal HF's."""
    _require(torch.float32)
    from engine.models.loader import load_hf_config

    monkeypatch.setenv("TESSERA_CPU_GEMM", "1")
    calls = []
    real = cpu_gemm.linear
    monkeypatch.setattr(cpu_gemm, "linear", lambda *a: calls.append(1) or real(*a))
    prompts = make_prompts(load_hf_config(tiny_llama_dir).vocab_size)
    expected = hf_greedy(tiny_llama_dir, prompts, 12)
    got, _ = engine_greedy(tiny_llama_dir, prompts)
    assert [g[0] for g in got] == expected
    assert len(calls) > 100, "the layers did not run on the kernel"
