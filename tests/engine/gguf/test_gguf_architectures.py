"""llama.cpp's qwen3moe, qwen2moe, gemma3 and phi3 GGUF files, written from tiny random HF models the way
its convert_hf_to_gguf.py writes them (gguf_files.write_llama_cpp_gguf: stacked experts,
Gemma's norms plus one, Phi-3's fused q/k/v and gate/up and rope factor tensors), served
through LLM(path.gguf): HF transformers' greedy tokens on the original folder (F32: the same
values), or on a folder of the file's values (F16, Q8_0: the weights rounded as stored; Q8_0's
layers on the file's blocks, x rounded to int8 per block as llama.cpp does). The converted
folder's config keeps what the original's says where it matters (windows, experts, rope)."""

from __future__ import annotations

import json

import pytest
import torch

from engine.gguf.convert import _read_config
from engine.kernels.cpu import gguf as cpu_gguf
from engine.models.hf_config import load_hf_config
from engine.models.loader import resolve_model
from tests.conftest import MOE_MODELS, private_cache_dir
from tests.engine.gguf.gguf_files import save_as_hf, write_llama_cpp_gguf
from tests.engine.test_llm_exactness import (
    assert_agrees_but_near_ties,
    hf_greedy,
    hf_greedy_gaps,
)

NUM_NEW = 8


@pytest.fixture(scope="session")
def gemma3_gguf_dir(make_tiny_model):
    """Gemma 3 as llama.cpp serves it: every 6th layer global (its fixed pattern; six layers,
    so one), queries scaled by head_dim ** -0.5 (the file has no query_pre_attn_scalar: every
    size but the 27B's), the local rope base 10,000; global rope linearly scaled, tied
    embeddings, soft-capped logits, a window of 16 the prompts run past."""
    return make_tiny_model(
        "tiny-gemma3-gguf",
        arch="gemma3",
        seed=11,
        num_hidden_layers=6,
        head_dim=16,
        query_pre_attn_scalar=16,
        hidden_activation="gelu_pytorch_tanh",
        sliding_window=16,
        sliding_window_pattern=6,
        rope_local_base_freq=10000.0,
        rope_theta=1000000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        tie_word_embeddings=True,
        final_logit_softcapping=30.0,
    )


@pytest.fixture(scope="session")
def qwen2_moe_gguf_dir(make_tiny_model):
    """Qwen2-MoE (tests/conftest.py's) with a shared expert 64 wide (Q8_0 blocks of 32); seed 7:
    with conftest's 5 the prompts meet top-2 logit gaps under 0.01, which Q8_0's int8 rounding
    of x (llama.cpp's) decides either way."""
    moe = {**MOE_MODELS["qwen2_moe"], "shared_expert_intermediate_size": 64, "seed": 7}
    return make_tiny_model("tiny-qwen2-moe-gguf", arch="qwen2_moe", **moe)


def _prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(77)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in (5, 17, 40)]


def _hf_greedy(model_dir, prompts) -> list[list[int]]:
    return hf_greedy(model_dir, prompts, NUM_NEW, attn_implementation="eager")


# Q8_0's dot products take x as int8 per 32 (the VNNI / AVX2 kernels; AMX CPUs dequantize to
# bf16 tiles instead): where HF's own top-2 logits are nearer than this, either token is the
# reference's (tests/engine/gguf/test_gguf_blocks.py's tolerance for the same kernels)
Q8_GAP_TOL = 0.05


def _engine_greedy(gguf, prompts, **kw) -> tuple[list[list[int]], object]:
    from engine import LLM, SamplingParams

    llm = LLM(str(gguf), dtype="float32", seed=0, num_kv_blocks=64, max_model_len=128, **kw)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    runner = llm.engine.executor.runner
    quantization, model = runner.quantization, runner.model
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], (quantization, model)


def _same_config(original, converted) -> None:
    """What the served model reads from either folder, where the GGUF carries it."""
    a, b = load_hf_config(original), load_hf_config(converted)
    for field in (
        "architecture", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
        "max_position_embeddings", "rope_theta", "rope_scaling", "tie_word_embeddings",
        "layer_sliding_windows", "sliding_window", "partial_rotary_factor", "num_experts",
        "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
        "qk_norm", "hidden_act",
    ):  # fmt: skip
        assert getattr(a, field) == getattr(b, field), field
    assert a.rms_norm_eps == pytest.approx(b.rms_norm_eps, rel=1e-6)  # float32 in the file
    for key in (
        "query_pre_attn_scalar",
        "final_logit_softcapping",
        "original_max_position_embeddings",
    ):
        assert a.raw.get(key) == b.raw.get(key), key
    if a.model_type == "gemma3_text":
        from engine.models.gemma3 import rope_parameters

        assert rope_parameters(a) == rope_parameters(b)


