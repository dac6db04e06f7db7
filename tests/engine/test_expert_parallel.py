"""--enable-expert-parallel (engine.layers.moe): each of two tensor-parallel ranks holds whole
experts (4 of 8) instead of half of every expert. Greedy tokens equal HF's for Mixtral,
Qwen3-MoE (a dense layer among the MoE ones) and gpt-oss (expert biases added where the expert
lives); the routing split: pairs of the other rank's experts weigh nothing and are skipped."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.args import EngineArgs
from engine.layers.moe import FusedMoE, experts_cpu
from tests.engine.test_llm_exactness import hf_greedy, make_prompts

NUM_NEW = 10


def test_local_pairs_and_skipped_experts():
    """A rank's view of the routing: its experts renumbered from 0, the rest one id past its
    last expert with weight 0; experts_cpu runs only its own and gives the sum of their
    weighted outputs (what the all-reduce then adds up over the ranks)."""
    gen = torch.Generator().manual_seed(0)
    layer = FusedMoE(8, 2, 16, 12, renormalize=True)
    layer.first_expert, layer.num_local_experts = 4, 4  # rank 1 of 2, as built under EP
    ids = torch.tensor([[0, 5], [7, 4], [1, 2]])
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    w, local = layer.local_pairs(weights, ids)
    assert local.tolist() == [[4, 1], [3, 0], [4, 4]]
    assert torch.equal(w, torch.tensor([[0.0, 0.4], [0.7, 0.3], [0.0, 0.0]]))
    x = torch.randn(3, 16, generator=gen)
    w13 = torch.randn(8, 24, 16, generator=gen)
    w2 = torch.randn(8, 16, 12, generator=gen)
    mine = experts_cpu(x, w13[4:], w2[4:], w, local)
    full = experts_cpu(x, w13, w2, weights, ids)
    other = experts_cpu(x, w13[:4], w2[:4], *layer_view(weights, ids, first=0))
    torch.testing.assert_close(mine + other, full)
    assert mine[2].abs().max() == 0  # no expert of this rank: nothing


def layer_view(weights, ids, first):
    local = ids - first
    ok = (local >= 0) & (local < 4)
    return weights * ok, torch.where(ok, local, 4)


def test_flag():
    assert (
        EngineArgs(enable_expert_parallel=True)
        .create_engine_config()
        .parallel.enable_expert_parallel
    )
    assert not EngineArgs().create_engine_config().parallel.enable_expert_parallel


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["tiny_mixtral_dir", "tiny_qwen3_moe_dir", "tiny_gpt_oss_dir"])
def test_tp2_expert_parallel_matches_hf(request, fixture):
    model_dir = request.getfixturevalue(fixture)
    from engine.models.loader import load_hf_config

    prompts = make_prompts(load_hf_config(model_dir).vocab_size)[:4]
    expected = hf_greedy(model_dir, prompts, NUM_NEW, attn_implementation="eager")
    torch.set_num_threads(1)
    llm = LLM(
        str(model_dir),
        dtype="float32",
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        num_kv_blocks=64,
    )
    try:  # rank 0 (in this process) holds experts 0-3 whole
        experts = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, FusedMoE)]
        assert experts and all(
            m.num_local_experts == 4 and m.first_expert == 0 and m.w13_weight.shape[0] == 4
            for m in experts
        )
        params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
