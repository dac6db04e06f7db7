"""The compiled CPU GEMM (engine.kernels.cpu.gemm) against torch's F.linear, and the whole
engine through it against HF transformers, token for token."""

from __future__ import annotations

import sys

import pytest
import torch

from engine.kernels.cpu import gemm as cpu_gemm
from engine.kernels.cpu import isa as cpu_isa
from engine.layers.quantization.int8 import quantize_rows_int8
from tests.engine.test_llm_exactness import engine_greedy, hf_greedy, make_prompts


def _require(dtype: torch.dtype) -> None:
    if not cpu_gemm.available(dtype):
        pytest.skip("no C compiler for the CPU kernels")


# Shapes: remainders of every tile dimension (4 input rows, 3 or 6 weight rows, 16-row
# groups and 48-row blocks, 8- and 32-wide K vectors), both sides of the row-streaming limit
# (8 rows) and of the widening one (16), a K past the int16 path's 8192-element chunk, a
# decode GEMV, and a prefill-sized GEMM.
SHAPES = [
    (1, 7, 5),
    (5, 13, 19),
    (3, 96, 64),
    (4, 49, 24),
    (8, 50, 100),
    (9, 37, 70),
    (19, 61, 47),
    (2, 40, 9000),
    (1, 5, 8300),
    (1, 2000, 576),
    (67, 300, 136),
]


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
@pytest.mark.parametrize("allow_dp", [True, False])
def test_bfloat16_within_one_rounding_of_float32_math(m, n, k, allow_dp):
    """bf16 in, bf16 out, float32 in between: the result is the float32 product rounded once,
    so it is within one bf16 ulp of the exact product of the bf16 inputs. Both kernels: the
    AVX512-BF16 one (where the CPU has it; tiles of 4 x 6, K in 32s with a masked tail) and
    the widening one."""
    _require(torch.bfloat16)
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double())
    got = cpu_gemm.linear(x, w, b, allow_dp=allow_dp)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    ulp = exact.abs().clamp_min(1e-3) * 2.0**-7  # bf16 keeps 8 significant bits
    assert ((got.double() - exact).abs() <= ulp + 1e-4).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_and_strided_inputs(dtype):
    """[batch, seq, K] inputs, and rows that are a strided view (a slice of a wider tensor)."""
    _require(dtype)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(40, 24, generator=g).to(dtype)
    x3 = torch.randn(2, 5, 24, generator=g).to(dtype)
    tol = {} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-2}
    torch.testing.assert_close(cpu_gemm.linear(x3, w), torch.nn.functional.linear(x3, w), **tol)
    wide = torch.randn(9, 64, generator=g).to(dtype)
    view = wide[:, 8:32]  # row stride 64, unit column stride
    torch.testing.assert_close(cpu_gemm.linear(view, w), torch.nn.functional.linear(view, w), **tol)
    empty = torch.empty(0, 24, dtype=dtype)
    assert cpu_gemm.linear(empty, w).shape == (0, 40)


def test_policy(monkeypatch):
    _require(torch.float32)
    w32, w16 = torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.bfloat16)
    always = sys.maxsize
    monkeypatch.setenv("TESSERA_CPU_GEMM", "1")
    assert cpu_gemm.max_rows_for(w32) == always and cpu_gemm.max_rows_for(w16) == always
    assert cpu_gemm.max_rows_for(torch.zeros(8, 4).t()) == 0  # not contiguous
    monkeypatch.setenv("TESSERA_CPU_GEMM", "0")
    assert cpu_gemm.max_rows_for(w32) == 0 and cpu_gemm.max_rows_for(w16) == 0
    monkeypatch.setenv("TESSERA_CPU_GEMM", "auto")
    assert cpu_gemm.max_rows_for(w32) == 0  # float32 stays with MKL / oneDNN
    # bf16: every batch without native bf16; small batches where the AVX512-BF16 kernel is.
    if not cpu_gemm._native_bf16():
        expected = always
    else:
        expected = cpu_isa.plan().dp_max_rows if cpu_gemm._dp_fn() is not None else 0
    assert cpu_gemm.max_rows_for(w16) == expected
    monkeypatch.setenv("TESSERA_CPU_GEMM", "fast")
    with pytest.raises(ValueError, match="TESSERA_CPU_GEMM"):
        cpu_gemm.max_rows_for(w32)


