"""int8 activations (engine.kernels.cpu.w8a8): the C row quantizer against its torch
reference, the whole projection against exact integer arithmetic, and the layers' routing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.kernels.cpu import gemm as cpu_gemm
from engine.kernels.cpu import w8a8 as cpu_w8a8
from engine.layers.quantization.int8 import Int8LinearMethod, quantize_rows_int8
from engine.layers.quantization.quantize import quantize_layer
from engine.layers.quantization.w8a8 import (
    AMX_W8A8_MIN_ROWS,
    W8A8_MIN_ROWS,
    W8A8LinearMethod,
    W8A8LMHeadMethod,
)


@pytest.fixture(autouse=True)
def _require_kernels():
    if cpu_w8a8._load() is None or not cpu_gemm.available(torch.float32, torch.int8):
        pytest.skip("no C compiler for the CPU kernels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_matches_the_torch_reference(dtype):
    torch.manual_seed(0)
    x = (torch.randn(70, 333) * torch.logspace(-3, 2, 70)[:, None]).to(dtype)
    x[5] = 0  # an all-zero row: scale 0, q 0, no division by zero
    x[6, 7] = -1000  # one outlier sets its row's scale
    q, s = cpu_w8a8.quantize_rows(x)
    q_ref, s_ref = cpu_w8a8.quantize_rows_reference(x)
    assert s[5] == 0 and not q[5].any()
    assert q[6, 7] == -127
    # the same IEEE divisions and round-half-to-even: the same bytes, ties included
    assert torch.equal(s, s_ref) and torch.equal(q, q_ref)


@pytest.mark.parametrize("m, n, k", [(9, 13, 19), (40, 96, 64), (67, 300, 136)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_w8a8_is_exact_integer_math_then_the_scales(m, n, k, dtype, bias):
    torch.manual_seed(1)
    x = torch.randn(m, k).to(dtype)
    w, ws = quantize_rows_int8(torch.randn(n, k) * 0.05)
    b = torch.randn(n).to(dtype) if bias else None
    y = cpu_w8a8.linear_w8a8(x, w, b, ws)
    assert y.dtype == dtype and y.shape == (m, n)
    q, s = cpu_w8a8.quantize_rows(x)
    ref = (q.double() @ w.double().T) * s.double()[:, None] * ws.double()
    if b is not None:
        ref = ref + b.double()
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-5  # one rounding to the output type
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    # and it is a fair approximation of the float product
    exact = x.double() @ (w.double() * ws.double()[:, None]).T
    assert (y.double() - (exact if b is None else exact + b.double())).abs().max() < 0.05 * (
        exact.abs().max()
    )


@pytest.mark.parametrize(
    "m, n, k", [(1, 16, 4), (13, 48, 64), (37, 80, 36), (40, 48, 128), (300, 96, 576)]
)
def test_packed_int8_gemm_is_exact(m, n, k, tiles):
    """The GEMM on packed weights gives torch._int_mm's int32 sums exactly, the int8 range's
    ends included, over partial row tiles and column blocks; shapes it cannot pack are
    refused (None), and then int_mm is torch._int_mm."""
    if cpu_w8a8.pack_weight(torch.zeros(16, 4, dtype=torch.int8)) is None:
        pytest.skip("no AVX512-VNNI (or no compiler) for the packed int8 GEMM")
    torch.manual_seed(4)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    x = torch.randint(-128, 128, (m, k), dtype=torch.int8)
    w[0, :], x[0, :] = -128, -128  # the +128 shift's worst case
    packed = cpu_w8a8.pack_weight(w)
    assert packed is not None and packed.numel() == n * k
    y = cpu_w8a8.int_mm(x, w, packed)
    assert y.dtype == torch.int32 and torch.equal(y, (x.long() @ w.long().T).int())
    assert cpu_w8a8.pack_weight(torch.zeros(20, 8, dtype=torch.int8)) is None  # N % 16
    assert cpu_w8a8.pack_weight(torch.zeros(16, 6, dtype=torch.int8)) is None  # K % 4


@pytest.mark.parametrize("m, n, k", [(1, 16, 4), (13, 96, 64), (37, 80, 36), (300, 48, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_gemm_scales_its_sums_as_it_stores_them(m, n, k, dtype, bias, tiles):
    """linear_w8a8 on a packed weight: the GEMM's epilogue writes sums * s * w_scale (+ bias)
    straight to the output dtype: the exact products scaled, rounded once (bf16: once more),
    and within an ulp of the separate int32-then-dequant passes."""
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    packed = cpu_w8a8.pack_weight(w)
    if packed is None:
        pytest.skip("no AVX512-VNNI (or no compiler) for the packed int8 GEMM")
    torch.manual_seed(5)
    x = torch.randn(m, k).to(dtype)
    ws = torch.rand(n) * 0.01
    b = torch.randn(n).to(dtype) if bias else None
    y = cpu_w8a8.linear_w8a8(x, w, b, ws, None, packed)
    assert y.dtype == dtype and y.shape == (m, n)
    q, s = cpu_w8a8.quantize_rows(x)
    ref = (q.double() @ w.double().T) * s.double()[:, None] * ws.double()
    if b is not None:
        ref = ref + b.double()
    tol = 2**-8 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    separate = cpu_w8a8.linear_w8a8(x, w, b, ws)  # no packed copy: int32 sums, then dequant
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-22
    torch.testing.assert_close(y, separate, rtol=ulp, atol=ulp * separate.abs().max().item())


def test_w8a8_layers_carry_the_packed_weight(tiny_llama_dir):
    """quantization="w8a8": every linear layer and the LM head hold the packed copy, and a
    step's output is the one the repacking torch._int_mm gives."""
    from engine import LLM, SamplingParams
    from engine.layers.embedding import ParallelLMHead
    from engine.layers.linear import LinearBase

    llm = LLM(
        str(tiny_llama_dir), quantization="w8a8", num_kv_blocks=64, enable_prefix_caching=False
    )
    model = llm.engine.executor.runner.model
    mods = [m for m in model.modules() if isinstance(m, (LinearBase, ParallelLMHead))]
    if cpu_w8a8.pack_weight(torch.zeros(16, 4, dtype=torch.int8)) is not None:
        assert all(m.packed_int8 is not None for m in mods)
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    prompts = [list(range(3, 3 + n)) for n in (20, 15)]  # prefill rows take int8 activations
    packed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for m in mods:
        m.packed_int8 = None  # torch._int_mm, repacking each call
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    assert packed == plain


