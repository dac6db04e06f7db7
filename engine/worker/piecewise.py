"""Piecewise CUDA graphs: mixed and prefill steps captured in pieces, attention run between.

A decode graph (cuda_graph.py) holds a whole step: every request has one query token, so the
attention kernels' launches depend on the batch size alone. A step with prefill chunks has
launches that follow its query lengths, so no one graph replays it; but everything except
attention (the embedding, norms, projections, rotary, MLP or experts, LoRA) works token by
token and depends only on the number of tokens. Such a step, padded to a size of a token
ladder, is captured as pieces: the forward up to the first layer's attention, from each
attention to the next, and from the last one to the final norm, a graph each. A replay runs
the pieces in order and each layer's attention eagerly between them, over the step's own
metadata and its own tokens: the padding tokens after them attend to nothing and write no K/V.
vLLM and SGLang do the same by default (they split a torch.compile graph at attention); here
the attention layer itself marks the seams and the model is unchanged.

The seams: while a piecewise step runs, each attention layer of the model holds the runner's
AttentionSplit (PagedAttention.split) and hands its call to it: attention over the first n
rows (n: the metadata's slots, the step's tokens), written into a static output buffer that
the next piece reads. Under capture (capture_pieces) the seam also ends the current piece's
graph before the attention and begins the next one after it, and records the attention as a
replay step over the piece's q/k/v, held as views that do not own their memory: the pool may
give those blocks to later captures (as it does the residual that crosses the seam), since a
replay rewrites them before the attention reads them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from engine.attention.backends.base import AttentionMetadata
    from engine.attention.layer import PagedAttention

Replay = Callable[["AttentionMetadata"], tuple[torch.Tensor, ...]]
Seam = Callable[..., torch.Tensor]


class AttentionSplit:
    """What the attention layers of a piecewise step call (PagedAttention.split): attention
    over the step's own tokens into a static buffer of up to max_tokens rows, one per output
    width and dtype, shared by every layer (a layer's output is read by the next piece, which
    runs before the next layer's attention rewrites it)."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._outputs: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
        self.seam: Seam | None = None  # capture_pieces's, while it captures

    def __call__(self, layer: PagedAttention, *qkv_meta) -> torch.Tensor:
        """What PagedAttention.forward hands over (q, k, v, meta): the seam's while a capture
        runs, else attend's."""
        return (self.seam or self.attend)(layer, *qkv_meta)

    def attend(
        self,
        layer: PagedAttention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The layer's attention (its K/V written) over the first n rows, n the metadata's
        slot count, into the static buffer's first n rows; -> the buffer's first q rows (the
        rows past n keep an earlier step's finite values: padding, dropped at the end)."""
        n = meta.slot_mapping.shape[0]
        own = layer.attend(q[:n], k[:n], v[:n], meta)
        out = self._output(own)[: q.shape[0]]
        out[:n].copy_(own)
        return out

    def _output(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.shape[1], like.dtype, like.device)
        buf = self._outputs.get(key)
        if buf is None:  # zeros: padding rows read finite values from the first step on
            buf = torch.zeros(self.max_tokens, like.shape[1], dtype=like.dtype, device=like.device)
            self._outputs[key] = buf
        return buf

    @contextlib.contextmanager
    def installed(self, layers: Iterable[PagedAttention]) -> Iterator[None]:
        """Inside, the layers hand their attention to this split (a piecewise step)."""
        layers = list(layers)
        for layer in layers:
            layer.split = self
        try:
            yield
        finally:
            for layer in layers:
                layer.split = None


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _ArrayInterface:
    """An array interface over memory someone else owns: torch.as_tensor (CUDA) or numpy
    (CPU) builds a tensor on it that keeps this object alive, not the memory."""

    def __init__(self, t: torch.Tensor):
        size = t.element_size()
        interface = {
            "shape": tuple(t.shape),
            "strides": tuple(s * size for s in t.stride()),
            "typestr": f"<i{size}",
            "data": (t.data_ptr(), False),
            "version": 2,
        }
        if t.is_cuda:
            self.__cuda_array_interface__ = interface
        else:
            self.__array_interface__ = interface


def unowned(t: torch.Tensor) -> torch.Tensor:
    """A view of t (its shape, strides and dtype) that does not keep t's memory allocated:
    what a replay step holds of a captured piece's tensors (see the module doc)."""
    raw = t.view(_INT_OF_SIZE[t.element_size()])  # the interfaces know no bfloat16
    holder = _ArrayInterface(raw)
    if t.is_cuda:
        view = torch.as_tensor(holder, device=t.device)
    else:
        view = torch.from_numpy(np.asarray(holder))
    return view.view(t.dtype)


def capture_stream() -> torch.cuda.Stream:
    """torch.cuda.graph's own side stream (created on first use), so that the pieces and the
    whole-step graphs share its cuBLAS workspaces."""
    graph = torch.cuda.graph
    if graph.default_capture_stream is None:
        graph.default_capture_stream = torch.cuda.Stream()
    return graph.default_capture_stream


def capture_pieces(
    step: Replay,
    meta: AttentionMetadata,
    split: AttentionSplit,
    pool: tuple[int, int],
    graphs: list[torch.cuda.CUDAGraph],
) -> Replay:
    """Capture step (run with split installed on its attention layers, warmed up by the
    caller) as pieces in pool, appended to graphs; -> the replay: the pieces in order, each
    layer's attention between them over the replay's metadata."""
    replay_steps: list[Callable[[AttentionMetadata], object]] = []
    piece: list[torch.cuda.CUDAGraph] = []

    def begin() -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=pool)
        piece.append(graph)

    def end() -> None:
        graph = piece.pop()
        graph.capture_end()
        graphs.append(graph)
        replay_steps.append(lambda _meta: graph.replay())

    def seam(layer, q, k, v, step_meta):
        end()
        views = tuple(unowned(t) for t in (q, k, v))
        replay_steps.append(lambda m: split.attend(layer, *views, m))
        out = split.attend(layer, q, k, v, step_meta)  # outside any graph
        begin()
        return out

    stream = capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        split.seam = seam
        try:
            begin()
            outs = step(meta)
            end()
        finally:
            split.seam = None
            if piece:  # a failed capture: end it, so the stream can run again
                with contextlib.suppress(RuntimeError):
                    piece.pop().capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()

    def replay(m: AttentionMetadata) -> tuple[torch.Tensor, ...]:
        for run in replay_steps:
            run(m)
        return outs

    return replay
