"""Timing on the device (CUDA events, or the wall clock on a CPU), the chip's ceilings (copy
bandwidth, bf16 matmul), and what the run says about its machine."""

from __future__ import annotations

import gc
import importlib.metadata
import inspect
import platform
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn: Callable[[], object], device: torch.device, n: int) -> float:
    """Mean seconds of n back-to-back calls: CUDA events on a GPU, the wall clock elsewhere."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / n
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def best_seconds(
    fn: Callable[[], object], device: torch.device, target_s: float = 0.1, repeats: int = 3
) -> float:
    """Seconds per call: the best of `repeats` loops of about target_s each, after a warm-up
    (JIT compiling and autotuning happen there)."""
    fn()
    fn()
    sync(device)
    one = seconds_per_call(fn, device, 1)
    n = max(1, min(200, int(target_s / max(one, 1e-7))))
    return min(seconds_per_call(fn, device, n) for _ in range(repeats))


def measure_copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes read + written per second by one large device-to-device copy_, best of 10."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    best = min(seconds_per_call(lambda: dst.copy_(src), device, 1) for _ in range(10))
    return 2 * nbytes / best


def measure_matmul_flops(device: torch.device, n: int) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    torch.mm(a, b, out=c)
    sync(device)
    best = min(seconds_per_call(lambda: torch.mm(a, b, out=c), device, 1) for _ in range(10))
    return 2 * n**3 / best


def triton_version() -> str:
    try:  # the distribution's version: importing triton is the backend's business
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def option_supported(fn: Callable, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def device_description(device: torch.device) -> tuple[str, str]:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return (
            p.name,
            f"sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs",
        )
    return platform.processor() or platform.machine(), f"CPU, {torch.get_num_threads()} threads"
