"""The AMX-bf16 GEMM (engine.kernels.cpu.amx_bf16) against F.linear in float32 on the same bf16
values, for each weight source: bf16 rows, 4-bit w4 tiles, GGUF rows. Then the layers that take
it above their dot kernels' rows (unquantized bf16, cpu_gguf's large batches) and a tiny
Llama's greedy tokens with it on against the torch path.

Tolerances: x and W are bf16 (or decoded to bf16) and the products are summed in float32, in
another order than torch's: a float32 output is within 1e-5 of sum |x| |w| of the reference,
a bf16 one within one bf16 rounding (2^-8 relative) more. Decoded weights (w4, GGUF) are
rounded to bf16 once more than the float reference: 2^-8 of sum |x| |w|.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu import amx_bf16 as cpu_amx
from engine.kernels.cpu import fused_ops as cpu_fused
from engine.kernels.cpu import gguf as cpu_gguf
from engine.kernels.cpu import isa as cpu_isa
from engine.kernels.cpu import w4 as cpu_w4
from tests.engine.kernels.kquant_blocks import TYPES as OWN_ENCODER
from tests.engine.kernels.kquant_blocks import quantize as quantize_k

pytestmark = pytest.mark.skipif(
    not cpu_amx.available(),
    reason="needs AMX-bf16 (Intel Sapphire Rapids or later; the kernels built; TESSERA_AMX "
    "not 0): elsewhere cpu_amx answers None and the layers keep their other paths",
)

ROWS = (1, 5, 16, 17, 33)  # one tile, a partial one, exactly one, one more, past two


def _close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b, rel: float) -> None:
    """y (bf16 or float32) against F.linear in float32 on x, w (float), b."""
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    mag = x.float().abs() @ w.float().abs().T + (0 if b is None else b.float().abs())
    tol = rel * mag + 1e-6
    if y.dtype == torch.bfloat16:
        tol = tol + ref.abs() * 2.0**-8
    err = (y.float() - ref).abs()
    assert y.shape == ref.shape
    assert bool((err <= tol).all()), float((err / tol).max())


@pytest.mark.parametrize("n, k", [(40, 64), (37, 96), (24, 50), (64, 576)])  # N % 16, K % 32
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32])
def test_bf16_rows_match_f_linear(n, k, bias, out):
    torch.manual_seed(0)
    w = torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    for m in ROWS:
        x = torch.randn(m, k).bfloat16()
        y = cpu_amx.linear(x, w, b, out)
        assert y is not None and y.dtype == out
        _close(y, x, w, b, 1e-5)


def test_bf16_batched_and_strided_inputs():
    torch.manual_seed(1)
    w = torch.randn(48, 64).bfloat16()
    x3 = torch.randn(2, 9, 64).bfloat16()
    y = cpu_amx.linear(x3, w)
    assert y.shape == (2, 9, 48)
    _close(y.reshape(18, 48), x3.reshape(18, 64), w, None, 1e-5)
    wide = torch.randn(20, 100).bfloat16()
    view = wide[:, 10:74]  # rows 100 apart
    _close(cpu_amx.linear(view, w), view, w, None, 1e-5)
    assert cpu_amx.linear(torch.randn(0, 64).bfloat16(), w).shape == (0, 48)
    assert cpu_amx.linear(torch.randn(3, 64), w) is None  # float32 x: not this kernel's


@pytest.mark.parametrize("n, k", [(40, 64), (16, 128), (33, 192)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32])
def test_w4_tiles_match_f_linear_on_their_weights(n, k, bias, out):
    torch.manual_seed(2)
    q4 = cpu_w4.quantize_groups(torch.randn(n, k))
    w = cpu_w4.dequantize(q4)
    b = torch.randn(n).bfloat16() if bias else None
    for m in ROWS:
        x = torch.randn(m, k).bfloat16()
        y = cpu_amx.linear_w4(x, q4.data, n, k, b, out)
        assert y is not None and y.dtype == out
        _close(y, x, w, b, 2.0**-8)


def test_w4_tiles_over_several_blocks_of_rows():
    """Rows past one block of x (AMX_W4_BLOCK_BYTES: 64 rows at K = 4,096): each block runs
    over every column pair again, the last block and its last row tile partial."""
    torch.manual_seed(5)
    n, k = 40, 4096
    q4 = cpu_w4.quantize_groups(torch.randn(n, k))
    w = cpu_w4.dequantize(q4)
    b = torch.randn(n).bfloat16()
    for m in (64, 65, 150):
        x = torch.randn(m, k).bfloat16()
        y = cpu_amx.linear_w4(x, q4.data, n, k, b)
        _close(y, x, w, b, 2.0**-8)
        for m0 in range(0, m, 64):  # each block alone gives the same rows
            part = cpu_amx.linear_w4(x[m0 : m0 + 64], q4.data, n, k, b)
            assert torch.equal(y[m0 : m0 + 64], part)


def test_w4_tiles_prefetching_other_bytes_give_the_same_outputs():
    """The GEMM that brings a LoRA step's slots into cache while it computes (decode_plan.c):
    the same outputs as without, whatever the ranges (an empty one, one of odd bytes, more
    lines than the GEMM has steps); it only reads them."""
    from engine.kernels.cpu import ops

    torch.manual_seed(7)
    n, k = 96, 576
    q4 = cpu_w4.quantize_groups(torch.randn(n, k))
    slots = [torch.randn(3 << 20).bfloat16(), torch.empty(0), torch.randn(1001).bfloat16()]
    before = [t.clone() for t in slots]
    pf = ops.PrefetchRanges()
    for i, t in enumerate(slots):
        pf.ptr[i], pf.bytes[i] = t.data_ptr() or None, t.numel() * t.element_size()
    pf.n = len(slots)
    torch.set_num_threads(2)
    for m in (13, 32, 80):
        x = torch.randn(m, k).bfloat16()
        want = cpu_amx.linear_w4(x, q4.data, n, k)
        y = torch.empty(m, n, dtype=torch.bfloat16)
        rc = ops.function("amx_bf16_linear_w4_prefetch")(
            x.data_ptr(), k, m, k, q4.data.data_ptr(), n, None, y.data_ptr(), n, 0,
            ctypes.byref(pf), 2,
        )  # fmt: skip
        assert rc == 0 and torch.equal(y, want)
    assert all(torch.equal(a, b) for a, b in zip(slots, before, strict=True))


@pytest.mark.parametrize("i, k", [(16, 64), (48, 128), (32, 1536)])  # K = 1,536: 160-row blocks
def test_gated_w4_is_gate_up_then_silu_and_mul_bit_for_bit(i, k):
    """gate_up (2 I rows: gate, then up) and SiLU-and-mul in one pass: each gate tile meets
    its up tile in the loop and the epilogue rounds as the two calls do, so the result is
    theirs exactly (the w4 GEMM itself is held to F.linear above); rows past one block too."""
    torch.manual_seed(7)
    q4 = cpu_w4.quantize_groups(torch.randn(2 * i, k) * 0.1)
    for m in (13, 17, 33, 170):
        x = torch.randn(m, k).bfloat16()
        got = cpu_amx.gated_w4(x, q4.data, i, k)
        want = cpu_fused.silu_and_mul(cpu_amx.linear_w4(x, q4.data, 2 * i, k))
        assert got is not None and got.shape == (m, i) and got.dtype == torch.bfloat16
        assert torch.equal(got, want), m
    x3 = torch.randn(2, 9, k).bfloat16()  # leading dims kept
    assert torch.equal(
        cpu_amx.gated_w4(x3, q4.data, i, k)[1], cpu_amx.gated_w4(x3[1], q4.data, i, k)
    )


def test_gated_w4_refuses_halves_that_split_a_tile():
    q4 = cpu_w4.quantize_groups(torch.randn(48, 64))  # I = 24: the up rows start mid-tile
    assert cpu_amx.gated_w4(torch.randn(20, 64).bfloat16(), q4.data, 24, 64) is None


def test_gated_mlp_on_w4_tiles_fuses_above_the_w4_kernel_rows():
    """A GatedMLP whose projections are w4 tiles (a Q4 GGUF's): above the w4 kernel's rows
    and up to AMX's, the MLP takes the fused call, and its output is the layers' one by one;
    at the w4 kernel's rows it declines (the kernel keeps them)."""
    from engine.layers.mlp import GatedMLP
    from engine.layers.quantization.gguf import GGUFW4LinearMethod

    torch.manual_seed(8)
    mlp = GatedMLP(64, 64)
    mlp.act.bind("cpu")  # SiLU-and-mul in C, as in a loaded model: the epilogue's arithmetic
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.w4 = cpu_w4.quantize_groups(torch.randn(*layer.weight.shape) * 0.1)
        layer.weight = torch.nn.Parameter(layer.w4.data, requires_grad=False)
        layer.quant_method = GGUFW4LinearMethod()
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    top, amx_top = cpu_w4.max_rows(), cpu_isa.plan().amx_w4_max_rows
    for rows in (1, top, top + 1, 64, amx_top, amx_top + 1):
        x = torch.randn(rows, 64).bfloat16()
        fused = gate_up.quant_method.apply_gated_mlp(gate_up, down, x)
        assert (fused is not None) == (top < rows <= amx_top), rows
        apart = down(mlp.act(gate_up(x)))
        assert torch.equal(mlp(x), apart if fused is None else fused), rows
        if fused is not None:
            assert torch.equal(fused, apart), rows


def _gguf_blocks(w: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[name]
    if name in OWN_ENCODER:  # gguf-py has no K-quant or IQ4_NL encoder
        raw = quantize_k(w.numpy().astype(np.float32), name)
    else:
        raw = quantize(w.numpy().astype(np.float32), qtype)
    ref = dequantize(raw, qtype).reshape(w.shape)
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(ref.astype(np.float32))


@pytest.mark.parametrize("name", sorted(cpu_gguf.TYPES))
@pytest.mark.parametrize("n, blocks", [(37, 3), (48, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_gguf_rows_match_f_linear_on_their_weights(name, n, blocks, bias):
    torch.manual_seed(3)
    k = blocks * cpu_gguf.block_weights(cpu_gguf.TYPES[name])  # 32, NVFP4 64, K-quants 256
    raw, w = _gguf_blocks(torch.randn(n, k), name)
    b = torch.randn(n).bfloat16() if bias else None
    for m in ROWS:
        x = torch.randn(m, k).bfloat16()
        for out in (torch.bfloat16, torch.float32):
            y = cpu_amx.linear_gguf(x, raw, cpu_gguf.TYPES[name], k, b, out)
            assert y is not None and y.dtype == out
            _close(y, x, w, b, 2.0**-8)


def test_gguf_refuses_a_type_it_cannot_decode():
    raw = torch.zeros(4, 18, dtype=torch.uint8)
    assert cpu_amx.linear_gguf(torch.randn(20, 32).bfloat16(), raw, 99, 32) is None


def test_gguf_large_batches_take_the_tiles():
    """cpu_gguf.linear above its dot rows: bf16 rows on AMX (not the dequantized copy)."""
    torch.manual_seed(4)
    raw, w = _gguf_blocks(torch.randn(40, 96), "Q4_1")
    x = torch.randn(cpu_gguf.dot_max_rows() + 3, 96).bfloat16()
    y = cpu_gguf.linear(x, raw, cpu_gguf.TYPES["Q4_1"], 96)
    assert torch.equal(y, cpu_amx.linear_gguf(x, raw, cpu_gguf.TYPES["Q4_1"], 96))
    _close(y, x, w, None, 2.0**-8)


def test_unquantized_layer_routes_dot_then_tiles(monkeypatch):
    """A bf16 layer: the dot kernel up to the plan's rows, AMX above on the same weight, and
    oneDNN from prefill sizes."""
    from engine.kernels.cpu import gemm as cpu_gemm
    from engine.layers.linear import ReplicatedLinear

    monkeypatch.setenv("TESSERA_CPU_GEMM", "auto")
    layer = ReplicatedLinear(64, 40, bias=True)
    layer.weight.data = torch.randn(40, 64).bfloat16()
    layer.bias.data = torch.randn(40).bfloat16()
    top = cpu_isa.plan().dp_max_rows
    assert cpu_isa.plan().amx
    for rows in (1, top, top + 1, 40, cpu_isa.plan().amx_max_rows + 1):
        x = torch.randn(rows, 64).bfloat16()
        y = layer(x)
        kernel = cpu_gemm.linear if rows <= top else cpu_amx.linear
        if rows > cpu_isa.plan().amx_max_rows:
            kernel = F.linear  # prefill sizes: oneDNN
        want = kernel(x, layer.weight, layer.bias)
        assert torch.equal(y, want), rows
        _close(y, x, layer.weight, layer.bias, 1e-5)
    assert layer.cpu_amx is True


@pytest.mark.parametrize("n", [96, 1000])
def test_argmax_epilogue_is_the_argmax_of_the_bf16_outputs(n):
    """linear_argmax: each row's first maximum over linear()'s bf16 outputs (the LM head's
    logits), never written; ties (equal weight rows; sums rounding to the same bf16) go to
    the lowest column, across the threads' column ranges too."""
    torch.manual_seed(7)
    w = torch.randn(n, 64).bfloat16()
    w[5] = 3 * w[5]  # a row 3x the others' norm ...
    w[n - 3] = w[5]  # ... twice: x = w[5] has its largest logit at columns 5 and n - 3
    w[n // 2 + 1] = w[n // 2]  # equal logits either side of the threads' split too
    for m in (*ROWS, 40):
        x = torch.randn(m, 64).bfloat16()
        x[0] = w[5]
        logits = cpu_amx.linear(x, w).float()
        got = cpu_amx.linear_argmax(x, w)
        assert got is not None and got.dtype == torch.int64
        assert torch.equal(got, logits.argmax(-1)), m
        assert logits[0, 5] == logits[0, n - 3] and got[0] == 5


def test_lm_head_greedy_on_tiles_is_its_logits_argmax(monkeypatch):
    """The greedy hook of a bf16 LM head: AMX's argmax epilogue exactly where forward runs on
    AMX tiles (its float32 sums), None on the dot kernel's rows."""
    from engine.layers.embedding import ParallelLMHead

    monkeypatch.setenv("TESSERA_CPU_GEMM", "auto")
    torch.manual_seed(8)
    head = ParallelLMHead(300, 64).to(torch.bfloat16)
    head.weight.data.normal_(0, 0.5)
    top = cpu_isa.plan().dp_max_rows
    for rows in (1, top, top + 1, 40, cpu_isa.plan().amx_max_rows + 1):
        x = torch.randn(rows, 64).bfloat16()
        greedy = head.greedy(x)
        if top < rows <= cpu_isa.plan().amx_max_rows:
            assert torch.equal(greedy, head(x).argmax(-1)), rows
        else:
            assert greedy is None, rows


def test_amx_off_keeps_the_other_paths(monkeypatch):
    """Where AMX does not run (here: forced off) every function answers None."""
    monkeypatch.setattr(cpu_amx, "_on", [False])
    x = torch.randn(20, 64).bfloat16()
    assert cpu_amx.linear(x, torch.randn(8, 64).bfloat16()) is None
    q4 = cpu_w4.quantize_groups(torch.randn(16, 64))
    assert cpu_amx.linear_w4(x, q4.data, 16, 64) is None
    assert cpu_amx.gated_w4(x, q4.data, 8, 64) is None


def _greedy_bf16(model_dir, prompts) -> list[list[int]]:
    from engine import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="bfloat16", seed=0)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def test_tiny_llama_greedy_tokens_unchanged(tiny_llama_dir, monkeypatch):
    """bf16 tiny Llama: greedy tokens with AMX on (prefill and multi-row decode) equal the
    torch path's (TESSERA_CPU_GEMM=0: every linear layer on F.linear)."""
    from engine.models.loader import load_hf_config

    g = torch.Generator().manual_seed(5)
    vocab = load_hf_config(tiny_llama_dir).vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 17, 33, 48)]
    monkeypatch.setenv("TESSERA_CPU_GEMM", "0")
    expected = _greedy_bf16(tiny_llama_dir, prompts)
    monkeypatch.setenv("TESSERA_CPU_GEMM", "auto")
    calls = []
    real = cpu_amx.linear
    monkeypatch.setattr(cpu_amx, "linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    assert _greedy_bf16(tiny_llama_dir, prompts) == expected
    assert len(calls) > 50, "the layers did not run on AMX"
