"""The fused Triton MoE (engine/kernels/triton/fused_moe.py) against the torch reference: the
alignment's blocks, and the experts' output for 8 experts / top-2 and 16 / top-4 with uneven
routing (some experts get many pairs, one gets none); MXFP4 experts (gpt-oss) on the quantized
variant against the same bytes dequantized, and every code and E8M0 scale decoded exactly.

Without a GPU it runs under Triton's interpreter on CPU tensors (tests/engine/conftest.py),
whose fp32 -> bf16 cast truncates (a bf16 step of tolerance). On a GPU the `cuda` tests run it
compiled, through the layer, and check a MoE model's greedy tokens against the CPU path's.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels.triton import fused_moe  # noqa: E402
from engine.layers.moe import experts_cpu  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
}


def _uneven_ids(tokens: int, experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    odds = torch.ones(experts)
    odds[: experts // 2] = 4.0
    odds[-1] = 0.0  # never routed to
    return torch.stack([torch.multinomial(odds, top_k, generator=gen) for _ in range(tokens)])


@pytest.mark.parametrize("block_m", [16, 32])
def test_align_block_size(block_m):
    gen = torch.Generator().manual_seed(block_m)
    ids = _uneven_ids(23, 8, 2, gen)
    sorted_ids, expert_ids, num_post = fused_moe.moe_align_block_size(ids, block_m, 8)
    flat = ids.reshape(-1)
    n = flat.numel()
    total = int(num_post)
    assert total % block_m == 0 and sorted_ids.numel() >= total
    assert (sorted_ids[total:] == n).all()
    seen = []
    for b in range(total // block_m):
        rows = sorted_ids[b * block_m : (b + 1) * block_m]
        real = rows[rows < n]
        assert len(real) > 0, "a block of padding only"
        assert (flat[real] == expert_ids[b]).all(), "a block mixes experts"
        seen += real.tolist()
    assert sorted(seen) == list(range(n))  # every pair once
    assert expert_ids[: total // block_m].tolist() == sorted(expert_ids[: total // block_m])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts, top_k", [(8, 2), (16, 4)])
@pytest.mark.parametrize("tokens, hidden, inter", [(1, 64, 32), (19, 48, 40), (70, 64, 96)])
def test_fused_experts_match_torch(dtype, experts, top_k, tokens, hidden, inter):
    gen = torch.Generator().manual_seed(experts + tokens)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.15
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.15
    ids = _uneven_ids(tokens, experts, top_k, gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    want = experts_cpu(x.double(), w13.double(), w2.double(), weights.double(), ids)
    args = [t.to(dtype).to(DEVICE) for t in (x, w13, w2)]
    got = fused_moe.fused_experts(*args, weights.to(DEVICE), ids.to(DEVICE))
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    torch.testing.assert_close(got.cpu().double(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 37])
def test_fused_experts_with_biases_and_clamped_swiglu(dtype, tokens):
    """gpt-oss's experts: biases in both epilogues, the clamped SwiGLU (large enough inputs
    that the clamps bite), against the CPU path (itself checked against transformers')."""
    from engine.layers.activation import SwigluOAIAndMul

    gen = torch.Generator().manual_seed(tokens)
    experts, top_k, hidden, inter = 8, 4, 64, 32
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.15
    b13 = torch.randn(experts, 2 * inter, generator=gen) * 3
    b2 = torch.randn(experts, hidden, generator=gen)
    ids = _uneven_ids(tokens, experts, top_k, gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    act = SwigluOAIAndMul()
    want = experts_cpu(
        x.double(), w13.double(), w2.double(), weights.double(), ids, None, None,
        (b13.double(), b2.double()), act.forward_native,
    )  # fmt: skip
    args = [t.to(dtype).to(DEVICE) for t in (x, w13, w2)]
    biases = (b13.to(dtype).to(DEVICE), b2.to(dtype).to(DEVICE))
    got = fused_moe.fused_experts(
        *args, weights.to(DEVICE), ids.to(DEVICE), biases, activation="swigluoai"
    )
    # bf16: the intermediate (up to ~50 here) is stored in bf16, so the tolerance scales
    tol = TOL[dtype] if dtype == torch.float32 else dict(rtol=0, atol=0.02 * want.abs().max())
    torch.testing.assert_close(got.cpu().double(), want, **tol)
    plain = fused_moe.fused_experts(*args, weights.to(DEVICE), ids.to(DEVICE))
    assert (plain.cpu().double() - want).abs().max() > 0.1  # biases and activation mattered


def test_no_tokens():
    x = torch.empty(0, 32, device=DEVICE)
    w13, w2 = torch.zeros(4, 32, 32, device=DEVICE), torch.zeros(4, 32, 16, device=DEVICE)
    ids = torch.empty(0, 2, dtype=torch.int64, device=DEVICE)
    out = fused_moe.fused_experts(x, w13, w2, torch.empty(0, 2, device=DEVICE), ids)
    assert out.shape == (0, 32)


@pytest.mark.cuda
def test_layer_picks_the_kernel_and_captures_in_a_graph(monkeypatch):
    """On CUDA the MoE layer runs the fused kernel (no host sync: it replays in a CUDA graph)
    and gives the CPU path's output."""
    from engine.layers.moe import SparseMoeBlock

    calls = []
    real = fused_moe.fused_experts
    monkeypatch.setattr(
        fused_moe, "fused_experts", lambda *a: calls.append(a[0].device) or real(*a)
    )

    torch.manual_seed(0)
    block = SparseMoeBlock(64, 16, 4, 32, renormalize=True)
    for p in block.parameters():
        p.data.normal_(0, 0.2)
    x = torch.randn(24, 64)
    want = block(x)
    block = block.cuda()
    static_x = x.cuda()
    torch.testing.assert_close(block(static_x).cpu(), want, **TOL[torch.float32])
    assert calls and calls[-1].type == "cuda", "the layer did not take the fused kernel"
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        block(static_x)  # warm up (compiles the kernels)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        static_out = block(static_x)
    x2 = torch.randn(24, 64)
    static_x.copy_(x2.cuda())
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_out.cpu(), block.cpu()(x2), **TOL[torch.float32])


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_moe_models_on_cuda_keep_the_cpu_tokens(
    tiny_mixtral_dir, tiny_qwen2_moe_dir, tiny_gpt_oss_dir
):
    """The engine on CUDA (the fused kernel, CUDA graphs) gives the CPU path's float32 greedy
    tokens for Mixtral, Qwen2-MoE and gpt-oss (biases, clamped SwiGLU, attention sinks)."""
    from engine import LLM, SamplingParams

    prompts = [list(range(5 + 3 * i, 30 + 5 * i)) for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for model_dir in (tiny_mixtral_dir, tiny_qwen2_moe_dir, tiny_gpt_oss_dir):
        tokens = []
        for device in ("cuda", "cpu"):
            llm = LLM(str(model_dir), dtype="float32", device=device, num_kv_blocks=64)
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens.append([list(o.outputs[0].token_ids) for o in outs])
            llm.shutdown()
        assert tokens[0] == tokens[1]


# -- MXFP4 experts (gpt-oss as OpenAI publishes it): the codes and E8M0 scales read as stored --


def _mxfp4_experts(experts: int, rows: int, k: int, gen: torch.Generator, lo: int = 120):
    """Random MXFP4 bytes: codes uint8 [E, rows, K / 2] (every e2m1 code), scales uint8
    [E, rows, K / 32] (powers of two 2^(lo - 127) .. 2^(lo - 121))."""
    codes = torch.randint(0, 256, (experts, rows, k // 2), dtype=torch.uint8, generator=gen)
    scales = torch.randint(lo, lo + 7, (experts, rows, k // 32), dtype=torch.uint8, generator=gen)
    return codes, scales


def _mxfp4_float(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    from engine.layers.quantization.mxfp4_blocks import dequantize_mxfp4

    e, rows, half = codes.shape
    return dequantize_mxfp4(codes.reshape(e, rows, half // 16, 16), scales, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 37])
def test_mxfp4_experts_match_dequantize_then_matmul(dtype, tokens):
    """gpt-oss's MXFP4 experts on the quantized kernel (codes and E8M0 scales decoded in its
    inner loop), with their biases and the clamped SwiGLU, routed unevenly (one expert gets
    no pair), against the CPU path on the same bytes dequantized (float64)."""
    from engine.layers.activation import SwigluOAIAndMul

    gen = torch.Generator().manual_seed(100 + tokens)
    experts, top_k, hidden, inter = 8, 4, 96, 64
    c13, s13 = _mxfp4_experts(experts, 2 * inter, hidden, gen, lo=122)
    c2, s2 = _mxfp4_experts(experts, hidden, inter, gen)
    x = torch.randn(tokens, hidden, generator=gen)
    b13 = torch.randn(experts, 2 * inter, generator=gen)
    b2 = torch.randn(experts, hidden, generator=gen) * 0.1
    ids = _uneven_ids(tokens, experts, top_k, gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    act = SwigluOAIAndMul()
    w13, w2 = _mxfp4_float(c13, s13), _mxfp4_float(c2, s2)
    want = experts_cpu(
        x.to(dtype).double(), w13, w2, weights.double(), ids, None, None,
        (b13.to(dtype).double(), b2.to(dtype).double()), act.forward_native,
    )  # fmt: skip
    ew = fused_moe.ExpertWeights
    got = fused_moe.fused_experts_quantized(
        x.to(dtype).to(DEVICE),
        ew(c13.to(DEVICE), s13.to(DEVICE), bits=4, group=32, mxfp4=True),
        ew(c2.to(DEVICE), s2.to(DEVICE), bits=4, group=32, mxfp4=True),
        weights.to(DEVICE), ids.to(DEVICE),
        (b13.to(dtype).to(DEVICE), b2.to(dtype).to(DEVICE)), "swigluoai",
    )  # fmt: skip
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    # float32: exact weights, float32 sums (outputs up to ~50 here); 16-bit: x, the
    # intermediate and the output rounded
    scale = want.abs().max()
    tol = dict(rtol=1e-5, atol=(1e-5 if dtype == torch.float32 else 0.02) * scale)
    torch.testing.assert_close(got.cpu().double(), want, **tol)
    assert (got.cpu().double() - want).abs().max() < 0.1 * want.abs().max()


def test_mxfp4_decodes_every_code_and_scale():
    """One expert, one output row per E8M0 byte 0..200 (0: the subnormal 2^-127; from 214 on
    6 * 2^(e - 127) is past float32's range) and the 16 codes twice along K; x one-hot, so each
    output is one decoded weight times 1: every value comes back exactly (float32; a GPU may
    flush the subnormal products of the smallest scales to zero)."""
    k, rows = 32, 201
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)  # values 0..15, 0..15 along K
    packed = (codes[0::2] | (codes[1::2] << 4)).repeat(rows, 1).unsqueeze(0)  # [1, rows, 16]
    scales = torch.arange(rows, dtype=torch.uint8).reshape(1, rows, 1)
    want = _mxfp4_float(packed, scales)[0].float()  # [rows, K]
    got = torch.empty(k, rows)
    eye = torch.eye(k)
    ew = fused_moe.ExpertWeights(packed.to(DEVICE), scales.to(DEVICE), bits=4, group=32,
                                 mxfp4=True)  # fmt: skip
    # the down projection alone: one grouped GEMM of x (rows of the identity) by the weights
    sorted_ids, expert_ids, num_post = fused_moe.moe_align_block_size(
        torch.zeros(k, 1, dtype=torch.int64, device=DEVICE), 16, 1
    )
    out = torch.empty(k, rows, dtype=torch.float32, device=DEVICE)
    fused_moe._launch_quant(eye.to(DEVICE), ew, out, torch.ones(k, device=DEVICE), sorted_ids,
                            expert_ids, num_post, rows, k, 1, False, True, 16)  # fmt: skip
    got = out.cpu().T
    normal = (want == 0) | (want.abs() >= torch.finfo(torch.float32).tiny)
    assert torch.equal(got[normal], want[normal])
    assert ((got[~normal] == want[~normal]) | (got[~normal] == 0)).all()
    if not HAS_CUDA:
        assert torch.equal(got, want)
    assert got[127, 1] == 0.5 and got[127, 15] == -6.0 and got[0, 2] == 2.0**-127
