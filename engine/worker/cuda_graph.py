"""CUDA graphs for decode and verification steps: the GPU's step graph (engine.worker.
step_graph: the model runner runs it where it takes the step, the eager forward otherwise, as
it does the CPU's one-call plan, cpu_graph.py). It reads the step's host-side inputs only
(eager_inputs False).

A decode step of a 32-layer model is ~1,200-1,500 small kernel launches: at small batches the
GPU waits on Python and the launch queue. Captured once at start, a step is one graph replay.
One graph per batch size of a ladder (1, 2, 4, 8, 16, 24, 32, then every 16 up to
max_num_seqs, at most 512), all in one memory pool; a decode step of n requests runs the graph
of the next size up, the extra rows padded. What a graph reads lives in static buffers filled
in place before each replay: the input ids and positions (one pinned host buffer, one
non_blocking copy) and the attention backend's static metadata (its
allocate_static_metadata / fill_static_metadata hooks).

Padding rows are decode requests of one token at position 0 whose context is slot 0 of block
0: block 0 is reserved (never given to a request, only the padding of block tables), so what
they write lands nowhere anyone reads, with every backend and without a special case in any
kernel. They come first (the shortest contexts: the decodes stay sorted by context length);
their outputs are dropped. Graphs are captured on padding rows at the longest context.

With LoRA on the Triton kernels (engine.lora) every graph holds the shrink / expand launches,
captured over the LoRA batch's fixed segment buffers (a grid of max_loras segments and the
graph's rows: segments and row tiles past a step's own return at once); each replay writes its
step's segments there, its rows moved past the padding, or no segment for a step without
adapters. A step whose adapters need DoRA's rescaling or embedding / experts' deltas runs
eagerly (LoRAManager.graph_blockers).

Speculative decoding's verification steps (each request its last token and up to k drafts)
have graphs of their own (verify_len = 1 + k): one per batch size of a second ladder (up to
MAX_CAPTURE_SIZE tokens), every request padded to verify_len query tokens. A request with
fewer tokens (fewer drafts, none, or a short prefill chunk) gets padding tokens after its own:
the attention kernels are causal, so its real tokens never see them; they write PAD_SLOT and
read keys of block 0 past the request's blocks; their outputs are dropped (the replay gathers
the step's own rows, in its order). A draft model's forwards use the same runner over its own
weights and cache: its one-token steps the decode graphs, the feed after a verification step
(at most k + 2 tokens a request) a verify_len k + 2 family; an EAGLE head's as a stage after
its target (given the target's features, returning its two outputs; k + 1 tokens a feed).

Under pipeline parallelism a stage's graphs hold its own layers (StageShape): after the first
stage they read the received hidden states and residual from static buffers, which run()
fills at the step's rows; before the last they return the stage's own, which the runner sends
on (the sends and receives stay outside the graphs).

Where an EAGLE-3 head reads the target's layer inputs (engine.spec_decode.eagle3), each graph
keeps them as outputs too and hands the step's rows back to the model after a replay, as the
eager forward leaves them.

Mixed and prefill steps (and any other no whole-step graph takes) of up to piece_tokens tokens
(the step budget, at most MAX_CAPTURE_SIZE) replay piecewise graphs (engine.worker.piecewise):
one per size of a token ladder, each the forward cut at every attention layer, whose attention
runs eagerly between the pieces over the step's own metadata (built as for an eager step); the
step's tokens come first, padding tokens (token 0 at position 0) after them, which attend to
nothing and write no K/V. `--cudagraph-mode full_decode_only` leaves them eager.

Steps no graph takes run eagerly: more tokens than piece_tokens, a backend whose launches
depend on the step's contents (`cuda_graph_capturable`), more than one tensor-parallel rank
(capturing collectives is not wired up yet), `--enforce-eager`.
A layer's sliding window is a constant argument of its attention launch (the triton
backend's), so a sliding-window model's decode steps are captured like any other's.

How a step is captured is a strategy: CudaGraphCapture (torch.cuda.CUDAGraph, on CUDA) or
EagerReplay (each "replay" calls the step again over the same static buffers: the runner's
logic on any device, which the CPU tests use).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from engine.attention.backends.base import AttentionBackend, AttentionMetadata
from engine.attention.metadata import CommonAttentionMetadata
from engine.lora.layers import find_batch
from engine.models.pipeline import IntermediateTensors
from engine.worker import kv_budget
from engine.worker.piecewise import AttentionSplit, capture_pieces
from engine.worker.step_graph import StepGraphConfig, StepInputs

logger = logging.getLogger("tessera.engine")

LADDER_HEAD = (1, 2, 4, 8, 16, 24, 32)
LADDER_STEP = 16
MAX_CAPTURE_SIZE = 512  # vLLM's cap: larger batches gain little from a graph
PAD_SLOT = 0  # slot 0 of the reserved block 0: padding rows write nowhere anyone reads
PIECEWISE = 0  # a shape's query length where its graph is piecewise (any layout of its tokens)

# a step: the final norm's output, then whatever else the model leaves for later (an EAGLE-3
# head's layer inputs), each [tokens, ...]
StepFn = Callable[[AttentionMetadata], tuple[torch.Tensor, ...]]


def batch_ladder(max_num_seqs: int, cap: int = MAX_CAPTURE_SIZE) -> tuple[int, ...]:
    """The batch sizes to capture: 1, 2, 4, 8, 16, 24, 32, then steps of 16, and the top
    itself (min(max_num_seqs, cap)) so that every decode batch up to it has a graph."""
    top = max(1, min(max_num_seqs, cap))
    sizes = {b for b in LADDER_HEAD if b < top}
    sizes.update(range(LADDER_HEAD[-1] + LADDER_STEP, top, LADDER_STEP))
    sizes.add(top)
    return tuple(sorted(sizes))


def graphs_off_reason(
    device: torch.device, backend: AttentionBackend, enforce_eager: bool, tp_size: int
) -> str | None:
    """Why no graphs are captured, or None where CudaGraphRunner.build captures them (the KV
    budget reserves their pool on the same condition)."""
    if device.type != "cuda":
        return "not a CUDA device"
    if enforce_eager:
        return "--enforce-eager"
    if not backend.cuda_graph_capturable:
        return f"the {backend.name} attention backend's launches follow each step's contexts"
    if tp_size > 1:
        return "tensor parallelism (collectives are not captured yet)"
    return None


def bucket_for(num_rows: int, ladder: Sequence[int]) -> int | None:
    """The smallest captured size that holds num_rows, or None above the ladder."""
    i = bisect.bisect_left(ladder, num_rows)
    return ladder[i] if i < len(ladder) else None


def graph_takes(common: CommonAttentionMetadata, max_rows: int, max_blocks: int) -> bool:
    """Whether a step is a decode graph's: decodes only (one query token per request), at
    most max_rows of them, block tables of at most max_blocks."""
    return (
        0 < common.num_reqs <= max_rows
        and common.num_decodes == common.num_reqs
        and common.num_actual_tokens == common.num_reqs
        and common.block_table.shape[1] <= max_blocks
    )


def piece_capture_metadata(tokens: int, block_size: int) -> CommonAttentionMetadata:
    """What a piecewise graph is captured on: `tokens` one-token requests, each at position 0
    in slot PAD_SLOT (its attention runs eagerly between the pieces, so any valid step of
    that many tokens will do; this one is the cheapest)."""
    qsl = np.arange(tokens + 1, dtype=np.int64)
    seq_lens = np.ones(tokens, dtype=np.int64)
    table = np.zeros((tokens, 1), dtype=np.int32)
    slots = torch.full((tokens,), PAD_SLOT, dtype=torch.int64)
    return _uniform_metadata(qsl, seq_lens, table, slots, block_size, 1)


def verify_graph_takes(
    common: CommonAttentionMetadata, verify_len: int, max_rows: int, max_blocks: int
) -> bool:
    """Whether a step is a verify graph's: at most max_rows requests of at most verify_len
    query tokens each, one of them more than one (else a decode graph's), and every request
    padded to verify_len still inside max_blocks blocks."""
    if not 0 < common.num_reqs <= max_rows or not 1 < common.max_query_len <= verify_len:
        return False
    last_start = int(common.start_positions_np.max())
    return last_start + verify_len <= max_blocks * common.block_size


def pad_decode_metadata(common: CommonAttentionMetadata, rows: int) -> CommonAttentionMetadata:
    """An all-decode step's metadata grown to `rows` requests by padding requests in front
    (the shortest contexts, so the decodes stay sorted by context length): each one token at
    position 0 in slot PAD_SLOT, attending to that one key (a block table row of block 0)."""
    n = common.num_reqs
    pad = rows - n
    if pad == 0:
        return common
    assert pad > 0 and common.num_decodes == n
    qsl = np.arange(rows + 1, dtype=np.int64)
    seq_lens = np.concatenate([np.ones(pad, dtype=np.int64), common.seq_lens_np])
    table = np.zeros((rows, max(common.block_table_np.shape[1], 1)), dtype=np.int32)
    table[pad:, : common.block_table_np.shape[1]] = common.block_table_np
    slots = torch.cat(
        [torch.full((pad,), PAD_SLOT, dtype=common.slot_mapping.dtype), common.slot_mapping]
    )
    return _uniform_metadata(qsl, seq_lens, table, slots, common.block_size, common.max_seq_len)


def pad_verify_metadata(
    common: CommonAttentionMetadata, rows: int, verify_len: int
) -> tuple[CommonAttentionMetadata, np.ndarray]:
    """A step of requests of at most verify_len query tokens as `rows` requests of exactly
    verify_len: padding requests in front (verify_len tokens at the start of block 0), then
    each request's own tokens followed by padding tokens (slot PAD_SLOT; its context grows by
    as many, past its blocks into block 0). Returns the padded metadata and each of the
    step's tokens' row in it (int64 [num_tokens], in the step's order)."""
    q, n, bs = verify_len, common.num_reqs, common.block_size
    pad = rows - n
    assert pad >= 0 and int(common.max_query_len) <= q
    lens = common.query_lens_np
    seq_lens = np.concatenate([np.full(pad, q, dtype=np.int64), common.start_positions_np + q])
    own = common.block_table_np
    table = np.zeros((rows, max(-(-int(seq_lens.max()) // bs), own.shape[1])), dtype=np.int32)
    table[pad:, : own.shape[1]] = own
    req_of_token = np.repeat(np.arange(n), lens)
    token_rows = (pad + req_of_token) * q + (
        np.arange(common.num_actual_tokens) - common.query_start_loc_np[:-1][req_of_token]
    )
    slots = torch.full((rows * q,), PAD_SLOT, dtype=common.slot_mapping.dtype)
    slots[torch.from_numpy(token_rows)] = common.slot_mapping
    qsl = np.arange(rows + 1, dtype=np.int64) * q
    return _uniform_metadata(qsl, seq_lens, table, slots, bs, int(seq_lens.max())), token_rows


def capture_metadata(
    rows: int, block_size: int, max_blocks: int, query_len: int = 1
) -> CommonAttentionMetadata:
    """What a graph is captured on: `rows` padding requests of query_len tokens at the
    longest context (every block of their tables block 0), so whatever a backend sizes by the
    step's maximum is as large as any later step needs. Their K/V go to PAD_SLOT."""
    qsl = np.arange(rows + 1, dtype=np.int64) * query_len
    seq_lens = np.full(rows, max_blocks * block_size, dtype=np.int64)
    table = np.zeros((rows, max_blocks), dtype=np.int32)
    slots = torch.full((rows * query_len,), PAD_SLOT, dtype=torch.int64)
    return _uniform_metadata(qsl, seq_lens, table, slots, block_size, max_blocks * block_size)


def _uniform_metadata(qsl, seq_lens, table, slots, block_size, max_seq_len):
    """Metadata of requests of one query length each (qsl's step): decodes where it is 1."""
    rows = len(seq_lens)
    q = int(qsl[1] - qsl[0]) if rows else 1
    decodes = rows if q == 1 else 0
    return CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
        block_table=torch.from_numpy(table),
        slot_mapping=slots,
        block_size=block_size,
        num_reqs=rows,
        num_actual_tokens=rows * q,
        num_decodes=decodes,
        num_decode_tokens=decodes,
        max_query_len=q,
        max_seq_len=max(max_seq_len, 1),
        query_start_loc_np=qsl,
        seq_lens_np=seq_lens,
        block_table_np=table,
    )


class StaticStepInputs:
    """The graphs' input ids and positions, and where a verify graph's output rows are the
    step's: one int64 device buffer, written from one pinned host buffer by one non_blocking
    copy per step. The graph of t tokens reads ids from [0, t) and positions from [t, 2t); a
    verify step's token rows follow at [2t, 2t + its tokens)."""

    def __init__(self, max_tokens: int, device: torch.device):
        self.device = device
        pin = device.type == "cuda"
        self.host = torch.zeros(3 * max_tokens, dtype=torch.int64, pin_memory=pin)
        self._host_np = self.host.numpy()
        self.buffer = torch.zeros(3 * max_tokens, dtype=torch.int64, device=device)
        # The last copy out of the pinned buffer: it must finish before the host rewrites it.
        self._copied = torch.cuda.Event() if pin else None

    def ids(self, tokens: int) -> torch.Tensor:
        return self.buffer[:tokens]

    def positions(self, tokens: int) -> torch.Tensor:
        return self.buffer[tokens : 2 * tokens]

    def token_rows(self, tokens: int, n: int) -> torch.Tensor:
        """The rows of a verify step's n tokens in its graph of `tokens` (fill's `at`)."""
        return self.buffer[2 * tokens : 2 * tokens + n]

    def fill(
        self,
        ids: Sequence[int],
        positions: Sequence[int],
        tokens: int,
        at: np.ndarray | None = None,
    ) -> None:
        """This step's ids and positions in a graph of `tokens`: after tokens - len(ids)
        padding tokens (token 0 at 0), or at rows `at` (a verify step) with padding (0 at
        0) around them."""
        if self._copied is not None:
            self._copied.synchronize()  # normally long done: the last step read its tokens
        h = self._host_np
        t = tokens
        if at is None:
            pad = t - len(ids)
            h[:pad] = 0
            h[pad:t] = ids
            h[t : t + pad] = 0
            h[t + pad : 2 * t] = positions
            end = 2 * t
        else:
            h[: 2 * t] = 0
            h[at] = ids
            h[t + at] = positions
            end = 2 * t + len(at)
            h[2 * t : end] = at
        self.buffer[:end].copy_(self.host[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()


class CaptureStrategy(Protocol):
    def capture(
        self, step: StepFn, meta: AttentionMetadata, split: AttentionSplit | None = None
    ) -> StepFn:
        """Capture step (which reads only static buffers) run with meta, whose tensors are
        views of the backend's static metadata; return the replay: called with a later
        fill's metadata, it returns the step's output for the buffers' new contents. With
        split (installed on the model's attention layers): a piecewise step, whose meta is
        an eager step's and whose attention runs between the captured pieces."""
        ...

    def close(self) -> None: ...


class CudaGraphCapture:
    """torch.cuda.CUDAGraph per batch size, all in one memory pool (captured largest first,
    so the smaller graphs reuse the largest one's memory)."""

    def __init__(self, warmup_runs: int = 2):
        self.pool = torch.cuda.graph_pool_handle()
        self.warmup_runs = warmup_runs
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def capture(
        self, step: StepFn, meta: AttentionMetadata, split: AttentionSplit | None = None
    ) -> StepFn:
        # Eager runs first: lazy initialisation, kernel autotuning and library workspaces
        # must not happen inside the capture.
        for _ in range(self.warmup_runs):
            step(meta)
        torch.cuda.synchronize()
        if split is not None:  # a graph a piece, appended to self.graphs
            return capture_pieces(step, meta, split, self.pool, self.graphs)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step(meta)
        self.graphs.append(graph)

        def replay(_meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
            graph.replay()  # reads the static buffers the fill just wrote
            return out

        return replay

    def close(self) -> None:
        for g in self.graphs:
            g.reset()
        self.graphs.clear()


class EagerReplay:
    """A "capture" that keeps the step: each replay runs it again over the same static
    buffers, with the fill's metadata. The graph runner's bucketing, padding and buffer
    filling, on any device and any backend (the CPU tests); it saves no launch."""

    def capture(
        self, step: StepFn, meta: AttentionMetadata, split: AttentionSplit | None = None
    ) -> StepFn:
        step(meta)  # a piecewise step's attention: split's, installed by the runner
        return step

    def close(self) -> None:
        pass


def aux_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module whose forward leaves some layers' inputs in aux_hidden_states for an
    EAGLE-3 head (engine.models.llama), where it keeps any; else None. A graph keeps them
    as outputs of its own and hands the step's rows back there after each replay."""
    inner = getattr(model, "model", None)
    return inner if getattr(inner, "aux_hidden_layers", None) else None


def verify_ladder(max_num_seqs: int, verify_len: int) -> tuple[int, ...]:
    """The batch sizes of the verify graphs: the decode ladder up to MAX_CAPTURE_SIZE tokens
    (vLLM's sizes count tokens too), none without speculative decoding."""
    if verify_len <= 1:
        return ()
    return batch_ladder(max_num_seqs, cap=max(1, MAX_CAPTURE_SIZE // verify_len))


def piece_ladder(piece_tokens: int) -> tuple[int, ...]:
    """The token counts of the piecewise graphs: the batch ladder up to piece_tokens (the
    model runner's: the step budget, at most MAX_CAPTURE_SIZE), none for 0."""
    return batch_ladder(piece_tokens) if piece_tokens > 0 else ()


@dataclass(frozen=True, slots=True)
class StageShape:
    """Where a pipeline stage's graphs sit: after the first stage they read the previous
    stage's hidden states and residual ([tokens, hidden_size] of dtype; the hidden states
    alone where residual is False: an EAGLE head after its target), before the last they
    return their own. The defaults: the whole model."""

    first: bool = True
    last: bool = True
    hidden_size: int = 0
    dtype: torch.dtype = torch.float32
    residual: bool = True


class CudaGraphRunner:
    """The step graph of CUDA decode (and verification) steps: run(inputs) reads the step's
    host-side inputs (lists of ids and positions, the flat CommonAttentionMetadata, the fed
    ids), since it fills its own static buffers -> hidden [tokens, H], or None for the steps
    it leaves to the eager forward."""

    eager_inputs = False
    graph_bytes = 0  # measured by capture_all
    takes_lora = False  # set where the model's LoRA layers run the Triton kernels
    # a step with these runs eagerly: DoRA's rescaling, and the embedding's and experts'
    # deltas (their rows are grouped on the host)
    lora_blockers = frozenset({"dora", "embedding", "experts"})
    keeps_aux_hidden = True  # run() leaves the step's rows of them (aux_module)
    runs_stages = True  # a stage's graphs read and return IntermediateTensors (StageShape)

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        ladder: Sequence[int],
        max_blocks_per_req: int,
        strategy: CaptureStrategy,
        device: torch.device | str,
        verify_len: int = 0,
        verify_sizes: Sequence[int] = (),
        stage: StageShape | None = None,
        piece_sizes: Sequence[int] = (),
    ):
        self.model = model
        self.backend = backend
        self.ladder = tuple(sorted(ladder))
        self.max_rows = self.ladder[-1]
        # verification steps: verify_sizes requests of verify_len tokens (none: no such graphs)
        self.verify_len = verify_len if verify_sizes else 0
        self.verify_ladder = tuple(sorted(verify_sizes)) if self.verify_len > 1 else ()
        # piecewise graphs: steps of any layout of up to piece_ladder[-1] tokens (none: eager)
        layers = getattr(model, "attention_layers", None)
        self.piece_ladder = tuple(sorted(piece_sizes)) if layers is not None else ()
        self._attention_layers = list(layers()) if self.piece_ladder else []
        max_tokens = max(
            self.max_rows,
            max(self.verify_ladder, default=0) * self.verify_len,
            max(self.piece_ladder, default=0),
        )
        self.split = AttentionSplit(max_tokens) if self.piece_ladder else None
        self.max_blocks = max_blocks_per_req
        self.strategy = strategy
        self.device = torch.device(device)
        self.inputs = StaticStepInputs(max_tokens, self.device)
        self.static_meta = backend.allocate_static_metadata(max_tokens, max_blocks_per_req)
        self._replays: dict[tuple[int, int], StepFn] = {}  # (requests, query length) ->
        self.runs: dict[int, int] = {}  # decode replays per batch size (tests, stats)
        self.verify_runs: dict[int, int] = {}  # verification replays per batch size
        self.piece_runs: dict[int, int] = {}  # piecewise replays per token count
        self.capture_seconds = 0.0
        self.graph_bytes = 0
        # LoRA (engine.lora): the Triton shrink / expand are captured over the batch's fixed
        # segment buffers, which each replay fills with its step's (none: nothing added)
        found = find_batch(model)
        self.lora = found[0] if found is not None and found[0].kernel == "triton" else None
        if self.lora is not None:
            self.lora.make_static(max_tokens, found[1])
        self.takes_lora = self.lora is not None
        self._aux = aux_module(model)  # EAGLE-3: the target's layer inputs, kept per graph
        # pipeline parallelism (and an EAGLE head, a stage after its target): a stage after
        # the first reads the previous stage's hidden states (and residual, where it is given
        # one) from static buffers; one before the last returns its own
        self.stage = stage or StageShape()
        self._stage_in: tuple[torch.Tensor, ...] | None = None
        if not self.stage.first:
            shape = (max_tokens, self.stage.hidden_size)
            self._stage_in = tuple(
                torch.zeros(shape, dtype=self.stage.dtype, device=self.device)
                for _ in range(2 if self.stage.residual else 1)
            )

    @classmethod
    def build(cls, model: torch.nn.Module, config: StepGraphConfig) -> CudaGraphRunner | None:
        """Graphs captured for the ladder on CUDA, or None (with the reason logged) where
        every step runs eagerly."""
        c = config
        why_not = graphs_off_reason(c.device, c.backend, c.enforce_eager, c.tp_size)
        if why_not is not None:
            if c.log and c.device.type == "cuda":
                logger.info("CUDA graphs: off (%s); every step runs eagerly", why_not)
            return None
        runner = cls.from_config(model, c, CudaGraphCapture())
        if c.log:
            verify = (
                f" and {len(runner.verify_ladder)} of {runner.verify_len}-token verification "
                f"steps ({runner.verify_ladder[0]}-{runner.verify_ladder[-1]} requests)"
                if runner.verify_ladder
                else ""
            )
            pieces = runner.piece_ladder
            mixed = (
                f"; mixed and prefill steps of up to {pieces[-1]} tokens: {len(pieces)} "
                "piecewise sizes (larger steps eager: compute-bound)"
                if pieces
                else "; mixed and prefill steps eager"
                + (" (their capture failed: above)" if c.piece_tokens else " (full_decode_only)")
            )
            logger.info(
                "CUDA graphs%s: %d decode batch sizes (%d-%d)%s%s; captured in %.1f s, %.0f MiB",
                f" ({c.what})" if c.what else "",
                len(runner.ladder),
                runner.ladder[0],
                runner.max_rows,
                verify,
                mixed,
                runner.capture_seconds,
                runner.graph_bytes / 2**20,
            )
        return runner

    @classmethod
    def from_config(
        cls, model: torch.nn.Module, config: StepGraphConfig, strategy: CaptureStrategy
    ) -> CudaGraphRunner:
        """The ladders the configuration asks for, captured with `strategy` (build's on
        CUDA; the tests' EagerReplay anywhere)."""
        c = config
        runner = cls(
            model,
            c.backend,
            batch_ladder(c.max_num_seqs),
            -(-c.max_model_len // c.block_size),
            strategy,
            c.device,
            verify_len=c.verify_len,
            verify_sizes=verify_ladder(c.max_num_seqs, c.verify_len),
            stage=StageShape(
                c.first_stage, c.last_stage, c.hf_config.hidden_size, c.dtype, c.stage_residual
            ),
            piece_sizes=piece_ladder(c.piece_tokens),
        )
        runner.capture_all()
        return runner

    @classmethod
    def reserve_bytes(cls, config: StepGraphConfig) -> int:
        """The graphs' pool, reserved before the cache is sized (they are captured after it):
        kv_budget.graph_reserve_bytes where build() captures them, else 0."""
        c = config
        if graphs_off_reason(c.device, c.backend, c.enforce_eager, c.tp_size):
            return 0
        hf = c.hf_config
        inter = getattr(hf, "intermediate_size", 0)
        moe = getattr(hf, "moe_intermediate_size", None)  # routed experts' rows, if any
        if moe:
            inter = max(inter, moe * getattr(hf, "num_experts_per_tok", 1))
        verify = verify_ladder(c.max_num_seqs, c.verify_len)
        pieces = piece_ladder(c.piece_tokens)
        return kv_budget.graph_reserve_bytes(
            # each graph's tokens (a piecewise size's pieces together as one graph's)
            (*batch_ladder(c.max_num_seqs), *(n * c.verify_len for n in verify), *pieces),
            outputs_per_row=1 + c.aux_outputs,
            hidden_size=hf.hidden_size,
            num_heads=hf.num_attention_heads // c.tp_size,
            num_kv_heads=c.num_kv_heads,
            head_dim=hf.head_dim,
            intermediate_size=inter,
            act_bytes=torch.empty((), dtype=c.dtype).element_size(),
        )

    def _shapes(self) -> list[tuple[int, int]]:
        """Every graph's (requests, query length), a piecewise one's (tokens, PIECEWISE), the
        most tokens first (one memory pool: the smaller graphs reuse the largest's memory)."""
        shapes = [(rows, 1) for rows in self.ladder]
        shapes += [(rows, self.verify_len) for rows in self.verify_ladder]
        shapes += [(tokens, PIECEWISE) for tokens in self.piece_ladder]
        return sorted(shapes, key=lambda s: s[0] * max(s[1], 1), reverse=True)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every shape, the largest first, on padding-only steps."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            free_before, _ = torch.cuda.mem_get_info(self.device)
        t0 = time.perf_counter()
        bs = self.backend.block_size
        for rows, q in self._shapes():
            if q == PIECEWISE:
                if self.piece_ladder:  # (emptied by a failed capture)
                    self._capture_pieces(rows)
                continue
            common = capture_metadata(rows, bs, self.max_blocks, q)
            self.inputs.fill([], [], rows * q)
            meta = self.backend.fill_static_metadata(self.static_meta, common)
            with self._lora_buffers(None):
                self._replays[rows, q] = self.strategy.capture(self._step_fn(rows * q), meta)
        if cuda:
            torch.cuda.synchronize(self.device)
            free_after, _ = torch.cuda.mem_get_info(self.device)
            self.graph_bytes = max(0, free_before - free_after)
        self.capture_seconds = time.perf_counter() - t0

    def _capture_pieces(self, tokens: int) -> None:
        """The piecewise graph of `tokens` (its attention runs eagerly between the pieces: an
        eager step's metadata). One that fails to capture leaves mixed and prefill steps to
        the eager forward, logged: the server still starts, as with full_decode_only."""
        meta = self.backend.build_metadata(piece_capture_metadata(tokens, self.backend.block_size))
        self.inputs.fill([], [], tokens)
        try:
            with self._lora_buffers(None), self._pieces():
                step = self._step_fn(tokens)
                self._replays[tokens, PIECEWISE] = self.strategy.capture(step, meta, self.split)
        except Exception:
            logger.exception(
                "Piecewise CUDA graphs failed to capture at %d tokens: mixed and prefill steps "
                "run eagerly (as --cudagraph-mode full_decode_only)",
                tokens,
            )
            self.piece_ladder = ()
            for shape in [s for s in self._replays if s[1] == PIECEWISE]:
                del self._replays[shape]

    def _step_fn(self, tokens: int) -> StepFn:
        ids, positions = self.inputs.ids(tokens), self.inputs.positions(tokens)
        model, aux = self.model, self._aux
        given = None
        if self._stage_in is not None:
            views = [t[:tokens] for t in self._stage_in]
            given = IntermediateTensors(views[0], views[1] if len(views) > 1 else None)

        def step(meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
            out = (
                model(ids, positions, meta) if given is None else model(ids, positions, meta, given)
            )
            if isinstance(out, IntermediateTensors):  # a stage before the last
                return out.hidden, out.residual
            return (out,) if aux is None else (out, *aux.aux_hidden_states)

        return step

    def bucket(self, common: CommonAttentionMetadata) -> tuple[int, int] | None:
        """The captured (requests, query length) this step runs as, (tokens, PIECEWISE) for
        a piecewise graph's, or None (eager)."""
        if graph_takes(common, self.max_rows, self.max_blocks):
            return bucket_for(common.num_reqs, self.ladder), 1
        if self.verify_ladder and verify_graph_takes(
            common, self.verify_len, self.verify_ladder[-1], self.max_blocks
        ):
            return bucket_for(common.num_reqs, self.verify_ladder), self.verify_len
        if self.piece_ladder and common.num_actual_tokens <= self.piece_ladder[-1]:
            return bucket_for(common.num_actual_tokens, self.piece_ladder), PIECEWISE
        return None

    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """The step's host-side inputs into the static buffers, then the replay of its shape.
        inputs.fed: (rows, values on the device) replacing those rows' input ids after the host
        copy: async scheduling's placeholders, the last step's sampled ids."""
        meta = inputs.common
        shape = self.bucket(meta)
        if shape is None:
            return None
        rows, q = shape
        n = meta.num_reqs
        # where the step's tokens sit in the graph's `tokens` rows (own: a slice or rows)
        own: slice | torch.Tensor
        if q == 1:  # the step's rows come after rows - n padding rows
            tokens, at, own = rows, None, slice(rows - n, rows)
            attn_meta = self.backend.fill_static_metadata(
                self.static_meta, pad_decode_metadata(meta, rows)
            )
        elif q == PIECEWISE:  # the step's tokens first, padding tokens after them
            tokens, at = rows, np.arange(meta.num_actual_tokens)
            own = slice(0, meta.num_actual_tokens)
            attn_meta = self.backend.build_metadata(meta)  # its attention runs eagerly
        else:  # a verification step: each request's tokens, then its padding tokens
            tokens = rows * q
            padded, at = pad_verify_metadata(meta, rows, q)
            attn_meta = self.backend.fill_static_metadata(self.static_meta, padded)
        self.inputs.fill(inputs.ids, inputs.positions, tokens, at)
        if q not in (1, PIECEWISE):
            own = self.inputs.token_rows(tokens, len(at))
        if inputs.fed is not None:
            fed_rows, values = inputs.fed
            fed_rows = fed_rows + own.start if isinstance(own, slice) else own[fed_rows]
            self.inputs.ids(tokens).index_copy_(0, fed_rows, values)
        if self._stage_in is not None:  # the previous stage's rows where the step's sit
            given = tuple(inputs.intermediate)[: len(self._stage_in)]
            for buf, t in zip(self._stage_in, given, strict=True):
                if isinstance(own, slice):
                    buf[own].copy_(t)
                else:
                    buf.index_copy_(0, own, t)
        if at is None and self.lora is not None:  # the decode rows after the padding
            at = np.arange(rows - n, rows)
        with self._lora_buffers(at), self._pieces(q == PIECEWISE):
            outs = self._replays[rows, q](attn_meta)
        runs = {1: self.runs, PIECEWISE: self.piece_runs}.get(q, self.verify_runs)
        runs[rows] = runs.get(rows, 0) + 1
        if isinstance(own, slice):
            mine = [t[own] for t in outs]
        else:
            mine = [t.index_select(0, own) for t in outs]
        if not self.stage.last:  # a stage's outputs for the next (pp_send reads them)
            return IntermediateTensors(*mine)
        if self._aux is not None:  # as the eager forward leaves them: the step's rows
            self._aux.aux_hidden_states = mine[1:]
        return mine[0]

    def _pieces(self, piecewise: bool = True):
        """Inside: the model's attention layers hand their calls to the split (a piecewise
        step's capture or replay; on CUDA a replay runs no Python of the model's)."""
        if not piecewise or self.split is None:
            return contextlib.nullcontext()
        return self.split.installed(self._attention_layers)

    def _lora_buffers(self, rows_at: np.ndarray | None):
        """The LoRA batch's fixed buffers for a capture (None) or a replay whose step rows
        sit at rows_at in the graph (engine.lora.layers.LoRABatch.use_static); nothing
        without LoRA."""
        return contextlib.nullcontext() if self.lora is None else self.lora.use_static(rows_at)

    def close(self) -> None:
        self.strategy.close()
        self._replays.clear()


class ReplayGraphRunner(CudaGraphRunner):
    """The graph runner over EagerReplay on any device and backend: every choice the CUDA
    graphs make (which steps, padding, static buffers, stages, LoRA rows, a draft's graphs)
    without a GPU; it saves no launch and reserves nothing. The model runner builds it in
    place of its step graph where TESSERA_STEP_GRAPH=replay (the tests: in-process engines
    and pipeline workers alike)."""

    @classmethod
    def build(cls, model: torch.nn.Module, config: StepGraphConfig) -> ReplayGraphRunner | None:
        if config.enforce_eager or config.tp_size > 1:  # as CUDA: no graphs there
            return None
        return cls.from_config(model, config, EagerReplay())

    @classmethod
    def reserve_bytes(cls, config: StepGraphConfig) -> int:
        return 0