def test_w8a8_lm_head_writes_float32_logits_in_its_epilogue():
    """The LM head's int32 sums go to float32 logits in the one epilogue pass: the same
    values as the bf16 epilogue before its rounding, with no bf16 step in between."""
    from engine.layers.embedding import ParallelLMHead

    torch.manual_seed(3)
    head = ParallelLMHead(500, 64)
    head.weight.data.normal_(0, 0.05)
    quantize_layer(head, "w8a8")
    head.packed_int8 = None  # no packed copy: the int32 sums, then the epilogue pass
    h = torch.randn(W8A8_MIN_ROWS + 3, 64).bfloat16()
    logits = head(h)
    assert logits.dtype == torch.float32
    q, s = cpu_w8a8.quantize_rows(h)
    ref = (q.double() @ head.qweight.double().T) * s.double()[:, None] * head.weight_scale.double()
    torch.testing.assert_close(logits.double(), ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())
    bf16 = cpu_w8a8.linear_w8a8(h, head.qweight, None, head.weight_scale)
    assert bf16.dtype == torch.bfloat16 and torch.equal(logits.bfloat16(), bf16)


def test_layers_quantize_activations_only_from_w8a8_min_rows(tiles):
    """w8a8 layers: below w8a8_min_rows rows (13; 8 where the packed GEMM runs on AMX tiles)
    the weight-only kernel (activations untouched), from it int8 activations; int8 layers
    never quantize activations."""
    from engine.layers.linear import ReplicatedLinear

    torch.manual_seed(2)
    layer = ReplicatedLinear(64, 48, bias=True)
    layer.weight.data.normal_(0, 0.05)
    layer.bias.data.normal_()
    quantize_layer(layer, "w8a8")
    w, ws = layer.weight, layer.weight_scale
    w8a8 = layer.quant_method
    first = w8a8.w8a8_min_rows(layer, 64)
    amx = tiles == "amx"
    assert first == (AMX_W8A8_MIN_ROWS if amx else W8A8_MIN_ROWS)
    for rows, quantized in ((1, False), (first - 1, False), (first, True), (64, True)):
        x = torch.randn(rows, 64)
        layer.quant_method = Int8LinearMethod()  # the same int8 rows, weight-only
        assert torch.equal(layer(x), cpu_gemm.linear(x, w, layer.bias, ws))
        layer.quant_method = w8a8
        expected = (
            cpu_w8a8.linear_w8a8(x, w, layer.bias, ws, None, layer.packed_int8)
            if quantized
            else cpu_gemm.linear(x, w, layer.bias, ws)
        )
        assert torch.equal(layer(x), expected), rows


