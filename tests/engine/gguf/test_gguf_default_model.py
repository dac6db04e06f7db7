"""The default model: GGUF -> HF folder conversion (once, cached), tokenizer and logits."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from engine.attention.backends import cpu as cpu_backend
from engine.attention.backends.cpu import CpuAttentionBackend
from engine.attention.backends.torch import TorchAttentionBackend
from engine.attention.metadata import common_metadata_from_seqs
from engine.config import DEFAULT_MODEL
from engine.gguf.convert import LINK, _unpermute
from engine.gguf.source import default_gguf_path
from engine.layers.quantization.gguf import q8_tiles_head
from engine.models.loader import load_model, resolve_model

pytestmark = pytest.mark.slow


def test_unpermute_inverts_llama_cpp_permute():
    # llama.cpp's convert_hf_to_gguf permute(), applied to known rows, then undone.
    n_head, rows, cols = 3, 3 * 8, 5
    w = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols).numpy()
    permuted = w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert (_unpermute(permuted, n_head) == w).all()


def test_converted_folder_and_cache(default_model_dir):
    cfg = json.loads((default_model_dir / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152 and cfg["rope_theta"] == 100000.0
    assert cfg["tie_word_embeddings"] is True
    # A second resolve finds the cached folder and converts nothing.
    # the file's float32 tensors only (the norms): the Q8_0 embedding and the linear layers'
    # Q4_1 blocks stay in the linked file
    shards = sorted(default_model_dir.glob("*.safetensors"))
    assert [p.name for p in shards] == ["model.safetensors"]
    names = set(load_file(str(shards[0])))
    assert len(names) == 2 * 30 + 1 and all(n.endswith("norm.weight") for n in names)
    link = json.loads((default_model_dir / LINK).read_text())
    assert link["path"] == str(default_gguf_path().resolve())
    mtimes = [os.stat(p).st_mtime_ns for p in shards]
    assert (
        resolve_model(DEFAULT_MODEL, cache_dir=default_model_dir.parent.parent) == default_model_dir
    )
    assert [os.stat(p).st_mtime_ns for p in shards] == mtimes
    assert not [p for p in default_model_dir.parent.iterdir() if p.name.startswith(".tmp")]


def test_tokenizer_has_chat_template_and_eos(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


def test_logits_match_hf_and_answer_paris(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Name the capital of France."}],
        tokenize=True,
        add_generation_prompt=True,
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    gguf = default_gguf_path()  # transformers dequantizes the file itself: an independent read
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    model = load_model(default_model_dir, dtype="float32")
    cfg = model.config
    bs, nb = 16, 16
    caches = [torch.zeros(2, nb, bs, 3, 64) for _ in range(cfg.num_hidden_layers)]
    for attn, c in zip(model.attention_layers(), caches, strict=True):
        attn.kv_cache = c
    backend = TorchAttentionBackend(bs, 9, 3, 64, torch.float32)
    for attn in model.attention_layers():
        attn.backend = backend
    blocks = list(range(nb - 1, 0, -1))  # descending block ids
    with torch.inference_mode():
        meta = backend.build_metadata(common_metadata_from_seqs([(0, len(prompt), blocks)], bs))
        logits = model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt)), meta))
        # float32 sums in another order than HF's (the BLAS picks its blocking per CPU): on
        # logits of magnitude ~20, differences of a few 1e-5 relative
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=2e-5)
        toks = list(prompt)
        out = [int(logits[-1].argmax())]
        while len(out) < 12 and out[-1] != tok.eos_token_id:
            toks.append(out[-1])
            meta = backend.build_metadata(
                common_metadata_from_seqs([(len(toks) - 1, 1, blocks)], bs)
            )
            h = model(torch.tensor([out[-1]]), torch.tensor([len(toks) - 1]), meta)
            out.append(int(model.compute_logits(h)[-1].argmax()))
    assert "Paris" in tok.decode(out)


def test_quantized_models_stay_close_to_the_float_model(default_model_dir, monkeypatch):
    """The real model's next-token distributions over a chat prompt and a paragraph: int8
    weights alone stay very close to float32, int8 activations too (w8a8) cost more but stay
    within the loss of a 4-bit GGUF (a mean KL of ~0.05 measured over 1,024 tokens); an int8
    KV cache costs less than int8 weights (~0.003 over 1,024 tokens); all still answer, w4a8's
    answer decoded one row at a time on its 4-bit weights."""
    from transformers import AutoTokenizer

    from engine.attention.cpu_kernel import kernel_supports
    from engine.attention.kv_int8 import Int8KVCacheSpec
    from engine.attention.kv_int8 import allocate_scales as kv_scales
    from engine.kernels.cpu import w4 as cpu_w4
    from engine.layers.quantization.quantize import quantize_model

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    text = (
        "The Eiffel Tower was built for the 1889 World's Fair in Paris. At first many artists "
        "disliked it, but it soon became the most visited paid monument in the world."
    )
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": text + " What is the capital of France?"}],
        tokenize=True,
        add_generation_prompt=True,
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)

    def logits_and_answer(quantization, kv_int8=False):
        model = load_model(default_model_dir, dtype="bfloat16")
        quantize_model(model, quantization)
        bs, nb = 16, 16
        for attn in model.attention_layers():
            attn.kv_cache = torch.zeros(
                2, nb, bs, 3, 64, dtype=torch.int8 if kv_int8 else torch.bfloat16
            )
            attn.kv_scales = kv_scales(nb, bs, 3, "cpu") if kv_int8 else None
            attn.kv_spec = Int8KVCacheSpec(bs, 3, 64, torch.bfloat16) if kv_int8 else None
        # the prompt's attention through the kernel reads the cache, as decode steps do (with
        # AMX the server sends prompts past 64 tokens to SDPA, which reads K/V as computed)
        kernel = kernel_supports(torch.bfloat16, torch.device("cpu"), 3, 64)
        monkeypatch.setattr(
            cpu_backend, "AMX_KERNEL_PREFILL_MAX_CONTEXT", cpu_backend.KERNEL_PREFILL_MAX_CONTEXT
        )
        backend = (CpuAttentionBackend if kernel else TorchAttentionBackend)(
            bs, 9, 3, 64, torch.bfloat16
        )
        for attn in model.attention_layers():
            attn.backend = backend
        blocks = list(range(1, nb))
        with torch.inference_mode():
            meta = backend.build_metadata(common_metadata_from_seqs([(0, len(prompt), blocks)], bs))
            pos = torch.arange(len(prompt))
            logits = model.compute_logits(model(torch.tensor(prompt), pos, meta))
            out = [int(logits[-1].argmax())]
            while len(out) < 16 and out[-1] != tok.eos_token_id:
                step = [(len(prompt) + len(out) - 1, 1, blocks)]
                meta = backend.build_metadata(common_metadata_from_seqs(step, bs))
                pos = torch.tensor([len(prompt) + len(out) - 1])
                h = model(torch.tensor([out[-1]]), pos, meta)
                out.append(int(model.compute_logits(h)[-1].argmax()))
        return logits.log_softmax(-1), tok.decode(out)

    ref, _ = logits_and_answer(None)
    kl = {}
    # w4a8: the prompt runs as w8a8, the one-row decode steps on 4-bit weights
    for q in ("int8", "w8a8") + (("w4a8",) if cpu_w4.available() else ()):
        lp, answer = logits_and_answer(q)
        kl[q] = float((ref.exp() * (ref - lp)).sum(-1).mean())
        assert "Paris" in answer, (q, answer)
    lp, answer = logits_and_answer(None, kv_int8=True)
    kl["kv_int8"] = float((ref.exp() * (ref - lp)).sum(-1).mean())
    assert "Paris" in answer, answer
    assert 0 < kl["int8"] < kl["w8a8"] < 0.15, kl
    assert 0 < kl["kv_int8"] < 0.02, kl


def test_file_blocks_answer_paris(default_model_dir):
    """--quantization gguf: every linear layer on the bundled file's own Q4_1 blocks (its
    weights' bytes are the file tensors'), prompt and one-row decode steps, still answers."""
    from transformers import AutoTokenizer

    from engine.gguf.source import default_gguf_path
    from engine.kernels.cpu import w4 as cpu_w4
    from engine.layers.quantization.gguf import GGUFLinearMethod
    from engine.layers.quantization.quantize import quantize_model

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Name the capital of France."}],
        tokenize=True,
        add_generation_prompt=True,
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    model = load_model(default_model_dir, dtype="bfloat16")
    # every linear layer, and the LM head on the file's Q8_0 token_embd rows (tied)
    assert quantize_model(model, "gguf", gguf_path=default_gguf_path()) == 30 * 4 + 1
    head = model.lm_head
    if q8_tiles_head():  # AVX2, or VNNI without AMX: the rows as tiles, 32 bytes a group more
        assert head.q8_tiles.data.nbytes == 49152 // 16 * 576 // 32 * cpu_w4.Q8_GROUP_BYTES
    else:
        assert head.gguf_blocks.nbytes == 49152 * 576 // 32 * 34
    linears = [
        m for m in model.modules() if isinstance(getattr(m, "quant_method", None), GGUFLinearMethod)
    ]
    assert sum(m.weight.nbytes for m in linears) < 0.7 * 135e6  # ~0.625 bytes a weight
    bs, nb = 16, 16
    backend = TorchAttentionBackend(bs, 9, 3, 64, torch.bfloat16)
    for attn in model.attention_layers():
        attn.kv_cache = torch.zeros(2, nb, bs, 3, 64, dtype=torch.bfloat16)
        attn.backend = backend
    blocks = list(range(1, nb))
    with torch.inference_mode():
        meta = backend.build_metadata(common_metadata_from_seqs([(0, len(prompt), blocks)], bs))
        h = model(torch.tensor(prompt), torch.arange(len(prompt)), meta)
        out = [int(model.compute_logits(h)[-1].argmax())]
        while len(out) < 12 and out[-1] != tok.eos_token_id:
            pos = len(prompt) + len(out) - 1
            meta = backend.build_metadata(common_metadata_from_seqs([(pos, 1, blocks)], bs))
            h = model(torch.tensor([out[-1]]), torch.tensor([pos]), meta)
            out.append(int(model.compute_logits(h)[-1].argmax()))
    assert "Paris" in tok.decode(out), tok.decode(out)


def _default_llm(**kw):
    from engine import LLM

    return LLM(max_model_len=256, num_kv_blocks=64, enable_prefix_caching=False, **kw)


def test_default_settings_serve_the_file_as_w4_tiles_and_none_dequantizes(monkeypatch):
    """No --quantization: the bundled Q4_1 file's blocks as w4 tiles (one-row decode steps on
    the decode plan's W4 kind, the same tokens as the modules), greedy "Paris"; the explicit
    `none` override gives the old path, the dequantized bf16 weights."""
    from engine import SamplingParams
    from engine.kernels.cpu import w4 as cpu_w4
    from engine.layers.quantization.gguf import (
        GGUFLMHeadMethod,
        GGUFQ8TilesHeadMethod,
        GGUFW4LinearMethod,
    )
    from engine.layers.quantization.unquantized import UnquantizedLinearMethod

    params = SamplingParams(max_tokens=8, temperature=0)
    prompt = "The capital of France is"
    runs = {}
    for plan in ("1", "0"):
        monkeypatch.setenv("TESSERA_DECODE_PLAN", plan)
        llm = _default_llm()
        runner = llm.engine.executor.runner
        assert runner.quantization == "gguf"
        linears = [m for layer in runner.model.model.layers for m in layer.modules()]
        methods = [m.quant_method for m in linears if hasattr(m, "quant_method")]
        if cpu_w4.available():
            assert len(methods) == 30 * 4 and all(
                isinstance(q, GGUFW4LinearMethod) for q in methods
            )
        head_method = GGUFQ8TilesHeadMethod if q8_tiles_head() else GGUFLMHeadMethod
        assert isinstance(runner.model.lm_head.quant_method, head_method)
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        runs[plan] = (out.token_ids, runner._step_graph)
        llm.shutdown()
        assert "Paris" in out.text, out.text
    if cpu_w4.available():
        assert runs["1"][1] is not None and runs["1"][1].runs.get(1, 0) > 0  # the plan's W4
        assert runs["0"][1] is None
    assert runs["1"][0] == runs["0"][0]

    llm = _default_llm(quantization="none")
    runner = llm.engine.executor.runner
    assert runner.quantization is None and runner.dtype == torch.bfloat16
    layer = runner.model.model.layers[0]
    assert isinstance(layer.mlp.down_proj.quant_method, UnquantizedLinearMethod)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    llm.shutdown()
    assert "Paris" in out.text, out.text
