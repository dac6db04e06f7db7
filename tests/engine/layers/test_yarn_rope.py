"""Yarn rope (engine.layers.rotary.yarn_parameters): transformers' frequencies and attention
factor, bit for bit, for gpt-oss's config and Qwen-style ones (mscale / mscale_all_dim,
beta_fast, truncate); cos/sin scaled by the attention factor."""

from __future__ import annotations

import pytest
import torch

from engine.layers.rotary import RotaryEmbedding, yarn_parameters
from engine.models.hf_config import parse_hf_config

CASES = [
    ("gpt_oss", {}),  # its default: factor 32, beta 32 / 1, truncate false, original 4096
    ("qwen3", {"factor": 4.0, "original_max_position_embeddings": 32768}),
    (
        "qwen3",
        {
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "beta_fast": 16,
            "truncate": False,
        },
    ),  # fmt: skip
]


@pytest.mark.parametrize("model_type, rope", CASES)
def test_yarn_matches_transformers(model_type, rope):
    from transformers import GptOssConfig, Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if model_type == "gpt_oss":
        hf = GptOssConfig(head_dim=64)
    else:
        params = {"rope_type": "yarn", "rope_theta": 1e6, **rope}
        hf = Qwen3Config(rope_parameters=params, max_position_embeddings=131072)
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    raw = hf.to_dict() | {"architectures": ["X"]}
    cfg = parse_hf_config(raw)
    assert cfg.rope_scaling["rope_type"] == "yarn"
    got, factor = yarn_parameters(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(got, want.float()) and factor == pytest.approx(want_factor, abs=0)
    assert factor > 1.0
    rope_emb = RotaryEmbedding(cfg.head_dim, 64, cfg.rope_theta, cfg.rope_scaling)
    t = torch.arange(64, dtype=torch.float32)
    torch.testing.assert_close(rope_emb.cos_cache, torch.outer(t, want).cos() * want_factor)


def test_yarn_needs_its_original_context():
    raw = {"architectures": ["X"], "model_type": "qwen3", "num_hidden_layers": 1,
           "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4,
           "vocab_size": 32, "rope_scaling": {"type": "yarn", "factor": 2.0}}  # fmt: skip
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        parse_hf_config(raw)
