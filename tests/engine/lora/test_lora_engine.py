"""Multi-LoRA serving end to end: greedy tokens of each request equal HF + peft's merged
model for its adapter, in one batch mixing three adapters and the base model; with fewer
slots than adapters in flight (swapping), prefix caching across adapters, chunked prefill."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from tests.engine.lora.lora_testing import NUM_NEW, expected_tokens, make_adapter, merged_greedy


@pytest.fixture(scope="module")
def llama_adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("llama-adapters")
    return [
        make_adapter(tiny_llama_dir, root / "all-r8", r=8, alpha=16, seed=1),
        make_adapter(tiny_llama_dir, root / "qv-r16", r=16, alpha=8, targets=["q_proj", "v_proj"], seed=2),
        make_adapter(
            tiny_llama_dir, root / "mlp-r4-rslora", r=4, alpha=4, use_rslora=True,
            targets=["gate_proj", "up_proj", "down_proj", "o_proj"], seed=3,
        ),
    ]  # fmt: skip


def _prompts(vocab: int, n: int, seed: int = 7, shared: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (shared,), generator=g).tolist()
    lengths = [5, 19, 33, 11, 24, 40, 8, 17]
    return [
        prefix + torch.randint(3, vocab, (lengths[i % 8],), generator=g).tolist() for i in range(n)
    ]


def _expected(model_dir, adapters, prompts, assign):
    """The reference tokens of each prompt for its adapter index (None: the base)."""
    return expected_tokens(model_dir, adapters, prompts, assign)


def _run(model_dir, adapters, prompts, assign, n: int = 1, **kwargs):
    kwargs.setdefault("num_kv_blocks", 128)
    llm = LLM(str(model_dir), dtype="float32", seed=0, enable_lora=True, **kwargs)
    loras = [None if a is None else LoRARequest(f"a{a}", a + 1, str(adapters[a])) for a in assign]
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, n=n)
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    if n > 1:  # greedy samples are all the same
        assert all(len({tuple(c.token_ids) for c in o.outputs}) == 1 for o in outs)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_mixed_batch_matches_merged_models(tiny_llama_dir, llama_adapters):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(tiny_llama_dir)).vocab_size
    prompts = _prompts(vocab, 8)
    assign = [0, None, 1, 2, 0, 2, None, 1]
    want = _expected(tiny_llama_dir, llama_adapters, prompts, assign)
    # the adapters change the output: otherwise this test would prove nothing
    base = merged_greedy(tiny_llama_dir, None, prompts, NUM_NEW)
    assert all(want[i] != base[i] for i, a in enumerate(assign) if a is not None)
    llm, got = _run(tiny_llama_dir, llama_adapters, prompts, assign, max_loras=3)
    assert got == want
    assert llm.engine.scheduler.stats().kv_usage == 0.0
    llm.shutdown()


def test_fewer_slots_than_adapters_in_flight(tiny_llama_dir, llama_adapters):
    """max_loras=1 with three adapters and the base in flight: adapters take turns in the
    one slot (and, with max_cpu_loras=1, are read again from their folders)."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(tiny_llama_dir)).vocab_size
    prompts = _prompts(vocab, 7, seed=11)
    assign = [2, 0, None, 1, 0, 2, 1]
    want = _expected(tiny_llama_dir, llama_adapters, prompts, assign)
    llm, got = _run(tiny_llama_dir, llama_adapters, prompts, assign, max_loras=1, max_cpu_loras=1)
    assert got == want
    manager = llm.engine.executor.runner.lora_manager
    assert manager.num_swaps >= 3 and manager.num_loads >= 3
    llm.shutdown()


def test_prefix_cache_is_never_shared_across_adapters(tiny_llama_dir, llama_adapters):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(tiny_llama_dir)).vocab_size
    prompts = _prompts(vocab, 4, seed=5, shared=48)  # three full blocks in common
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=128,
        seed=0,
        enable_lora=True,
        max_loras=2,
    )
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    a0 = LoRARequest("a0", 1, str(llama_adapters[0]))
    a1 = LoRARequest("a1", 2, str(llama_adapters[1]))
    first = llm.generate(prompts[0], params, lora_request=a0, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    # the same prefix: another adapter and the base model miss, the same adapter hits
    other, base, same = (
        llm.generate(prompts[i], params, lora_request=lora, use_tqdm=False)[0]
        for i, lora in ((1, a1), (2, None), (3, a0))
    )
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert same.num_cached_tokens == 48
    want = [
        merged_greedy(tiny_llama_dir, d, [p], NUM_NEW)[0]
        for d, p in zip(
            [llama_adapters[0], llama_adapters[1], None, llama_adapters[0]], prompts, strict=True
        )
    ]
    got = [o.outputs[0].token_ids for o in (first, other, base, same)]
    assert got == want
    llm.shutdown()


def test_chunked_prefill_with_adapters(tiny_llama_dir, llama_adapters):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(tiny_llama_dir)).vocab_size
    prompts = _prompts(vocab, 6, seed=3, shared=20)
    assign = [0, 1, 2, None, 2, 0]
    want = _expected(tiny_llama_dir, llama_adapters, prompts, assign)
    llm, got = _run(
        tiny_llama_dir, llama_adapters, prompts, assign, max_loras=2, max_num_batched_tokens=16
    )
    assert got == want
    llm.shutdown()