def test_layer_routes_by_batch_size(monkeypatch):
    """A layer whose kernel covers batches up to N rows sends larger ones to torch."""
    _require(torch.bfloat16)
    from engine.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(24, 40)
    layer.weight.data = torch.randn(40, 24).bfloat16()
    layer.cpu_gemm_max_rows = 4
    calls, real = [], cpu_gemm.linear

    def spy(x, *args, **kwargs):  # records the batch, then runs the real kernel
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(cpu_gemm, "linear", spy)
    for rows in (4, 5):
        x = torch.randn(rows, 24).bfloat16()
        ref = torch.nn.functional.linear(x, layer.weight)
        torch.testing.assert_close(layer(x), ref, rtol=2**-7, atol=1e-2)
    assert calls == [4]


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


# --- int8 weights (engine.layers.quantization) ---


def test_int8_rows_round_trip_within_half_a_step():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(37, 50, generator=g) * torch.rand(37, 1, generator=g) * 4
    w[5] = 0.0  # an all-zero row must not divide by zero
    q, scale = quantize_rows_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (37,)
    assert q.abs().max() == 127 and q[5].abs().max() == 0
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize(
    "dtype, allow_dp",
    [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)],
)
def test_int8_matches_dequantized_f_linear(m, n, k, dtype, allow_dp):
    _require(dtype)
    g = torch.Generator().manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    q, scale = quantize_rows_int8(torch.randn(n, k, generator=g))
    b = torch.randn(n, generator=g).to(dtype)
    want = torch.nn.functional.linear(x.double(), q.double() * scale.double()[:, None], b.double())
    got = cpu_gemm.linear(x, q, b, scale, allow_dp=allow_dp)
    assert got.dtype == dtype and got.shape == (m, n)
    tol = want.abs() * (2.0**-7 if dtype == torch.bfloat16 else 1e-5) + 1e-3
    assert ((got.double() - want).abs() <= tol).all()


def _dequantized_copy(src, dst):
    """The checkpoint with every matrix replaced by its int8 round trip: the weights the
    quantized engine computes with, for HF to run in float32."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for path in dst.glob("*.safetensors"):
        tensors = load_file(path)
        for name, t in tensors.items():
            if t.dim() == 2:
                q, scale = quantize_rows_int8(t)
                tensors[name] = (q.float() * scale[:, None]).to(t.dtype).contiguous()
        save_file(tensors, path, metadata={"format": "pt"})
    return dst


def test_int8_engine_matches_hf_on_the_dequantized_weights(tiny_llama_dir, tmp_path):
    """Quantizing the round-tripped weights gives back the same int8 rows, so the quantized
    engine and HF (float32, dequantized weights) compute the same model: greedy tokens must
    agree token for token."""
    _require(torch.float32)
    from engine.models.loader import load_hf_config

    model_dir = _dequantized_copy(tiny_llama_dir, tmp_path / "deq")
    prompts = make_prompts(load_hf_config(model_dir).vocab_size)
    expected = hf_greedy(model_dir, prompts, 12)
    got, _ = engine_greedy(model_dir, prompts, quantization="int8")
    assert [g[0] for g in got] == expected


def test_int8_layers_hold_int8_weights(tiny_qwen2_dir):
    """Qwen2 (qkv bias, tied LM head): every projection is int8, the tied embedding keeps
    its float rows for the lookup, and generation runs."""
    _require(torch.float32)
    from engine import LLM, SamplingParams
    from engine.layers.linear import LinearBase

    llm = LLM(str(tiny_qwen2_dir), dtype="float32", quantization="int8", num_kv_blocks=64)
    model = llm.engine.executor.runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight.dtype == torch.int8 for m in linears)
    assert model.lm_head.qweight.dtype == torch.int8
    assert model.model.embed_tokens.weight.dtype == torch.float32
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    llm.shutdown()


def test_int8_is_validated():
    from engine.args import EngineArgs

    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(quantization="int4").create_engine_config()
