"""LoRA on a mixture of experts' projections: the adapters' two layouts read into one, and the
slots of one FusedMoE layer.

PEFT writes experts' adapters two ways:

    per expert (transformers 4, where each expert's gate/up/down was an nn.Linear; Mixtral's
    w1 / w3 / w2):  layers.L.mlp.experts.E.gate_proj.lora_A.weight [r, H], lora_B [I, r]
    stacked (transformers 5's 3D expert parameters, peft's `target_parameters`):
                    layers.L.mlp.experts.lora_A.weight [r * E, in], lora_B [out, r * E]

In the stacked layout A's rows are expert-major (expert e's are rows e*r .. e*r + r) and B's
columns expert-minor (rank j of expert e is column j*E + e), as peft's ParamWrapper reshapes
them. One module with both parameters targeted nests two wrappers: the parameter defined
last in transformers' expert module (down_proj) is the outer one (`experts.lora_A`), the
first (gate_up_proj) under it (`experts.base_layer.lora_A`); a layer with one targeted has
it outermost. gate_up_proj's rows are [gate | up] (gpt-oss: interleaved, gate at the even
rows), as the base weight's.

Either way an adapter becomes, per MoE layer, (A, B) for FusedMoE's two projections, every
expert stacked, the scaling folded into B (float32 until the slots' dtype):

    w13: A [E, r13, H], B [E, 2I, r13]   B's rows gate | up, as FusedMoE's w13
    w2:  A [E, r2, I],  B [E, H, r2]

A per-expert gate and up (each its own rank) share w13 as peft's own conversion does: A
their ranks stacked, B block-diagonal (r13 = r_gate + r_up). Shards follow FusedMoE's: B13's
gate and up rows and A2's input columns split on I across TP ranks (FusedMoE's all-reduce
sums the partial deltas with the experts' outputs), or, with expert parallelism, a rank's
own whole experts.

A step applies it inside the experts' loop (engine.layers.moe.experts_cpu, which every
device runs while a step has expert adapters): the routed pairs are sorted by expert, then by
adapter slot, and each (expert, slot) run adds (x A_e^T) B_e^T to its rows' gate_up product
before the activation and to their down product: one pair of small matmuls per expert and
adapter of the step, never per token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine.lora.layers import LoRABatch
    from engine.models.hf_config import HFModelConfig

GATE_UP, DOWN = 0, 1  # the two projections' index in a layer's slices
STACKED = ("gate_up_proj", "down_proj")  # transformers' expert parameters, in definition order
PER_EXPERT = {  # a transformers 4 expert's module -> (projection, its part of gate_up)
    "gate_proj": (GATE_UP, 0),
    "up_proj": (GATE_UP, 1),
    "down_proj": (DOWN, 0),
    "w1": (GATE_UP, 0),  # Mixtral's names
    "w3": (GATE_UP, 1),
    "w2": (DOWN, 0),
}
LAYER = "experts"  # the key of a layer's expert weights in LoRAAdapter.weights

_STACKED_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.mlp\.experts((?:\.base_layer)*)\.lora_([AB])(?:\.\w+)?\.weight$"
)
_PER_EXPERT_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)"
    r"\.lora_([AB])(?:\.\w+)?\.weight$"
)


def is_expert_key(key: str) -> bool:
    return _STACKED_KEY.search(key) is not None or _PER_EXPERT_KEY.search(key) is not None


def stacked_targets(target_parameters: list[str], layer: int) -> list[str]:
    """The expert parameters of layer `layer` that target_parameters names, in definition
    order (peft's rule: the parameter's full name equals a target or ends with "." + it)."""
    out = []
    for param in STACKED:
        name = f"model.layers.{layer}.mlp.experts.{param}"
        if any(name == t or name.endswith("." + t) for t in target_parameters):
            out.append(param)
    return out


@dataclass
class ExpertsReader:
    """Collects one adapter's expert tensors as read_adapter meets them, then assembles each
    layer's (A, B) per projection. bad(key, why) makes the ValueError naming the field."""

    cfg: HFModelConfig
    bad: object
    target_parameters: list[str]
    check: bool
    # (layer, projection, expert or -1 for stacked, part) -> {"A"/"B": tensor or None}
    halves: dict[tuple[int, int, int, int], dict[str, object]] = field(default_factory=dict)
    # the same keys -> (rank, scaling)
    ranks: dict[tuple[int, int, int, int], tuple[int, float]] = field(default_factory=dict)
    modules: set[str] = field(default_factory=set)  # the targets met, as peft names them
    forms: dict[tuple[int, int], bool] = field(default_factory=dict)  # (layer, proj): stacked

    def add(self, key: str, shape: tuple[int, ...], rank_scale, tensor) -> None:
        """One tensor. rank_scale(module name) -> (rank, scaling) as peft gives that module
        (its rank_pattern / alpha_pattern); tensor() reads the values (not with check)."""
        cfg = self.cfg
        h, inter, e_count = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        m = _STACKED_KEY.search(key)
        if m is not None:
            layer, depth, half = int(m.group(1)), m.group(2).count(".base_layer"), m.group(3)
            targeted = stacked_targets(self.target_parameters, layer)
            if depth >= len(targeted):
                raise self.bad(
                    key,
                    "stacked expert LoRA weights, but target_parameters names "
                    f"{len(targeted)} of this layer's expert parameters ({', '.join(STACKED)})",
                )
            param = targeted[len(targeted) - 1 - depth]
            proj, expert, part = STACKED.index(param), -1, 0
            name = f"model.layers.{layer}.mlp.experts.{param}"
            r, scale = rank_scale(name)
            in_f, out_f = (h, 2 * inter) if proj == GATE_UP else (inter, h)
            want = (r * e_count, in_f) if half == "A" else (out_f, r * e_count)
        else:
            m = _PER_EXPERT_KEY.search(key)
            layer, expert, module, half = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
            if module not in PER_EXPERT:
                raise self.bad(key, f"expert module {module!r} is not supported")
            if expert >= e_count:
                raise self.bad(key, f"expert {expert} does not exist (the model has {e_count})")
            proj, part = PER_EXPERT[module]
            name = key.split(".lora_")[0].removeprefix("base_model.model.")
            r, scale = rank_scale(name)
            in_f, out_f = (h, inter) if proj == GATE_UP else (inter, h)
            want = (r, in_f) if half == "A" else (out_f, r)
            param = module
        if layer >= cfg.num_hidden_layers:
            raise self.bad(
                key, f"layer {layer} does not exist (the model has {cfg.num_hidden_layers})"
            )
        if not cfg.is_moe_layer(layer):
            raise self.bad(key, f"layer {layer} has no experts (a dense MLP)")
        if shape != want:
            raise self.bad(key, f"shape {shape} does not fit the base model (expected {want})")
        form = self.forms.setdefault((layer, proj), expert < 0)
        if form != (expert < 0):
            raise self.bad(key, "this layer's expert weights are both stacked and per expert")
        where = (layer, proj, expert, part)
        self.halves.setdefault(where, {})[half] = None if self.check else tensor()
        self.ranks[where] = (r, scale)
        self.modules.add(param)

    def assemble(self) -> dict[tuple[int, str], list | None]:
        """{(layer, "experts"): [(A13, B13) or None, (A2, B2) or None]} (None with check);
        ValueError for a half without its other half."""

        for (layer, proj, expert, part), ab in self.halves.items():
            for half in "AB":
                if half not in ab:
                    what = STACKED[proj] if expert < 0 else f"{expert}.{_part_name(proj, part)}"
                    raise self.bad(f"layers.{layer}.mlp.experts.{what}.lora_{half}", "missing")
        out: dict[tuple[int, str], list | None] = {}
        for layer in sorted({k[0] for k in self.halves}):
            if self.check:
                out[(layer, LAYER)] = None
                continue
            slices: list = [None, None]
            for proj in (GATE_UP, DOWN):
                keys = [k for k in self.halves if k[:2] == (layer, proj)]
                if not keys:
                    continue
                if keys[0][2] < 0:
                    slices[proj] = self._stacked(layer, proj)
                else:
                    slices[proj] = self._per_expert(layer, proj, keys)
            out[(layer, LAYER)] = slices
        return out

    def _stacked(self, layer: int, proj: int) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        ab = self.halves[(layer, proj, -1, 0)]
        r, scale = self.ranks[(layer, proj, -1, 0)]
        e = self.cfg.num_experts
        a = ab["A"].float().reshape(e, r, -1)
        b = ab["B"].float().reshape(-1, r, e).permute(2, 0, 1) * scale
        if proj == GATE_UP and self.cfg.moe_gate_up_interleaved:  # gpt-oss: to gate | up
            b = torch.cat((b[:, 0::2], b[:, 1::2]), dim=1)
        return a.contiguous(), b.contiguous()

    def _per_expert(self, layer: int, proj: int, keys) -> tuple[torch.Tensor, torch.Tensor]:
        """Each expert's parts: gate and up stacked on rank (B block-diagonal); experts the
        adapter leaves out hold zeros."""
        import torch

        cfg = self.cfg
        e_count, inter, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        parts = sorted({k[3] for k in keys})
        rank = {p: max(self.ranks[k][0] for k in keys if k[3] == p) for p in parts}
        width = sum(rank.values())
        in_f, out_rows = (h, inter) if proj == GATE_UP else (inter, h)
        a = torch.zeros(e_count, width, in_f)
        b = torch.zeros(e_count, out_rows * (2 if proj == GATE_UP else 1), width)
        for _, _, expert, part in keys:
            ab = self.halves[(layer, proj, expert, part)]
            r, scale = self.ranks[(layer, proj, expert, part)]
            off = sum(rank[p] for p in parts if p < part)
            a[expert, off : off + r] = ab["A"].float()
            b[expert, part * out_rows : (part + 1) * out_rows, off : off + r] = (
                ab["B"].float() * scale
            )
        return a, b


