"""GGUF weights served in the file's own quantization (`--quantization gguf`, the default for
a .gguf model on the CPU).

Each linear layer whose GGUF tensors are of a type the CPU kernels read keeps the file's
values, so the weights in memory are about the file's size and nothing is requantized: the
loaded (dequantized) float weight is dropped.
- Q4_0 and Q4_1 blocks are repacked bit for bit into the w4 kernel's tiles (engine.gguf.w4:
  1.3-2x the per-row dot kernel at 1-12 rows); larger batches read the same tiles
  in AMX-bf16 tiles (engine.kernels.cpu.amx_bf16) where the CPU has them, else on the AVX512-VNNI
  batch kernel (int8 activations per 32, cpu_w4.linear_batch). With AVX2 only, the w4
  kernel takes every batch (int8 activations per 32: 2.2-2.6x the dot kernel, 1.4-1.7x the
  C GEMM on the bf16 weight at 8-128 rows).
- Q5_0, Q5_1 and IQ4_NL (llama.cpp's stand-ins for Q4_K, Q5_K and IQ4_XS/Q3_K/Q2_K where
  K % 256 != 0), Q8_0, the K-quants Q2_K-Q6_K and IQ4_XS (K % 256 == 0), and Q4
  layers the w4 kernel cannot take
  (K not a multiple of 64, a float32 model, neither AVX512-VNNI nor AVX2) keep the file's
  blocks on the GGUF dot kernels (engine.kernels.cpu.gguf), AMX on decoded rows for larger
  batches.
- A merged projection whose parts the file stores in different types (Q4_K_M: q/k Q4_K, v
  Q6_K) holds them as row segments of their own types, one kernel call per segment
  (GGUFSegmentsLinearMethod).
Layers of other types (float parts, types without a kernel, K the blocks do not divide) keep
the dequantized weights on the unquantized method; the log says which layer kinds took which
path. The LM head reads the file's rows (output.weight, or the tied token_embd) in small
batches, and in large ones the float table a tied embedding keeps anyway; an untied head
holds no float weight (an 8B model's 1 GB in bf16) and multiplies large batches on its rows
like the other layers (AMX's decoded rows, or slices dequantized per call); with AVX2, or
AVX512-VNNI without AMX, Q8_0 rows become tiles read at every batch. An embedding not tied
to the head looks its tokens up in the file's token_embd blocks (GGUFEmbeddingRows: an 8B
model's 1 GB bf16 table becomes its ~0.3 GB of blocks); a tied one stays the float table the
head reads. A MoE layer's stacked experts (qwen3moe's ffn_*_exps) keep their blocks too
(GGUFExperts: each routed expert's gate/up and down on cpu_gguf.linear), unless a part is a
float tensor or gate and up differ in type; gpt-oss's MXFP4 experts stay the file's MXFP4
blocks (the dot kernels read them as they are).
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from engine.gguf import w4 as gguf_w4
from engine.kernels.cpu import amx_bf16 as cpu_amx
from engine.kernels.cpu import gemm as cpu_gemm
from engine.kernels.cpu import gguf as cpu_gguf
from engine.kernels.cpu import isa as cpu_isa
from engine.kernels.cpu import w4 as cpu_w4
from engine.layers.moe import DOWN, FusedMoE
from engine.layers.quantization.base import LinearMethodBase, LMHeadMethodBase
from engine.layers.quantization.unquantized import greedy_by_rows, linear_by_rows

logger = logging.getLogger("tessera.engine")


class GGUFLinearMethod(LinearMethodBase):
    """layer.weight: uint8 [out, row bytes] file blocks; layer.gguf_type (ggml id) and
    layer.in_features tell the kernel how to read them."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return cpu_gguf.linear(x, layer.weight, layer.gguf_type, layer.in_features, bias)


