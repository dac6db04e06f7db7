"""LoRA on the token embedding and the LM head (PEFT's embed_tokens / lm_head targets):
greedy tokens equal HF + peft's for each adapter in one batch mixing them with adapters on
the projections and the base model; untied (against the merged model) and tied embeddings
(against peft's unmerged model: each keeps its own delta over the shared weight); with fewer
slots than adapters in flight; the Triton kernels under the interpreter."""

from __future__ import annotations

import os

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from tests.engine.lora.lora_testing import NUM_NEW, generate_tokens, make_adapter, merged_greedy

QV = ["q_proj", "v_proj"]


def _adapters(model_dir, root):
    return [
        make_adapter(model_dir, root / "embed-head-qv", r=8, alpha=16, targets=["embed_tokens", "lm_head", *QV], seed=31),
        make_adapter(model_dir, root / "head-down", r=16, alpha=16, targets=["lm_head", "down_proj"], seed=32),
        make_adapter(model_dir, root / "embed", r=4, alpha=8, targets=["embed_tokens"], seed=33),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def tied_llama_dir(make_tiny_model):
    return make_tiny_model("tiny-llama-tied", tie_word_embeddings=True, seed=3)


@pytest.fixture(scope="module")
def untied_adapters(tiny_llama_dir, tmp_path_factory):
    return _adapters(tiny_llama_dir, tmp_path_factory.mktemp("vocab-untied"))


@pytest.fixture(scope="module")
def tied_adapters(tied_llama_dir, tmp_path_factory):
    return _adapters(tied_llama_dir, tmp_path_factory.mktemp("vocab-tied"))


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [6, 21, 13, 30, 9, 17]
    return [torch.randint(3, vocab, (lengths[i % 6],), generator=g).tolist() for i in range(n)]


def _want(model_dir, adapters, prompts, assign, merge):
    out = []
    for p, a in zip(prompts, assign, strict=True):
        d = None if a is None else adapters[a]
        out.append(merged_greedy(model_dir, d, [p], NUM_NEW, merge=merge)[0])
    return out


def _generate(model_dir, adapters, prompts, assign, **kwargs):
    """(tokens, the runner's LoRA manager: None under TP) of generate_tokens."""
    llm, tokens = generate_tokens(model_dir, adapters, prompts, assign, **kwargs)
    tp1 = kwargs.get("tensor_parallel_size", 1) == 1
    return tokens, llm.engine.executor.runner.lora_manager if tp1 else None


def _vocab(model_dir) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir)).vocab_size


def test_untied_mixed_batch_matches_merged_models(tiny_llama_dir, untied_adapters):
    prompts = _prompts(_vocab(tiny_llama_dir), 6, seed=41)
    assign = [0, None, 1, 2, 0, 1]
    want = _want(tiny_llama_dir, untied_adapters, prompts, assign, merge=True)
    base = merged_greedy(tiny_llama_dir, None, prompts, NUM_NEW)
    # each adapter changes the tokens: otherwise this would prove nothing
    assert all(want[i] != base[i] for i, a in enumerate(assign) if a is not None)
    got, manager = _generate(tiny_llama_dir, untied_adapters, prompts, assign, max_loras=3)
    assert got == want
    assert manager.embedding is not None and manager.head is not None


def test_tied_embeddings_with_swapping_match_peft(tied_llama_dir, tied_adapters):
    """A tied base: the embedding's and the head's deltas stay apart over the shared
    weight, as in peft's model; one slot and one CPU copy for three adapters in flight."""
    prompts = _prompts(_vocab(tied_llama_dir), 6, seed=43)
    assign = [2, 0, None, 1, 0, 2]
    want = _want(tied_llama_dir, tied_adapters, prompts, assign, merge=False)
    base = merged_greedy(tied_llama_dir, None, prompts, NUM_NEW)
    assert all(want[i] != base[i] for i, a in enumerate(assign) if a is not None)
    got, manager = _generate(
        tied_llama_dir, tied_adapters, prompts, assign, max_loras=1, max_cpu_loras=1
    )
    assert got == want
    assert manager.num_swaps >= 3 and manager.num_loads >= 3


def test_the_torch_path_serves_them_too(tiny_llama_dir, untied_adapters, monkeypatch):
    monkeypatch.setenv("TESSERA_LORA_KERNEL", "torch")
    prompts = _prompts(_vocab(tiny_llama_dir), 4, seed=45)
    assign = [1, 0, 2, None]
    want = _want(tiny_llama_dir, untied_adapters, prompts, assign, merge=True)
    got, manager = _generate(tiny_llama_dir, untied_adapters, prompts, assign, max_loras=2)
    assert manager.batch.kernel == "torch"
    assert got == want


def test_the_triton_kernels_serve_them(tiny_llama_dir, untied_adapters, monkeypatch):
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and not under the Triton interpreter")
    monkeypatch.setenv("TESSERA_LORA_KERNEL", "triton")
    prompts = _prompts(_vocab(tiny_llama_dir), 3, seed=47)
    assign = [0, None, 1]
    want = _want(tiny_llama_dir, untied_adapters, prompts, assign, merge=True)
    got, manager = _generate(tiny_llama_dir, untied_adapters, prompts, assign, max_loras=2)
    assert manager.batch.kernel == "triton"
    assert got == want


