"""Attention backends: one interface (base.AttentionBackend), one file per implementation.

torch: the reference (dense gather + SDPA), any device. cpu: the compiled C kernels, int8 KV
cache included. triton: the Triton kernels on CUDA, fp8 KV cache included (triton is imported
when that backend is built, not here). A new backend is one file here plus one line in BACKENDS. This module imports
no backend (nor torch) until one is chosen, so the config can validate names cheaply.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine.attention.backends.base import AttentionBackend

# name -> "module:class", imported when chosen
BACKENDS = {
    "torch": "engine.attention.backends.torch:TorchAttentionBackend",
    "cpu": "engine.attention.backends.cpu:CpuAttentionBackend",
    "triton": "engine.attention.backends.triton:TritonAttentionBackend",
}
ATTENTION_BACKEND_CHOICES = ("auto", *BACKENDS)
# What `auto` tries, in order; torch, which runs anywhere, is the last resort.
AUTO_ORDER = ("triton", "cpu", "torch")


def backend_class(name: str) -> type[AttentionBackend]:
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKEND_CHOICES)}"
        )
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


@dataclass(slots=True)
class BackendSelection:
    backend: type[AttentionBackend]
    reason: str  # for the start-up log line


def select_backend(
    name: str,
    device: torch.device | str,
    dtype: torch.dtype,
    kv_cache_dtype: str,
    num_kv_heads: int,
    head_dim: int,
) -> BackendSelection:
    """The backend for `name` (auto: the first of AUTO_ORDER that supports the model). An
    explicit choice that cannot run it raises ValueError saying why."""
    import torch

    device = torch.device(device)
    args = (device, dtype, kv_cache_dtype, num_kv_heads, head_dim)
    if name != "auto":
        cls = backend_class(name)
        why_not = cls.kv_cache_dtype_reason(kv_cache_dtype) or cls.unsupported_reason(*args)
        if why_not is not None:
            raise ValueError(f"attention backend {name!r} cannot run this model: {why_not}")
        return BackendSelection(cls, "chosen explicitly")
    passed: list[str] = []
    for candidate in AUTO_ORDER:
        cls = backend_class(candidate)
        why_not = cls.kv_cache_dtype_reason(kv_cache_dtype) or cls.unsupported_reason(*args)
        if why_not is None:
            return BackendSelection(cls, "; ".join([f"auto: {candidate} runs this model", *passed]))
        passed.append(f"not {candidate}: {why_not}")
    raise ValueError("no attention backend can run this model: " + "; ".join(passed))
