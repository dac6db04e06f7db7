"""The pooling runner offline (LLM.embed) against HF transformers' hidden states on the same
tiny random folders: last-token, mean and CLS pooling, normalized or not, through chunked
prefill (prompts longer than the 16-token step budget) and the prefix cache (a repeated
prompt), Matryoshka dimensions, and the runner's refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM
from engine.pooler_config import read_pooler_config, resolve_runner
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams

LONG = "The capital of France is Paris. Paris is a city on the Seine. " * 4
PROMPTS = ["Hello world", "The quick brown fox", LONG, "Hello world", LONG]
CHUNK = 16  # the step's token budget: LONG takes several steps


def make_llm(folder, **options) -> LLM:
    return LLM(
        str(folder),
        dtype="float32",
        device="cpu",
        num_kv_blocks=64,
        max_model_len=256,
        max_num_batched_tokens=CHUNK,
        **options,
    )


def hf_hidden(folder, token_ids: list[int]) -> torch.Tensor:
    """HF AutoModel's last_hidden_state (after the final norm) for one prompt: [T, H]."""
    from transformers import AutoModel

    model = hf_hidden.cache.get(str(folder))
    if model is None:
        model = hf_hidden.cache[str(folder)] = AutoModel.from_pretrained(
            str(folder), dtype=torch.float32
        ).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).last_hidden_state[0]


hf_hidden.cache = {}


def reference(folder, token_ids, mode: str, normalize: bool, dims: int | None = None):
    hidden = hf_hidden(folder, token_ids)
    vec = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[mode]
    if dims is not None:
        vec = vec[:dims]
    return F.normalize(vec, dim=-1) if normalize else vec


def assert_no_leak(llm: LLM) -> None:
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == llm.engine.num_blocks - 1, "KV blocks leaked"
    assert not llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def last_llm(tiny_embedding_dir):
    llm = make_llm(tiny_embedding_dir)  # runner auto: Qwen3Model has no LM head
    yield llm
    llm.shutdown()


def test_auto_runner_picks_pooling_for_embedding_folders(tiny_embedding_dir, tiny_llama_dir):
    assert resolve_runner("auto", tiny_embedding_dir, "Qwen3Model") == "pooling"
    assert resolve_runner("auto", tiny_llama_dir, "LlamaForCausalLM") == "generate"
    with pytest.raises(ValueError, match="--runner pooling"):
        resolve_runner("generate", tiny_embedding_dir, "Qwen3Model")


def test_last_token_matches_hf_through_chunks_and_prefix_cache(last_llm, tiny_embedding_dir):
    assert last_llm.engine.runner == "pooling"
    hits_before = last_llm.engine.scheduler.stats().prefix_cache_hits
    outs = last_llm.embed(PROMPTS, use_tqdm=False)
    assert len(last_llm.tokenizer.encode(LONG)) > 3 * CHUNK
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = last_llm.tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        want = reference(tiny_embedding_dir, ids, "LAST", normalize=True)
        got = torch.tensor(out.outputs.embedding)
        assert got.shape == (64,) and out.embedding == out.outputs.embedding
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        assert abs(got.norm().item() - 1) < 1e-5
    # the repeated LONG prompt's full blocks came from the cache (its last position recomputed)
    again = last_llm.embed([LONG], use_tqdm=False)[0]
    assert last_llm.engine.scheduler.stats().prefix_cache_hits > hits_before
    torch.testing.assert_close(
        torch.tensor(again.embedding), torch.tensor(outs[2].embedding), atol=2e-5, rtol=1e-4
    )
    assert_no_leak(last_llm)


def test_token_id_prompts_and_matryoshka_dimensions(last_llm, tiny_embedding_dir):
    ids = last_llm.tokenizer.encode("Tessera serves language models")
    out = last_llm.embed([ids], PoolingParams(dimensions=16), use_tqdm=False)[0]
    want = reference(tiny_embedding_dir, ids, "LAST", normalize=True, dims=16)
    torch.testing.assert_close(torch.tensor(out.embedding), want, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="dimensions.*16, 32, 64"):
        last_llm.embed("Hello", PoolingParams(dimensions=20), use_tqdm=False)
    assert_no_leak(last_llm)