CASES = [
    ("tiny_qwen3_moe_dir", "F32"),  # a dense layer among the MoE ones (no router: mlp_only)
    ("tiny_qwen3_moe_dir", "Q8_0"),
    ("tiny_qwen3_moe_dir", "Q8_0-none"),  # --quantization none: experts dequantized per expert
    # a shared expert behind a sigmoid gate, q/k/v biases, top-k weights not renormalized
    ("qwen2_moe_gguf_dir", "F32"),
    ("qwen2_moe_gguf_dir", "Q8_0"),
    ("gemma3_gguf_dir", "F32"),
    ("gemma3_gguf_dir", "Q8_0"),
    ("tiny_phi3_dir", "F16"),
    ("tiny_phi3_longrope_dir", "F32"),  # LongRoPE: the 40-token prompt decodes past 56
    ("tiny_phi4_mini_dir", "Q8_0"),  # LongRoPE on half of each head, tied embeddings
]


@pytest.mark.parametrize("fixture, type_name", CASES)
def test_a_llama_cpp_file_serves_hf_greedy_tokens(
    request, fixture, type_name, tmp_path, monkeypatch
):
    hf_dir = request.getfixturevalue(fixture)
    type_name, _, quantization = type_name.partition("-")
    gguf = tmp_path / f"{fixture}-{type_name}.gguf"
    held = write_llama_cpp_gguf(hf_dir, gguf, type_name)
    private_cache_dir(tmp_path / "cache", monkeypatch)  # models to tmp_path; kernels shared
    folder = resolve_model(gguf)
    _same_config(hf_dir, folder)

    reference = hf_dir if type_name == "F32" else save_as_hf(hf_dir, tmp_path / "held", held)
    prompts = _prompts(load_hf_config(hf_dir).vocab_size)
    got, (served, model) = _engine_greedy(gguf, prompts, quantization=quantization or None)
    if type_name == "Q8_0" and quantization != "none":  # int8 activations in the dots
        reference_gaps = hf_greedy_gaps(reference, prompts, NUM_NEW)
        assert_agrees_but_near_ties(got, reference_gaps, Q8_GAP_TOL)
    else:
        assert got == _hf_greedy(reference, prompts)
    blocks = type_name == "Q8_0" and quantization != "none" and cpu_gguf.available()
    if blocks:  # the layers hold the file's blocks
        assert served == "gguf"
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert qkv.weight.dtype == torch.uint8
    if fixture == "qwen2_moe_gguf_dir" and blocks:  # the shared expert on the file's blocks
        shared = model.model.layers[0].mlp.shared_expert
        assert shared.gate_up_proj.weight.dtype == torch.uint8
        assert model.model.layers[0].mlp.experts.w13_weight.dtype == torch.uint8
    if fixture == "tiny_qwen3_moe_dir":
        experts = model.model.layers[0].mlp.experts
        assert model.model.layers[1].mlp.gate_up_proj is not None  # the dense layer
        if blocks:  # the file's stacked blocks, as stored
            assert experts.w13_weight.dtype == torch.uint8
            assert experts.w13_weight.shape[:2] == (experts.num_experts, 2 * experts.inter)
        else:  # dequantized into the layer (from the file, or F32 in the folder), each
            # expert's gate rows then its up rows
            want = torch.stack(
                [
                    torch.cat([torch.from_numpy(held[f"model.layers.0.mlp.experts.{e}.{p}.weight"])
                               for p in ("gate_proj", "up_proj")])
                    for e in range(experts.num_experts)
                ]
            )  # fmt: skip
            assert torch.equal(experts.w13_weight, want)