def w4_large_batch_linear(
    x: torch.Tensor, q4: cpu_w4.Q4Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] of more than cpu_w4.max_rows() rows (or calls the w4 kernel refuses) against
    w4 tiles: AMX-bf16 tiles reading them (cpu_amx) up to the plan's AMX w4 rows; without AMX
    the AVX512-VNNI batch kernel (cpu_w4.linear_batch: SmolLM2's four layer shapes on two Zen
    5 cores 1.5-1.7x faster at 13-64 rows than the 12-row kernel in chunks, 1.5-2.2x at
    128-512 than the tiles dequantized for oneDNN); elsewhere, and for prefill chunks above
    AMX's rows (oneDNN's GEMM uses the tiles itself), the tiles dequantized per call
    (cpu_w4.unpack, one C pass) for cpu_gemm.dense_linear. (With AVX2 the w4 kernel takes
    every batch: none of this runs.)"""
    k, n = x.shape[-1], q4.out_features
    rows = x.numel() // k
    plan = cpu_isa.plan()
    if plan.amx_w4_rows(rows):
        y = cpu_amx.linear_w4(x, q4.data, n, k, bias)
        if y is not None:
            return y
    if not plan.amx or plan.amx_w4_rows(rows):
        y = cpu_w4.linear_batch(x, q4, bias)
        if y is not None:
            return y
    w = cpu_w4.unpack(q4, x.dtype)
    return cpu_gemm.dense_linear(x, w, None if bias is None else bias.to(x.dtype))


class GGUFW4LinearMethod(GGUFLinearMethod):
    """A Q4_0/Q4_1 layer repacked into w4 tiles: layer.w4 (a cpu_w4.Q4Weight; layer.weight is
    its uint8 data, the only copy). 1-cpu_w4.max_rows() rows on the w4 kernel (any with AVX2),
    more on w4_large_batch_linear (the batch kernel where there is no AMX)."""

    @staticmethod
    def w8a8_min_rows(layer: nn.Module, k: int) -> int:
        """Rows from which a call leaves the w4 tiles' kernels (the decode plan's W4 steps end
        here): never where the batch kernel takes what the w4 kernel does not (no AMX)."""
        if cpu_w4.batch_available() and not cpu_isa.plan().amx:
            return cpu_isa.ALWAYS
        return cpu_w4.max_rows() + 1

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        y = cpu_w4.linear(x, layer.w4, bias)
        return y if y is not None else w4_large_batch_linear(x, layer.w4, bias)

    def apply_gated_mlp(
        self, gate_up: nn.Module, down: nn.Module, x: torch.Tensor
    ) -> torch.Tensor | None:
        # where gate_up would run on AMX tiles, SiLU-and-mul runs in their epilogue and the
        # [rows, 2 I] outputs are never written (SmolLM2-135M's 30 gate_up + SiLU, two Xeon
        # cores: 10.7 -> 10.3 ms at 128 rows, 143 -> 106 ms at a 1,024-token prefill chunk)
        rows = x.numel() // x.shape[-1]
        if gate_up.bias is not None or rows <= cpu_w4.max_rows():
            return None
        if not cpu_isa.plan().amx_w4_rows(rows):
            return None
        w4 = gate_up.w4
        h = cpu_amx.gated_w4(x, w4.data, w4.out_features // 2, w4.in_features)
        return None if h is None else down(h)


class GGUFSegmentsLinearMethod(LinearMethodBase):
    """A merged projection of parts in different types: layer.weight is uint8, every byte of
    the segments (1-D, the only copy); layer.gguf_segments ((ggml id, uint8 [rows, row bytes])
    views of it, in row order) and layer.in_features tell the kernel how to read them."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return cpu_gguf.linear_segments(x, layer.gguf_segments, layer.in_features, bias)


