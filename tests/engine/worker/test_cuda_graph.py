"""The CUDA-graph runner (engine.worker.cuda_graph): the batch ladder, which steps a graph
takes, padding, and its logic end to end on the CPU (EagerReplay: each "replay" runs the step
again over the same static buffers), padded steps against unpadded eager ones, decode steps
and speculative decoding's verification steps (every request padded to 1 + k tokens; on the
torch backend and the Triton kernels); on a GPU (`cuda` marker) real graph replays against
eager steps."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from engine.args import EngineArgs
from engine.attention.metadata import common_metadata_from_seqs
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.worker.cuda_graph import (
    PAD_SLOT,
    CudaGraphCapture,
    CudaGraphRunner,
    EagerReplay,
    batch_ladder,
    bucket_for,
    capture_metadata,
    graph_takes,
    graphs_off_reason,
    pad_decode_metadata,
    pad_verify_metadata,
    verify_graph_takes,
    verify_ladder,
)
from engine.worker.model_runner import ModelRunner
from engine.worker.step_graph import StepInputs

BLOCK = 8
MAX_LEN = 128


def test_batch_ladder() -> None:
    assert batch_ladder(256) == (1, 2, 4, 8, 16, 24, 32, *range(48, 257, 16))
    assert batch_ladder(100) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100)
    assert batch_ladder(20) == (1, 2, 4, 8, 16, 20)
    assert batch_ladder(1) == (1,)
    assert batch_ladder(3) == (1, 2, 3)
    assert batch_ladder(4096)[-3:] == (480, 496, 512)  # capped
    assert batch_ladder(64, cap=40) == (1, 2, 4, 8, 16, 24, 32, 40)


def test_bucket_for() -> None:
    ladder = batch_ladder(100)
    got = {n: bucket_for(n, ladder) for n in (1, 2, 3, 5, 9, 17, 25, 33, 49, 97, 100, 101)}
    assert got == {
        1: 1, 2: 2, 3: 4, 5: 8, 9: 16, 17: 24, 25: 32, 33: 48, 49: 64, 97: 100, 100: 100,
        101: None,
    }  # fmt: skip


def test_graphs_take_decode_steps_only() -> None:
    decodes = [(5, 1, [1]), (9, 1, [2, 3]), (20, 1, [4, 5, 6])]
    assert graph_takes(common_metadata_from_seqs(decodes, BLOCK), 8, 16)
    assert not graph_takes(common_metadata_from_seqs(decodes, BLOCK), 2, 16)  # too many
    assert not graph_takes(common_metadata_from_seqs(decodes, BLOCK), 8, 2)  # tables too wide
    mixed = [*decodes, (0, 4, [7])]  # a prefill chunk: eager
    assert not graph_takes(common_metadata_from_seqs(mixed, BLOCK), 8, 16)
    assert not graph_takes(common_metadata_from_seqs([(0, 1, [7])] * 0, BLOCK), 8, 16)


def test_padding_rows_attend_to_the_reserved_slot_only() -> None:
    common = common_metadata_from_seqs([(5, 1, [3]), (17, 1, [4, 9, 2])], BLOCK)
    padded = pad_decode_metadata(common, 4)
    assert (padded.num_reqs, padded.num_actual_tokens, padded.num_decodes) == (4, 4, 4)
    assert padded.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert padded.seq_lens.tolist() == [1, 1, 6, 18]  # in front: still sorted by context
    assert padded.slot_mapping.tolist() == [PAD_SLOT, PAD_SLOT, *common.slot_mapping.tolist()]
    assert PAD_SLOT // BLOCK == 0  # in block 0, which the block pool never hands out
    assert padded.block_table.tolist() == [[0, 0, 0], [0, 0, 0], [3, 0, 0], [4, 9, 2]]
    assert padded.max_seq_len == common.max_seq_len and padded.max_query_len == 1
    assert pad_decode_metadata(common, 2) is common
    captured = capture_metadata(3, BLOCK, 16)  # the longest context, all in block 0
    assert captured.seq_lens.tolist() == [128] * 3 and captured.max_seq_len == 128
    assert captured.block_table.shape == (3, 16) and not captured.block_table.any()
    assert captured.slot_mapping.tolist() == [PAD_SLOT] * 3


def test_verify_steps_take_graphs_of_their_own() -> None:
    """A step of requests of at most verify_len tokens (one of them more than one) is a
    verify graph's while every request padded to verify_len stays inside the tables' width."""
    seqs = [(9, 1, [2, 3]), (5, 3, [1]), (20, 4, [4, 5, 6])]  # decodes first
    common = common_metadata_from_seqs(seqs, BLOCK)
    assert verify_graph_takes(common, 4, 8, 16)
    assert not verify_graph_takes(common, 3, 8, 16)  # a request of 4 tokens
    assert not verify_graph_takes(common, 4, 2, 16)  # three requests
    assert verify_graph_takes(common, 4, 8, 3)  # 20 + 4 tokens: three blocks of 8
    assert not verify_graph_takes(common, 5, 8, 3)  # 20 + 5: a fourth block
    decodes = common_metadata_from_seqs([(9, 1, [2, 3]), (20, 1, [4, 5, 6])], BLOCK)
    assert not verify_graph_takes(decodes, 4, 8, 16)  # the decode graphs'
    assert verify_ladder(16, 0) == () and verify_ladder(16, 1) == ()
    assert verify_ladder(16, 4) == batch_ladder(16)
    assert verify_ladder(512, 5)[-1] == 102  # at most 512 tokens a graph


def test_verify_padding_follows_each_requests_own_tokens() -> None:
    seqs = [(9, 1, [2, 3]), (5, 3, [1]), (20, 4, [4, 5, 6])]
    common = common_metadata_from_seqs(seqs, BLOCK)
    padded, rows = pad_verify_metadata(common, 4, 4)  # one padding request in front
    assert rows.tolist() == [4, 8, 9, 10, 12, 13, 14, 15]
    assert (padded.num_reqs, padded.num_actual_tokens, padded.max_query_len) == (4, 16, 4)
    assert padded.num_decodes == 0 and padded.query_start_loc.tolist() == [0, 4, 8, 12, 16]
    # each request's context grows by its padding tokens: its own tokens keep their positions
    assert padded.seq_lens.tolist() == [4, 13, 9, 24]
    assert (padded.seq_lens_np - padded.query_lens_np)[1:].tolist() == [9, 5, 20]
    slots = padded.slot_mapping.tolist()
    assert [slots[r] for r in rows] == common.slot_mapping.tolist()
    assert all(slots[r] == PAD_SLOT for r in set(range(16)) - set(rows.tolist()))
    assert padded.block_table.tolist() == [[0, 0, 0], [2, 3, 0], [1, 0, 0], [4, 5, 6]]
    captured = capture_metadata(2, BLOCK, 16, query_len=4)
    assert captured.query_start_loc.tolist() == [0, 4, 8] and captured.num_actual_tokens == 8
    assert captured.slot_mapping.tolist() == [PAD_SLOT] * 8 and captured.num_decodes == 0


def _runner(model_dir, max_num_seqs=16, **model_kw) -> ModelRunner:
    """A runner on the CPU unless model_kw names a device (the auto device is CUDA on a GPU
    machine, and the CPU tests below mean the CPU there too)."""
    model_kw.setdefault("device", "cpu")
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=MAX_LEN, **model_kw),
        cache=CacheConfig(block_size=BLOCK, num_blocks=64),
        scheduler=SchedulerConfig(
            block_size=BLOCK, max_model_len=MAX_LEN, max_num_seqs=max_num_seqs
        ),
    )
    runner = ModelRunner(config, model_dir=model_dir)
    runner.load_model()
    runner.init_kv_cache(64)
    return runner


def _decode_step(rng: random.Random, n: int, num_blocks: int):
    """n decodes with scattered blocks and contexts of 1-60 tokens, sorted by context."""
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    ctx = sorted(rng.randint(1, 60) for _ in range(n))
    seqs = [(c - 1, 1, [free.pop() for _ in range(-(-c // BLOCK))]) for c in ctx]
    ids = [rng.randrange(1, 300) for _ in range(n)]
    return ids, [c - 1 for c in ctx], seqs


def test_padded_decode_steps_equal_unpadded_eager_steps(tiny_llama_dir) -> None:
    """Steps of 1, 3, 5, 6 and 8 decodes through the graph runner (ladder 1, 2, 4, 8: padded to
    1, 4, 8, 8, 8) give the eager unpadded step's hidden states and greedy tokens, write the
    same K/V, and the padding rows write only into the reserved block 0."""
    torch.set_num_threads(1)
    runner = _runner(tiny_llama_dir, attention_backend="torch")
    g = torch.Generator().manual_seed(0)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=g))
    graphs = CudaGraphRunner(
        runner.model, runner.attn_backend, (1, 2, 4, 8), MAX_LEN // BLOCK, EagerReplay(), "cpu"
    )
    graphs.capture_all()
    rng = random.Random(1)
    for n in (1, 3, 5, 6, 8):
        ids, positions, seqs = _decode_step(rng, n, runner.num_blocks)
        hidden, eager = _graph_step_equals_eager(runner, graphs, ids, positions, seqs)
        with torch.inference_mode():
            assert torch.equal(
                runner.model.compute_logits(hidden).argmax(-1),
                runner.model.compute_logits(eager).argmax(-1),
            )
    assert graphs.runs == {1: 1, 4: 1, 8: 3}
    # A step with a prefill chunk and one above the ladder are left to the eager forward.
    ids, positions, seqs = _decode_step(rng, 9, runner.num_blocks)
    assert graphs.run(StepInputs(ids, positions, common_metadata_from_seqs(seqs, BLOCK))) is None
    mixed = common_metadata_from_seqs([*seqs[:2], (0, 3, [60])], BLOCK)
    assert graphs.run(StepInputs([*ids[:2], 1, 2, 3], [*positions[:2], 0, 1, 2], mixed)) is None


def _graph_step_equals_eager(runner: ModelRunner, graphs: CudaGraphRunner, ids, positions, seqs):
    """The step through graphs.run against the eager unpadded forward on the same backend:
    the same hidden states, and the same K/V written outside block 0 (the eager step's
    writes are undone first: the graph step must write them itself). -> (graph's, eager's)"""
    common = common_metadata_from_seqs(seqs, BLOCK)
    before = [c[:, 1:].clone() for c in runner.kv_caches]
    with torch.inference_mode():
        meta = graphs.backend.build_metadata(common)
        eager = runner.model(torch.tensor(ids), torch.tensor(positions), meta)
        written = [c[:, 1:].clone() for c in runner.kv_caches]
        for cache, old in zip(runner.kv_caches, before, strict=True):
            cache[:, 1:] = old
        hidden = graphs.run(StepInputs(ids, positions, common))
    assert hidden is not None and hidden.shape == eager.shape
    torch.testing.assert_close(hidden, eager, rtol=1e-5, atol=1e-5)
    for cache, w in zip(runner.kv_caches, written, strict=True):
        # As close as the hidden states: a padded batch changes the GEMM's blocking (and
        # float32 rounding) on some CPUs; outside block 0 nothing else may differ.
        torch.testing.assert_close(cache[:, 1:], w, rtol=1e-5, atol=1e-5)
    return hidden, eager


def _verify_step(rng: random.Random, n: int, num_blocks: int, verify_len: int):
    """n requests of 1..verify_len tokens (the last at least 2: a verification step) at
    contexts of 1-60 tokens (one-token ones first, by context), scattered blocks."""
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    reqs = [(rng.randint(0, 59), rng.randint(1 if i else 2, verify_len)) for i in range(n)]
    reqs.sort(key=lambda r: (r[1] != 1, r[0] if r[1] == 1 else 0))
    seqs = [(s, c, [free.pop() for _ in range(-(-(s + c) // BLOCK))]) for s, c in reqs]
    ids = [rng.randrange(1, 300) for _, c in reqs for _ in range(c)]
    positions = [p for s, c in reqs for p in range(s, s + c)]
    return ids, positions, seqs


def _triton_backend(runner: ModelRunner):
    """The Triton kernels (the interpreter on the CPU) in place of the runner's backend."""
    pytest.importorskip("triton")
    from engine.attention.backends.triton import TritonAttentionBackend

    b = runner.attn_backend
    backend = TritonAttentionBackend(
        BLOCK, b.num_heads, b.num_kv_heads, b.head_dim, torch.float32, "cpu"
    )
    for attn in runner.model.attention_layers():
        attn.backend = backend
    runner.attn_backend = backend
    return backend


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_padded_verify_steps_equal_unpadded_eager_steps(tiny_llama_dir, kernels) -> None:
    """Verification steps (requests of 1-4 tokens) through verify graphs of 4 tokens a request
    (ladder 1, 2, 4): the eager unpadded step's hidden states and K/V writes, every request's
    padding after its own tokens; the padding writes only into block 0. On the torch backend
    and on the Triton kernels (the GPU's, here interpreted)."""
    torch.set_num_threads(1)
    runner = _runner(tiny_llama_dir, attention_backend="torch")
    backend = _triton_backend(runner) if kernels == "triton" else runner.attn_backend
    g = torch.Generator().manual_seed(0)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=g))
    graphs = CudaGraphRunner(
        runner.model, backend, (1, 2, 4), MAX_LEN // BLOCK, EagerReplay(), "cpu",
        verify_len=4, verify_sizes=(1, 2, 4),
    )  # fmt: skip
    graphs.capture_all()
    rng = random.Random(3)
    sizes = (1, 3, 4) if kernels == "triton" else (1, 2, 3, 4, 4)
    for n in sizes:
        ids, positions, seqs = _verify_step(rng, n, runner.num_blocks, 4)
        _graph_step_equals_eager(runner, graphs, ids, positions, seqs)
    expected: dict[int, int] = {}
    for n in sizes:  # 3 requests pad to 4
        expected[bucket_for(n, (1, 2, 4))] = expected.get(bucket_for(n, (1, 2, 4)), 0) + 1
    assert graphs.verify_runs == expected and not graphs.runs
    # more requests than the verify ladder, or a request of more tokens: eager
    ids, positions, seqs = _verify_step(rng, 5, runner.num_blocks, 4)
    assert graphs.run(StepInputs(ids, positions, common_metadata_from_seqs(seqs, BLOCK))) is None
    long = [*seqs[:1], (0, 5, [60])]
    ids = [*ids[: seqs[0][1]], 1, 2, 3, 4, 5]
    positions = [*positions[: seqs[0][1]], 0, 1, 2, 3, 4]
    assert graphs.run(StepInputs(ids, positions, common_metadata_from_seqs(long, BLOCK))) is None


