"""llama.cpp's gpt-oss GGUF files (what ggml-org/gpt-oss-20b-GGUF ships: MXFP4 experts in
ggml's block_mxfp4), written from the tiny random gpt-oss model the way its GptOssModel
converter writes them (gguf_files.write_gpt_oss_gguf), served through LLM(path.gguf): HF
transformers' greedy tokens on a folder of the file's values. On one CPU rank the MXFP4
experts are served from the file's blocks, whose dot kernels round x to int8 per 32 (every row
forced onto them: the same integer sums on every CPU): a token may differ only at HF's near
ties; with --quantization none they are
dequantized and every token is HF's; float experts likewise. The converted config keeps what
the original says (windows, yarn, experts, sinks), and the tokenizer comes from the file with
harmony's markers whole and its stop tokens."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch

from engine.kernels.cpu import gguf as cpu_gguf
from engine.layers.quantization.mxfp4_blocks import (
    dequantize_mxfp4,
    split_ggml_blocks,
    to_gguf_mxfp4,
)
from engine.models.hf_config import load_hf_config
from engine.models.loader import resolve_model
from tests.conftest import GPT_OSS, private_cache_dir
from tests.engine.gguf.gguf_files import save_as_hf, write_gpt_oss_gguf
from tests.engine.models.test_gpt_oss import quantize_mxfp4
from tests.engine.test_llm_exactness import (
    SW_NUM_NEW,
    assert_agrees_but_near_ties,
    hf_greedy,
    hf_greedy_gaps,
    sliding_window_prompts,
)

HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>",
                   "<|call|>", "<|constrain|>")  # fmt: skip


def _llama_cpp_repack(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """OpenAI's MXFP4 pair as llama.cpp's converter stores it (block_mxfp4): the scale byte,
    then 16 bytes whose low nibbles are values 0-15 and high nibbles values 16-31."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # value order
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat((scales.unsqueeze(-1), qs), dim=-1).flatten(-2).numpy()


def test_ggml_blocks_hold_openais_values():
    """The same MXFP4 values in both layouts: gguf-py's dequantization of llama.cpp's repack,
    ours of its blocks (split_ggml_blocks, halves) and of OpenAI's; and our repack of OpenAI's
    pair (the HF MXFP4 path's) is llama.cpp's, byte for byte."""
    from gguf import GGMLQuantizationType, quants

    w = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0))
    blocks, scales = quantize_mxfp4(w)
    want = dequantize_mxfp4(blocks, scales, torch.float32)
    raw = _llama_cpp_repack(blocks, scales)  # [3, 5, 2 * 17]
    assert torch.equal(torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.MXFP4)), want)
    codes, e = split_ggml_blocks(torch.from_numpy(raw))
    assert torch.equal(e, scales)
    assert torch.equal(dequantize_mxfp4(codes, e, torch.float32, halves=True), want)
    assert torch.equal(to_gguf_mxfp4(blocks, scales), torch.from_numpy(raw))


def test_the_converted_config_is_the_models(tiny_gpt_oss_dir, tmp_path):
    gguf = tmp_path / "g.gguf"
    write_gpt_oss_gguf(tiny_gpt_oss_dir, gguf)
    a = load_hf_config(tiny_gpt_oss_dir)
    b = load_hf_config(resolve_model(gguf, cache_dir=tmp_path / "cache"))
    for field in (
        "architecture", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
        "rope_theta", "layer_sliding_windows", "sliding_window", "num_experts",
        "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "attention_sinks",
        "o_proj_bias", "tie_word_embeddings",
    ):  # fmt: skip
        assert getattr(a, field) == getattr(b, field), field
    want = {k: v for k, v in a.rope_scaling.items() if k != "rope_theta"}
    got = {"beta_fast": 32.0, "beta_slow": 1.0, **b.rope_scaling}  # HF's defaults
    assert got == want and got["truncate"] is False
    for key in ("swiglu_alpha", "swiglu_limit"):
        assert b.raw[key] == pytest.approx(a.raw[key])


def test_a_fused_gate_up_file_is_refused(tiny_gpt_oss_dir, tmp_path):
    from gguf import GGUFReader

    from engine.gguf.convert import _read_config

    gguf = tmp_path / "g.gguf"
    write_gpt_oss_gguf(tiny_gpt_oss_dir, gguf)
    reader = GGUFReader(str(gguf))  # gate's tensor named as the converter's fused option's
    fused = {"blk.0.ffn_gate_exps.weight": "blk.0.ffn_gate_up_exps.weight"}
    reader.tensors = [t._replace(name=fused.get(t.name, t.name)) for t in reader.tensors]
    with pytest.raises(ValueError, match="fused gate/up experts are not supported"):
        _read_config(reader)