def test_gemma3_norms_lose_the_one_llama_cpp_adds(gemma3_gguf_dir, tmp_path):
    """The file's norm weights are 1 + w (convert_hf_to_gguf's Gemma rule); the converted
    folder's are HF's w again, to float32 rounding."""
    from gguf import GGUFReader
    from safetensors.torch import load_file

    gguf = tmp_path / "g.gguf"
    write_llama_cpp_gguf(gemma3_gguf_dir, gguf, "F32")
    reader = GGUFReader(str(gguf))
    stored = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    original = load_file(str(gemma3_gguf_dir / "model.safetensors"))
    w = original["model.layers.2.post_feedforward_layernorm.weight"]
    assert torch.equal(stored["blk.2.post_ffw_norm.weight"], w + 1)
    folder = resolve_model(gguf, cache_dir=tmp_path / "cache")
    converted = load_file(str(folder / "model.safetensors"))
    for name in ("model.norm.weight", "model.layers.2.post_feedforward_layernorm.weight",
                 "model.layers.0.self_attn.k_norm.weight", "model.layers.3.pre_feedforward_layernorm.weight"):  # fmt: skip
        torch.testing.assert_close(converted[name], original[name], rtol=0, atol=1e-6)


def test_gemma3_window_pattern_from_the_file_or_llama_cpps_default():
    from engine.gguf.arch_config import gemma3_layer_types

    s, f = "sliding_attention", "full_attention"
    assert gemma3_layer_types(7, 512, 6) == [s, s, s, s, s, f, s]  # llama.cpp's fixed 6
    assert gemma3_layer_types(3, 512, [True, False, True]) == [s, f, s]
    assert gemma3_layer_types(2, 0, 6) == [f, f]  # no window: every layer global


def test_an_unsupported_architecture_is_named(tmp_path):
    from gguf import GGUFReader, GGUFWriter

    path = tmp_path / "x.gguf"
    w = GGUFWriter(str(path), "mamba")
    w.add_array("tokenizer.ggml.tokens", ["a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        ValueError, match=r"'mamba' is not supported \(supported: .*qwen3moe, gemma3, phi3"
    ):
        _read_config(GGUFReader(str(path)))


def test_a_phi3_file_with_one_rope_factor_tensor_is_refused(tiny_phi3_longrope_dir, tmp_path):
    """Written without rope_factors_short, the file would serve with the wrong frequencies."""
    from gguf import GGUFReader

    gguf = tmp_path / "p.gguf"
    write_llama_cpp_gguf(tiny_phi3_longrope_dir, gguf, "F32")
    reader = GGUFReader(str(gguf))
    reader.tensors = [t for t in reader.tensors if t.name != "rope_factors_short.weight"]
    with pytest.raises(ValueError, match="rope_factors_long / rope_factors_short"):
        _read_config(reader)
    assert json.dumps(_read_config(GGUFReader(str(gguf)))["rope_scaling"])


@pytest.mark.skipif(not cpu_gguf.available(), reason="needs the CPU kernels")
@pytest.mark.parametrize(
    "type_name, dtype, tokens",
    [  # the dot kernel's few rows, the batch paths; a bf16 model's
        ("Q8_0", "float32", 3),
        ("Q8_0", "float32", 300),
        ("Q4_0", "bfloat16", 300),
    ],
)
def test_experts_on_the_file_blocks_match_the_dequantized_experts(
    tiny_qwen3_moe_dir, tmp_path, type_name, dtype, tokens
):
    """A file's stacked experts served from their blocks (gate/up and down on the GGUF
    kernels, x rounded to int8 per 32) against the same experts dequantized: the MoE layer's
    output within that rounding (and bf16's), for a few tokens and for hundreds."""
    from engine.layers.quantization.gguf import GGUFExperts, apply_gguf_blocks, block_parameters
    from engine.models.loader import load_model

    gguf = tmp_path / "moe.gguf"
    write_llama_cpp_gguf(tiny_qwen3_moe_dir, gguf, type_name)
    folder = resolve_model(gguf, cache_dir=tmp_path / "cache")
    ref = load_model(folder, dtype=dtype)
    model = load_model(folder, dtype=dtype)
    paths = apply_gguf_blocks(model, gguf)
    assert paths["experts"] == {f"{type_name} stacked blocks on the gguf kernels": 2}  # 0, 2
    assert "model.layers.2.mlp.experts.w13_weight" in block_parameters(model)
    moe, moe_ref = model.model.layers[2].mlp, ref.model.layers[2].mlp
    assert isinstance(moe.experts.expert_linear, GGUFExperts)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(0)).to(
        getattr(torch, dtype)
    )
    with torch.inference_mode():
        y, want = moe(x), moe_ref(x)
    assert y.dtype == x.dtype
    y, want = y.float(), want.float()
    assert (y - want).abs().max() <= 0.03 * want.abs().max()