def test_qwen2_mixed_batch(tiny_qwen2_dir, tmp_path):
    """Qwen2: biases on q/k/v, tied embeddings."""
    from transformers import AutoConfig

    adapters = [
        make_adapter(tiny_qwen2_dir, tmp_path / "q0", r=8, alpha=16, seed=4),
        make_adapter(tiny_qwen2_dir, tmp_path / "q1", r=16, alpha=32, targets=["k_proj", "down_proj"], seed=5),
        make_adapter(tiny_qwen2_dir, tmp_path / "q2", r=4, alpha=8, targets=["v_proj", "up_proj"], seed=6),
    ]  # fmt: skip
    vocab = AutoConfig.from_pretrained(str(tiny_qwen2_dir)).vocab_size
    prompts = _prompts(vocab, 5, seed=9)
    assign = [0, 1, None, 2, 1]
    want = _expected(tiny_qwen2_dir, adapters, prompts, assign)
    llm, got = _run(tiny_qwen2_dir, adapters, prompts, assign, max_loras=3)
    assert got == want
    llm.shutdown()


def test_quantized_base_weights_take_adapters(tiny_llama_dir, llama_adapters):
    """int8 weights (a quantized linear method): the deltas are added after its product, so an
    adapter changes the tokens as it does over float weights (compared at the first token,
    where int8's own error has not compounded)."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(tiny_llama_dir)).vocab_size
    prompts = _prompts(vocab, 4, seed=13)
    assign = [0, None, 1, 2]
    want = _expected(tiny_llama_dir, llama_adapters, prompts, assign)
    llm, got = _run(
        tiny_llama_dir, llama_adapters, prompts, assign, max_loras=3, quantization="int8"
    )
    llm.shutdown()
    assert [g[0] for g in got] == [w[0] for w in want]


def test_preemption_and_forks_keep_each_adapter(tiny_llama_dir, llama_adapters):
    """A small KV cache (recompute preemption: a preempted request comes back under the
    max_loras rule) and n=2 (the forked sample keeps its parent's adapter)."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(tiny_llama_dir)).vocab_size
    prompts = _prompts(vocab, 6, seed=17)
    assign = [1, 0, 2, None, 0, 1]
    want = _expected(tiny_llama_dir, llama_adapters, prompts, assign)
    llm, got = _run(
        tiny_llama_dir,
        llama_adapters,
        prompts,
        assign,
        n=2,
        max_loras=2,
        num_kv_blocks=16,
        max_model_len=64,
        block_size=8,
    )
    assert got == want
    assert llm.engine.scheduler.stats().num_preemptions > 0
    llm.shutdown()


def test_the_triton_kernels_serve_a_mixed_batch(tiny_llama_dir, llama_adapters, monkeypatch):
    """The whole engine on the Triton shrink/expand (under the interpreter without a GPU)."""
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and not under the Triton interpreter")
    monkeypatch.setenv("TESSERA_LORA_KERNEL", "triton")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(tiny_llama_dir)).vocab_size
    prompts = _prompts(vocab, 4, seed=19)
    assign = [0, 2, None, 1]
    want = _expected(tiny_llama_dir, llama_adapters, prompts, assign)
    llm, got = _run(tiny_llama_dir, llama_adapters, prompts, assign, max_loras=3)
    assert llm.engine.executor.runner.lora_manager.batch.kernel == "triton"
    llm.shutdown()
    assert got == want


