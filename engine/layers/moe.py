"""Mixture-of-experts: a router picks top_k of num_experts gated MLPs per token, whose outputs
are summed with the router's weights (Mixtral, Qwen2-MoE, Qwen3-MoE).

FusedMoE holds every expert's weights stacked, w13 [E, 2I, H] (gate | up) and w2 [E, H, I], and
runs them where the tensors are: on CUDA one fused Triton kernel per projection
(engine.kernels.triton.fused_moe: tokens sorted by expert, SiLU-and-mul in the first GEMM's
epilogue); elsewhere experts_cpu, one matmul per expert over the tokens routed to it (or,
where a GGUF file's blocks replace the weights, its expert_linear on the GGUF kernels). A
quantized checkpoint's experts (engine.layers.quantization.experts; gpt-oss's MXFP4 ones:
engine.layers.quantization.mxfp4) set expert_linear on the CPU and fused_quantized on CUDA.
Models name neither.

gpt-oss's experts add biases (w13_bias [E, 2I], w2_bias [E, H]) and take another activation
(SwigluOAIAndMul: clamped, gate * sigmoid(1.702 gate) * (up + 1)); both run on every path.

Tensor parallelism as the dense MLP: every expert is split on I (w13 column-wise, w2 row-wise),
each rank sums its partial outputs and one all-reduce follows (w2's bias is added on rank 0
only, so the sum holds it once). With --enable-expert-parallel each rank holds whole experts,
E / tp of them, runs the routed pairs of its own (the others weigh 0) and the same all-reduce
sums the experts' outputs: no expert is sliced (vLLM's expert parallelism over the TP group,
combined by all-reduce rather than all-to-all). The router and the shared
expert's gate are replicated and never quantized (small, and their scores pick experts).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import get_ep_rank_size, get_tp_rank, get_tp_size, tp_all_reduce
from engine.layers.activation import SiluAndMul, SwigluOAIAndMul
from engine.layers.mlp import GatedMLP
from engine.layers.quantization.unquantized import linear_by_rows

if TYPE_CHECKING:
    from engine.lora.experts import ExpertsLoRA

SCORING_FUNCS = ("softmax", "sigmoid")
ACTIVATIONS = ("silu", "swigluoai")  # SiluAndMul; gpt-oss's SwigluOAIAndMul
GATE, UP, DOWN = 0, 1, 2  # shard ids of one expert's three checkpoint tensors
LORA_W13, LORA_W2 = 0, 1  # a LoRA slot's two projections (engine.lora.experts)


@functools.cache
def _triton_moe():
    if os.environ.get("TESSERA_GPU_FUSED") == "0":
        return None
    try:  # imports triton: never on a CPU-only path
        from engine.kernels.triton import fused_moe
    except ImportError:
        return None
    return fused_moe


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring_func: str = "softmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, top_k] float32, expert ids [T, top_k] int64).

    Scores are softmax (Mixtral, Qwen) or sigmoid over the experts, in float32; the top_k
    scores are the weights, divided by their sum with renormalize (Mixtral always, Qwen where
    norm_topk_prob)."""
    logits = router_logits.float()
    if scoring_func == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring_func == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        raise ValueError(f"MoE scoring function {scoring_func!r} is not one of {SCORING_FUNCS}")
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


_silu_and_mul = SiluAndMul()


class GemmChoice:
    """What linear_by_rows decides once per weight shape (the C GEMM's rows, AMX): one per
    stacked weight, its experts all alike."""