@pytest.mark.slow
def test_tp2_shards_the_vocabulary(tied_llama_dir, tied_adapters, tiny_llama_dir, untied_adapters):
    """Two gloo ranks: each holds its vocabulary shard of the embedding's A and the head's
    B (the all-reduce and the all-gather put the deltas together)."""
    torch.set_num_threads(1)
    for model_dir, adapters, merge in (
        (tiny_llama_dir, untied_adapters, True),
        (tied_llama_dir, tied_adapters, False),
    ):
        prompts = _prompts(_vocab(model_dir), 4, seed=49)
        assign = [0, 1, None, 2]
        want = _want(model_dir, adapters, prompts, assign, merge=merge)
        got, _ = _generate(
            model_dir, adapters, prompts, assign, max_loras=2, tensor_parallel_size=2,
            device="cpu", num_kv_blocks=64,
        )  # fmt: skip
        assert got == want


@pytest.mark.parametrize("kernel", ["torch", "cpu"])
def test_vocab_shards_add_up_to_the_full_deltas(tiny_llama_dir, untied_adapters, kernel):
    """Each rank's embedding delta (ids on other shards add nothing) summed over the ranks,
    and the head's shards side by side, equal the unsharded deltas; with 5 ranks the last
    shard is padded (its padding's logits get no delta)."""
    from engine.kernels.cpu import lora as cpu_lora
    from engine.lora.adapter import MODEL_LAYER, read_adapter, vocab_shard
    from engine.lora.layers import LoRABatch, LoRAEmbedding, LoRALayer
    from engine.models.hf_config import load_hf_config

    if kernel == "cpu" and not cpu_lora.available():
        pytest.skip("CPU kernels not built")
    cfg = load_hf_config(tiny_llama_dir)
    vocab, hidden, cpu = cfg.vocab_size, cfg.hidden_size, torch.device("cpu")
    adapter = read_adapter(untied_adapters[0], cfg, 16)
    a_e, b_e = adapter.weights[(MODEL_LAYER, "embed_tokens")]
    a_h, b_h = adapter.weights[(MODEL_LAYER, "lm_head")]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (20,), generator=g)
    h = torch.randn(5, hidden, generator=g)
    want_embed, want_head = a_e.T[ids] @ b_e.T, (h @ a_h.T) @ b_h.T
    for tp in (2, 5):
        embed_sum, heads = torch.zeros(20, hidden), []
        for rank in range(tp):
            shard = adapter.shard(cfg, rank, tp, torch.float32)
            start, _, size = vocab_shard(vocab, rank, tp)
            batch = LoRABatch(cpu, kernel)
            batch.set([(1, 0, 20)])  # slot 1 of 2: slot 0 stays empty
            emb = LoRAEmbedding(batch, start, size, hidden, 2, 16, torch.float32, cpu)
            emb.set_slot(1, shard.weights[(MODEL_LAYER, "embed_tokens")])
            emb.armed = True
            embed_sum += emb.apply(ids, torch.zeros(20, hidden))
            head_batch = LoRABatch(cpu, kernel)
            head_batch.set([(1, 0, 2), (1, 3, 2)])  # row 2: the base model's
            head = LoRALayer(head_batch, [(0, size)], hidden, 2, 16, torch.float32, cpu)
            head.set_slot(1, shard.weights[(MODEL_LAYER, "lm_head")])
            heads.append(head.apply(h, torch.zeros(5, size)))
        torch.testing.assert_close(embed_sum, want_embed, atol=1e-5, rtol=1e-5)
        logits = torch.cat(heads, dim=1)
        torch.testing.assert_close(logits[[0, 1, 3, 4], :vocab], want_head[[0, 1, 3, 4]], atol=1e-5, rtol=1e-5)  # fmt: skip
        assert not logits[2].any() and not logits[:, vocab:].any()


