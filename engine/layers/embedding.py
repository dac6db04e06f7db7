"""Token embedding and LM head, split over the vocabulary across tensor-parallel ranks.

Each rank holds ceil(vocab / tp) rows (the last shard zero-padded); the embedding masks ids
outside its shard and all-reduces, the LM head all-gathers its logits and drops the padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from engine.layers import cpu_gemm, cpu_w8a8


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.num_embeddings = num_embeddings
        self.shard_size = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, num_embeddings)
        self.weight = nn.Parameter(torch.zeros(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.num_embeddings or loaded.shape[1] != param.shape[1]:
            raise ValueError(
                f"embedding shape mismatch: checkpoint {tuple(loaded.shape)}, "
                f"model ({self.num_embeddings}, {param.shape[1]})"
            )
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(loaded[self.vocab_start : self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        y = F.embedding((input_ids - self.vocab_start) * mask, self.weight)
        y.mul_(mask.unsqueeze(-1).to(y.dtype))
        return tp_all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding, cpu_gemm.UsesCpuGemm):
    """hidden [S, H] -> logits [S, vocab] in float32. Tie by sharing the embedding's weight."""

    tied = False
    qweight: torch.Tensor | None = None  # int8 rows and their scales, once quantized
    weight_scale: torch.Tensor | None = None

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        self.tied = True

    def quantize_int8(self) -> None:
        from engine.layers.quantization import quantize_rows_int8

        self.qweight, self.weight_scale = quantize_rows_int8(self.weight.data)
        if not self.tied:  # nothing else reads the full-precision rows
            self.weight = nn.Parameter(self.weight.data.new_empty(0), requires_grad=False)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """argmax(self(hidden)) per row, the first maximum winning, without the logits in
        memory (the w8a8 GEMM's argmax epilogue, on the same float32 values); None where that
        path is not the one forward would take: then compute the logits."""
        # (a 4-bit copy, where there is one, takes exactly the rows without int8 activations)
        if self.qweight is None or self.tp_size > 1 or not self.int8_activations(hidden):
            return None
        return cpu_w8a8.argmax_w8a8(hidden, self.qweight, self.weight_scale, self.packed_int8)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.qweight is not None:
            # float32 straight from the int32 sums (w8a8): no bf16 rounding, no extra pass
            logits = self.project(hidden, self.qweight, None, self.weight_scale, torch.float32)
        else:
            logits = self.project(hidden, self.weight)
        if self.tp_size > 1:
            logits = tp_all_gather(logits, dim=-1)[:, : self.num_embeddings]
        return logits.float()