def _part_name(proj: int, part: int) -> str:
    return ("gate_proj", "up_proj")[part] if proj == GATE_UP else "down_proj"


def shard_experts(
    slices: list, cfg: HFModelConfig, tp_rank: int, tp_size: int, expert_parallel: bool
) -> list:
    """A layer's [(A13, B13), (A2, B2)] (either None) as FusedMoE holds its weights on this
    rank: I split across ranks (B13's gate and up rows, A2's columns), or with expert
    parallelism this rank's E / tp whole experts."""
    import torch

    inter, e_count = cfg.moe_intermediate_size, cfg.num_experts
    if expert_parallel:
        local = e_count // tp_size
        return [
            None if ab is None else (ab[0][tp_rank * local : (tp_rank + 1) * local],
                                     ab[1][tp_rank * local : (tp_rank + 1) * local])
            for ab in slices
        ]  # fmt: skip
    i = inter // tp_size
    out: list = [None, None]
    if slices[GATE_UP] is not None:
        a, b = slices[GATE_UP]
        rows = torch.cat((b[:, tp_rank * i : (tp_rank + 1) * i],
                          b[:, inter + tp_rank * i : inter + (tp_rank + 1) * i]), dim=1)  # fmt: skip
        out[GATE_UP] = (a, rows)
    if slices[DOWN] is not None:
        a, b = slices[DOWN]
        out[DOWN] = (a[:, :, tp_rank * i : (tp_rank + 1) * i], b)
    return out


