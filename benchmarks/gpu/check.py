"""The run's state shared by its sections: plan, device, model folders and the ceilings once
measured."""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.gpu.measure import measure_copy_bandwidth, measure_matmul_flops
from benchmarks.gpu.models import write_model_folder
from benchmarks.gpu.plan import Plan
from benchmarks.gpu.report import Report, progress


class Check:
    def __init__(self, plan: Plan, device: torch.device, workdir: Path, report: Report) -> None:
        self.plan = plan
        self.device = device
        self.workdir = workdir
        self.report = report
        self.copy_ceiling: float | None = None
        self.matmul_ceiling: float | None = None
        self.shared_llm = None  # §4's default-mode engine, kept for §5 when §5 runs
        self.keep_llm_for_throughput = False
        self._folders: dict[str, Path] = {}

    def copy_bandwidth(self) -> float | None:
        if self.copy_ceiling is None:
            try:
                self.copy_ceiling = measure_copy_bandwidth(self.device, self.plan.copy_bytes)
            except Exception as e:  # a section without its ceiling still reports its figures
                progress(f"copy bandwidth: {type(e).__name__}: {e}")
        return self.copy_ceiling

    def matmul_flops(self) -> float | None:
        if self.matmul_ceiling is None:
            try:
                self.matmul_ceiling = measure_matmul_flops(self.device, self.plan.matmul_n)
            except Exception as e:
                progress(f"matmul: {type(e).__name__}: {e}")
        return self.matmul_ceiling

    def folder(self, name: str, config: dict, tokenizer: bool = True) -> Path:
        if name not in self._folders:
            self._folders[name] = write_model_folder(self.workdir / name, config, tokenizer)
        return self._folders[name]