CASES = [
    ("MXFP4", "F32", {}),  # the experts on the file's MXFP4 blocks (x rounded to int8 per 32)
    # as ggml-org's files: the attention, embedding and LM head Q8_0 too (on the file's blocks,
    # every row on their exact path)
    ("MXFP4", "Q8_0", {}),
    ("MXFP4", "F32", {"quantization": "none"}),  # dequantized from the file: HF's exactly
    ("F32", "F32", {}),  # float experts (llama.cpp writes them from a float checkpoint)
    # two ranks: every expert's I and the gate/up biases sliced, the down bias added once
    pytest.param("MXFP4", "F32", {"tensor_parallel_size": 2}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("experts, type_name, kwargs", CASES)
def test_a_gpt_oss_file_serves_hf_greedy_tokens(
    tiny_gpt_oss_dir, tmp_path, monkeypatch, experts, type_name, kwargs
):
    from engine import LLM, SamplingParams

    gguf = tmp_path / "gpt-oss.gguf"
    held = write_gpt_oss_gguf(tiny_gpt_oss_dir, gguf, experts=experts, type_name=type_name)
    private_cache_dir(tmp_path / "cache", monkeypatch)  # models to tmp_path; kernels shared
    reference = save_as_hf(tiny_gpt_oss_dir, tmp_path / "held", held)
    prompts = sliding_window_prompts(load_hf_config(tiny_gpt_oss_dir).vocab_size)
    # one rank and no --quantization: the MXFP4 experts stay the file's blocks
    blocks = experts == "MXFP4" and not kwargs and cpu_gguf.available()
    # every row on the dot kernels (x as int8 per 32: the same sums on any CPU), or with the
    # attention, embedding and head on Q8_0 too (more int8 roundings than one tolerance
    # covers) every row the dot kernels need not take on the decoded weights' exact path
    dot_rows = (16 if type_name == "F32" else 0) if blocks else None
    if "tensor_parallel_size" in kwargs:
        torch.set_num_threads(1)
        kwargs = {**kwargs, "num_kv_blocks": 96}
    else:
        kwargs = {**kwargs, "max_num_batched_tokens": 32}
    forced = contextlib.nullcontext() if dot_rows is None else cpu_gguf.forced_dot_rows(dot_rows)
    with forced:
        llm = LLM(str(gguf), dtype="float32", seed=0, **kwargs)
        try:
            model = llm.engine.executor.runner.model
            params = SamplingParams(max_tokens=SW_NUM_NEW, temperature=0.0, ignore_eos=True)
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.shutdown()
    got = [list(o.outputs[0].token_ids) for o in outs]
    moe = model.model.layers[0].mlp.experts
    assert (moe.w13_weight.dtype == torch.uint8) == blocks
    if type_name == "Q8_0" and blocks:
        assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.uint8
    if blocks:  # MXFP4 rows: 17 bytes per 32 values
        assert moe.w13_weight.shape == (8, 64, 2 * 17) and moe.w2_weight.shape == (8, 64, 17)
    if blocks:
        assert_agrees_but_near_ties(got, hf_greedy_gaps(reference, prompts, SW_NUM_NEW), 0.15)
    else:
        assert got == hf_greedy(reference, prompts, SW_NUM_NEW, attn_implementation="eager")


@pytest.fixture(scope="module")
def harmony_gguf(make_tiny_model, tmp_path_factory):
    """A tiny gpt-oss whose vocabulary has harmony's markers, as a GGUF with llama.cpp's
    o200k pre-tokenizer name and the markers CONTROL tokens (as in gpt-oss's files)."""
    hf_dir = make_tiny_model(
        "tiny-gpt-oss-harmony", arch="gpt_oss", tokenizer=dict(added_tokens=HARMONY_MARKERS),
        **GPT_OSS,
    )  # fmt: skip
    gguf = tmp_path_factory.mktemp("harmony") / "h.gguf"
    write_gpt_oss_gguf(hf_dir, gguf, pre="gpt-4o", control=HARMONY_MARKERS)
    return hf_dir, gguf


def test_the_tokenizer_and_stops_come_from_the_file(harmony_gguf, tmp_path):
    from transformers import AutoTokenizer

    hf_dir, gguf = harmony_gguf
    folder = resolve_model(gguf, cache_dir=tmp_path / "cache")
    ours, theirs = (
        AutoTokenizer.from_pretrained(str(folder)),
        AutoTokenizer.from_pretrained(str(hf_dir)),
    )
    text = "<|start|>assistant<|channel|>final<|message|>hello<|return|>"
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert all(ours.convert_tokens_to_ids(m) in ids for m in ("<|start|>", "<|return|>"))
    assert ours.chat_template == theirs.chat_template
    cfg = load_hf_config(folder)
    stops = {ours.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>", "<|endoftext|>")}
    assert set(cfg.eos_token_ids) == stops | {theirs.eos_token_id}
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"][0] == theirs.eos_token_id


@pytest.mark.skipif(not cpu_gguf.available(), reason="needs the CPU kernels")
@pytest.mark.parametrize("tokens", [3, 300])  # the dot kernel's few rows, the batch paths
def test_mxfp4_experts_on_the_files_blocks_match_the_dequantized_layer(
    tiny_gpt_oss_dir, tmp_path, tokens
):
    """The file's MXFP4 experts on its blocks (apply_gguf_blocks) against the same experts
    dequantized by gguf-py: each MoE layer's output within x's int8 rounding, a layer with a
    block scale of ~2^20 (past float16's range: E8M0 holds any power of two) included."""
    from safetensors.torch import load_file

    from engine.layers.quantization.gguf import apply_gguf_blocks
    from engine.models.loader import load_model

    state = {
        n: t.numpy() for n, t in load_file(str(tiny_gpt_oss_dir / "model.safetensors")).items()
    }
    # one block of expert 3's down rows scaled so its MXFP4 scale is ~2^20
    state["model.layers.0.mlp.experts.down_proj"][3, :, 5] *= 2.0**24
    hf_dir = save_as_hf(tiny_gpt_oss_dir, tmp_path / "huge", state)
    gguf = tmp_path / "g.gguf"
    write_gpt_oss_gguf(hf_dir, gguf)
    folder = resolve_model(gguf, cache_dir=tmp_path / "cache")
    ref, model = load_model(folder, dtype="float32"), load_model(folder, dtype="float32")
    paths = apply_gguf_blocks(model, gguf)
    assert paths["experts"] == {"MXFP4 stacked blocks on the gguf kernels": 3}
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for i in range(3):
            y, want = model.model.layers[i].mlp(x), ref.model.layers[i].mlp(x)
            assert model.model.layers[i].mlp.experts.w13_weight.dtype == torch.uint8
            assert (y - want).abs().max() <= 0.03 * want.abs().max()