class GGUFLMHeadMethod(LMHeadMethodBase):
    """The LM head's rows as the file stores them (head.gguf_blocks: uint8 [vocab, row bytes],
    head.gguf_type, head.gguf_in_features) for calls of up to cpu_gguf.dot_max_rows() rows,
    the tied embedding's float table above; an untied head keeps no float weight (head.weight
    is empty) and runs every batch on cpu_gguf.linear (above the dot kernel's rows: AMX on
    decoded rows, or the rows dequantized per call, in 128 MiB slices: 1.0-1.3x the GEMM on a
    float copy at 64-128 rows on Zen 4, for a copy as large as the vocabulary times the
    width). A decode
    step reads the file's bytes instead of the bf16 weight's (Q8_0: 0.53x; SmolLM2-135M's
    head, Zen 3: 1.6 vs 4.2 ms at 1 row, 8.9 vs 11.8 at 8), and its logits are the file's
    values against x rounded to int8 per 32 (llama.cpp's arithmetic), summed in float32;
    larger batches run the GEMM paths, faster there, on the weight the embedding keeps."""

    def apply(self, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        small = hidden.numel() <= cpu_gguf.dot_max_rows() * hidden.shape[-1]
        if small or head.weight.numel() == 0:
            return cpu_gguf.linear(
                hidden.float() if small else hidden,
                head.gguf_blocks, head.gguf_type, head.gguf_in_features,
            )  # fmt: skip
        return linear_by_rows(head, hidden, head.weight, None)

    def greedy(self, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
        """Above the dot kernels' rows, on the tied float table: AMX's argmax epilogue where
        the weight's call runs there (the same bf16 logits apply() returns); else None."""
        small = hidden.numel() <= cpu_gguf.dot_max_rows() * hidden.shape[-1]
        if small or head.weight.numel() == 0:
            return None
        return greedy_by_rows(head, hidden, head.weight)


class GGUFQ8TilesHeadMethod(LMHeadMethodBase):
    """The LM head's Q8_0 rows repacked, bit for bit, into tiles of 16 rows (head.q8_tiles:
    cpu_w4.pack_q8_0, this build's layout) whose kernel takes every batch: float32 logits, x
    rounded to int8 per 32 as the dot kernel does (the same logits to float rounding). The
    tiles (1.06x the rows' bytes) replace the rows. SmolLM2-135M's head (49,152 x 576), ms:
    - AVX2 (two nibble planes of w4 tiles), two Zen 3 cores: 1 row 1.07 against the dot
      kernel's 1.22, 16 rows 6.0 / 9.1, 32 rows 11.3 against the C GEMM on the bf16 weight's
      17.1, 128 rows 43.8 / 57.7;
    - AVX512-VNNI without AMX (one plane on vpdpbusd), two Zen 5 cores: 1 row 0.44 against
      the dot kernel's 0.69, 8 rows 0.50 / 2.02, 16 rows 1.25 / 4.35, 32 rows 2.50 against
      the AVX512-BF16 kernel's 3.56, 64 rows 5.5 / 5.5 and 128 rows 10.4 / 9.5 against
      oneDNN's (level within the noise; one path at every batch keeps a sequence's logits
      independent of the batch it runs in). With AMX the rows stay on the dot kernel and
      the tiles there."""

    def apply(self, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        y = cpu_w4.linear_q8(hidden, head.q8_tiles)
        if y is None and head.weight.numel() == 0:  # untied: the tiles are the only copy
            y = cpu_w4.linear_q8(hidden.to(torch.bfloat16).contiguous(), head.q8_tiles)
            if y is None:
                raise RuntimeError("the LM head's Q8 tiles kernel refused a call")
        return y if y is not None else linear_by_rows(head, hidden, head.weight, None)

    def greedy(self, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
        """The VNNI tiles' argmax epilogue: the tokens of apply()'s logits, none written (128
        rows of SmolLM2's vocabulary: 25 MB a greedy step neither writes nor scans)."""
        return cpu_w4.argmax_q8(hidden, head.q8_tiles)


def _refusal(module: nn.Module, b) -> str | None:
    """Why this layer (or the LM head) keeps its dequantized weights, or None."""
    if module.weight.device.type != "cpu":
        return "runs on the CPU kernels only"
    if getattr(module, "tp_size", 1) != 1:
        return "tensor parallel shards keep the float weights"
    for s in b.segments:
        if s.type_name not in cpu_gguf.TYPES:
            return f"{s.type_name} has no kernel"
        why = cpu_gguf.refusal(s.type_id, b.in_features)
        if why is not None:
            return f"{s.type_name}: {why}"
    if tuple(module.weight.shape) != (b.out_features, b.in_features):
        return "shape differs from the model's"
    return None


def _w4_refusal(module: nn.Module, type_name: str, in_features: int) -> str | None:
    """Why a Q4 layer stays on the GGUF dot kernel instead of w4 tiles, or None."""
    why = gguf_w4.supports(type_name, in_features)
    if why is None and module.weight.dtype != torch.bfloat16:
        why = f"a {str(module.weight.dtype).removeprefix('torch.')} model: the w4 kernel takes bf16"
    if why is None and not cpu_w4.available():
        why = "no w4 kernel on this CPU (AVX512-VNNI or AVX2)"
    return why


def q8_tiles_head() -> bool:
    """Whether a bf16 model's Q8_0 LM head becomes Q8 tiles (GGUFQ8TilesHeadMethod): a Q8 tile
    kernel in the build and no AMX (whose machines keep their measured path)."""
    return cpu_w4.q8_available() and not cpu_isa.plan().amx


def _drop_float_weight(head: nn.Module) -> str:
    """An untied head's float weight, which nothing reads once its rows serve every batch."""
    was = head.weight.numel() * head.weight.element_size()
    head.weight = nn.Parameter(
        torch.empty(0, head.weight.shape[1], dtype=head.weight.dtype), requires_grad=False
    )
    return f"no float copy (untied: {was / 2**20:.0f} MiB saved)"


def _take_head_blocks(head: nn.Module, b, why: str | None) -> str:
    """The LM head's path: the file's blocks for small batches (GGUFLMHeadMethod), or why not;
    an untied head's float weight is dropped (its rows take every batch)."""
    dtype = str(head.weight.dtype).removeprefix("torch.")
    if why is not None:
        return f"dequantized ({why})"
    if (
        b.type_name == "Q8_0"
        and head.weight.dtype == torch.bfloat16
        and b.in_features % cpu_w4.K_MULTIPLE == 0
        and q8_tiles_head()
    ):
        try:
            head.q8_tiles = cpu_w4.pack_q8_0(b.data, b.in_features)
        except ValueError as e:
            logger.info("The LM head's Q8_0 rows stay rows: %s", e)
        else:
            head.quant_method = GGUFQ8TilesHeadMethod()
            if head.q8_tiles.layout == "vnni":
                path = "Q8_0 blocks as 16-row tiles at every batch (AVX512-VNNI, no AMX)"
            else:
                path = "Q8_0 blocks as two planes of w4 tiles at every batch (AVX2)"
            return path if head.tied else f"{path}; {_drop_float_weight(head)}"
    head.gguf_blocks, head.gguf_type, head.gguf_in_features = b.data, b.type_id, b.in_features
    head.quant_method = GGUFLMHeadMethod()
    small = f"{b.type_name} blocks on the gguf dot kernel up to {cpu_gguf.dot_max_rows()} rows"
    if head.tied:
        return f"{small}, the tied {dtype} table above"
    return f"{small}, on the blocks above too; {_drop_float_weight(head)}"


class GGUFEmbeddingRows:
    """An embedding's lookup on the file's token_embd blocks: each step dequantizes the rows of
    its tokens (cpu_gguf.gather_rows), so the float table is never held."""

    def __init__(self, b, dtype: torch.dtype):
        self.data, self.type_id, self.in_features = b.data, b.type_id, b.in_features
        self.dtype = dtype

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        return cpu_gguf.gather_rows(
            self.data, self.type_id, self.in_features, input_ids, self.dtype
        )


def _take_embedding_rows(embed: nn.Module, b, tied: bool) -> str:
    """The embedding's path: the file's rows per token (GGUFEmbeddingRows), or why not."""
    if tied:  # the LM head multiplies the same float table in large batches
        return "dequantized (tied: the LM head shares its float table)"
    if b is None:
        return "dequantized (token_embd is a float tensor, or absent)"
    why = _refusal(embed, b)
    if why is not None:
        return f"dequantized ({why})"
    dtype = embed.weight.dtype
    was = embed.weight.numel() * embed.weight.element_size()
    embed.rows = GGUFEmbeddingRows(b, dtype)
    embed.weight = nn.Parameter(torch.empty(0, b.in_features, dtype=dtype), requires_grad=False)
    return (
        f"{b.type_name} rows dequantized per token ({b.data.nbytes / 2**20:.0f} MiB of blocks "
        f"where the {str(dtype).removeprefix('torch.')} table took {was / 2**20:.0f} MiB)"
    )


class GGUFExperts:
    """A MoE layer's experts on the file's stacked blocks (engine.gguf.blocks.ExpertBlocks):
    FusedMoE.expert_linear, each routed expert's gate/up and down on the GGUF kernels (the dot
    kernel for the few tokens an expert gets at decode, cpu_gguf.linear's larger-batch paths
    above). The layer's w13_weight / w2_weight hold the blocks, the only copy."""

    def __init__(self, b):
        self.w13, self.w2 = b.w13, b.w2
        self.types = (b.w13_type_id, b.w2_type_id)
        self.in_features = (b.hidden_size, b.intermediate_size)

    def __call__(self, expert: int, which: int, x: torch.Tensor) -> torch.Tensor:
        i = 0 if which != DOWN else 1
        blocks = (self.w13 if i == 0 else self.w2)[expert]
        return cpu_gguf.linear(x, blocks, self.types[i], self.in_features[i])


def _expert_refusal(module: nn.Module, b) -> str | None:
    """Why a MoE layer keeps its dequantized experts, or None."""
    if module.w13_weight.device.type != "cpu":
        return "runs on the CPU kernels only"
    if module.tp_size != 1:
        return "tensor parallel shards keep the float weights"
    for type_name, type_id, k in (
        (b.w13_type, b.w13_type_id, b.hidden_size),
        (b.w2_type, b.w2_type_id, b.intermediate_size),
    ):
        if type_name not in cpu_gguf.TYPES:
            return f"{type_name} has no kernel"
        why = cpu_gguf.refusal(type_id, k)
        if why is not None:
            return f"{type_name}: {why}"
    want = (module.num_experts, 2 * module.inter, module.w2_weight.shape[1])
    if (b.w13.shape[0], b.w13.shape[1], b.hidden_size) != want:
        return "shape differs from the model's"
    return None


def _take_expert_blocks(module: nn.Module, b) -> str:
    module.w13_weight = nn.Parameter(b.w13, requires_grad=False)
    module.w2_weight = nn.Parameter(b.w2, requires_grad=False)
    module.expert_linear = GGUFExperts(b)
    kinds = b.w13_type if b.w13_type == b.w2_type else f"{b.w13_type}/{b.w2_type}"
    return f"{kinds} stacked blocks on the gguf kernels"


def _kind(name: str) -> str:
    return name.rsplit(".", 1)[-1]  # "model.layers.3.mlp.down_proj" -> "down_proj"


def _take_blocks(module: nn.Module, b) -> str:
    """Give one layer the file's values and the method that reads them; returns the path."""
    module.in_features = b.in_features
    if len(b.segments) > 1:
        module.weight = nn.Parameter(b.data, requires_grad=False)
        module.gguf_segments = tuple((s.type_id, s.data) for s in b.segments)
        module.quant_method = GGUFSegmentsLinearMethod()
        return f"{b.type_name} row segments on the gguf dot kernels"
    module.gguf_type = b.type_id
    w4, dot_why = None, _w4_refusal(module, b.type_name, b.in_features)
    if b.type_name in gguf_w4.TYPES and dot_why is None:
        try:
            w4 = gguf_w4.repack(b.data, b.type_name, b.in_features)
        except ValueError as e:  # a Q4_0 scale whose -8d overflows float16
            dot_why = str(e)
    if w4 is not None:
        module.w4 = w4
        module.weight = nn.Parameter(w4.data, requires_grad=False)
        module.quant_method = GGUFW4LinearMethod()
        return f"{b.type_name} as w4 tiles"
    module.weight = nn.Parameter(b.data, requires_grad=False)
    module.quant_method = GGUFLinearMethod()
    path = f"{b.type_name} blocks on the gguf dot kernel"
    return path + f" ({dot_why})" if b.type_name in gguf_w4.TYPES else path


def block_parameters(model: nn.Module) -> set[str]:
    """Names of the parameters that hold a GGUF file's blocks (w4 tiles included): what a
    loader must not fill from the float checkpoint after apply_gguf_blocks."""
    methods = (GGUFLinearMethod, GGUFSegmentsLinearMethod)
    heads = (GGUFLMHeadMethod, GGUFQ8TilesHeadMethod)
    held = {
        f"{name}.weight"
        for name, m in model.named_modules()
        if isinstance(getattr(m, "quant_method", None), methods)
        or isinstance(getattr(m, "rows", None), GGUFEmbeddingRows)
        or (isinstance(getattr(m, "quant_method", None), heads) and not m.tied)
    }
    for name, m in model.named_modules():
        if isinstance(getattr(m, "expert_linear", None), GGUFExperts):
            held |= {f"{name}.w13_weight", f"{name}.w2_weight"}
    return held


def apply_gguf_blocks(model: nn.Module, gguf_path: str | Path) -> dict[str, Counter]:
    """Give every linear layer whose file type has a kernel the file's values: Q4_0/Q4_1 as
    w4 tiles (GGUFW4LinearMethod) where the w4 kernel takes them, else the file's blocks
    (GGUFLinearMethod); and the LM head its rows' blocks for small batches (GGUFLMHeadMethod).
    Returns {layer kind: Counter(path taken)}, also logged. Linear layers' paths other than
    "dequantized (why)" hold the file's values. Runs on a loaded model, or on a built one
    before its float weights load (ModelRunner: they then skip block_parameters(model))."""
    from engine.gguf.blocks import read_expert_blocks, read_linear_blocks
    from engine.gguf.convert import rows_interleaved

    if not cpu_gguf.available():
        raise ValueError(
            "--quantization gguf needs the compiled CPU kernels (a C compiler on the machine, "
            "TESSERA_CPU_KERNELS not 0)"
        )
    attn = model.model.layers[0].self_attn
    interleaved = rows_interleaved(model.config.model_type)
    blocks, skipped = read_linear_blocks(gguf_path, attn.num_heads, attn.num_kv_heads, interleaved)
    modules = dict(model.named_modules())
    paths: dict[str, Counter] = {}
    for name, module in modules.items():
        if not isinstance(getattr(module, "quant_method", None), LinearMethodBase):
            continue
        b = blocks.pop(name, None)  # each layer's blocks freed once it holds its weights
        why = (
            skipped.get(name, "not in the file's block tensors")
            if b is None
            else _refusal(module, b)
        )
        kind = _kind(name)
        if why is not None:
            paths.setdefault(kind, Counter())[f"dequantized ({why})"] += 1
            continue
        paths.setdefault(kind, Counter())[_take_blocks(module, b)] += 1
    experts = [(n, m) for n, m in modules.items() if isinstance(m, FusedMoE)]
    if experts:
        found, skipped_experts = read_expert_blocks(gguf_path)
        for name, module in experts:
            b = found.pop(name, None)
            why = (
                skipped_experts.get(name, "not in the file's block tensors")
                if b is None
                else _expert_refusal(module, b)
            )
            path = f"dequantized ({why})" if why is not None else _take_expert_blocks(module, b)
            paths.setdefault("experts", Counter())[path] += 1
    head = getattr(model, "lm_head", None)
    if head is not None and not isinstance(
        head.quant_method, (GGUFLMHeadMethod, GGUFQ8TilesHeadMethod)
    ):
        b = blocks.pop("lm_head", None)
        why = skipped.get("lm_head", "not in the file") if b is None else _refusal(head, b)
        paths["lm_head"] = Counter({_take_head_blocks(head, b, why): 1})
    embed = model.model.embed_tokens
    if embed.rows is None:
        tied = head is not None and getattr(head, "tied", False)
        b = blocks.pop("embed_tokens", None)
        paths["embed_tokens"] = Counter({_take_embedding_rows(embed, b, tied): 1})
    for kind, c in paths.items():
        logger.info(
            "GGUF %s: %s", kind, ", ".join(f"{n} layers {why}" for why, n in sorted(c.items()))
        )
    return paths
