"""The fused Triton MoE (engine/kernels/triton/fused_moe.py) against the torch reference: the
alignment's blocks, and the experts' output for 8 experts / top-2 and 16 / top-4 with uneven
routing (some experts get many pairs, one gets none).

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