def experts_cpu(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gemms: tuple[GemmChoice, GemmChoice] | None = None,
    expert_linear: Callable[[int, int, torch.Tensor], torch.Tensor] | None = None,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    activation: Callable[[torch.Tensor], torch.Tensor] = _silu_and_mul,
    num_experts: int | None = None,
    lora: ExpertsLoRA | None = None,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for every token, [T, H].

    The (token, k) pairs are sorted by expert; each expert that has tokens runs one gate_up
    matmul over its tokens gathered, SiLU-and-mul, one down matmul, and its weighted rows are
    added into the output (float32, experts in ascending order). The loop is over experts, never
    over tokens; the per-expert counts are read on the host (one sync: this is not the CUDA
    path). With gemms, each matmul runs where the unquantized linear layers' would (the C GEMM
    for few rows, AMX tiles, else oneDNN: engine.layers.quantization.unquantized). With
    expert_linear(e, GATE or DOWN, x), that runs them instead (a GGUF file's blocks: w13 and w2
    are then not float weights, or None: a quantized checkpoint's, give num_experts).
    biases: (b13 [E, 2I], b2 [E, H]) added to each expert's two products; activation: the
    gated activation over [gate | up] (SiLU-and-mul).
    lora: the step's LoRA adapters on these experts (engine.lora.experts): the pairs are then
    sorted by expert and, within one, by adapter slot; every expert's gate_up product goes
    into one tensor first, then each adapter's deltas are added to its rows at once
    (ExpertsLoRA.add_runs) before the activation, and likewise for the down product."""
    g13, g2 = gemms if gemms is not None else (None, None)
    t, k = topk_ids.shape
    num_experts = num_experts or w13.shape[0]
    flat = topk_ids.reshape(-1)
    groups = 1  # runs per expert: the base, then one per LoRA slot
    if lora is not None:
        groups = len(lora.weights) + 1
        flat = flat * groups + lora.pair_slots(t, k) + 1
    order = torch.argsort(flat, stable=True)
    # ids past the last expert (another rank's, under expert parallelism) sort last: skipped
    runs = torch.bincount(flat, minlength=num_experts * groups).tolist()[: num_experts * groups]
    tokens = order // k
    weights = topk_weights.reshape(-1)[order].to(torch.float32).unsqueeze(1)
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)

    def gate_up(e: int, xs: torch.Tensor) -> torch.Tensor:
        b13 = None if biases is None else biases[0][e]
        if expert_linear is not None:
            return _biased(expert_linear(e, GATE, xs), b13)
        return _linear(g13, xs, w13[e], b13)

    def down(e: int, h: torch.Tensor) -> torch.Tensor:
        b2 = None if biases is None else biases[1][e]
        if expert_linear is not None:
            return _biased(expert_linear(e, DOWN, h), b2)
        return _linear(g2, h, w2[e], b2)

    experts = [(e, sum(runs[e * groups : (e + 1) * groups])) for e in range(num_experts)]
    experts = [(e, n) for e, n in experts if n]
    if lora is not None:  # every expert's product first, then each adapter's deltas at once
        used = sum(n for _, n in experts)
        rows = tokens[:used]
        xs = x.index_select(0, rows)
        h = _by_expert(experts, xs, gate_up)
        lora.add_runs(LORA_W13, runs, xs, h)
        h = activation(h)
        y = _by_expert(experts, h, down)
        lora.add_runs(LORA_W2, runs, h, y)
        out.index_add_(0, rows, y.to(torch.float32).mul_(weights[:used]))
        return out.to(x.dtype)
    start = 0
    for e, n in experts:
        rows = tokens[start : start + n]
        y = down(e, activation(gate_up(e, x.index_select(0, rows))))
        y = y.to(torch.float32).mul_(weights[start : start + n])
        out.index_add_(0, rows, y)
        start += n
    return out.to(x.dtype)


def _by_expert(
    experts: list[tuple[int, int]],
    x: torch.Tensor,
    product: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """product(e, rows) for each expert's run of rows of x (in order, n rows each), into one
    tensor."""
    out = None
    start = 0
    for e, n in experts:
        y = product(e, x[start : start + n])
        if out is None:
            out = torch.empty(x.shape[0], y.shape[1], dtype=y.dtype, device=y.device)
        out[start : start + n] = y
        start += n
    return out


def _linear(
    choice: GemmChoice | None, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(x, w, b) if choice is None else linear_by_rows(choice, x, w, b)


def _biased(y: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return y if b is None else y + b


class ReplicatedGate(nn.Module):
    """y = x W^T (+ b) with W [out, in] whole on every rank: a router (out = num_experts; with a
    bias in gpt-oss) or a shared expert's gate (out = 1). Not a LinearBase, so no
    --quantization method takes it."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class FusedMoE(nn.Module):
    """num_experts gated MLPs of intermediate size I, stacked: w13_weight [E, 2I/tp, H],
    w2_weight [E, H, I/tp]. forward(x [T, H], router_logits [T, E]) -> [T, H], all-reduced over
    the tensor-parallel group unless reduce_results is False.

    Each checkpoint tensor loads through weight_loader(param, tensor, (expert, GATE|UP|DOWN));
    a parameter's `expected_shards` tells the loader which it needs before it is whole."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        scoring_func: str = "softmax",
        reduce_results: bool = True,
        bias: bool = False,
        activation: str = "silu",
        swiglu: tuple[float, float] = (1.702, 7.0),
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"MoE activation {activation!r} is not one of {ACTIVATIONS}")
        if scoring_func not in SCORING_FUNCS:
            raise ValueError(f"MoE scoring function {scoring_func!r} is not one of {SCORING_FUNCS}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in 1..num_experts {num_experts}")
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        # expert parallelism: whole experts per rank, E / ep_size of them (the I slice's rank
        # and size then 1); else every rank holds its tp slice of I of every expert
        self.ep_rank, self.ep_size = get_ep_rank_size()
        if num_experts % self.ep_size:
            raise ValueError(
                f"--enable-expert-parallel: {num_experts} experts do not split evenly over "
                f"{self.ep_size} ranks"
            )
        self.num_local_experts = num_experts // self.ep_size
        self.first_expert = self.ep_rank * self.num_local_experts
        self.slice_rank, slices = (0, 1) if self.ep_size > 1 else (self.tp_rank, self.tp_size)
        self.inter_slices = slices  # how many ranks split each expert's I (1: whole experts)
        if intermediate_size % slices:
            raise ValueError(
                f"moe_intermediate_size ({intermediate_size}) is not divisible by "
                f"tensor_parallel_size ({self.tp_size}); --enable-expert-parallel keeps "
                "experts whole"
            )
        self.num_experts, self.top_k, self.hidden_size = num_experts, top_k, hidden_size
        self.renormalize, self.scoring_func = renormalize, scoring_func
        self.reduce_results = reduce_results
        self.inter = inter = intermediate_size // slices  # this rank's share
        local = self.num_local_experts
        self.w13_weight = nn.Parameter(
            torch.empty(local, 2 * inter, hidden_size), requires_grad=False
        )
        self.w2_weight = nn.Parameter(torch.empty(local, hidden_size, inter), requires_grad=False)
        self.activation, self.swiglu = activation, swiglu  # swiglu: gpt-oss's (alpha, limit)
        self._act = SwigluOAIAndMul(*swiglu) if activation == "swigluoai" else _silu_and_mul
        # gpt-oss: a bias on each expert's gate_up (this rank's slice of I) and down
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = nn.Parameter(torch.zeros(local, 2 * inter), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.zeros(local, hidden_size), requires_grad=False)
        self._gemms = (GemmChoice(), GemmChoice())
        # (e, GATE or DOWN, x) -> x @ expert e's w13 or w2, where the weights are not floats
        # (engine.layers.quantization.gguf.GGUFExperts: a GGUF file's blocks); CPU only
        self.expert_linear: Callable[[int, int, torch.Tensor], torch.Tensor] | None = None
        # (x, topk_weights, topk_ids) -> [T, H]: a quantized checkpoint's experts on CUDA
        # (engine.layers.quantization.experts: the fused Triton kernel on the quantized weights)
        self.fused_quantized: Callable[..., torch.Tensor] | None = None
        # LoRA adapters' slots on these experts (engine.lora.manager attaches them): a step
        # with one adds their deltas in experts_cpu's loop, or on CUDA in the fused kernel's
        # (ExpertsLoRA.fused_hooks)
        self.lora: ExpertsLoRA | None = None
        for param, shards in (
            (self.w13_weight, {(e, s) for e in range(num_experts) for s in (GATE, UP)}),
            (self.w2_weight, {(e, DOWN) for e in range(num_experts)}),
        ):
            param.weight_loader = self.weight_loader
            param.expected_shards = shards

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int]
    ) -> None:
        """One expert's gate [I, H], up [I, H] or down [H, I], this rank's slice of I; under
        expert parallelism the whole of it where this rank holds the expert, else nothing."""
        expert, which = shard_id
        expert = self.local_expert(expert)
        if expert is None:
            return  # another rank's expert
        i = self.inter
        if which == DOWN:
            dst, src = param.data[expert], loaded.narrow(1, self.slice_rank * i, i)
        else:
            dst = param.data[expert].narrow(0, which * i, i)
            src = loaded.narrow(0, self.slice_rank * i, i)
        if dst.shape != src.shape:
            raise ValueError(
                f"expert weight shape mismatch: checkpoint {tuple(loaded.shape)} (this rank's "
                f"slice {tuple(src.shape)}), model {tuple(dst.shape)}"
            )
        dst.copy_(src)

    def local_expert(self, expert: int) -> int | None:
        """A checkpoint's expert index in this rank's stacks, or None: another rank's expert
        (expert parallelism)."""
        local = expert - self.first_expert
        return local if 0 <= local < self.num_local_experts else None

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(
            router_logits, self.top_k, self.renormalize, self.scoring_func
        )
        if self.ep_size > 1:  # this rank's experts only: the others' pairs weigh nothing
            weights, ids = self.local_pairs(weights, ids)
        biases = None if self.w13_bias is None else (self.w13_bias, self.w2_bias)
        lora = self.lora if self.lora is not None and self.lora.active else None
        # the fused kernels take LoRA deltas through the LoRA Triton kernels (lora.triton)
        fusable = lora is None or lora.triton
        fused = _triton_moe() if x.is_cuda and self.expert_linear is None and fusable else None
        quantized = self.fused_quantized if fusable else None
        if self.fused_quantized is not None and quantized is None and self.expert_linear is None:
            raise RuntimeError(
                "LoRA on quantized experts on CUDA runs in their fused kernel, with the LoRA "
                "Triton kernels (TESSERA_LORA_KERNEL=torch does not take them)"
            )
        if self.ep_size > 1 and (fused is not None or quantized is not None):
            # the kernels take no other id: another rank's pairs run on the last local expert,
            # weighing 0
            ids = ids.clamp(max=self.num_local_experts - 1)
        hooks = None
        if lora is not None and (fused is not None or quantized is not None):
            hooks = lora.fused_hooks(x, ids, self._act)
        if quantized is not None:
            out = quantized(x, weights, ids, lora=hooks)
        elif fused is not None:
            out = fused.fused_experts(
                x, self.w13_weight, self.w2_weight, weights, ids, biases, self.activation,
                self.swiglu, hooks,
            )  # fmt: skip
        else:
            out = experts_cpu(
                x, self.w13_weight, self.w2_weight, weights, ids, self._gemms,
                self.expert_linear, biases, self._act, self.num_local_experts, lora,
            )  # fmt: skip
        return tp_all_reduce(out) if self.reduce_results else out

    def local_pairs(
        self, weights: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed pairs in this rank's expert numbering: another rank's expert becomes
        num_local_experts (experts_cpu skips it) with weight 0 (the fused kernel, which
        takes no such id, runs it on its last local expert and scales it away)."""
        local = ids - self.first_expert
        mine = (local >= 0) & (local < self.num_local_experts)
        return weights * mine, torch.where(mine, local, self.num_local_experts)


class SparseMoeBlock(nn.Module):
    """The MLP of a MoE decoder layer: gate (the router) -> experts, plus, where the model has
    one, a shared expert every token runs (Qwen2-MoE: scaled by sigmoid(shared_expert_gate(x)))."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        scoring_func: str = "softmax",
        shared_intermediate_size: int = 0,
        shared_expert_gate: bool = False,
    ):
        super().__init__()
        self.gate = ReplicatedGate(hidden_size, num_experts)
        self.experts = FusedMoE(
            num_experts, top_k, hidden_size, intermediate_size, renormalize, scoring_func
        )
        self.shared_expert = (
            GatedMLP(hidden_size, shared_intermediate_size) if shared_intermediate_size else None
        )
        self.shared_expert_gate = (
            ReplicatedGate(hidden_size, 1)
            if shared_intermediate_size and shared_expert_gate
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


# a quantized checkpoint's tensors too (engine.layers.quantization.experts)
_EXPERT_TENSOR = re.compile(
    r"^(?P<prefix>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\."
    r"(?P<tensor>weight|weight_packed|weight_scale|weight_scale_inv|weight_zero_point"
    r"|weight_shape|weight_g_idx|input_scale|input_zero_point|qweight|qzeros|scales|g_idx"
    r"|bnb_\w+)$"  # bitsandbytes' statistics, as engine.layers.quantization.bnb names them
)


def expert_weight_target(
    ckpt_name: str, proj_shards: dict[str, int]
) -> tuple[str, tuple[int, int]] | None:
    """A checkpoint's per-expert tensor ("<prefix>.experts.<e>.<proj>.weight", proj a key of
    proj_shards; or .weight_scale etc. of a quantized checkpoint) -> (the stacked parameter's
    name: w13_weight, w2_weight_scale, ..., (e, shard)); None for any other name."""
    m = _EXPERT_TENSOR.match(ckpt_name)
    if m is None or m["proj"] not in proj_shards:
        return None
    shard = proj_shards[m["proj"]]
    param = f"{'w2' if shard == DOWN else 'w13'}_{m['tensor']}"
    return f"{m['prefix']}.experts.{param}", (int(m["expert"]), shard)