def test_graphs_hand_back_the_steps_layer_inputs(tiny_llama_dir) -> None:
    """With an EAGLE-3 head's layers kept (aux_hidden_layers), a decode or verification step
    through the graphs leaves the eager step's aux_hidden_states: the step's own rows, in its
    order, padding dropped."""
    torch.set_num_threads(1)
    runner = _runner(tiny_llama_dir, attention_backend="torch")
    inner = runner.model.model
    inner.aux_hidden_layers = frozenset({0, 2})
    g = torch.Generator().manual_seed(5)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=g))
    graphs = CudaGraphRunner(
        runner.model, runner.attn_backend, (1, 2, 4), MAX_LEN // BLOCK, EagerReplay(), "cpu",
        verify_len=4, verify_sizes=(1, 2, 4),
    )  # fmt: skip
    graphs.capture_all()
    rng = random.Random(6)
    steps = [_decode_step(rng, 3, runner.num_blocks), _verify_step(rng, 3, runner.num_blocks, 4)]
    for ids, positions, seqs in steps:
        common = common_metadata_from_seqs(seqs, BLOCK)
        with torch.inference_mode():
            meta = runner.attn_backend.build_metadata(common)
            runner.model(torch.tensor(ids), torch.tensor(positions), meta)
            eager = inner.aux_hidden_states
            inner.aux_hidden_states = []
            graphs.run(StepInputs(ids, positions, common))
        got = inner.aux_hidden_states
        assert len(got) == 2 and got[0].shape == (len(ids), eager[0].shape[1])
        for a, b in zip(got, eager, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got[0], got[1], atol=1e-3)  # two layers told apart
    assert graphs.runs == {4: 1} and graphs.verify_runs == {4: 1}


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_mistral_sw_dir"])
def test_engine_greedy_output_through_the_graph_runner(request, fixture) -> None:
    """The whole engine's greedy tokens, with the runner's step graph swapped for the graph
    runner (EagerReplay): the same as the eager engine's, decode steps through the buckets;
    a sliding-window model's too (window 16, contexts past it)."""
    from engine import LLM, SamplingParams

    model_dir = request.getfixturevalue(fixture)
    prompts = [list(range(10 + 7 * i, 25 + 9 * i)) for i in range(5)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    kw = dict(dtype="float32", num_kv_blocks=96, block_size=BLOCK, max_num_seqs=8)
    llm = LLM(str(model_dir), device="cpu", attention_backend="torch", **kw)
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    runner = llm.engine.executor.runner
    assert runner._step_graph is None  # float32 on the CPU: no decode plan
    graphs = CudaGraphRunner(
        runner.model, runner.attn_backend, batch_ladder(8), -(-runner.max_model_len // BLOCK),
        EagerReplay(), "cpu",
    )  # fmt: skip
    graphs.capture_all()
    runner._step_graph = graphs
    graphed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    assert graphed == eager
    assert set(graphs.runs) == {8}  # five decodes a step, padded to the next size up
    assert graphs.runs[8] >= 9


def test_no_graphs_off_cuda_or_under_enforce_eager(tiny_llama_dir) -> None:
    runner = _runner(tiny_llama_dir, enforce_eager=True)
    assert not isinstance(runner._step_graph, CudaGraphRunner)
    config = dataclasses.replace(runner.step_graph_config(), enforce_eager=False)
    assert config.device == torch.device("cpu") and config.tp_size == 1
    assert CudaGraphRunner.build(runner.model, config) is None
    assert not runner.attn_backend.cuda_graph_capturable  # the CPU's C kernels


def test_the_kv_budget_reserves_for_graphs_only_where_they_are_captured(tiny_llama_dir) -> None:
    runner = _runner(tiny_llama_dir)
    assert runner.graph_reserve_bytes() == 0  # the CPU: no CUDA graphs, nothing reserved
    b, gpu = runner.attn_backend, torch.device("cuda")
    assert graphs_off_reason(torch.device("cpu"), b, False, 1) == "not a CUDA device"
    assert graphs_off_reason(gpu, b, True, 1) == "--enforce-eager"
    assert "attention backend" in graphs_off_reason(gpu, b, False, 1)  # the CPU's C kernels


def test_the_kv_budget_reserves_for_the_verify_graphs_too(tiny_llama_dir) -> None:
    """With speculative decoding the verify graphs' pool is kept out of the KV cache too:
    their outputs and per-graph overhead on top of the decode graphs'."""
    from engine.worker.kv_budget import GRAPH_OVERHEAD_BYTES

    runner = _runner(tiny_llama_dir, attention_backend="torch")
    config = dataclasses.replace(
        runner.step_graph_config(), device=torch.device("cuda"), backend=_triton_backend(runner)
    )  # what build() would capture on a GPU (nothing is allocated here)
    plain = CudaGraphRunner.reserve_bytes(config)
    spec = CudaGraphRunner.reserve_bytes(dataclasses.replace(config, verify_len=4))
    assert plain > 0
    assert spec - plain >= len(verify_ladder(16, 4)) * GRAPH_OVERHEAD_BYTES


def test_enforce_eager_reaches_the_engine_config() -> None:
    assert not EngineArgs(model="m").create_engine_config().model.enforce_eager
    assert EngineArgs(model="m", enforce_eager=True).create_engine_config().model.enforce_eager


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kind", ["decode", "verify"])
def test_graph_replay_equals_eager_on_cuda(tiny_llama_dir, kind) -> None:
    """Real CUDA graphs over the runner's backend: every decode step's (padded or not) and
    every verification step's (4 tokens a request) hidden states and greedy tokens equal the
    eager step's."""
    runner = _runner(tiny_llama_dir, device="cuda", enforce_eager=True)
    if not runner.attn_backend.cuda_graph_capturable:
        pytest.skip(f"the {runner.attn_backend.name} backend is not capturable")
    verify = kind == "verify"
    graphs = CudaGraphRunner(
        runner.model, runner.attn_backend, (1, 2, 4, 8), MAX_LEN // BLOCK, CudaGraphCapture(),
        "cuda", verify_len=4 if verify else 0, verify_sizes=(1, 2, 4, 8) if verify else (),
    )  # fmt: skip
    graphs.capture_all()
    g = torch.Generator(device="cuda").manual_seed(0)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=g, device="cuda"))
    rng = random.Random(2)
    for n in (1, 2, 3, 5, 8):
        if verify:
            ids, positions, seqs = _verify_step(rng, n, runner.num_blocks, 4)
        else:
            ids, positions, seqs = _decode_step(rng, n, runner.num_blocks)
        cuda_step_equals_eager(runner, graphs, ids, positions, seqs)
    assert sum((graphs.verify_runs if verify else graphs.runs).values()) == 5
    graphs.close()


