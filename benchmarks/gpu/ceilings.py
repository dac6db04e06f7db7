"""§1 ceilings: device, versions, device-to-device copy bandwidth and bf16 matmul TFLOP/s:
what the other sections are held to."""

from __future__ import annotations

import platform

import torch

from benchmarks.gpu.check import Check
from benchmarks.gpu.measure import device_description, triton_version
from benchmarks.gpu.report import SKIPPED, Budget, Report, fmt_bandwidth, fmt_flops


def section_ceilings(chk: Check, out: Report, budget: Budget) -> None:
    name, detail = device_description(chk.device)
    out.row(1, "device", name, note=detail)
    out.row(
        1,
        "versions",
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton_version()}",
        note=f"python {platform.python_version()}",
    )
    out.result(
        1,
        device=name,
        detail=detail,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        triton=triton_version(),
    )
    copy = chk.copy_bandwidth()
    if copy is None:
        raise RuntimeError("the copy bandwidth could not be measured (see stderr)")
    out.row(
        1,
        "device-to-device copy",
        fmt_bandwidth(copy),
        note=f"copy_ of {chk.plan.copy_bytes / 2**30:.2g} GiB, bytes read + written, best of 10",
    )
    out.result(1, copy_bytes_per_s=copy)
    out.summary(1, f"copy {fmt_bandwidth(copy)}")
    if budget.spent:
        out.row(1, "bf16 matmul", SKIPPED)
        return
    flops = chk.matmul_flops()
    n = chk.plan.matmul_n
    out.row(
        1,
        "bf16 matmul",
        fmt_flops(flops) if flops else "failed (see stderr)",
        note=f"{n} x {n} x {n}, best of 10",
    )
    out.result(1, matmul_flops=flops)
    if flops:
        out.summary(1, f"copy {fmt_bandwidth(copy)}, bf16 matmul {fmt_flops(flops)}")
