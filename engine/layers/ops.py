"""Fused ops with one dispatch rule, chosen once when the model is on its device.

A CustomOp (the model of vLLM's) has a torch reference, forward_native, and per-device forms,
forward_cpu (the C kernels of engine/kernels/cpu/fused_ops.py) and forward_cuda (the Triton
kernels of engine/kernels/triton/fused_ops.py), which default to the reference. Which one
forward runs is bound once, by bind_custom_ops(model, device) when the loader has placed the
model on its device; until then (a layer built on its own, in a test) forward is the
reference. The per-device forms keep only the checks about a call's tensors (a dtype, a
stride the kernel cannot take) and run the reference for those; whether a kernel exists for
the device is never asked again per call.

The switches, read at bind: TESSERA_CPU_KERNELS=0 (or no C compiler) binds the CPU's ops to
the reference; TESSERA_GPU_FUSED=0 (or no triton) binds CUDA's to it. Triton is imported
only when an op is bound to CUDA: never on a CPU-only path.
"""

from __future__ import annotations

import functools
import logging
import os
from types import ModuleType

import torch
from torch import nn

from engine.kernels.cpu import fused_ops as cpu_fused

logger = logging.getLogger("tessera.engine")

NATIVE, CPU, CUDA = "native", "cpu", "cuda"


class CustomOp(nn.Module):
    """An op with a torch reference and per-device kernels; see the module's docstring.

    Subclasses implement forward_native and override forward_cpu / forward_cuda where a
    kernel serves the device (falling back to forward_native for tensors it cannot take).
    """

    def __init__(self) -> None:
        super().__init__()
        self.dispatch = NATIVE  # which forward_<dispatch> runs: native, cpu or cuda

    def forward(self, *args, **kwargs):  # until bound: the reference
        return self.forward_native(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_cpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def bind(self, dispatch: str) -> None:
        """Run forward_<dispatch> from now on (bind_custom_ops chooses it for a device)."""
        if dispatch not in (NATIVE, CPU, CUDA):
            raise ValueError(f"dispatch must be native, cpu or cuda; got {dispatch!r}")
        self.dispatch = dispatch
        # The instance's own forward: nn.Module.__call__ runs the chosen method directly, with
        # no dispatching frame between (these ops run hundreds of times a step).
        self.forward = getattr(self, f"forward_{dispatch}")


@functools.cache
def triton_fused() -> ModuleType | None:
    """engine.kernels.triton.fused_ops, or None without triton. Importing it imports triton:
    only ops bound to CUDA call this."""
    try:
        from engine.kernels.triton import fused_ops
    except ImportError:
        return None
    return fused_ops


def dispatch_for(device: str | torch.device) -> str:
    """The forward the ops run on device: its kernels where they are on, else the reference."""
    kind = torch.device(device).type
    if kind == "cpu" and cpu_fused.available():
        return CPU
    if kind == "cuda" and os.environ.get("TESSERA_GPU_FUSED") != "0" and triton_fused():
        return CUDA
    return NATIVE


def bind_custom_ops(model: nn.Module, device: str | torch.device) -> str:
    """Bind every CustomOp in model to device's forward (dispatch_for); returns it."""
    dispatch = dispatch_for(device)
    ops = [m for m in model.modules() if isinstance(m, CustomOp)]
    for op in ops:
        op.bind(dispatch)
    logger.debug("%d fused ops bound to their %s forward on %s", len(ops), dispatch, device)
    return dispatch
