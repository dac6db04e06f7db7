"""Token embedding and LM head, split over the vocabulary across tensor-parallel ranks.

Each rank holds ceil(vocab / tp) rows (the last shard zero-padded); the embedding masks ids
outside its shard and all-reduces, the LM head all-gathers its logits and drops the padding.
The LM head's `quant_method` (engine.layers.quantization) multiplies its rows. An embedding
may take its rows from elsewhere (`rows`: a GGUF file's blocks, dequantized per token), its
weight then empty. With LoRA enabled both carry a `lora` state (engine.lora.layers): the
embedding's deltas are added to this rank's rows before the all-reduce, the LM head's to
this rank's logits before the all-gather.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from engine.layers.quantization.base import LMHeadMethodBase
from engine.layers.quantization.unquantized import UnquantizedLMHeadMethod


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.num_embeddings = num_embeddings
        self.shard_size = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, num_embeddings)
        # empty, not zeros: a table the loader replaces or a GGUF's rows stand in for should
        # not be written (resident) at build; only the last shard's padding rows are zeroed
        weight = torch.empty(self.shard_size, embedding_dim)
        weight[self.vocab_end - self.vocab_start :].zero_()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.rows: Callable[[torch.Tensor], torch.Tensor] | None = None  # ids -> their rows
        self.lora = None  # engine.lora.layers.LoRAEmbedding (LoRALayer on the LM head)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.num_embeddings or loaded.shape[1] != param.shape[1]:
            raise ValueError(
                f"embedding shape mismatch: checkpoint {tuple(loaded.shape)}, "
                f"model ({self.num_embeddings}, {param.shape[1]})"
            )
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(loaded[self.vocab_start : self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:  # set on single-rank models only
            y = self.rows(input_ids)
            return y if self.lora is None else self.lora.apply(input_ids, y)
        if self.tp_size == 1:
            y = F.embedding(input_ids, self.weight)
            return y if self.lora is None else self.lora.apply(input_ids, y)
        mask = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        y = F.embedding((input_ids - self.vocab_start) * mask, self.weight)
        y.mul_(mask.unsqueeze(-1).to(y.dtype))
        if self.lora is not None:  # rows of other shards add nothing: the all-reduce sums
            y = self.lora.apply(input_ids, y)
        return tp_all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden [S, H] -> logits [S, vocab] in float32. Tie by sharing the embedding's weight."""

    tied = False

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.quant_method: LMHeadMethodBase = UnquantizedLMHeadMethod()

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        self.tied = True

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """argmax(self(hidden)) per row, the first maximum winning, without the logits in
        memory (the quant method's greedy hook: w8a8's GEMM argmax epilogue, on the same
        float32 values); None where that path is not the one forward would take: then compute
        the logits."""
        if self.tp_size > 1 or (self.lora is not None and self.lora.active):
            return None  # (LoRA deltas on this call's rows: the logits, then the argmax)
        return self.quant_method.greedy(self, hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = self.quant_method.apply(self, hidden)
        if self.lora is not None and self.lora.active:  # the rows set for this call, once
            logits = self.lora.apply(hidden, logits)
            self.lora.batch.clear()
        if self.tp_size > 1:
            logits = tp_all_gather(logits, dim=-1)[:, : self.num_embeddings]
        return logits.float()
