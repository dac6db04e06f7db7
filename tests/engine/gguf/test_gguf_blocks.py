"""`--quantization gguf` on tiny random Llamas written as GGUF files by gguf-py's writer, one
per block type, and one of mixed K-quants (Q4_K_M's pattern: q/k Q4_K, v and down Q6_K, so
qkv_proj holds two segments): the linear layers hold the file's bytes (their nbytes are the
file tensors'; in a bf16 model Q4_0/Q4_1 as w4 tiles), and greedy tokens equal those of the
same model on the dequantized float weights wherever the reference's top-2 logit gap exceeds
GAP_TOL. K-quants need K % 256 == 0: their files are of a wider tiny Llama (hidden 256,
intermediate 512); their blocks come from the tests' numpy encoder (gguf-py has none for
them)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from engine.attention.backends.torch import TorchAttentionBackend
from engine.attention.metadata import common_metadata_from_seqs
from engine.gguf.convert import _write_weights
from engine.kernels.cpu import gemm as cpu_gemm
from engine.kernels.cpu import gguf as cpu_gguf
from engine.kernels.cpu import isa as cpu_isa
from engine.kernels.cpu import w4 as cpu_w4
from engine.layers.quantization.gguf import (
    GGUFLinearMethod,
    GGUFSegmentsLinearMethod,
    GGUFW4LinearMethod,
    apply_gguf_blocks,
    q8_tiles_head,
)
from engine.layers.quantization.quantize import quantize_model
from engine.models.loader import load_model
from tests.engine.gguf.gguf_files import HEADS, KV_HEADS, write_gguf

pytestmark = pytest.mark.skipif(not cpu_gguf.available(), reason="needs the CPU kernels")

# logits of the tiny model are O(1); int8 activations per block move them by ~1e-2
GAP_TOL = 0.05
# the wide one's (weights drawn at half the std, as wide layers sum 4x the terms) reach ~3,
# and x's int8 rounding moves them by up to ~0.065, the Q8_0 kernel's as the K-quants'
# (measured): a gap over twice the largest move keeps the argmax
WIDE_GAP_TOL = 0.15
BLOCK_TYPES = sorted(set(cpu_gguf.TYPES) - set(cpu_gguf.K_TYPES))  # gguf-py quantizes these
# Q4_K_M's pattern, and layer 1's ffn_up Q5_K (a gate_up of two segments too)
MIXED = {"attn_v": "Q6_K", "ffn_down": "Q6_K", (1, "ffn_up"): "Q5_K"}
_METHODS = (GGUFLinearMethod, GGUFSegmentsLinearMethod)


@pytest.fixture(scope="session")
def wide_llama_dir(make_tiny_model):
    """The tiny Llama with K % 256 == 0 in every linear layer (head_dim 64)."""
    return make_tiny_model(
        "tiny-llama-256", hidden_size=256, intermediate_size=512, initializer_range=0.05
    )


@pytest.fixture(scope="module", params=[*BLOCK_TYPES, *sorted(cpu_gguf.K_TYPES), "mixed"])
def gguf_model(request, tiny_llama_dir, wide_llama_dir, tmp_path_factory):
    """(type name, the .gguf file, an HF folder holding its dequantized float weights)."""
    tmp = tmp_path_factory.mktemp(f"gguf-{request.param}")
    path = tmp / "tiny.gguf"
    hf_dir = tiny_llama_dir if request.param in BLOCK_TYPES else wide_llama_dir
    if request.param == "mixed":
        write_gguf(hf_dir, path, "Q4_K", MIXED)
    else:
        write_gguf(hf_dir, path, request.param)
    folder = tmp / "dequantized"
    shutil.copytree(hf_dir, folder)
    heads = {"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS}
    _write_weights(GGUFReader(str(path)), heads, folder)  # over the copy's model.safetensors
    return request.param, path, folder


def _logits(model, tokens: list[int]) -> torch.Tensor:
    head_dim = model.model.layers[0].self_attn.head_dim
    dtype = model.model.embed_tokens.weight.dtype
    backend = TorchAttentionBackend(16, HEADS, KV_HEADS, head_dim, dtype)
    for attn in model.attention_layers():
        attn.kv_cache = torch.zeros(2, 4, 16, KV_HEADS, head_dim, dtype=dtype)
        attn.backend = backend
    meta = backend.build_metadata(common_metadata_from_seqs([(0, len(tokens), [1, 2, 3])], 16))
    with torch.inference_mode():
        h = model(torch.tensor(tokens), torch.arange(len(tokens)), meta)
        return model.compute_logits(h)[-1]


def test_file_blocks_load_and_generate_like_the_dequantized_model(gguf_model):
    type_name, path, folder = gguf_model
    gap_tol = GAP_TOL if type_name in BLOCK_TYPES else WIDE_GAP_TOL
    ref = load_model(folder, dtype="float32")
    model = load_model(folder, dtype="float32")
    paths = apply_gguf_blocks(model, path)
    # the file's output.weight is float32 here: the LM head keeps the model's float weight
    assert paths.pop("lm_head") == {"dequantized (F32 (a float tensor: not a block type))": 1}
    assert paths.pop("embed_tokens") == {"dequantized (token_embd is a float tensor, or absent)": 1}
    assert not any(why.startswith("dequantized") for c in paths.values() for why in c), paths
    assert sum(n for c in paths.values() for n in c.values()) == 3 * 4  # every linear layer
    linears = [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), _METHODS)]
    assert len(linears) == 3 * 4 and all(m.weight.dtype == torch.uint8 for m in linears)
    # a float32 model: Q4 blocks too stay on the dot kernel (the w4 kernel takes bf16)
    assert not any(isinstance(m.quant_method, GGUFW4LinearMethod) for m in linears)
    if type_name == "mixed":  # q/k Q4_K + v Q6_K in every qkv_proj, one layer's gate Q4_K + up Q5_K
        seg = "row segments on the gguf dot kernels"
        assert paths["qkv_proj"] == {f"Q4_K/Q6_K {seg}": 3}
        dot = "blocks on the gguf dot kernel"
        assert paths["gate_up_proj"] == {f"Q4_K {dot}": 2, f"Q4_K/Q5_K {seg}": 1}
        assert paths["down_proj"] == {f"Q6_K {dot}": 3}
    else:
        assert not any(isinstance(m.quant_method, GGUFSegmentsLinearMethod) for m in linears)
    file_bytes = sum(
        t.data.nbytes
        for t in GGUFReader(str(path)).tensors
        if t.name.startswith("blk.") and t.data.ndim > 1
    )
    assert sum(m.weight.nbytes for m in linears) == file_bytes  # the file's blocks, as they are
    compared = 0
    for start in ([5, 9, 17, 3], [11, 2, 30]):  # two greedy runs: enough clear-gap tokens
        tokens = list(start)
        while len(tokens) < 16:  # prefixes up to 16 rows: the kernel's dot-product path
            r, c = _logits(ref, tokens), _logits(model, tokens)
            top2 = r.topk(2).values
            if top2[0] - top2[1] > gap_tol:
                assert int(c.argmax()) == int(r.argmax()), (type_name, tokens)
                compared += 1
            assert (c - r).abs().max() < 4 * GAP_TOL  # and the logits themselves stay close
            tokens.append(int(r.argmax()))
    assert compared >= 6
    # a prefill above every dot-kernel limit: the large-batch path's weights
    prompt = list(range(5, 5 + max(16, cpu_gguf.dot_max_rows()) + 4))
    torch.testing.assert_close(_logits(model, prompt), _logits(ref, prompt), rtol=1e-4, atol=1e-4)


def test_q4_blocks_of_a_bf16_model_are_w4_tiles(gguf_model):
    """bf16: Q4_0/Q4_1 layers repacked into w4 tiles (no other copy: 20 bytes a block of 32),
    the other types on the dot kernels; prefixes of 1-15 rows cross the w4 kernel's MAX_ROWS."""
    type_name, path, folder = gguf_model
    ref = load_model(folder, dtype="bfloat16")
    model = load_model(folder, dtype="bfloat16")
    paths = apply_gguf_blocks(model, path)
    del paths["lm_head"], paths["embed_tokens"]  # float32 in these files
    linears = [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), _METHODS)]
    assert len(linears) == 3 * 4
    if type_name not in ("Q4_0", "Q4_1") or not cpu_w4.available():  # Q8_0, the K-quants
        assert not any(isinstance(m.quant_method, GGUFW4LinearMethod) for m in linears)
        assert all("gguf dot kernel" in why for c in paths.values() for why in c), paths
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


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_the_lm_head_reads_the_file_rows_in_small_batches(tiny_llama_dir, tmp_path, name):
    """output.weight in Q8_0 (the bundled model's tied token_embd type), untied: up to the dot
    kernels' rows the head multiplies the file's blocks (float32 logits, x rounded to int8
    per 32), above them the same blocks dequantized (AMX: its decoded rows); no float copy
    of the weight is kept, nor filled by a loader (block_parameters)."""
    from engine.layers.quantization.gguf import GGUFLMHeadMethod, block_parameters

    path = tmp_path / "head-q8.gguf"
    write_gguf(tiny_llama_dir, path, "Q4_1", head_type="Q8_0")
    model = load_model(tiny_llama_dir, dtype=name)
    dtype = getattr(torch, name)
    head = model.lm_head
    weight = head.weight.clone()
    if name == "bfloat16" and q8_tiles_head():
        pytest.skip("this build reads a bf16 model's Q8_0 head as tiles (the test below)")
    paths = apply_gguf_blocks(model, path)
    rows = cpu_gguf.dot_max_rows()
    saved = weight.numel() * weight.element_size() / 2**20
    assert paths["lm_head"] == {
        f"Q8_0 blocks on the gguf dot kernel up to {rows} rows, on the blocks above too; "
        f"no float copy (untied: {saved:.0f} MiB saved)": 1
    }
    assert isinstance(head.quant_method, GGUFLMHeadMethod)
    (out,) = [t for t in GGUFReader(str(path)).tensors if t.name == "output.weight"]
    assert head.gguf_blocks.nbytes == out.data.nbytes  # the file's rows, as they are
    assert head.weight.numel() == 0 and "lm_head.weight" in block_parameters(model)
    file_w = torch.from_numpy(
        dequantize(np.asarray(out.data), GGMLQuantizationType.Q8_0).reshape(weight.shape)
    )
    torch.manual_seed(0)
    for m in sorted({1, 3, rows}):
        hidden = torch.randn(m, weight.shape[1]).to(dtype)
        logits = head(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (m, head.num_embeddings)
        ref = hidden.float() @ file_w.T
        assert (logits - ref).norm() / ref.norm() < 1.5e-2  # x's int8 rounding (test_cpu_gguf)
    big = torch.randn(rows + 1, weight.shape[1]).to(dtype)
    if cpu_isa.plan().amx_rows(rows + 1):  # AMX's decoded rows: bf16 products
        ref = big.float() @ file_w.T
        assert (head(big) - ref).norm() / ref.norm() < 1e-2
    else:  # the blocks dequantized, then the dense GEMM a float weight would take
        deq = cpu_gguf.dequantize(head.gguf_blocks, out.tensor_type, weight.shape[1], dtype)
        assert torch.equal(head(big), cpu_gemm.dense_linear(big, deq).float())
    assert head.greedy(big) is None  # the logits' argmax (no float table for an epilogue)


def test_blocks_first_never_fills_an_untied_heads_float_weight(tiny_llama_dir, tmp_path):
    """The runner's load order (the file's blocks before the float weights, which then skip
    block_parameters): an untied head's weight stays empty through the load, and its logits
    at a small and a large batch are those of the head that held the file's blocks after a
    full float load."""
    from engine.layers.quantization.gguf import block_parameters

    path = tmp_path / "head-q8.gguf"
    write_gguf(tiny_llama_dir, path, "Q4_1", head_type="Q8_0")

    def blocks_first(model):
        apply_gguf_blocks(model, path)
        return block_parameters(model)

    model = load_model(tiny_llama_dir, dtype="float32", prepare=blocks_first)
    ref = load_model(tiny_llama_dir, dtype="float32")
    apply_gguf_blocks(ref, path)
    assert model.lm_head.weight.numel() == 0 and ref.lm_head.weight.numel() == 0
    torch.manual_seed(0)
    for m in (1, cpu_gguf.dot_max_rows() + 5):
        hidden = torch.randn(m, model.config.hidden_size)
        assert torch.equal(model.lm_head(hidden), ref.lm_head(hidden))


def test_the_lm_head_reads_q8_tiles_at_every_batch(tiny_llama_dir, tmp_path):
    """A bf16 model's Q8_0 head on an AVX2 build (two planes of w4 tiles) or an AVX512-VNNI
    one without AMX (one plane): the file's values, float32 logits at every batch (x rounded
    to int8 per 32, as the dot kernel)."""
    from engine.layers.quantization.gguf import GGUFQ8TilesHeadMethod

    if not q8_tiles_head():
        pytest.skip("Q8 tiles need AVX2 or AVX512-VNNI (and no AMX)")
    path = tmp_path / "head-q8.gguf"
    write_gguf(tiny_llama_dir, path, "Q4_1", head_type="Q8_0")
    model = load_model(tiny_llama_dir, dtype="bfloat16")
    head = model.lm_head
    paths = apply_gguf_blocks(model, path)
    path_of = {
        "planes": "Q8_0 blocks as two planes of w4 tiles at every batch (AVX2)",
        "vnni": "Q8_0 blocks as 16-row tiles at every batch (AVX512-VNNI, no AMX)",
    }
    saved = head.num_embeddings * head.weight.shape[1] * 2 / 2**20
    untied = f"no float copy (untied: {saved:.0f} MiB saved)"
    assert paths["lm_head"] == {f"{path_of[cpu_w4.q8_layout()]}; {untied}": 1}
    assert isinstance(head.quant_method, GGUFQ8TilesHeadMethod)
    assert not hasattr(head, "gguf_blocks")  # the tiles replace the rows
    (out,) = [t for t in GGUFReader(str(path)).tensors if t.name == "output.weight"]
    assert head.weight.numel() == 0  # untied: the tiles are the only copy
    k = head.weight.shape[1]
    rows = torch.from_numpy(np.asarray(out.data).copy()).view(torch.uint8)
    rows = rows.reshape(head.num_embeddings, -1)
    file_w = torch.from_numpy(
        dequantize(np.asarray(out.data), GGMLQuantizationType.Q8_0).reshape(-1, k)
    )
    torch.manual_seed(0)
    for m in (1, 3, cpu_gguf.dot_max_rows() + 1, 40):
        hidden = torch.randn(m, k).bfloat16()
        logits = head(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (m, head.num_embeddings)
        ref = hidden.float() @ file_w.T
        assert (logits - ref).norm() / ref.norm() < 1.5e-2  # x's int8 rounding
        if m <= cpu_gguf.dot_max_rows():  # the dot kernel on the file's rows: the same sums
            dot = cpu_gguf.linear(hidden.float(), rows, out.tensor_type, k)
            torch.testing.assert_close(logits, dot, rtol=1e-5, atol=1e-5 * dot.abs().max())
        # greedy steps: the VNNI tiles' argmax epilogue gives the logits' argmax (AVX2: none)
        tokens = head.greedy(hidden)
        if cpu_w4.q8_layout() == "vnni":
            assert tokens is not None and torch.equal(tokens, logits.argmax(-1))
        else:
            assert tokens is None


def test_types_without_a_kernel_keep_the_dequantized_weights(tiny_llama_dir, tmp_path):
    path = tmp_path / "f16.gguf"
    write_gguf(tiny_llama_dir, path, "F16")  # float tensors: nothing to keep as blocks
    model = load_model(tiny_llama_dir, dtype="float32")
    assert quantize_model(model, "gguf", gguf_path=path) == 0
    assert not any(
        isinstance(getattr(m, "quant_method", None), GGUFLinearMethod) for m in model.modules()
    )


def test_a_model_without_a_gguf_source_is_refused(tiny_llama_dir):
    from engine.config import ModelConfig
    from engine.gguf.source import gguf_source

    assert ModelConfig(model=str(tiny_llama_dir), quantization="gguf").quantization == "gguf"
    assert gguf_source(tiny_llama_dir) is None  # an HF folder has no blocks to keep
    model = load_model(tiny_llama_dir, dtype="float32")
    with pytest.raises(ValueError, match="needs a .gguf model"):
        quantize_model(model, "gguf", gguf_path=gguf_source(tiny_llama_dir))


def test_a_group_with_a_float_part_keeps_the_dequantized_weights(wide_llama_dir, tmp_path):
    path = tmp_path / "v-f16.gguf"
    write_gguf(wide_llama_dir, path, "Q4_K", {"attn_v": "F16"})
    model = load_model(wide_llama_dir, dtype="float32")
    paths = apply_gguf_blocks(model, path)
    assert paths["qkv_proj"] == {"dequantized (Q4_K/Q4_K/F16 (a float part: not a block type))": 3}
    assert all(
        paths[k] == {"Q4_K blocks on the gguf dot kernel": 3}
        for k in ("o_proj", "gate_up_proj", "down_proj")
    )
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float32 and not isinstance(qkv.quant_method, _METHODS)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_1"])
def test_a_qwen_file_keeps_its_row_order_biases_and_norms(request, tmp_path, type_name, arch):
    """llama.cpp permutes q/k rows in llama files only: a qwen2/qwen3 file's rows are HF's.
    Its blocks serve the tiny model (Qwen2's q/k/v biases, Qwen3's q/k norms from the float
    tensors; Qwen3's heads 32 wide against hidden / heads = 16) like its dequantized weights,
    and those like the original model (Q8_0: within int8 rounding)."""
    hf_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    path = tmp_path / f"{arch}.gguf"
    write_gguf(hf_dir, path, type_name, arch=arch)
    folder = tmp_path / "dequantized"
    shutil.copytree(hf_dir, folder)
    config = {"model_type": arch, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS}
    _write_weights(GGUFReader(str(path)), config, folder)
    original = load_model(hf_dir, dtype="float32")
    ref = load_model(folder, dtype="float32")
    model = load_model(folder, dtype="float32")
    paths = apply_gguf_blocks(model, path)
    del paths["lm_head"], paths["embed_tokens"]  # float32 in this file
    assert sum(n for c in paths.values() for n in c.values()) == 3 * 4
    assert not any(why.startswith("dequantized") for c in paths.values() for why in c)
    attn = model.model.layers[0].self_attn
    if arch == "qwen2":
        assert attn.qkv_proj.bias is not None
    else:  # the norms' weights from the file, as the original's (float32 there)
        assert attn.qkv_proj.bias is None and attn.q_norm is not None
        want = original.model.layers[0].self_attn.k_norm.weight
        assert torch.equal(attn.k_norm.weight, want)
    tokens, compared = [5, 9, 17, 3], 0
    while len(tokens) < 14:
        o, r, c = _logits(original, tokens), _logits(ref, tokens), _logits(model, tokens)
        if type_name == "Q8_0":  # the file's values are the original's, rounded per block
            assert (r - o).abs().max() < 4 * GAP_TOL
        top2 = r.topk(2).values
        if top2[0] - top2[1] > GAP_TOL:
            assert int(c.argmax()) == int(r.argmax()), tokens
            compared += 1
        assert (c - r).abs().max() < 4 * GAP_TOL
        tokens.append(int(r.argmax()))
    assert compared >= 5


@pytest.mark.parametrize("embed_type", ["Q8_0", "Q6_K"])
def test_an_untied_embedding_looks_tokens_up_in_the_file_blocks(
    wide_llama_dir, tmp_path, embed_type
):
    """token_embd in a block type, the LM head its own output.weight: the embedding keeps no
    float table (loaded as a held parameter, never read) and each step dequantizes its tokens'
    rows, equal to the dequantized model's lookup; an id past the vocabulary raises."""
    from engine.layers.quantization.gguf import GGUFEmbeddingRows, block_parameters

    path = tmp_path / "embed.gguf"
    write_gguf(wide_llama_dir, path, "Q8_0", embed_type=embed_type)
    folder = tmp_path / "dequantized"
    shutil.copytree(wide_llama_dir, folder)
    _write_weights(
        GGUFReader(str(path)),
        {"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS},
        folder,
    )
    ref = load_model(folder, dtype="bfloat16")
    model = load_model(folder, dtype="bfloat16")
    paths = apply_gguf_blocks(model, path)
    (why,) = paths["embed_tokens"]
    assert why.startswith(f"{embed_type} rows dequantized per token"), why
    embed = model.model.embed_tokens
    assert isinstance(embed.rows, GGUFEmbeddingRows) and embed.weight.numel() == 0
    assert "model.embed_tokens.weight" in block_parameters(model)
    ids = torch.tensor([0, 5, 17, 5, embed.num_embeddings - 1])
    assert torch.equal(embed(ids), ref.model.embed_tokens(ids))
    tokens = [5, 9, 17, 3, 11]
    torch.testing.assert_close(_logits(model, tokens), _logits(ref, tokens), rtol=0.05, atol=0.2)
    with pytest.raises(IndexError):
        embed(torch.tensor([embed.num_embeddings]))


def test_a_tied_embedding_keeps_its_float_table(tiny_qwen2_dir, tmp_path):
    path = tmp_path / "tied.gguf"
    write_gguf(tiny_qwen2_dir, path, "Q8_0", arch="qwen2", embed_type="Q8_0")
    model = load_model(tiny_qwen2_dir, dtype="bfloat16")
    paths = apply_gguf_blocks(model, path)
    assert paths["embed_tokens"] == {"dequantized (tied: the LM head shares its float table)": 1}
    assert model.model.embed_tokens.rows is None and model.model.embed_tokens.weight.numel() > 0
