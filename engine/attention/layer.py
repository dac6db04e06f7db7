"""PagedAttention: the attention layer of every model, over a flattened batch.

It holds its KV cache (and the int8 cache's scales) and the backend, all bound by the model
runner, its sliding window and attention sinks if it has them (the backend reads them); per
step it writes this
step's K/V through the backend, then lets the backend attend. No device or kernel is named
here: that is the backend's (engine.attention.backends).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.backends.base import AttentionBackend, AttentionMetadata
from engine.attention.kv_spec import KVCacheSpec
from engine.distributed import get_tp_rank


class PagedAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        sinks: bool = False,
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Query position i attends key j iff i - sliding_window < j <= i (HF's sliding-window
        # mask); None: every earlier key.
        self.sliding_window = sliding_window
        # gpt-oss's attention sinks: a learned logit per query head (this rank's heads) in
        # every softmax, with no value: attention may put weight on "nothing". float32.
        self.sinks: nn.Parameter | None = None
        if sinks:
            self.sinks = nn.Parameter(
                torch.zeros(num_heads, dtype=torch.float32), requires_grad=False
            )
            self.sinks.weight_loader = self._load_sinks
        self.kv_cache: torch.Tensor | None = None  # bound by the model runner
        self.kv_scales: torch.Tensor | None = None  # float32, with an int8 cache
        # an fp8 cache's per-tensor scales: stored K / k_scale, read back q * k_scale. 1.0
        # unless the checkpoint carries calibrated ones (engine.layers.quantization.kv_scales)
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.checkpoint_kv_scales = False
        self.kv_spec: KVCacheSpec | None = None  # the cache's layout (None: the model's dtype)
        self.backend: AttentionBackend | None = None  # bound by the model runner
        # a piecewise graph step's seam (engine.worker.piecewise.AttentionSplit), set while
        # one runs: attention then runs between the captured pieces
        self.split = None

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """The checkpoint's sinks of every head [H_total]: this tensor-parallel rank's."""
        h = self.num_heads
        if loaded.shape[0] % h:
            raise ValueError(f"sinks of {loaded.shape[0]} heads do not split into {h} per rank")
        param.data.copy_(loaded.narrow(0, get_tp_rank() * h, h).to(torch.float32))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (may be strided views) -> [T, H * D]."""
        if self.split is not None:
            return self.split(self, q, k, v, meta)
        return self.attend(q, k, v, meta)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """This step's K/V written, then attention: q's rows are the metadata's tokens."""
        backend = self.backend
        if backend is None:
            raise RuntimeError(
                "no attention backend is bound to this layer (the model runner binds one: "
                "engine.attention.backends.select_backend)"
            )
        if self.kv_cache is not None:
            backend.write_kv(self, k, v, self.kv_cache, meta)
        return backend.forward(self, q, k, v, self.kv_cache, meta)