def test_the_decode_plan_takes_them(tiny_llama_dir, untied_adapters):
    """bf16 on packed int8 weights: steps with embedding and LM-head adapters run in the CPU
    decode plan (its embedding and LM head are the modules') with the tokens and logprobs
    of the module path, on the same adapters and cache; plain greedy steps (which may take
    the LM head's argmax epilogue, without logits) step aside for the head's deltas."""
    from engine.kernels.cpu import w4 as cpu_w4
    from engine.kernels.cpu import w8a8 as cpu_w8a8

    if not cpu_w4.available() or cpu_w8a8.pack_weight(torch.zeros(16, 4, dtype=torch.int8)) is None:
        pytest.skip("the plan's int8 kernels are not built on this CPU")
    requests = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(untied_adapters)]
    llm = LLM(
        str(tiny_llama_dir), dtype="bfloat16", num_kv_blocks=128, enable_prefix_caching=False,
        max_num_seqs=16, enable_lora=True, max_loras=3, max_lora_rank=16, quantization="w8a8",
    )  # fmt: skip
    runner = llm.engine.executor.runner
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0, logprobs=3)
    batches = [[list(range(40 + 9 * i, 49 + 9 * i + i % 7)) for i in range(n)] for n in (1, 6)]

    def run(params=params) -> list:
        outs = []
        for prompts in batches:
            loras = [None if i % 4 == 3 else requests[i % 3] for i in range(len(prompts))]
            outs += llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        return [
            (o.outputs[0].token_ids, [repr(lp) for lp in o.outputs[0].logprobs or []]) for o in outs
        ]

    try:
        runner._step_graph = runner._build_step_graph()
        plan = runner._step_graph
        assert plan is not None and plan.takes_lora
        with_plan = run()
        assert plan.runs, "no step ran in the plan"
        plain = run(SamplingParams(max_tokens=6, ignore_eos=True, temperature=0))
        assert [t for t, _ in plain] == [t for t, _ in with_plan]
        runner._step_graph = None
        without = run()
    finally:
        llm.shutdown()
    assert with_plan == without


def test_prompt_logprobs_take_each_rows_head_adapter(tiny_llama_dir, untied_adapters):
    """Prompt rows go through the LM head with their request's adapter: the prompt logprobs
    of two adapters and the base, prefilled in one step, equal peft's log_softmax."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    prompts = _prompts(_vocab(tiny_llama_dir), 3, seed=51)
    assign = [1, None, 0]
    llm = LLM(str(tiny_llama_dir), dtype="float32", seed=0, enable_lora=True, max_loras=2, num_kv_blocks=64)  # fmt: skip
    try:
        loras = [None if a is None else LoRARequest(f"a{a}", a + 1, str(untied_adapters[a])) for a in assign]  # fmt: skip
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, a, out in zip(prompts, assign, outs, strict=True):
        model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
        if a is not None:
            model = PeftModel.from_pretrained(model, str(untied_adapters[a]))
        with torch.inference_mode():
            ref = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0], dim=-1)
        got = [e.logprob for e in out.prompt_logprobs[1:]]
        want = [float(ref[i - 1, prompt[i]]) for i in range(1, len(prompt))]
        assert got == pytest.approx(want, abs=1e-4)


def test_the_head_takes_its_rows_once_and_steps_aside_for_greedy():
    """ParallelLMHead with a LoRA slot: while rows are set its argmax hook (AMX's epilogue
    on the CPU, the unquantized argmax on CUDA) is not taken; the next forward adds the
    deltas on those rows and clears them, so a later call (a proposer's) is the base's."""
    from engine.layers.embedding import ParallelLMHead
    from engine.lora.layers import LoRABatch, LoRALayer

    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(5)
    head = ParallelLMHead(40, 8)
    head.weight.data.copy_(torch.randn(40, 8, generator=g))
    head.lora = LoRALayer(LoRABatch(cpu, "torch"), [(0, 40)], 8, 1, 4, torch.float32, cpu)
    a, b = torch.randn(4, 8, generator=g), torch.randn(40, 4, generator=g)
    head.lora.set_slot(0, [(a, b)])
    h = torch.randn(3, 8, generator=g)
    base = h @ head.weight.T
    head.lora.batch.set([(0, 1, 1)])  # row 1 on the adapter
    assert head.greedy(h) is None
    logits = head(h)
    torch.testing.assert_close(logits[1], base[1] + (h[1] @ a.T) @ b.T)
    torch.testing.assert_close(logits[[0, 2]], base[[0, 2]])
    assert not head.lora.active
    torch.testing.assert_close(head(h), base)


def test_gemma3_takes_a_head_adapter_and_refuses_one_on_its_scaled_embeddings(
    tiny_gemma3_dir, tmp_path
):
    """Gemma 3: the head's delta lands before the logits' soft cap, as in HF + peft; an
    embedding adapter is refused (HF adds its delta after the embedding's sqrt(hidden)
    scale, which Tessera applies to the embedding's output)."""
    from engine.lora.adapter import read_adapter
    from engine.models.hf_config import load_hf_config

    head = make_adapter(tiny_gemma3_dir, tmp_path / "head", r=8, targets=["lm_head", "q_proj"], seed=61)  # fmt: skip
    embed = make_adapter(tiny_gemma3_dir, tmp_path / "embed", r=8, targets=["embed_tokens"], seed=62)  # fmt: skip
    with pytest.raises(ValueError, match=r"lora_embedding_[AB]: LoRA on Gemma's scaled embeddings"):
        read_adapter(embed, load_hf_config(tiny_gemma3_dir), 16, check=True)
    prompts = _prompts(_vocab(tiny_gemma3_dir), 3, seed=63)
    assign = [0, None, 0]
    want = _want(tiny_gemma3_dir, [head], prompts, assign, merge=False)
    assert want[0] != merged_greedy(tiny_gemma3_dir, None, prompts[:1], NUM_NEW)[0]
    got, _ = _generate(tiny_gemma3_dir, [head], prompts, assign, max_loras=1)
    assert got == want