def cuda_step_equals_eager(runner: ModelRunner, graphs: CudaGraphRunner, ids, positions, seqs):
    """One step through real graphs against the eager forward on the GPU: the hidden states
    within 1e-4, the same greedy tokens."""
    common = common_metadata_from_seqs(seqs, BLOCK)
    dev = torch.device("cuda")
    with torch.inference_mode():
        meta = runner.attn_backend.build_metadata(common)
        ids_t, pos_t = torch.tensor(ids, device=dev), torch.tensor(positions, device=dev)
        eager = runner.model(ids_t, pos_t, meta)
        hidden = graphs.run(StepInputs(ids, positions, common))
        assert hidden is not None
        torch.testing.assert_close(hidden, eager, rtol=1e-4, atol=1e-4)
        assert torch.equal(
            runner.model.compute_logits(hidden).argmax(-1),
            runner.model.compute_logits(eager).argmax(-1),
        )


@pytest.mark.cuda
@cuda
def test_captured_graphs_fit_the_kv_budgets_reserve(tiny_llama_dir) -> None:
    """The graphs init_kv_cache captures take no more than graph_reserve_bytes kept for them."""
    runner = _runner(tiny_llama_dir, device="cuda")
    graphs = runner._step_graph
    if not isinstance(graphs, CudaGraphRunner):
        pytest.skip(f"the {runner.attn_backend.name} backend is not capturable")
    reserve = runner.graph_reserve_bytes()
    assert graphs.graph_bytes <= reserve, (graphs.graph_bytes, reserve)


@pytest.mark.cuda
@cuda
def test_engine_greedy_on_cuda_equals_the_cpu_torch_path(tiny_llama_dir) -> None:
    """The whole engine on CUDA (default backend, graphs, the GPU sampler) against the CPU's
    torch reference: the same greedy tokens."""
    from engine import LLM, SamplingParams

    prompts = [list(range(10 + 7 * i, 25 + 9 * i)) for i in range(6)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    kw = dict(dtype="float32", num_kv_blocks=128, block_size=BLOCK, max_num_seqs=8)
    outs = {}
    for device, backend in (("cpu", "torch"), ("cuda", "auto")):
        llm = LLM(str(tiny_llama_dir), device=device, attention_backend=backend, **kw)
        done = llm.generate(prompts, params, use_tqdm=False)
        outs[device] = [o.outputs[0].token_ids for o in done]
        llm.shutdown()
    assert outs["cuda"] == outs["cpu"]
