"""CUDA graphs for decode steps: the GPU's step graph (engine.worker.step_graph: the model
runner runs it where it takes the step, the eager forward otherwise, as it does the CPU's
one-call plan, cpu_graph.py). It reads the step's host-side inputs only (eager_inputs False).

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

Steps a graph does not take run eagerly: any step with a prefill chunk, a batch above the
ladder, a backend whose launches depend on the step's contents (`cuda_graph_capturable`), more
than one tensor-parallel rank (capturing collectives is not wired up yet), `--enforce-eager`.
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
from typing import Protocol

import numpy as np
import torch

from engine.attention.backends.base import AttentionBackend, AttentionMetadata
from engine.attention.metadata import CommonAttentionMetadata
from engine.lora.layers import find_batch
from engine.worker import kv_budget
from engine.worker.step_graph import StepGraphConfig, StepInputs

logger = logging.getLogger("tessera.engine")

LADDER_HEAD = (1, 2, 4, 8, 16, 24, 32)
LADDER_STEP = 16
MAX_CAPTURE_SIZE = 512  # vLLM's cap: larger batches gain little from a graph
PAD_SLOT = 0  # slot 0 of the reserved block 0: padding rows write nowhere anyone reads

StepFn = Callable[[AttentionMetadata], torch.Tensor]


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
    """Whether a step is a graph's: decodes only (one query token per request), at most
    max_rows of them, block tables of at most max_blocks."""
    return (
        0 < common.num_reqs <= max_rows
        and common.num_decodes == common.num_reqs
        and common.num_actual_tokens == common.num_reqs
        and common.block_table.shape[1] <= max_blocks
    )


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
    return _decode_metadata(qsl, seq_lens, table, slots, common.block_size, common.max_seq_len)


def capture_metadata(rows: int, block_size: int, max_blocks: int) -> CommonAttentionMetadata:
    """What a graph is captured on: `rows` padding requests at the longest context (every
    block of their tables block 0), so whatever a backend sizes by the step's maximum is as
    large as any later step needs. Their K/V go to PAD_SLOT."""
    qsl = np.arange(rows + 1, dtype=np.int64)
    seq_lens = np.full(rows, max_blocks * block_size, dtype=np.int64)
    table = np.zeros((rows, max_blocks), dtype=np.int32)
    slots = torch.full((rows,), PAD_SLOT, dtype=torch.int64)
    return _decode_metadata(qsl, seq_lens, table, slots, block_size, max_blocks * block_size)


def _decode_metadata(qsl, seq_lens, table, slots, block_size, max_seq_len):
    rows = len(seq_lens)
    return CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
        block_table=torch.from_numpy(table),
        slot_mapping=slots,
        block_size=block_size,
        num_reqs=rows,
        num_actual_tokens=rows,
        num_decodes=rows,
        num_decode_tokens=rows,
        max_query_len=1,
        max_seq_len=max(max_seq_len, 1),
        query_start_loc_np=qsl,
        seq_lens_np=seq_lens,
        block_table_np=table,
    )


class StaticStepInputs:
    """The graphs' input ids and positions: one int64 device buffer, written from one pinned
    host buffer by one non_blocking copy per step. The graph of size b reads ids from [0, b)
    and positions from [b, 2b), so a step copies just 2b values."""

    def __init__(self, max_rows: int, device: torch.device):
        self.device = device
        pin = device.type == "cuda"
        self.host = torch.zeros(2 * max_rows, dtype=torch.int64, pin_memory=pin)
        self._host_np = self.host.numpy()
        self.buffer = torch.zeros(2 * max_rows, dtype=torch.int64, device=device)
        # The last copy out of the pinned buffer: it must finish before the host rewrites it.
        self._copied = torch.cuda.Event() if pin else None

    def ids(self, rows: int) -> torch.Tensor:
        return self.buffer[:rows]

    def positions(self, rows: int) -> torch.Tensor:
        return self.buffer[rows : 2 * rows]

    def fill(self, ids: Sequence[int], positions: Sequence[int], rows: int) -> None:
        """This step's ids and positions after rows - len(ids) padding rows (token 0 at 0)."""
        pad = rows - len(ids)
        if self._copied is not None:
            self._copied.synchronize()  # normally long done: the last step read its tokens
        h = self._host_np
        h[:pad] = 0
        h[pad:rows] = ids
        h[rows : rows + pad] = 0
        h[rows + pad : 2 * rows] = positions
        self.buffer[: 2 * rows].copy_(self.host[: 2 * rows], non_blocking=True)
        if self._copied is not None:
            self._copied.record()


class CaptureStrategy(Protocol):
    def capture(self, step: StepFn, meta: AttentionMetadata) -> StepFn:
        """Capture step (which reads only static buffers) run with meta, whose tensors are
        views of the backend's static metadata; return the replay: called with a later
        fill's metadata, it returns the step's output for the buffers' new contents."""
        ...

    def close(self) -> None: ...


class CudaGraphCapture:
    """torch.cuda.CUDAGraph per batch size, all in one memory pool (captured largest first,
    so the smaller graphs reuse the largest one's memory)."""

    def __init__(self, warmup_runs: int = 2):
        self.pool = torch.cuda.graph_pool_handle()
        self.warmup_runs = warmup_runs
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def capture(self, step: StepFn, meta: AttentionMetadata) -> StepFn:
        # Eager runs first: lazy initialisation, kernel autotuning and library workspaces
        # must not happen inside the capture.
        for _ in range(self.warmup_runs):
            step(meta)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step(meta)
        self.graphs.append(graph)

        def replay(_meta: AttentionMetadata) -> torch.Tensor:
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

    def capture(self, step: StepFn, meta: AttentionMetadata) -> StepFn:
        step(meta)
        return step

    def close(self) -> None:
        pass