def test_pooling_engine_refuses_generation_and_long_inputs(last_llm):
    with pytest.raises(ValueError, match="pooling runner"):
        last_llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length is 256"):
        last_llm.embed([[5] * 257], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        last_llm.embed([[]], use_tqdm=False)
    assert last_llm.embed([[5] * 256], use_tqdm=False)[0].outputs.hidden_size == 64
    assert_no_leak(last_llm)


@pytest.mark.parametrize(
    ("mode", "normalize", "pooling_type"),
    [("mean_tokens", True, "MEAN"), ("cls_token", False, "CLS"), ("lasttoken", False, "LAST")],
)
def test_sentence_transformers_pooling_matches_hf(
    make_embedding_model, mode, normalize, pooling_type
):
    folder = make_embedding_model(
        f"st-{mode}", arch="llama", pooling_mode=mode, normalize=normalize, seed=12
    )
    pooler = read_pooler_config(folder, {}, 64)
    assert (pooler.pooling_type, pooler.normalize) == (pooling_type, normalize)
    llm = make_llm(folder)
    try:
        outs = llm.embed(PROMPTS, use_tqdm=False)
        for prompt, out in zip(PROMPTS, outs, strict=True):
            ids = llm.tokenizer.encode(prompt)
            want = reference(folder, ids, pooling_type, normalize)
            torch.testing.assert_close(torch.tensor(out.embedding), want, atol=2e-5, rtol=1e-4)
        if pooling_type != "LAST":  # every position pooled: the cache is not consulted
            assert llm.engine.scheduler.stats().prefix_cache_hits == 0
        with pytest.raises(ValueError, match="dimensions: this model does not support Matryoshka"):
            llm.embed("Hello", PoolingParams(dimensions=8), use_tqdm=False)
        assert_no_leak(llm)
    finally:
        llm.shutdown()


def test_unsupported_sentence_transformers_modules_are_refused(tmp_path):
    import json

    (tmp_path / "modules.json").write_text(
        json.dumps([{"path": "2_Dense", "type": "sentence_transformers.models.Dense"}])
    )
    with pytest.raises(ValueError, match="Dense.*not supported"):
        read_pooler_config(tmp_path, {}, 64)
    (tmp_path / "modules.json").write_text(
        json.dumps([{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}])
    )
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_max_tokens": True})
    )
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        read_pooler_config(tmp_path, {}, 64)


def test_generate_engine_refuses_embed(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    try:
        assert llm.engine.runner == "generate"
        with pytest.raises(ValueError, match="--runner pooling"):
            llm.embed("Hello", use_tqdm=False)
        assert_no_leak(llm)
    finally:
        llm.shutdown()


def test_causal_lm_folder_pools_with_runner_pooling(tiny_qwen2_dir):
    """A ForCausalLM checkpoint served with --runner pooling: its LM head is not loaded, and
    the vector is HF's last hidden state of the base model."""
    llm = make_llm(tiny_qwen2_dir, runner="pooling")
    try:
        assert llm.engine.executor.runner.model.lm_head is None
        ids = llm.tokenizer.encode(LONG)
        out = llm.embed([ids], use_tqdm=False)[0]
        want = reference(tiny_qwen2_dir, ids, "LAST", normalize=True)
        torch.testing.assert_close(torch.tensor(out.embedding), want, atol=2e-5, rtol=1e-4)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_tensor_parallel_pooling_matches_hf(make_embedding_model):
    """Two gloo ranks on the CPU: the worker rank runs the layers' collectives and pools
    nothing, the driver pools; the vectors are HF's."""
    torch.set_num_threads(1)
    folder = make_embedding_model(
        "st-mean_tokens", arch="llama", pooling_mode="mean_tokens", normalize=True, seed=12
    )
    llm = make_llm(folder, tensor_parallel_size=2)
    try:
        outs = llm.embed(PROMPTS[:3], use_tqdm=False)
        for prompt, out in zip(PROMPTS[:3], outs, strict=True):
            want = reference(folder, llm.tokenizer.encode(prompt), "MEAN", normalize=True)
            torch.testing.assert_close(torch.tensor(out.embedding), want, atol=2e-5, rtol=1e-4)
    finally:
        llm.shutdown()