class ExpertsLoRA:
    """The adapter slots of one FusedMoE layer: per slot, this rank's A [E, r, in] and B
    [E, out, r] (for the C kernel transposed, [E, r, out]) of w13 and of w2 (either None),
    in the slots' dtype. No slot is preallocated: an expert
    adapter is E times a projection's, and most adapters leave the experts alone; a slot holds
    the loaded copy itself where its dtype and device are the slots'.

    add_runs applies one projection's deltas to every routed pair of a step at once: on the
    CPU one C call per adapter of the step (engine.kernels.cpu.lora, its segments each one
    expert's rows of that adapter, its "slots" the adapter's experts), else a small matmul
    pair per expert and adapter (the torch reference). On CUDA (the batch's Triton kernels)
    fused_hooks gives the fused MoE kernel (engine.kernels.triton.fused_moe) the deltas of
    its pairs instead: the LoRA Triton shrink / expand once per adapter and projection, over
    the adapter's pairs grouped by expert (engine.kernels.triton.lora)."""

    def __init__(
        self, batch: LoRABatch, max_loras: int, dtype: torch.dtype, device, num_experts: int
    ) -> None:
        import torch

        self.batch = batch
        self.num_experts = num_experts  # this rank's
        self.device = torch.device(device)
        # the C kernel's slots are the dense layers' dtype (bf16 for a bf16 model); the torch
        # path's products are float32 on the CPU (a bf16 matmul of a few rows costs several
        # times a float32 one there), the model's dtype on CUDA
        self.kernel = batch.kernel == "cpu"
        self.triton = batch.kernel == "triton"
        self.dtype = dtype if self.kernel or self.device.type != "cpu" else torch.float32
        self.weights: list[list | None] = [None] * max_loras
        self._kernel_args: list[list] = [[None, None] for _ in range(max_loras)]
        self._has: torch.Tensor | None = None

    def set_slot(self, slot: int, slices: list | None, scales=None) -> None:
        """Put an adapter's [(A13, B13), (A2, B2)] (either None; B [E, out, r]) into a slot;
        None clears it."""
        import torch

        self._kernel_args[slot] = [None, None]
        self._has = None  # which slots hold expert weights (pair_slots), made again
        if slices is None or all(ab is None for ab in slices):
            self.weights[slot] = None
            return
        weights: list = []
        for proj, ab in enumerate(slices):
            if ab is None:
                weights.append(None)
                continue
            a = ab[0].to(self.device, self.dtype).contiguous()
            b = ab[1].to(self.device, self.dtype)
            # the C kernel reads B transposed [E, r, out], the Triton kernels as it is
            b = b.transpose(1, 2).contiguous() if self.kernel else b.contiguous()
            weights.append((a, b))
            experts, r = a.shape[0], a.shape[1]
            if self.kernel:  # the C kernel's per-"slot" (here: per-expert) tables
                self._kernel_args[slot][proj] = (
                    torch.full((experts,), r, dtype=torch.int32),  # width
                    torch.zeros(1, dtype=torch.int32),  # slice_row
                    torch.tensor([b.shape[2]], dtype=torch.int32),  # slice_size
                    torch.zeros(experts, 1, dtype=torch.int32),  # slice_off
                    torch.full((experts, 1), r, dtype=torch.int32),  # slice_rank
                )
            elif self.triton:  # the Triton kernels': width, slice_off, slice_rank
                self._kernel_args[slot][proj] = (
                    torch.full((experts,), r, dtype=torch.int32, device=self.device),
                    torch.zeros(experts, 1, dtype=torch.int32, device=self.device),
                    torch.full((experts, 1), r, dtype=torch.int32, device=self.device),
                )
        self.weights[slot] = weights

    @property
    def active(self) -> bool:
        """Whether a row of this step has an adapter with expert weights here."""
        batch = self.batch
        return batch.active and any(self.weights[s] is not None for s in batch.step_slots)

    def pair_slots(self, num_tokens: int, top_k: int) -> torch.Tensor:
        """Each routed (token, k) pair's slot, flat as topk_ids.reshape(-1): the slot of its
        token's adapter where that adapter has expert weights here, else -1 (the base)."""
        import torch

        if self._has is None:  # made once per change of the slots, not per step
            self._has = torch.tensor(
                [w is not None for w in self.weights] + [False], device=self.batch.device
            )  # index -1 (the base) reads the last: False
        has = self._has
        slots = self.batch.row_slots(num_tokens)
        slots = torch.where(has[slots], slots, -1)
        return slots.repeat_interleave(top_k)

    def add_runs(self, proj: int, runs: list[int], x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each row's (x A_e^T) B_e^T for projection proj, in place. x, y: the step's
        routed pairs sorted by expert and, within one, by group (the base, then each slot);
        runs: each (expert, group)'s row count, expert-major."""
        import numpy as np
        import torch

        from engine.kernels.cpu import lora as cpu_lora

        groups = len(self.weights) + 1
        counts = np.asarray(runs, dtype=np.int64).reshape(-1, groups)
        starts = (np.cumsum(counts.reshape(-1)) - counts.reshape(-1)).reshape(counts.shape)
        for slot, weights in enumerate(self.weights):
            ab = None if weights is None else weights[proj]
            if ab is None:
                continue
            experts = np.nonzero(counts[:, slot + 1])[0]
            if experts.size == 0:
                continue
            a, bt = ab
            if self.kernel and cpu_lora.supports(x, y, bt):
                # the kernel's segments index a list of this slot's rows, packed
                first, lens = starts[experts, slot + 1], counts[experts, slot + 1]
                packed = np.cumsum(lens) - lens
                rows = np.repeat(first - packed, lens) + np.arange(lens.sum())
                args = np.concatenate([rows, packed, lens, experts]).astype(np.int32)
                args = torch.from_numpy(args)
                n, m = experts.size, rows.size
                cpu_lora.lora_apply(x, y, a, bt, *self._kernel_args[slot][proj], args[:m],
                                    args[m : m + n], args[m + n : m + 2 * n], args[m + 2 * n :])  # fmt: skip
                continue
            for e in experts.tolist():  # the reference: a matmul pair per expert
                start, n = int(starts[e, slot + 1]), int(counts[e, slot + 1])
                dtype = torch.float32 if x.device.type == "cpu" else a.dtype
                b = bt[e] if self.kernel else bt[e].T  # bt: B transposed for the C kernel
                s = x[start : start + n].to(dtype) @ a[e].to(dtype).T
                y[start : start + n] += s @ b.to(dtype)

    def fused_hooks(self, x: torch.Tensor, topk_ids: torch.Tensor, activate) -> tuple:
        """(add13, activate, add2) for fused_experts: the step's pairs (flat t * top_k + k)
        each get their adapter's delta for their expert, grouped on the host once (one sync:
        LoRA steps run eagerly)."""
        import numpy as np
        import torch

        t, k = topk_ids.shape
        experts = self.num_experts
        slots = self.pair_slots(t, k)
        key = torch.where(slots >= 0, slots * experts + topk_ids.reshape(-1), -1).cpu().numpy()
        order = np.argsort(key, kind="stable")
        order = order[key[order] >= 0]
        # per adapter of the step: (slot, [rows | segment starts | lengths | experts] on the
        # device, rows, segments, the longest segment)
        plan = []
        for slot in np.unique(key[order] // experts).tolist():
            rows = order[key[order] // experts == slot]
            ids, lens = np.unique(key[rows] - slot * experts, return_counts=True)
            starts = np.cumsum(lens) - lens
            host = np.concatenate([rows, starts, lens, ids]).astype(np.int32)
            plan.append((slot, torch.from_numpy(host).to(self.device), rows.size, ids.size,
                         int(lens.max())))  # fmt: skip

        def deltas(proj: int, xs: torch.Tensor, y: torch.Tensor) -> None:
            from engine.kernels.triton.lora import lora_shrink_expand

            for slot, host, m, n, longest in plan:
                ab = self.weights[slot][proj]
                if ab is None:
                    continue
                a, b = ab
                width, off, rank = self._kernel_args[slot][proj]
                lora_shrink_expand(xs, y, a, b, width, off, rank, [(0, b.shape[1])], host[:m],
                                   host[m : m + n], host[m + n : m + 2 * n], host[m + 2 * n :],
                                   longest)  # fmt: skip

        def add13(pre: torch.Tensor) -> None:
            deltas(GATE_UP, x.repeat_interleave(k, dim=0), pre)

        def add2(h: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> None:
            delta = torch.zeros(h.shape[0], out.shape[1], dtype=h.dtype, device=h.device)
            deltas(DOWN, h, delta)
            out.add_(delta.float() * weights.unsqueeze(1))

        return add13, activate, add2
