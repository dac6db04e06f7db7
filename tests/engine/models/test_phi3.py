"""Phi-3 / Phi-4 (Phi3ForCausalLM): LongRoPE against transformers' own functions, the config
(longrope's factor and original context, the older "su" name, partial rotary, sliding windows),
the fused qkv_proj / gate_up_proj checkpoint tensors at load, and tensor parallelism.
Token-exactness against HF is in tests/engine/test_llm_exactness.py (test_phi3_match_hf)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.layers.rotary import RotaryEmbedding, longrope_parameters
from engine.models.hf_config import max_model_len_for, parse_hf_config
from engine.models.loader import load_model

_PHI3 = {
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "rope_theta": 10000.0,
}


def _factors(n: int, seed: int) -> tuple[list[float], list[float]]:
    g = torch.Generator().manual_seed(seed)
    return (1 + torch.rand(n, generator=g)).tolist(), (1 + 20 * torch.rand(n, generator=g)).tolist()


def _hf_phi3_config(partial: float, original: int, max_pos: int, **rope):
    from transformers import Phi3Config

    head_dim = 16
    short, long = _factors(int(head_dim * partial) // 2, seed=3)
    scaling = {"type": "longrope", "short_factor": short, "long_factor": long, **rope}
    hf = Phi3Config(
        **{k: v for k, v in _PHI3.items() if k not in ("architectures", "model_type")},
        max_position_embeddings=max_pos,
        original_max_position_embeddings=original,
        partial_rotary_factor=partial,
        rope_scaling=scaling,
    )
    raw = {
        **_PHI3,
        "max_position_embeddings": max_pos,
        "original_max_position_embeddings": original,
        "partial_rotary_factor": partial,
        "rope_scaling": scaling,
    }
    return hf, parse_hf_config(raw)


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("rope", [{}, {"attention_factor": 1.3}])
def test_longrope_parameters_match_transformers(partial, rope):
    """Both factor sets and the attention factor equal _compute_longrope_parameters' (short:
    no seq_len; long: seq_len past the original context), factor from max / original."""
    from transformers.modeling_rope_utils import _compute_longrope_parameters

    hf_cfg, cfg = _hf_phi3_config(partial, original=64, max_pos=2048, **rope)
    dim = int(cfg.head_dim * cfg.partial_rotary_factor)
    short, long, attention_factor = longrope_parameters(dim, cfg.rope_theta, cfg.rope_scaling)
    hf_short, hf_factor = _compute_longrope_parameters(hf_cfg, "cpu")
    hf_long, _ = _compute_longrope_parameters(hf_cfg, "cpu", seq_len=65)
    assert torch.equal(short, hf_short) and torch.equal(long, hf_long)
    assert attention_factor == hf_factor
    want = rope.get("attention_factor", math.sqrt(1 + math.log(2048 / 64) / math.log(64)))
    assert attention_factor == pytest.approx(want)


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_longrope_cos_sin_match_hf_rotary(partial):
    """The cos/sin cache equals HF's Phi3RotaryEmbedding: below the original context as HF
    computes a short forward, from it as HF computes a forward that reaches past it."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    original, max_pos = 64, 256
    hf_cfg, cfg = _hf_phi3_config(partial, original, max_pos)
    dim = int(cfg.head_dim * partial)
    ours = RotaryEmbedding(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling, dim)
    assert ours.cos_cache.shape == (max_pos, dim // 2)
    hf = Phi3RotaryEmbedding(hf_cfg)
    x = torch.zeros(1, dtype=torch.float32)
    for lo, hi in ((0, original), (original, max_pos)):
        cos, sin = hf(x, torch.arange(lo, hi)[None])
        torch.testing.assert_close(ours.cos_cache[lo:hi], cos[0, :, : dim // 2], atol=0, rtol=0)
        torch.testing.assert_close(ours.sin_cache[lo:hi], sin[0, :, : dim // 2], atol=0, rtol=0)


def test_phi3_configs():
    """Phi-3-mini-128k's config (older "su" name, original context at the top level), Phi-4-mini's
    partial rotary, and Phi-3-mini-4k's sliding window (on every layer, no context cap)."""
    short, long = _factors(8, seed=0)
    mini_128k = parse_hf_config(
        {
            **_PHI3,
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "sliding_window": 262144,
            "rope_scaling": {"type": "su", "short_factor": short, "long_factor": long},
        }
    )
    scaling = mini_128k.rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["factor"] == 32.0
    assert scaling["original_max_position_embeddings"] == 4096
    assert max_model_len_for(mini_128k, None) == 131072

    phi4_mini = parse_hf_config(
        {
            **_PHI3,
            "partial_rotary_factor": 0.75,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": short[:6],
                "long_factor": long[:6],
            },
            "original_max_position_embeddings": 4096,
            "max_position_embeddings": 131072,
        }
    )
    assert phi4_mini.partial_rotary_factor == 0.75
    RotaryEmbedding(16, 64, 10000.0, phi4_mini.rope_scaling, rotary_dim=12)  # 6 factors: fits
    with pytest.raises(ValueError, match="short_factor has 6 entries.*needs 8"):
        RotaryEmbedding(16, 64, 10000.0, phi4_mini.rope_scaling)

    mini_4k = parse_hf_config({**_PHI3, "max_position_embeddings": 4096, "sliding_window": 2047})
    # the window is attended per layer (no context cap): every layer has it, as HF's Phi-3
    assert mini_4k.rope_scaling is None and max_model_len_for(mini_4k, None) == 4096
    assert mini_4k.layer_sliding_windows == [2047] * mini_4k.num_hidden_layers

    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        parse_hf_config(
            {**_PHI3, "rope_scaling": {"type": "longrope", "short_factor": [1], "long_factor": [1]}}
        )


def test_fused_checkpoint_tensors_load(tiny_phi3_dir):
    """qkv_proj and gate_up_proj load whole at TP=1 (split into shards and put back in place)."""
    from safetensors.torch import load_file

    model = load_model(tiny_phi3_dir, dtype="float32")
    sd = load_file(str(tiny_phi3_dir / "model.safetensors"))
    ours = dict(model.named_parameters())
    assert set(ours) == set(sd)
    for name, tensor in sd.items():
        assert torch.equal(ours[name], tensor), name


BLOCK = 8
PROMPT = [7, 99, 250, 3, 18, 41, 300, 5, 120, 64, 11]


def _logits(model_dir) -> torch.Tensor:
    """A prefill of PROMPT into blocks [5, 2] then one decode step: logits of this rank's
    model (the tensor-parallel group's, under _worker)."""
    from engine.attention.backends.torch import TorchAttentionBackend
    from engine.attention.metadata import common_metadata_from_seqs
    from engine.distributed import get_tp_size

    model = load_model(model_dir, dtype="float32")
    cfg = model.config
    tp = get_tp_size()
    hkv, heads = cfg.num_key_value_heads // tp, cfg.num_attention_heads // tp
    backend = TorchAttentionBackend(BLOCK, heads, hkv, cfg.head_dim, torch.float32)
    for attn in model.attention_layers():
        attn.kv_cache = torch.zeros(2, 8, BLOCK, hkv, cfg.head_dim)
        attn.backend = backend
    with torch.inference_mode():
        meta = backend.build_metadata(common_metadata_from_seqs([(0, len(PROMPT), [5, 2])], BLOCK))
        a = model.compute_logits(model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), meta))
        meta = backend.build_metadata(common_metadata_from_seqs([(len(PROMPT), 1, [5, 2])], BLOCK))
        b = model.compute_logits(model(torch.tensor([42]), torch.tensor([len(PROMPT)]), meta))
    return torch.cat([a, b])


def _worker(rank: int, port: int, model_dirs: list, out_file: str) -> None:
    from engine.distributed import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, 2, f"tcp://127.0.0.1:{port}", "gloo")
    try:
        results = [_logits(d) for d in model_dirs]
        if rank == 0:
            torch.save(results, out_file)
    finally:
        destroy_distributed()


@pytest.mark.slow
def test_phi3_tp2_matches_tp1(tiny_phi3_dir, tiny_phi4_mini_dir, tmp_path):
    """Each rank's rows of the fused qkv_proj are its q, k and v heads (of gate_up_proj its
    slice of gate and of up), not a contiguous slice: 2 gloo ranks give one process's logits."""
    import socket

    import torch.multiprocessing as mp

    torch.set_num_threads(1)
    dirs = [tiny_phi3_dir, tiny_phi4_mini_dir]
    expected = [_logits(d) for d in dirs]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "tp2.pt"
    mp.spawn(_worker, args=(port, dirs, str(out)), nprocs=2, join=True)
    for got, want in zip(torch.load(out), expected, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_decode_plan_takes_longrope_not_partial_rotary(
    tiny_phi3_longrope_dir, tiny_phi4_mini_dir, monkeypatch
):
    """The CPU's decode plan (engine.worker.cpu_graph) reads the model's cos/sin, so LongRoPE
    runs in it, token for token as the modules do; its rotary turns whole heads, so a partial
    rotary model (Phi-4-mini) is not planned."""
    from engine import LLM, SamplingParams
    from engine.kernels.cpu import w4 as cpu_w4

    if not cpu_w4.available():
        pytest.skip("the plan runs the 4-bit (AVX512-VNNI or AVX2) kernels")
    prompts = [[5, 17, 33, 101, 7], [9, 8, 7, 6, 5, 4, 3, 250, 12, 99]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run(model_dir) -> tuple[bool, list[list[int]]]:
        llm = LLM(
            str(model_dir), dtype="bfloat16", quantization="w4a8", num_kv_blocks=40, max_num_seqs=4
        )
        planned = llm.engine.executor.runner._step_graph is not None
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.shutdown()
        return planned, [list(o.outputs[0].token_ids) for o in outs]

    planned, tokens = run(tiny_phi3_longrope_dir)
    assert planned
    monkeypatch.setenv("TESSERA_DECODE_PLAN", "0")
    assert run(tiny_phi3_longrope_dir) == (False, tokens)
    monkeypatch.delenv("TESSERA_DECODE_PLAN")
    assert not run(tiny_phi4_mini_dir)[0]