class CudaGraphRunner:
    """The step graph of CUDA decode steps: run(inputs) reads the step's host-side inputs
    (lists of ids and positions, the flat CommonAttentionMetadata, the fed ids), since it
    fills its own static buffers -> hidden [rows, H], or None for the steps it leaves to the
    eager forward."""

    eager_inputs = False
    graph_bytes = 0  # measured by capture_all
    takes_lora = False  # set where the model's LoRA layers run the Triton kernels
    # a step with these runs eagerly: DoRA's rescaling, and the embedding's and experts'
    # deltas (their rows are grouped on the host)
    lora_blockers = frozenset({"dora", "embedding", "experts"})

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        ladder: Sequence[int],
        max_blocks_per_req: int,
        strategy: CaptureStrategy,
        device: torch.device | str,
    ):
        self.model = model
        self.backend = backend
        self.ladder = tuple(sorted(ladder))
        self.max_rows = self.ladder[-1]
        self.max_blocks = max_blocks_per_req
        self.strategy = strategy
        self.device = torch.device(device)
        self.inputs = StaticStepInputs(self.max_rows, self.device)
        self.static_meta = backend.allocate_static_metadata(self.max_rows, max_blocks_per_req)
        self._replays: dict[int, StepFn] = {}
        self.runs: dict[int, int] = {}  # replays per batch size (tests, stats)
        self.capture_seconds = 0.0
        self.graph_bytes = 0
        # LoRA (engine.lora): the Triton shrink / expand are captured over the batch's fixed
        # segment buffers, which each replay fills with its step's (none: nothing added)
        found = find_batch(model)
        self.lora = found[0] if found is not None and found[0].kernel == "triton" else None
        if self.lora is not None:
            self.lora.make_static(self.max_rows, found[1])
        self.takes_lora = self.lora is not None

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
        runner = cls(
            model,
            c.backend,
            batch_ladder(c.max_num_seqs),
            -(-c.max_model_len // c.block_size),
            CudaGraphCapture(),
            c.device,
        )
        runner.capture_all()
        if c.log:
            logger.info(
                "CUDA graphs: %d decode batch sizes (%d-%d) captured in %.1f s, %.0f MiB",
                len(runner.ladder),
                runner.ladder[0],
                runner.max_rows,
                runner.capture_seconds,
                runner.graph_bytes / 2**20,
            )
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
        return kv_budget.graph_reserve_bytes(
            batch_ladder(c.max_num_seqs),
            hidden_size=hf.hidden_size,
            num_heads=hf.num_attention_heads // c.tp_size,
            num_kv_heads=c.num_kv_heads,
            head_dim=hf.head_dim,
            intermediate_size=inter,
            act_bytes=torch.empty((), dtype=c.dtype).element_size(),
        )

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size of the ladder, the largest first, on padding-only steps."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            free_before, _ = torch.cuda.mem_get_info(self.device)
        t0 = time.perf_counter()
        for rows in reversed(self.ladder):
            common = capture_metadata(rows, self.backend.block_size, self.max_blocks)
            self.inputs.fill([], [], rows)
            meta = self.backend.fill_static_metadata(self.static_meta, common)
            with self._lora_buffers(None):
                self._replays[rows] = self.strategy.capture(self._step_fn(rows), meta)
        if cuda:
            torch.cuda.synchronize(self.device)
            free_after, _ = torch.cuda.mem_get_info(self.device)
            self.graph_bytes = max(0, free_before - free_after)
        self.capture_seconds = time.perf_counter() - t0

    def _step_fn(self, rows: int) -> StepFn:
        ids, positions = self.inputs.ids(rows), self.inputs.positions(rows)
        model = self.model

        def step(meta: AttentionMetadata) -> torch.Tensor:
            return model(ids, positions, meta)

        return step

    def bucket(self, common: CommonAttentionMetadata) -> int | None:
        """The captured size this step runs as, or None (eager)."""
        if not graph_takes(common, self.max_rows, self.max_blocks):
            return None
        return bucket_for(common.num_reqs, self.ladder)

    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """The step's host-side inputs into the static buffers, then the replay of its size.
        inputs.fed: (rows, values on the device) replacing those rows' input ids after the host
        copy: async scheduling's placeholders, the last step's sampled ids."""
        meta = inputs.common
        rows = self.bucket(meta)
        if rows is None:
            return None
        n = meta.num_reqs
        self.inputs.fill(inputs.ids, inputs.positions, rows)
        fed = inputs.fed
        if fed is not None:  # the step's rows come after rows - n padding rows
            self.inputs.ids(rows).index_copy_(0, fed[0] + (rows - n), fed[1])
        attn_meta = self.backend.fill_static_metadata(
            self.static_meta, pad_decode_metadata(meta, rows)
        )
        with self._lora_buffers(rows - n):
            hidden = self._replays[rows](attn_meta)
        self.runs[rows] = self.runs.get(rows, 0) + 1
        return hidden[rows - n :]  # the padding rows came first

    def _lora_buffers(self, shift: int | None):
        """The LoRA batch's fixed buffers for a capture (shift None) or a replay whose step
        rows start at `shift` (engine.lora.layers.LoRABatch.use_static); nothing without LoRA."""
        return contextlib.nullcontext() if self.lora is None else self.lora.use_static(shift)

    def close(self) -> None:
        self.strategy.close()
        self._replays.clear()
