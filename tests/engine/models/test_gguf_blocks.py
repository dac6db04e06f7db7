"""`--quantization gguf` on tiny random Llamas written as GGUF files by gguf-py's writer, one
per block type: the linear layers hold the file's bytes (their nbytes are the file tensors';
in a bf16 model Q4_0/Q4_1 as w4 tiles), and greedy tokens equal those of the same model on
the dequantized float weights wherever the reference's top-2 logit gap exceeds GAP_TOL."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file, save_file

from engine.attention.backends.torch import TorchAttentionBackend
from engine.attention.metadata import common_metadata_from_seqs
from engine.layers import cpu_gguf, cpu_w4
from engine.layers.quantization import (
    GGUFLinearMethod,
    GGUFW4LinearMethod,
    apply_gguf_blocks,
    quantize_model,
)
from engine.models.gguf_convert import _read_tensors
from engine.models.loader import load_model

pytestmark = pytest.mark.skipif(not cpu_gguf.available(), reason="needs the CPU kernels")

# logits of the tiny model are O(1); int8 activations per block move them by ~1e-2
GAP_TOL = 0.05
HEADS, KV_HEADS = 4, 2  # tests/conftest.py's tiny Llama
_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's convert_hf_to_gguf
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, -1).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(hf_dir, path, type_name: str) -> None:
    state = load_file(str(hf_dir / "model.safetensors"))
    qtype = GGMLQuantizationType[type_name]
    writer = GGUFWriter(str(path), "llama")
    for name, t in state.items():
        w = t.float().numpy()
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", w)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", w)
        elif name == "lm_head.weight":
            writer.add_tensor("output.weight", w)
        else:
            _, _, layer, rest = name.split(".", 3)
            module = rest.removesuffix(".weight")
            if module.endswith(("q_proj", "k_proj")):
                w = _permute(w, HEADS if module.endswith("q_proj") else KV_HEADS)
            if w.ndim == 2:
                q = quantize(np.ascontiguousarray(w), qtype)
                writer.add_tensor(
                    f"blk.{layer}.{_NAMES[module]}.weight", q, raw_shape=q.shape, raw_dtype=qtype
                )
            else:
                writer.add_tensor(f"blk.{layer}.{_NAMES[module]}.weight", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=sorted(cpu_gguf.TYPES))
def gguf_model(request, tiny_llama_dir, tmp_path_factory):
    """(the .gguf file, an HF folder holding its dequantized float weights)."""
    tmp = tmp_path_factory.mktemp(f"gguf-{request.param}")
    path = tmp / "tiny.gguf"
    _write_gguf(tiny_llama_dir, path, request.param)
    folder = tmp / "dequantized"
    shutil.copytree(tiny_llama_dir, folder)
    tensors = _read_tensors(
        GGUFReader(str(path)), {"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS}
    )
    save_file(tensors, str(folder / "model.safetensors"))
    return request.param, path, folder


def _logits(model, tokens: list[int]) -> torch.Tensor:
    dtype = model.model.embed_tokens.weight.dtype
    backend = TorchAttentionBackend(16, HEADS, KV_HEADS, 16, dtype)
    for attn in model.attention_layers():
        attn.kv_cache = torch.zeros(2, 4, 16, KV_HEADS, 16, dtype=dtype)
        attn.backend = backend
    meta = backend.build_metadata(common_metadata_from_seqs([(0, len(tokens), [1, 2, 3])], 16))
    with torch.inference_mode():
        h = model(torch.tensor(tokens), torch.arange(len(tokens)), meta)
        return model.compute_logits(h)[-1]


def test_file_blocks_load_and_generate_like_the_dequantized_model(gguf_model):
    type_name, path, folder = gguf_model
    ref = load_model(folder, dtype="float32")
    model = load_model(folder, dtype="float32")
    assert quantize_model(model, "gguf", gguf_path=path) == 3 * 4  # every linear layer
    linears = [
        m for m in model.modules() if isinstance(getattr(m, "quant_method", None), GGUFLinearMethod)
    ]
    assert all(m.weight.dtype == torch.uint8 for m in linears)
    # a float32 model: Q4 blocks too stay on the dot kernel (the w4 kernel takes bf16)
    assert not any(isinstance(m.quant_method, GGUFW4LinearMethod) for m in linears)
    file_bytes = sum(
        t.data.nbytes for t in GGUFReader(str(path)).tensors if t.tensor_type.name == type_name
    )
    assert sum(m.weight.nbytes for m in linears) == file_bytes  # the file's blocks, as they are
    tokens, compared = [5, 9, 17, 3], 0
    while len(tokens) < 16:  # prefixes up to 16 rows: the kernel's dot-product path
        r, c = _logits(ref, tokens), _logits(model, tokens)
        top2 = r.topk(2).values
        if top2[0] - top2[1] > GAP_TOL:
            assert int(c.argmax()) == int(r.argmax()), (type_name, tokens)
            compared += 1
        assert (c - r).abs().max() < 4 * GAP_TOL  # and the logits themselves stay close
        tokens.append(int(r.argmax()))
    assert compared >= 6


def test_q4_blocks_of_a_bf16_model_are_w4_tiles(gguf_model):
    """bf16: Q4_0/Q4_1 layers repacked into w4 tiles (no other copy: 20 bytes a block of 32),
    Q8_0 on the dot kernel; prefixes of 1-15 rows cross the w4 kernel's MAX_ROWS."""
    type_name, path, folder = gguf_model
    ref = load_model(folder, dtype="bfloat16")
    model = load_model(folder, dtype="bfloat16")
    paths = apply_gguf_blocks(model, path)
    linears = [
        m for m in model.modules() if isinstance(getattr(m, "quant_method", None), GGUFLinearMethod)
    ]
    assert len(linears) == 3 * 4
    if type_name == "Q8_0" or not cpu_w4.available():
        assert not any(isinstance(m.quant_method, GGUFW4LinearMethod) for m in linears)
        assert all("gguf dot kernel" in why for c in paths.values() for why in c)
        return
    assert all(isinstance(m.quant_method, GGUFW4LinearMethod) for m in linears)
    assert paths["down_proj"] == {f"{type_name} as w4 tiles": 3}
    weights = sum(m.weight.numel() // 20 * 32 for m in linears)  # every row a multiple of 16
    assert weights == sum(m.w4.out_features * m.w4.in_features for m in linears)
    assert all(m.weight.data_ptr() == m.w4.data.data_ptr() for m in linears)  # one copy
    tokens, compared = [5, 9, 17, 3], 0
    while len(tokens) < 16:
        r, c = _logits(ref, tokens).float(), _logits(model, tokens).float()
        top2 = r.topk(2).values
        if top2[0] - top2[1] > 4 * GAP_TOL:  # bf16 activations on both sides
            assert int(c.argmax()) == int(r.argmax()), (type_name, tokens)
            compared += 1
        assert (c - r).abs().max() < 8 * GAP_TOL
        tokens.append(int(r.argmax()))
    assert compared >= 4


def test_types_without_a_kernel_keep_the_dequantized_weights(tiny_llama_dir, tmp_path):
    path = tmp_path / "f16.gguf"
    _write_gguf(tiny_llama_dir, path, "F16")  # float tensors: nothing to keep as blocks
    model = load_model(tiny_llama_dir, dtype="float32")
    assert quantize_model(model, "gguf", gguf_path=path) == 0
    assert not any(
        isinstance(getattr(m, "quant_method", None), GGUFLinearMethod) for m in model.modules()
    )


def test_a_model_without_a_gguf_source_is_refused(tiny_llama_dir):
    from engine.config import ModelConfig
    from engine.models.gguf_blocks import gguf_source

    assert ModelConfig(model=str(tiny_llama_dir), quantization="gguf").quantization == "gguf"
    assert gguf_source(tiny_llama_dir) is None  # an HF folder has no blocks to keep
    model = load_model(tiny_llama_dir, dtype="float32")
    with pytest.raises(ValueError, match="needs a .gguf model"):
        quantize_model(model, "gguf", gguf_path=gguf_source(tiny_llama_dir))