def test_w8a8_engine_generates_and_is_validated(tiny_qwen2_dir):
    from engine import LLM, SamplingParams
    from engine.args import EngineArgs
    from engine.layers.linear import LinearBase

    llm = LLM(str(tiny_qwen2_dir), dtype="float32", quantization="w8a8", num_kv_blocks=64)
    model = llm.engine.executor.runner.model
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert layers and all(
        isinstance(m.quant_method, W8A8LinearMethod) and m.weight.dtype == torch.int8
        for m in layers
    )
    assert isinstance(model.lm_head.quant_method, W8A8LMHeadMethod)
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    prompts = [
        list(range(5, 5 + n)) for n in (3, 20, 33)
    ]  # prefills below and above W8A8_MIN_ROWS rows
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in first] == [6, 6, 6]
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    llm.shutdown()
    with pytest.raises(ValueError, match="w8a8"):
        EngineArgs(quantization="w4a4").create_engine_config()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_mlp_matches_its_torch_reference_and_the_float_mlp(dtype, bias, monkeypatch):
    """mlp_w8a8 (two int8 GEMMs, one C pass for scales + SiLU + product + int8 rows) against
    the same arithmetic in torch (the fallback without the C library), and against the
    unquantized float MLP; a LlamaMLP of w8a8 layers takes it from W8A8_MIN_ROWS rows only."""
    from engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
    from engine.models.llama import LlamaMLP

    torch.manual_seed(3)
    hidden, inter, m = 64, 96, 40
    gate_up = MergedColumnParallelLinear(hidden, [inter, inter], bias=bias)
    down = RowParallelLinear(inter, hidden, bias=bias)
    for layer in (gate_up, down):
        layer.weight.data.normal_(0, 0.1)
        if bias:
            layer.bias.data.normal_(0, 0.5)
    x = torch.randn(m, hidden).to(dtype)
    gu = torch.nn.functional.linear(x.double(), gate_up.weight.double(), _double(gate_up.bias))
    exact = torch.nn.functional.linear(
        torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:],
        down.weight.double(),
        _double(down.bias),
    )
    for layer in (gate_up, down):
        layer.bias = None if not bias else torch.nn.Parameter(layer.bias.to(dtype), False)
        quantize_layer(layer, "w8a8")
        layer.packed_int8 = None  # torch._int_mm and the C pass after it
    y = cpu_w8a8.mlp_w8a8(x, gate_up, down)
    with monkeypatch.context() as patch:
        patch.setattr(cpu_w8a8, "_load", lambda: None)
        ref = cpu_w8a8.mlp_w8a8(x, gate_up, down)
    assert y.dtype == ref.dtype == dtype and y.shape == (m, hidden)
    scale = exact.abs().max().item()
    # the same math up to float rounding (an int8 value may flip at a .5 tie)
    torch.testing.assert_close(y.double(), ref.double(), rtol=0, atol=0.01 * scale)
    assert (y.double() - exact).abs().max() < 0.05 * scale  # int8 weights and activations

    # the fields LlamaMLP reads
    mlp = LlamaMLP(SimpleNamespace(hidden_size=hidden, intermediate_size=inter, mlp_bias=bias))
    mlp.gate_up_proj, mlp.down_proj = gate_up, down
    calls = []
    monkeypatch.setattr(cpu_w8a8, "mlp_w8a8", lambda *a: calls.append(a) or y)
    mlp(x[: gate_up.quant_method.w8a8_min_rows(gate_up, hidden) - 1])
    assert not calls
    assert mlp(x) is y and len(calls) == 1


def _double(t):
    return None if t is None else t.double()


