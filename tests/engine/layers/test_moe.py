"""The MoE layer (engine.layers.moe): routing and the CPU experts path against a naive
per-token reference, with uneven routing and experts that get no token; the checkpoint loader's
per-expert tensors into the stacked weights; the config fields."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers.moe import (
    DOWN,
    GATE,
    UP,
    FusedMoE,
    GemmChoice,
    SparseMoeBlock,
    expert_weight_target,
    experts_cpu,
    select_experts,
)
from engine.models.hf_config import parse_hf_config


def naive_moe(x, w13, w2, topk_weights, topk_ids):
    """Token by token, expert by expert: sum_k w[t, k] * down(silu(gate x) * up x)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            h = w13[e].double() @ x[t].double()
            a = F.silu(h[:inter]) * h[inter:]
            out[t] += float(topk_weights[t, k]) * (w2[e].double() @ a)
    return out


def uneven_ids(tokens: int, experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct experts per token drawn from the first half of the experts with 4x the odds: the
    busy ones get many tokens, some of the rest none."""
    odds = torch.ones(experts)
    odds[: experts // 2] = 4.0
    odds[-1] = 0.0  # the last expert never gets a token
    return torch.stack([torch.multinomial(odds, top_k, generator=gen) for _ in range(tokens)])


@pytest.mark.parametrize("gemms", [False, True], ids=["torch", "layer-gemms"])
@pytest.mark.parametrize("experts, top_k", [(8, 2), (16, 4)])
@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_experts_cpu_matches_per_token_reference(experts, top_k, tokens, gemms):
    gen = torch.Generator().manual_seed(experts * 100 + tokens)
    hidden, inter = 48, 40
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    ids = uneven_ids(tokens, experts, top_k, gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    counts = torch.bincount(ids.reshape(-1), minlength=experts)
    assert counts[-1] == 0
    choices = (GemmChoice(), GemmChoice()) if gemms else None
    got = experts_cpu(x, w13, w2, weights, ids, choices)
    want = naive_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # bf16 weights and activations: within bf16's precision of the float64 reference
    choices = (GemmChoice(), GemmChoice()) if gemms else None
    got16 = experts_cpu(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids, choices)
    torch.testing.assert_close(got16.double(), want, atol=0.05, rtol=0.03)


def naive_gpt_oss_experts(x, gate_up, gate_up_bias, down, down_bias, topk_weights, topk_ids):
    """transformers' GptOssExperts, token by token in float64: gate_up [E, H, 2I] interleaved
    (gate at even columns, up at odd), the clamped SwiGLU, down [E, I, H], biases."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            h = x[t].double() @ gate_up[e].double() + gate_up_bias[e].double()
            gate, up = h[::2].clamp(max=7.0), h[1::2].clamp(-7.0, 7.0)
            a = (up + 1) * gate * torch.sigmoid(gate * 1.702)
            out[t] += float(topk_weights[t, k]) * (a @ down[e].double() + down_bias[e].double())
    return out


@pytest.mark.parametrize("gemms", [False, True], ids=["torch", "layer-gemms"])
def test_experts_with_biases_and_clamped_swiglu_match_gpt_oss(gemms):
    """gpt-oss's experts through the layer: its interleaved gate_up and biases loaded, the
    clamped SwiGLU (inputs large enough that the clamps bite), against transformers' formula."""
    gen = torch.Generator().manual_seed(3)
    experts, top_k, hidden, inter, tokens = 8, 2, 32, 24, 29
    gate_up = torch.randn(experts, hidden, 2 * inter, generator=gen)
    gate_up_bias = torch.randn(experts, 2 * inter, generator=gen)
    down = torch.randn(experts, inter, hidden, generator=gen) * 0.2
    down_bias = torch.randn(experts, hidden, generator=gen)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = uneven_ids(tokens, experts, top_k, gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    want = naive_gpt_oss_experts(x, gate_up, gate_up_bias, down, down_bias, weights, ids)
    w13 = torch.cat((gate_up[..., ::2], gate_up[..., 1::2]), -1).transpose(1, 2)  # [E, 2I, H]
    b13 = torch.cat((gate_up_bias[:, ::2], gate_up_bias[:, 1::2]), -1)
    h = torch.einsum("th,ekh->tek", x, w13) + b13
    assert (h[..., :inter] > 7).any() and (h[..., inter:].abs() > 7).any()  # clamps bite
    layer = FusedMoE(experts, top_k, hidden, inter, True, bias=True, activation="swigluoai")
    layer.w13_weight.data.copy_(w13)
    layer.w13_bias.data.copy_(b13)
    layer.w2_weight.data.copy_(down.transpose(1, 2))
    layer.w2_bias.data.copy_(down_bias)
    choices = (GemmChoice(), GemmChoice()) if gemms else None
    biases = (layer.w13_bias, layer.w2_bias)
    got = experts_cpu(
        x, layer.w13_weight, layer.w2_weight, weights, ids, choices, None, biases, layer._act
    )
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="activation 'gelu'"):
        FusedMoE(experts, top_k, hidden, inter, True, activation="gelu")


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_select_experts(scoring, renormalize):
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5], [3.0, 0.0, 0.2, -2.0]])
    weights, ids = select_experts(logits, 2, renormalize, scoring)
    assert ids.tolist() == [[1, 3], [0, 2]]
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    want = scores.gather(1, ids)
    if renormalize:
        want = want / want.sum(-1, keepdim=True)
    torch.testing.assert_close(weights, want)
    with pytest.raises(ValueError, match="scoring"):
        select_experts(logits, 2, renormalize, "relu")