def test_lora_decode_steps_replay_in_cuda_graphs(tiny_llama_dir, llama_adapters, monkeypatch):
    """CUDA graphs with adapters, their logic on the CPU: the graph runner (EagerReplay) holds
    the LoRA Triton kernels (the interpreter without a GPU) over the batch's fixed segment
    buffers. Five requests on three adapters and the base decode as padded batches of eight
    (the step's rows after three padding rows) and give HF + peft's tokens; then a batch of
    the base alone replays with no delta, and an adapter with an embedding delta runs its
    steps eagerly (the graph holds no host-grouped embedding rows). On a GPU: the engine's
    own captured graphs."""
    import os

    from engine.worker.cuda_graph import CudaGraphRunner, EagerReplay, batch_ladder

    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and not under the Triton interpreter")
    monkeypatch.setenv("TESSERA_LORA_KERNEL", "triton")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(tiny_llama_dir)).vocab_size
    prompts = _prompts(vocab, 5, seed=23)
    assign = [0, 1, None, 2, 0]
    want = _expected(tiny_llama_dir, llama_adapters, prompts, assign)
    base = _expected(tiny_llama_dir, llama_adapters, prompts, [None] * 5)
    llm = LLM(str(tiny_llama_dir), dtype="float32", seed=0, enable_lora=True, max_loras=3,
              device="cuda" if cuda else "cpu", attention_backend="auto" if cuda else "torch",
              num_kv_blocks=128, max_num_seqs=8)  # fmt: skip
    try:
        runner = llm.engine.executor.runner
        if cuda:
            graphs = runner._step_graph
            assert isinstance(graphs, CudaGraphRunner)
        else:
            assert runner._step_graph is None  # float32 on the CPU: no decode plan
            graphs = CudaGraphRunner(
                runner.model, runner.attn_backend, batch_ladder(8),
                -(-runner.max_model_len // runner.block_size), EagerReplay(), "cpu",
            )  # fmt: skip
            graphs.capture_all()
            runner._step_graph = graphs
        assert graphs.takes_lora
        graphs.runs.clear()
        loras = [None if a is None else LoRARequest(f"a{a}", a + 1, str(llama_adapters[a]))
                 for a in assign]  # fmt: skip
        params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert graphs.runs == {8: NUM_NEW - 1}  # every decode step through the graph
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == base  # the buffers hold no segment
        assert graphs.runs == {8: 2 * (NUM_NEW - 1)}
        vocab_adapter = make_adapter(
            tiny_llama_dir, llama_adapters[0].parent / "embed", r=4,
            targets=["q_proj", "embed_tokens"], seed=24,
        )  # fmt: skip
        embed = LoRARequest("embed", 9, str(vocab_adapter))
        outs = llm.generate(prompts[:2], params, lora_request=[embed, None], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [
            merged_greedy(tiny_llama_dir, vocab_adapter, prompts[:1], NUM_NEW)[0],
            base[1],
        ]
        assert graphs.runs == {8: 2 * (NUM_NEW - 1)}  # its steps ran eagerly
    finally:
        llm.shutdown()


def test_adapters_in_speculative_verification_graphs(tiny_llama_dir, llama_adapters, monkeypatch):
    """N-gram speculative decoding with adapters, verification steps in the verify graphs
    (CUDA graphs' logic on the CPU, TESSERA_STEP_GRAPH=replay; the LoRA Triton kernels, interpreted
    without a GPU): each request's rows sit before its padding tokens in the graph, and the
    segment buffers follow them; the prompts' chunks (32-token steps) in piecewise graphs, the
    segments at the step's own rows; HF + peft's tokens for each adapter and the base."""
    import os

    from tests.engine.spec_decode.graphs_testing import REPLAY, step_graphs

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and not under the Triton interpreter")
    monkeypatch.setenv("TESSERA_LORA_KERNEL", "triton")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(tiny_llama_dir)).vocab_size
    units = _prompts(vocab, 4, seed=31)
    prompts = [u[:6] * 3 for u in units]  # repeats: the n-gram lookups find drafts
    assign = [0, 1, None, 2]
    want = _expected(tiny_llama_dir, llama_adapters, prompts, assign)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    monkeypatch.setenv(*REPLAY)
    llm = LLM(str(tiny_llama_dir), dtype="float32", seed=0, enable_lora=True, max_loras=3,
              device="cpu", attention_backend="torch", num_kv_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=32, speculative_config=spec,
              async_scheduling=False)  # fmt: skip
    try:
        graphs, _ = step_graphs(llm)
        assert graphs.takes_lora and graphs.piece_ladder[-1] == 32
        loras = [None if a is None else LoRARequest(f"a{a}", a + 1, str(llama_adapters[a]))
                 for a in assign]  # fmt: skip
        params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert llm.engine.scheduler.stats().spec_decoding.num_draft_tokens > 0
        assert sum(graphs.verify_runs.values()) > 0 and sum(graphs.piece_runs.values()) > 0
    finally:
        llm.shutdown()


def test_a_bf16_model_on_bf16_slots_gives_the_float32_slots_tokens(
    tiny_llama_dir, llama_adapters, monkeypatch
):
    """bf16 model: the C kernel's bf16 slots (lora_apply_bf16w) against the torch path's float32
    slots (the path the float32 tests above hold to HF + peft), greedy tokens of a batch mixing
    three adapters and the base."""
    from engine.kernels.cpu import lora as cpu_lora

    if not cpu_lora.available():
        pytest.skip("CPU kernels not built")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(tiny_llama_dir)).vocab_size
    prompts = _prompts(vocab, 6, seed=23)
    assign = [0, 1, None, 2, 0, 1]
    runs = {}
    for kernel in ("torch", "cpu"):
        monkeypatch.setenv("TESSERA_LORA_KERNEL", kernel)
        llm = LLM(
            str(tiny_llama_dir), dtype="bfloat16", seed=0, enable_lora=True, max_loras=3,
            num_kv_blocks=128,
        )  # fmt: skip
        manager = llm.engine.executor.runner.lora_manager
        loras = [
            None if a is None else LoRARequest(f"a{a}", a + 1, str(llama_adapters[a]))
            for a in assign
        ]
        params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        runs[kernel] = ([o.outputs[0].token_ids for o in outs], manager.dtype)
        llm.shutdown()
    assert runs["torch"][1] == torch.float32 and runs["cpu"][1] == torch.bfloat16
    assert runs["cpu"][0] == runs["torch"][0]
