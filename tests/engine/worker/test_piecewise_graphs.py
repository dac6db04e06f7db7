"""Piecewise graphs for mixed and prefill steps (engine.worker.piecewise, through the CUDA
graph runner): on the CPU with EagerReplay (each "replay" runs the model again with the
attention split installed: every choice of the runner's, the padding and the seams' slicing,
without a GPU), steps of decodes and prefill chunks against unpadded eager steps on the torch
backend and the Triton kernels, the whole engine with chunked prefill, the default sizes and
their reserve; on a GPU (`cuda` marker) real piecewise captures against eager steps."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.args import EngineArgs
from engine.attention.metadata import common_metadata_from_seqs
from engine.worker.cuda_graph import (
    CudaGraphCapture,
    CudaGraphRunner,
    EagerReplay,
    batch_ladder,
    bucket_for,
    piece_capture_metadata,
    piece_ladder,
)
from engine.worker.kv_budget import GRAPH_OVERHEAD_BYTES
from engine.worker.piecewise import AttentionSplit, unowned
from engine.worker.step_graph import StepInputs
from tests.engine.spec_decode.graphs_testing import REPLAY, step_graphs
from tests.engine.worker.test_cuda_graph import (
    BLOCK,
    MAX_LEN,
    _graph_step_equals_eager,
    _runner,
    _triton_backend,
    cuda_step_equals_eager,
)

PIECES = (8, 16, 32, 64)


def _mixed_step(rng: random.Random, decodes: int, chunks: int, num_blocks: int):
    """decodes one-token requests (sorted by context, 1-60 tokens), then chunks prefill
    chunks of 2-20 tokens each after 0-40 cached ones; scattered blocks."""
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    reqs = [(c - 1, 1) for c in sorted(rng.randint(1, 60) for _ in range(decodes))]
    reqs += [(rng.randint(0, 40), rng.randint(2, 20)) for _ in range(chunks)]
    seqs = [(s, c, [free.pop() for _ in range(-(-(s + c) // BLOCK))]) for s, c in reqs]
    ids = [rng.randrange(1, 300) for _, c in reqs for _ in range(c)]
    positions = [p for s, c in reqs for p in range(s, s + c)]
    return ids, positions, seqs


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_piecewise_steps_equal_unpadded_eager_steps(tiny_llama_dir, kernels) -> None:
    """Steps of decodes and prefill chunks through piecewise graphs of 8-64 tokens: the eager
    unpadded step's hidden states and K/V writes; the padding tokens after the step's write
    no K/V anywhere (block 0 included). Decode steps keep their whole-step graphs; a step
    above the top size is left to the eager forward."""
    torch.set_num_threads(1)
    runner = _runner(tiny_llama_dir, attention_backend="torch")
    backend = _triton_backend(runner) if kernels == "triton" else runner.attn_backend
    g = torch.Generator().manual_seed(0)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=g))
    graphs = CudaGraphRunner(
        runner.model, backend, (1, 2, 4), MAX_LEN // BLOCK, EagerReplay(), "cpu",
        piece_sizes=PIECES,
    )  # fmt: skip
    graphs.capture_all()
    rng = random.Random(4)
    shapes = ((0, 1), (2, 1), (3, 2)) if kernels == "triton" else ((0, 1), (2, 1), (3, 2), (1, 3))
    expected: dict[int, int] = {}
    for decodes, chunks in shapes:
        ids, positions, seqs = _mixed_step(rng, decodes, chunks, runner.num_blocks)
        block0 = [c[:, 0].clone() for c in runner.kv_caches]
        _graph_step_equals_eager(runner, graphs, ids, positions, seqs)
        for cache, before in zip(runner.kv_caches, block0, strict=True):
            assert torch.equal(cache[:, 0], before)  # no padding token wrote there
        size = bucket_for(len(ids), PIECES)
        expected[size] = expected.get(size, 0) + 1
    assert graphs.piece_runs == expected and len(expected) > 1
    assert not graphs.runs and not graphs.verify_runs
    for _ in range(2):  # decodes: the decode graphs', as before
        ids, positions, seqs = _mixed_step(rng, 3, 0, runner.num_blocks)
        _graph_step_equals_eager(runner, graphs, ids, positions, seqs)
    assert graphs.runs == {4: 2}
    ids, positions, seqs = _mixed_step(rng, 0, 4, runner.num_blocks)
    while len(ids) <= PIECES[-1]:  # above the top size: eager
        ids, positions, seqs = _mixed_step(rng, 2, 5, runner.num_blocks)
    common = common_metadata_from_seqs(seqs, BLOCK)
    assert graphs.run(StepInputs(ids, positions, common)) is None


@pytest.mark.parametrize("mode", ["full_and_piecewise", "full_decode_only"])
def test_engine_greedy_output_through_piecewise_graphs(tiny_llama_dir, monkeypatch, mode):
    """The whole engine with chunked prefill (16-token steps: prompts of 15-31 tokens in
    chunks, mixed with decodes) on the graph runner built from its configuration
    (TESSERA_STEP_GRAPH=replay): the eager engine's greedy tokens; its mixed and prefill
    steps through piecewise graphs of up to 16 tokens, none with full_decode_only."""
    prompts = [list(range(10 + 7 * i, 25 + 11 * i)) for i in range(5)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    kw = dict(
        device="cpu", attention_backend="torch", dtype="float32", num_kv_blocks=96,
        block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=16,
    )  # fmt: skip
    outs = {}
    for eager in (True, False):
        if not eager:
            monkeypatch.setenv(*REPLAY)
        llm = LLM(str(tiny_llama_dir), enforce_eager=eager, cudagraph_mode=mode, **kw)
        done = llm.generate(prompts, params, use_tqdm=False)
        outs[eager] = [o.outputs[0].token_ids for o in done]
        if not eager:
            graphs, _ = step_graphs(llm)
        llm.shutdown()
    assert outs[False] == outs[True]
    assert graphs.runs  # the decode steps, as before
    if mode == "full_and_piecewise":
        assert graphs.piece_ladder == batch_ladder(16)
        prompt_steps = -(-sum(map(len, prompts)) // 16)
        assert sum(graphs.piece_runs.values()) >= prompt_steps
    else:
        assert graphs.piece_ladder == () and not graphs.piece_runs


def test_piece_sizes_follow_the_step_budget_and_the_mode(tiny_llama_dir) -> None:
    """By default the pieces cover the step budget up to 512 tokens (vLLM's cap), none with
    full_decode_only; the KV budget reserves for them (where they would be captured)."""
    assert piece_ladder(0) == () and piece_ladder(16) == batch_ladder(16)
    assert piece_ladder(512) == batch_ladder(4096)  # capped at 512
    runner = _runner(tiny_llama_dir, attention_backend="torch")
    config = runner.step_graph_config()
    assert config.piece_tokens == min(runner.config.scheduler.max_num_batched_tokens, 512)
    args = EngineArgs(model="m", cudagraph_mode="full_decode_only")
    assert args.create_engine_config().model.cudagraph_mode == "full_decode_only"
    with pytest.raises(ValueError, match="cudagraph_mode must be one of"):
        EngineArgs(model="m", cudagraph_mode="piecewise").create_engine_config()
    gpu = dataclasses.replace(
        config, device=torch.device("cuda"), backend=_triton_backend(runner)
    )  # what build() would capture on a GPU (nothing is allocated here)
    full = CudaGraphRunner.reserve_bytes(dataclasses.replace(gpu, piece_tokens=0))
    pieces = CudaGraphRunner.reserve_bytes(dataclasses.replace(gpu, piece_tokens=64))
    assert pieces - full >= len(piece_ladder(64)) * GRAPH_OVERHEAD_BYTES


class _PiecesFailToCapture(EagerReplay):
    """A capture strategy whose piecewise captures fail (as a CUDA capture error would)."""

    def capture(self, step, meta, split=None):
        if split is not None:
            raise RuntimeError("operation not permitted when stream is capturing")
        return super().capture(step, meta, split)


def test_a_failed_piecewise_capture_leaves_mixed_steps_eager(tiny_llama_dir, caplog) -> None:
    """The server still starts: the decode graphs as before, mixed steps to the eager
    forward, the failure logged."""
    runner = _runner(tiny_llama_dir, attention_backend="torch")
    graphs = CudaGraphRunner(
        runner.model, runner.attn_backend, (1, 2, 4), MAX_LEN // BLOCK, _PiecesFailToCapture(),
        "cpu", piece_sizes=PIECES,
    )  # fmt: skip
    with caplog.at_level("ERROR", logger="tessera.engine"):
        graphs.capture_all()
    assert "Piecewise CUDA graphs failed to capture" in caplog.text
    assert graphs.piece_ladder == () and all(q == 1 for _, q in graphs._replays)
    rng = random.Random(5)
    ids, positions, seqs = _mixed_step(rng, 2, 1, runner.num_blocks)
    assert graphs.run(StepInputs(ids, positions, common_metadata_from_seqs(seqs, BLOCK))) is None
    ids, positions, seqs = _mixed_step(rng, 3, 0, runner.num_blocks)
    _graph_step_equals_eager(runner, graphs, ids, positions, seqs)
    assert graphs.runs == {4: 1} and not graphs.piece_runs


def test_piece_capture_metadata_is_one_token_requests_in_the_reserved_slot() -> None:
    meta = piece_capture_metadata(5, BLOCK)
    assert (meta.num_reqs, meta.num_actual_tokens, meta.max_query_len) == (5, 5, 1)
    assert meta.seq_lens.tolist() == [1] * 5 and meta.slot_mapping.tolist() == [0] * 5
    assert meta.block_table.tolist() == [[0]] * 5  # block 0: never a request's


def test_the_split_is_installed_only_inside_and_slices_to_the_steps_tokens(tiny_llama_dir):
    """Inside installed() every attention layer hands its call to the split, which attends
    over the metadata's tokens only and returns static rows for all of q's; after, none."""
    runner = _runner(tiny_llama_dir, attention_backend="torch")
    layers = runner.model.attention_layers()
    split = AttentionSplit(32)
    layer = layers[0]
    h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    common = common_metadata_from_seqs([(0, 5, [3])], BLOCK)
    meta = runner.attn_backend.build_metadata(common)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(12, n, d, generator=g) for n in (h, hkv, hkv))
    with torch.inference_mode(), split.installed(layers):
        assert all(a.split is split for a in layers)
        out = layer(q, k, v, meta)
        again = layer(q, k, v, meta)
    assert all(a.split is None for a in layers)
    with torch.inference_mode():
        own = layer(q[:5], k[:5], v[:5], meta)
    assert out.shape == (12, h * d) and torch.equal(out[:5], own)
    assert out.data_ptr() == again.data_ptr()  # one static buffer, every layer's and step's
    assert not out[5:].any()  # rows past the step's: the buffer's zeros, untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_an_unowned_view_shares_the_tensors_memory_and_layout(dtype) -> None:
    base = torch.arange(60).to(dtype).view(5, 12)
    t = base[1:, 2:10:2]  # strided
    u = unowned(t)
    assert (u.shape, u.stride(), u.dtype) == (t.shape, t.stride(), t.dtype)
    assert u.data_ptr() == t.data_ptr() and torch.equal(u, t)
    base.fill_(7)  # a write through the owner shows through the view
    assert torch.equal(u, torch.full_like(t, 7))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@cuda
def test_piecewise_replay_equals_eager_on_cuda(tiny_llama_dir) -> None:
    """Real piecewise CUDA graphs over the runner's backend: steps of decodes and prefill
    chunks (padded to 8-64 tokens) give the eager step's hidden states and greedy tokens,
    step after step over the same captured pieces."""
    runner = _runner(tiny_llama_dir, device="cuda", enforce_eager=True)
    graphs = CudaGraphRunner(
        runner.model, runner.attn_backend, (1, 2, 4), MAX_LEN // BLOCK, CudaGraphCapture(),
        "cuda", piece_sizes=PIECES,
    )  # fmt: skip
    graphs.capture_all()
    layers = len(runner.model.attention_layers())
    assert len(graphs.strategy.graphs) == 3 + len(PIECES) * (layers + 1)
    g = torch.Generator(device="cuda").manual_seed(0)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=g, device="cuda"))
    rng = random.Random(2)
    for decodes, chunks in ((0, 1), (2, 1), (3, 2), (1, 3), (4, 2)):
        ids, positions, seqs = _mixed_step(rng, decodes, chunks, runner.num_blocks)
        cuda_step_equals_eager(runner, graphs, ids, positions, seqs)
    assert sum(graphs.piece_runs.values()) == 5
    graphs.close()