@pytest.mark.parametrize("inter, m", [(96, 40), (112, 13), (48, 300)])
@pytest.mark.parametrize("bias", [None, torch.float32, torch.bfloat16])
def test_silu_pass_inside_the_gemm_equals_the_pass_after_it(inter, m, bias, tiles):
    """gemm_i8_silu_quant (gate and up tiles through L1, h never rounded, a partial |h| max
    per 48-column block) writes the int8 rows down_proj takes as gate_up's int32 sums followed
    by silu_quant do, up to its exp (exp512, within 2e-7 of libm's): scales within a few
    ulps, bytes equal but for a rare flip at a .5 tie; a remainder block narrower than 48
    columns (inter 112) and partial row tiles included."""
    from engine.layers.linear import MergedColumnParallelLinear

    torch.manual_seed(6)
    hidden = 64
    dtype = bias or torch.bfloat16
    gate_up = MergedColumnParallelLinear(hidden, [inter, inter], bias=bias is not None)
    gate_up.weight.data.normal_(0, 0.1)
    if bias is not None:
        gate_up.bias = torch.nn.Parameter(torch.randn(2 * inter).to(bias), False)
    quantize_layer(gate_up, "w8a8")
    if gate_up.packed_int8 is None:
        pytest.skip("no AVX512-VNNI (or no compiler) for the packed int8 GEMM")
    q, s = cpu_w8a8.quantize_rows(torch.randn(m, hidden).to(dtype) * 3)
    fused = cpu_w8a8._silu_quant_fused(q, s, gate_up, dtype)
    assert fused is not None
    hq, hs = cpu_w8a8._silu_quant(q, s, gate_up, dtype)
    flips = (fused[0].int() - hq.int()).abs()
    assert flips.max() <= 1 and flips.sum() <= hq.numel() // 1000
    torch.testing.assert_close(fused[1], hs, rtol=1e-6, atol=0)
    assert hq.abs().max() == 127  # every row uses the int8 range


@pytest.mark.parametrize("m, n, k", [(13, 96, 64), (37, 16, 4), (300, 112, 36), (128, 4096, 64)])
def test_argmax_epilogue_picks_the_token_the_logits_would(m, n, k, tiles):
    """argmax_w8a8 compares the float32 logits linear_w8a8 would write (sums * s * w_scale)
    without writing them: the same token per row, the first of equal maxima winning (three
    identical best columns across column blocks); None where the packed GEMM does not run."""
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    packed = cpu_w8a8.pack_weight(w)
    if packed is None:
        pytest.skip("no AVX512-VNNI (or no compiler) for the packed int8 GEMM")
    torch.manual_seed(7)
    ws = torch.rand(n) * 0.01
    x = torch.randn(m, k).to(torch.bfloat16)
    logits = cpu_w8a8.linear_w8a8(x, w, None, ws, torch.float32, packed)
    assert torch.equal(cpu_w8a8.argmax_w8a8(x, w, ws, packed), logits.argmax(-1))

    best = [5, n // 2 + 1, n - 1]  # tied: same row of weights, same scale, largest logits
    w[best] = 127
    ws[best] = ws.max()
    x = x.abs() + 0.1
    packed = cpu_w8a8.pack_weight(w)
    logits = cpu_w8a8.linear_w8a8(x, w, None, ws, torch.float32, packed)
    assert (logits[:, best] == logits.amax(-1, keepdim=True)).all()
    assert cpu_w8a8.argmax_w8a8(x, w, ws, packed).tolist() == [5] * m
    assert cpu_w8a8.argmax_w8a8(x, w, ws, None) is None
    too_many = torch.randn(cpu_w8a8.PACKED_MAX_ROWS + 1, k).to(torch.bfloat16)
    assert cpu_w8a8.argmax_w8a8(too_many, w, ws, packed) is None


def test_greedy_steps_take_the_argmax_epilogue_and_sample_the_same_tokens(
    tiny_llama_dir, monkeypatch
):
    """A w8a8 step whose rows are all plain greedy gets its tokens from the LM head's argmax
    epilogue (no logits); tokens equal those sampled from the logits. A row asking for
    logprobs (or a temperature) sends the step through the logits and the sampler."""
    from engine import LLM, SamplingParams
    from engine.layers.embedding import ParallelLMHead

    if cpu_w8a8.pack_weight(torch.zeros(16, 4, dtype=torch.int8)) is None:
        pytest.skip("no AVX512-VNNI (or no compiler) for the packed int8 GEMM")
    calls = []
    greedy = ParallelLMHead.greedy
    monkeypatch.setattr(
        ParallelLMHead, "greedy", lambda self, h: calls.append(h.shape[0]) or greedy(self, h)
    )
    prompts = [list(range(5 + i, 12 + 2 * i)) for i in range(16)]
    plain = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0)
    with_lp = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0, logprobs=1)

    llm = LLM(str(tiny_llama_dir), dtype="bfloat16", quantization="w8a8", num_kv_blocks=64)
    fused = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    assert 16 in calls  # the 16-row decode steps took the epilogue
    calls.clear()
    logits = [o.outputs[0].token_ids for o in llm.generate(prompts, with_lp, use_tqdm=False)]
    assert not calls
    llm.shutdown()
    assert fused == logits