def test_sparse_block_with_shared_expert():
    """Router -> experts, plus a shared expert scaled by sigmoid(its gate): the block's output
    is the reference's, Qwen2-MoE's formula."""
    torch.manual_seed(0)
    hidden, inter, experts, top_k = 32, 16, 8, 2
    block = SparseMoeBlock(hidden, experts, top_k, inter, renormalize=False,
                           shared_intermediate_size=24, shared_expert_gate=True)  # fmt: skip
    for p in block.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(9, hidden)
    logits = x @ block.gate.weight.T
    w, ids = select_experts(logits, top_k, False)
    want = naive_moe(x, block.experts.w13_weight, block.experts.w2_weight, w, ids).float()
    gu = x @ block.shared_expert.gate_up_proj.weight.T
    shared = (F.silu(gu[:, :24]) * gu[:, 24:]) @ block.shared_expert.down_proj.weight.T
    want = want + torch.sigmoid(x @ block.shared_expert_gate.weight.T) * shared
    torch.testing.assert_close(block(x), want, atol=1e-5, rtol=1e-5)


def test_weight_loader_stacks_experts():
    moe = FusedMoE(4, 2, hidden_size=6, intermediate_size=5, renormalize=True)
    gate, up, down = torch.randn(5, 6), torch.randn(5, 6), torch.randn(6, 5)
    moe.weight_loader(moe.w13_weight, gate, (2, GATE))
    moe.weight_loader(moe.w13_weight, up, (2, UP))
    moe.weight_loader(moe.w2_weight, down, (2, DOWN))
    assert torch.equal(moe.w13_weight[2], torch.cat([gate, up]))
    assert torch.equal(moe.w2_weight[2], down)
    assert moe.w13_weight.expected_shards == {(e, s) for e in range(4) for s in (GATE, UP)}
    with pytest.raises(ValueError, match="shape mismatch"):
        moe.weight_loader(moe.w2_weight, torch.randn(7, 5), (0, DOWN))


def test_expert_weight_target():
    qwen = {"gate_proj": GATE, "up_proj": UP, "down_proj": DOWN}
    assert expert_weight_target("model.layers.3.mlp.experts.12.up_proj.weight", qwen) == (
        "model.layers.3.mlp.experts.w13_weight",
        (12, UP),
    )
    assert expert_weight_target("model.layers.3.mlp.experts.0.down_proj.weight", qwen) == (
        "model.layers.3.mlp.experts.w2_weight",
        (0, DOWN),
    )
    assert expert_weight_target("model.layers.3.mlp.shared_expert.gate_proj.weight", qwen) is None
    assert expert_weight_target("model.layers.3.mlp.gate.weight", qwen) is None


def _raw(**kw):
    base = dict(
        num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        vocab_size=100,
    )  # fmt: skip
    return {**base, **kw}


def test_config_fields():
    mixtral = parse_hf_config(
        _raw(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            num_local_experts=8,
            num_experts_per_tok=2,
        )  # fmt: skip
    )
    assert (mixtral.num_experts, mixtral.num_experts_per_tok) == (8, 2)
    assert mixtral.moe_intermediate_size == 128 and mixtral.norm_topk_prob
    assert all(mixtral.is_moe_layer(i) for i in range(4))
    qwen3 = parse_hf_config(
        _raw(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            decoder_sparse_step=1,
        )  # fmt: skip
    )
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.norm_topk_prob
    assert [qwen3.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    qwen2 = parse_hf_config(
        _raw(
            architectures=["Qwen2MoeForCausalLM"],
            model_type="qwen2_moe",
            num_experts=60,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=256,
            decoder_sparse_step=2,
        )  # fmt: skip
    )
    assert qwen2.attention_bias and not qwen2.o_proj_bias and not qwen2.norm_topk_prob
    assert qwen2.shared_expert_intermediate_size == 256
    assert [qwen2.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    dense = parse_hf_config(_raw(architectures=["LlamaForCausalLM"], model_type="llama"))
    assert dense.num_experts == 0 and not dense.is_moe_layer(0)
