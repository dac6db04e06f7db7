"""LoRA on a linear layer: stacked per-slot A/B and the step's batched apply.

Every LoRA-capable linear layer (qkv, o, gate_up, down) gets a `LoRALayer` as its `lora`
attribute (engine.layers.linear calls `lora.apply(x, y)` after its own product, before a
row-parallel layer's all-reduce). It holds, for each of max_loras resident slots,

    a [max_loras, n * R, in]    the slices' A stacked on rank (n: 3 for qkv, 2 for gate_up)
    b [max_loras, out, R]       each slice's B (scaling folded in) in its rows of the merged
                                output, columns 0..its rank (for the C kernel a view of
                                bt [max_loras, R, out], the layout it reads)

packed to each slot's own width (sum of its slices' ranks), so a rank-8 adapter costs rank 8
in a slot of max_lora_rank. All layers share one `LoRABatch`, the step's token -> slot
mapping, set once per step by the runner (engine.lora.manager). Applying it:

    torch (any device): per adapter in the step, never per token,
        y[rows_g] += (x[rows_g] @ A_g^T) @ B_g^T        rows_g: a slice, or an index gather
        Its slots are float32 whatever the model's dtype: there a bf16 GEMM of a few rows
        costs 4-5x a float32 one (measured: 4 rows x 576 -> 48 -> 960, 89 us in bf16, 22 us
        with the rows cast to float32), and the deltas are small.
    cpu: the same grouping in one C call per layer for every adapter of the step
        (engine.kernels.cpu.lora), over the segments the Triton kernels read. A bf16 model's
        slots are bf16 (half the bytes: with several adapters a step streams more slot bytes
        than 4-bit base weights), the sums float32; a float32 model's float32.
    triton (CUDA): shrink then expand over the tokens grouped by adapter (punica / S-LoRA
        style, engine.kernels.triton.lora), one launch each for every adapter of the step.

DoRA (engine.lora.adapter): a slot may hold a per-output-row scale g = m / ||W + s B A|| for
each slice its adapter targets (1 elsewhere); `rescale` then makes its rows g * (y - bias)
+ bias after the delta is added (after a row-parallel layer's all-reduce: the layer calls it).
Only a step with a DoRA adapter pays for it (LoRABatch.dora): one multiply per DoRA slot's
rows, in torch on every device, over the rows the kernels read.

The LM head is a LoRALayer too (one slice: this rank's vocabulary shard) over a batch of its
own, set for each call on the rows the runner picks (engine.lora.manager), used once. The
token embedding's delta is `LoRAEmbedding`: a lookup of A's column for each token times B,
in torch on every device (one gather and one small GEMM per adapter of the step).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from engine.kernels.cpu import lora as cpu_lora


class LoRABatch:
    """One step's token -> adapter slot mapping, shared by every LoRA layer of a model.

    set(ranges) takes (slot, first row, row count) for each scheduled request with an
    adapter; rows of the base model are in none. `groups` (the torch path) holds each slot's
    rows as a slice when contiguous, else an index tensor; the C and Triton kernels read the
    same rows sorted by slot (token_rows) with each segment's start, length and slot.
    """

    def __init__(self, device: torch.device, kernel: str = "torch") -> None:
        self.device = device
        self.kernel = kernel  # "torch" | "cpu" | "triton"
        self.active = False
        self.dora = False  # whether a slot of this step holds a DoRA adapter (the manager's)
        self.groups: list[tuple[int, slice | torch.Tensor]] = []
        self.token_rows: torch.Tensor | None = None
        self.seg_start: torch.Tensor | None = None
        self.seg_len: torch.Tensor | None = None
        self.seg_slot: torch.Tensor | None = None
        self.max_rows = 0
        self.step_slots: list[int] = []  # the slots this step's rows use
        self._by_slot: dict[int, list[tuple[int, int]]] = {}  # this step's rows per slot
        self._static: torch.Tensor | None = None  # CUDA graphs' buffers (make_static)
        self._static_shape = (0, 0)
        self._ranges: list[tuple[int, int, int]] = []
        self._row_slots: torch.Tensor | None = None

    def clear(self) -> None:
        self.active = False
        self.dora = False
        self.groups = []
        self.step_slots = []
        self._ranges = []
        self._row_slots = None

    def row_slots(self, num_rows: int) -> torch.Tensor:
        """Each of the step's num_rows rows' slot (-1: the base model), int64 on the device;
        made once a step, for the layers that group by something else first (experts)."""
        cached = self._row_slots
        if cached is None or cached.shape[0] != num_rows:
            host = torch.full((num_rows,), -1, dtype=torch.int64)
            for slot, start, n in self._ranges:
                host[start : start + n] = slot
            cached = self._row_slots = host.to(self.device)
        return cached

    def row_groups(self) -> list[tuple[int, slice | torch.Tensor]]:
        """Each slot's rows (a slice or an index tensor), whichever kernel the batch is for."""
        if not self.groups and self.active:
            segments = zip(
                self.seg_start.tolist(), self.seg_len.tolist(), self.seg_slot.tolist(), strict=True
            )
            self.groups = [
                (slot, self.token_rows[start : start + n].long()) for start, n, slot in segments
            ]
        return self.groups

    def set(self, ranges: list[tuple[int, int, int]]) -> None:
        by_slot: dict[int, list[tuple[int, int]]] = {}
        for slot, start, n in ranges:
            spans = by_slot.setdefault(slot, [])
            if spans and spans[-1][1] == start:  # adjacent rows of the same adapter: merge
                spans[-1] = (spans[-1][0], start + n)
            else:
                spans.append((start, start + n))
        if not by_slot:
            self.clear()
            return
        self.active = True
        self.step_slots = list(by_slot)
        self._ranges, self._row_slots = ranges, None
        if self.kernel != "torch":
            self.groups = []  # the torch path's, built from the segments if a layer needs them
            self._set_segments(by_slot)
            return
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot, spans in by_slot.items():
            if len(spans) == 1:
                groups.append((slot, slice(*spans[0])))
            else:
                rows = torch.cat([torch.arange(a, b) for a, b in spans]).to(self.device)
                groups.append((slot, rows))
        self.groups = groups

    @staticmethod
    def _segment_arrays(by_slot: dict[int, list[tuple[int, int]]]) -> tuple[np.ndarray, list]:
        """The rows sorted by slot, and each segment's start, length and slot."""
        starts, lens, slots = [], [], []
        n = 0
        for slot, spans in by_slot.items():
            starts.append(n)
            lens.append(sum(b - a for a, b in spans))
            slots.append(slot)
            n += lens[-1]
        spans = [span for group in by_slot.values() for span in group]
        rows = np.concatenate([np.arange(a, b, dtype=np.int32) for a, b in spans])
        return rows, [starts, lens, slots]

    def _to_device(self, host: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(host)
        if self.device.type == "cuda":
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def _set_segments(self, by_slot: dict[int, list[tuple[int, int]]]) -> None:
        self._by_slot = by_slot
        rows, (starts, lens, slots) = self._segment_arrays(by_slot)
        n = rows.size
        dev = self._to_device(np.concatenate([rows, np.array(starts + lens + slots, np.int32)]))
        s = len(slots)
        self.token_rows = dev[:n]
        self.seg_start, self.seg_len, self.seg_slot = (
            dev[n : n + s],
            dev[n + s : n + 2 * s],
            dev[n + 2 * s :],
        )
        self.max_rows = max(lens)

    # -- CUDA graphs: a captured step's kernels read fixed buffers --------------------------

    def make_static(self, capacity: int, max_loras: int) -> None:
        """Buffers of `capacity` rows and max_loras segments for captured steps
        (engine.worker.cuda_graph): the Triton kernels' launch grid is then fixed (segments
        and row tiles past a step's own return at once)."""
        self._static = torch.zeros(capacity + 3 * max_loras, dtype=torch.int32, device=self.device)
        self._static_shape = (capacity, max_loras)

    @contextlib.contextmanager
    def use_static(self, rows_at: np.ndarray | None):
        """Inside: the layers read the static buffers, which hold this step's segments with
        its row i moved to rows_at[i] (a replay: the graph's padding rows come first, or
        follow each request's tokens in a verification graph), or no segment at all (rows_at
        None: the capture; or a step without adapters, whose replay then adds nothing)."""
        capacity, slots = self._static_shape
        host = np.zeros(capacity + 3 * slots, dtype=np.int32)
        if rows_at is not None and self.active:
            rows, (starts, lens, seg_slots) = self._segment_arrays(self._by_slot)
            host[: rows.size] = rows_at[rows]
            n = len(lens)
            for i, values in enumerate((starts, lens, seg_slots)):
                host[capacity + i * slots : capacity + i * slots + n] = values
        self._static.copy_(self._to_device(host))
        saved = (self.active, self.token_rows, self.seg_start, self.seg_len, self.seg_slot,
                 self.max_rows, self.groups)  # fmt: skip
        static = self._static
        self.active, self.groups, self.max_rows = True, [], capacity
        self.token_rows = static[:capacity]
        self.seg_start, self.seg_len, self.seg_slot = (
            static[capacity + i * slots : capacity + (i + 1) * slots] for i in range(3)
        )
        try:
            yield
        finally:
            (self.active, self.token_rows, self.seg_start, self.seg_len, self.seg_slot,
             self.max_rows, self.groups) = saved  # fmt: skip


def find_batch(model: torch.nn.Module) -> tuple[LoRABatch, int] | None:
    """The LoRA batch a model's linear layers share and their slots (max_loras), or None."""
    for module in model.modules():
        slots = getattr(module, "lora", None)
        if isinstance(slots, LoRALayer):
            return slots.batch, slots.a.shape[0]
    return None


class LoRALayer:
    """The slots of one linear layer (see the module's docstring). slices: (first output
    row, rows) of each slice in this rank's output; in_features: this rank's input size."""

    def __init__(
        self,
        batch: LoRABatch,
        slices: list[tuple[int, int]],
        in_features: int,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.batch = batch
        self.slices = slices
        n = len(slices)
        out_features = sum(size for _, size in slices)
        self.a = torch.zeros(max_loras, n * max_rank, in_features, dtype=dtype, device=device)
        # The C kernel reads B transposed, [max_loras, max_rank, out] (a rank's row of output
        # columns contiguous: one vector per 16 columns); b is then a view of it, as the torch
        # path and set_slot address it. The Triton kernels read b as laid out.
        self.bt: torch.Tensor | None = None
        if batch.kernel == "cpu":
            self.bt = torch.zeros(max_loras, max_rank, out_features, dtype=dtype, device=device)
            self.b = self.bt.transpose(1, 2)
        else:
            self.b = torch.zeros(max_loras, out_features, max_rank, dtype=dtype, device=device)
        # per slot: its packed rank (0: not targeted) and (first row, rows, offset in the
        # shrink's output, rank) of each slice it targets
        self.width = [0] * max_loras
        self.parts: list[list[tuple[int, int, int, int]]] = [[] for _ in range(max_loras)]
        # the same on the device for the Triton kernels: width [S]; offset and rank [S, n]
        self.width_t = torch.zeros(max_loras, dtype=torch.int32, device=device)
        self.slice_off = torch.zeros(max_loras, n, dtype=torch.int32, device=device)
        self.slice_rank = torch.zeros(max_loras, n, dtype=torch.int32, device=device)
        # and each slice's (first row, rows), for the C kernel
        self.slice_row = torch.tensor([row for row, _ in slices], dtype=torch.int32)
        self.slice_size = torch.tensor([size for _, size in slices], dtype=torch.int32)
        # DoRA: each slot's output scale (float32, made once a slot holds a DoRA adapter)
        self.out_features, self.device = out_features, device
        self.scale: torch.Tensor | None = None
        self.dora = [False] * max_loras

    @property
    def active(self) -> bool:
        """Whether this step adds a delta (a fused path over the layer must step aside)."""
        return self.batch.active

    def set_slot(
        self,
        slot: int,
        slices: list[tuple[torch.Tensor, torch.Tensor] | None] | None,
        scales: list[torch.Tensor | None] | None = None,
    ) -> None:
        """Put an adapter's slices (this rank's A [r, in], B [rows, r]; None where it does
        not target one) into a slot; None clears the slot. scales: a DoRA adapter's g [rows]
        per slice (None: a slice it leaves alone), else None. Only what the slot's last adapter
        wrote is zeroed: a swap is a few copies of rank-sized blocks, each too small to fork
        threads (a busy core made a whole-slot fill's thread start-ups cost ~10 ms each)."""
        for row, size, off, r in self.parts[slot]:
            self.a[slot, off : off + r].zero_()
            self.b[slot, row : row + size, :r].zero_()
        offset, parts = 0, []
        offs, ranks = [0] * len(self.slices), [0] * len(self.slices)
        for i, ((row, size), ab) in enumerate(
            zip(self.slices, slices or [None] * len(self.slices), strict=True)
        ):
            if ab is None:
                continue
            a, b = ab
            r = a.shape[0]
            self.a[slot, offset : offset + r].copy_(a)
            self.b[slot, row : row + size, :r].copy_(b)
            parts.append((row, size, offset, r))
            offs[i], ranks[i] = offset, r
            offset += r
        self.width[slot], self.parts[slot] = offset, parts
        self.width_t[slot] = offset
        self.slice_off[slot] = torch.tensor(offs, dtype=torch.int32)
        self.slice_rank[slot] = torch.tensor(ranks, dtype=torch.int32)
        self._set_scale(slot, scales)

    def _set_scale(self, slot: int, scales: list[torch.Tensor | None] | None) -> None:
        self.dora[slot] = scales is not None and any(g is not None for g in scales)
        if not self.dora[slot]:
            return
        if self.scale is None:
            n = len(self.dora)
            self.scale = torch.ones(n, self.out_features, dtype=torch.float32, device=self.device)
        self.scale[slot].fill_(1.0)
        for (row, size), g in zip(self.slices, scales, strict=True):
            if g is not None:
                self.scale[slot, row : row + size].copy_(g)

    def rescale(self, y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """DoRA's output of the rows of DoRA slots (in place): g * (y - bias) + bias, y the
        base product plus the delta (bias: the one y holds, None if added later)."""
        batch = self.batch
        if not batch.dora:
            return y
        y2 = y.view(-1, y.shape[-1])
        for slot, rows in batch.row_groups():
            if not self.dora[slot]:
                continue
            g = self.scale[slot]
            part = y2[rows].float()
            if bias is not None:
                b = bias.float()
                out = (part - b) * g + b
            else:
                out = part * g
            if isinstance(rows, slice):
                y2[rows] = out.to(y2.dtype)
            else:
                y2.index_copy_(0, rows, out.to(y2.dtype))
        return y

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + this step's LoRA deltas (in place): x [..., in], y [..., out]."""
        batch = self.batch
        if not batch.active:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.view(-1, y.shape[-1])
        if batch.kernel == "triton":
            from engine.kernels.triton.lora import lora_shrink_expand

            lora_shrink_expand(
                x2,
                y2,
                self.a,
                self.b,
                self.width_t,
                self.slice_off,
                self.slice_rank,
                self.slices,
                batch.token_rows,
                batch.seg_start,
                batch.seg_len,
                batch.seg_slot,
                batch.max_rows,
            )
            return y
        if self.bt is not None and cpu_lora.supports(x2, y2, self.bt):
            cpu_lora.lora_apply(
                x2,
                y2,
                self.a,
                self.bt,
                self.width_t,
                self.slice_row,
                self.slice_size,
                self.slice_off,
                self.slice_rank,
                batch.token_rows,
                batch.seg_start,
                batch.seg_len,
                batch.seg_slot,
            )
            return y
        batch.row_groups()  # (a dtype the C kernel does not take: the torch path's groups)
        return self._apply_torch(x2, y2, y)

    def _apply_torch(self, x2: torch.Tensor, y2: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        batch = self.batch
        a_all, b_all = self.a, self.b
        for slot, rows in batch.groups:
            w = self.width[slot]
            if not w:
                continue
            gathered = not isinstance(rows, slice)
            xs = x2.index_select(0, rows) if gathered else x2[rows]
            s = xs.to(a_all.dtype) @ a_all[slot, :w].T  # (float32 slots over bf16: the CPU's)
            parts = self.parts[slot]
            if gathered:
                delta = torch.zeros(s.shape[0], y2.shape[1], dtype=s.dtype, device=s.device)
                for row, size, off, r in parts:
                    delta[:, row : row + size] = (
                        s[:, off : off + r] @ b_all[slot, row : row + size, :r].T
                    )
                y2.index_add_(0, rows, delta.to(y2.dtype))
                continue
            for row, size, off, r in parts:
                out = y2[rows, row : row + size]
                b = b_all[slot, row : row + size, :r]
                if s.dtype == y2.dtype:
                    out.addmm_(s[:, off : off + r], b.T)
                else:
                    out.add_(s[:, off : off + r] @ b.T)
        return y


class LoRAEmbedding:
    """The token embedding's slots: a [max_loras, shard, R] (A transposed: a token's row of
    this rank's vocabulary shard) and b [max_loras, hidden, R] (scaling folded in). The delta
    of row t with slot s is b[s] a[s, id_t - first id] (rows whose ids are on another rank's
    shard add nothing: the embedding's all-reduce sums the ranks). It applies only while
    `armed`: during the step's forward, not to another caller's ids (a draft proposer)."""

    def __init__(
        self,
        batch: LoRABatch,
        vocab_start: int,
        shard_size: int,
        hidden: int,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.batch = batch
        self.vocab_start, self.shard_size = vocab_start, shard_size
        self.a = torch.zeros(max_loras, shard_size, max_rank, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, hidden, max_rank, dtype=dtype, device=device)
        self.rank = [0] * max_loras
        self.armed = False

    def set_slot(
        self, slot: int, slices: list[tuple[torch.Tensor, torch.Tensor] | None] | None
    ) -> None:
        """Put an adapter's (A^T [shard, r], B [hidden, r]) into a slot; None clears it."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        ab = slices[0] if slices else None
        self.rank[slot] = 0
        if ab is not None:
            a, b = ab
            r = a.shape[1]
            self.a[slot, :, :r].copy_(a)
            self.b[slot, :, :r].copy_(b)
            self.rank[slot] = r

    def apply(self, input_ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [T, hidden] + the step's embedding deltas (in place) for input_ids [T]."""
        if not (self.armed and self.batch.active):
            return y
        for slot, rows in self.batch.row_groups():
            r = self.rank[slot]
            if not r:
                continue
            local = input_ids[rows] - self.vocab_start
            inside = (local >= 0) & (local < self.shard_size)
            s = self.a[slot, local.clamp(0, self.shard_size - 1), :r]
            s = s * inside.unsqueeze(-1).to(s.dtype)
            delta = (s @ self.b[slot, :, :r].T).to(y.dtype)
            if isinstance(rows, slice):
                y[rows] += delta
            else:
                y.index_add_(0, rows, delta)
        return y
