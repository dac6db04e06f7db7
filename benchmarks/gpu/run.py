"""The runner: the chosen sections in order, each in its own try and budget, within one limit
for the whole run; a summary table first (a line a section: status, key figure, goal), then
the details, then the figures as JSON. See benchmarks/gpu/__init__.py for the sections."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

if not torch.cuda.is_available():  # §6-§8's Triton kernels on CPU tensors: before their import
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.gpu.check import Check  # noqa: E402
from benchmarks.gpu.measure import device_description, free_memory, triton_version  # noqa: E402
from benchmarks.gpu.plan import (  # noqa: E402
    DECODE_BANDWIDTH_GOAL,
    FULL,
    OFFLINE_GOAL_TOK_S,
    QUICK,
    Plan,
)
from benchmarks.gpu.report import (  # noqa: E402
    Budget,
    Report,
    SectionRecord,
    TimeLimit,
    print_details,
    print_summary,
    progress,
)

Section = Callable[[Check, Report, Budget], None]


def _load(module: str, name: str) -> Callable[[], Section]:
    """A section's function, imported when it runs: one section's import error (a kernel
    module this machine cannot load) is that section's error, not the run's."""

    def load() -> Section:
        import importlib

        return getattr(importlib.import_module(f"benchmarks.gpu.{module}"), name)

    return load


# number: (name, loader); the numbers of §1-§5 are those of benchmarks/gpu_check.py before
SECTIONS: dict[int, tuple[str, Callable[[], Section]]] = {
    1: ("ceilings", _load("ceilings", "section_ceilings")),
    2: ("kernel correctness", _load("correctness", "section_correctness")),
    3: ("attention microbenchmark", _load("attention", "section_attention")),
    4: ("end to end", _load("end_to_end", "section_end_to_end")),
    5: ("offline throughput", _load("throughput", "section_throughput")),
    6: ("quantized GEMMs", _load("quant", "section_quant")),
    7: ("fused MoE", _load("moe", "section_moe")),
    8: ("batched LoRA", _load("lora", "section_lora")),
    9: ("speculative verification", _load("spec", "section_spec")),
    10: ("serving", _load("serving", "section_serving")),
}
# The kernels' short sections first, the engines' long ones last (§5 reuses §4's engine).
RUN_ORDER = (1, 2, 7, 8, 6, 3, 9, 4, 5, 10)
ALIASES = {
    "ceilings": 1,
    "correctness": 2,
    "attention": 3,
    "end_to_end": 4,
    "throughput": 5,
    "quant": 6,
    "moe": 7,
    "lora": 8,
    "spec": 9,
    "serving": 10,
}


def section_number(text: str) -> int:
    if text in ALIASES:
        return ALIASES[text]
    if text.isdigit() and int(text) in SECTIONS:
        return int(text)
    raise argparse.ArgumentTypeError(
        f"unknown section {text!r}: one of {sorted(SECTIONS)} or {', '.join(ALIASES)}"
    )


def _on_alarm(signum, frame):
    raise TimeLimit("the time limit was reached (the section's budget and grace, or the run's)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 -m benchmarks.gpu",
        description="The device check: Tessera's CUDA path against the chip's own ceilings.",
    )
    parser.add_argument(
        "--sections",
        type=section_number,
        nargs="+",
        default=list(RUN_ORDER),
        help="which sections to run, by number or name (default: all); "
        + ", ".join(f"{n} {name}" for n, (name, _) in SECTIONS.items()),
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes and model: a smoke run")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="default: cuda when available, else cpu (only with --quick)",
    )
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="seconds for the whole run (default: the plan's)",
    )
    return parser


def ordered(sections: list[int]) -> list[int]:
    chosen = set(sections)
    return [n for n in RUN_ORDER if n in chosen]


# A section checks its budget between measurements; one stuck in a single call (a compile, a
# hung kernel) is stopped this long after its budget by SIGALRM, and the next one runs.
GRACE_S = 30


def _arm(seconds: float) -> None:
    if hasattr(signal, "SIGALRM"):
        signal.alarm(max(1, int(seconds)))


def run_sections(
    sections: list[int], plan: Plan, total: float, started: float, chk: Check, report: Report
) -> None:
    """Each section in its own try and time: one that fails, or overruns its budget by more
    than GRACE_S, leaves its error in the tables and the next one runs (SIGALRM's handler,
    raising TimeLimit, is main's)."""
    for num in ordered(sections):
        name, load = SECTIONS[num]
        rec = report.sections[num] = SectionRecord(name)
        left = total - (time.monotonic() - started)
        if left <= 5:
            rec.status = "skipped"
            report.row(num, name, "skipped: the run's time limit was reached")
            continue
        budget = Budget(min(plan.budgets[num], left))
        progress(f"§{num} {name} (budget {budget.seconds:.0f} s)")
        t = time.monotonic()
        try:
            _arm(min(left, budget.seconds + GRACE_S))
            load()(chk, report, budget)
            rec.status = "ok"
        except Exception as e:  # TimeLimit included
            rec.status = "error"
            rec.error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            report.row(num, f"{name}: ERROR", rec.error[:300])
        finally:
            _arm(total - (time.monotonic() - started))  # the run's own limit again
        rec.seconds = time.monotonic() - t
        free_memory()


def write_json(result: dict, json_path: str | None) -> None:
    paths = [Path(json_path)] if json_path else []
    if os.environ.get("OUT"):
        paths.append(Path(os.environ["OUT"]) / "gpu_check.json")
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=str))
        progress(f"figures written to {path}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    if device.type == "cpu" and not args.quick:
        print("gpu_check: the full run needs a GPU; on the CPU use --quick", file=sys.stderr)
        return 2
    plan = QUICK if args.quick else FULL
    total = args.time_limit or plan.total_s
    report = Report()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tessera-gpu-check-") as tmp:
        chk = Check(plan, device, Path(tmp), report)
        chk.keep_llm_for_throughput = 5 in args.sections
        use_alarm = hasattr(signal, "SIGALRM")
        if use_alarm:
            signal.signal(signal.SIGALRM, _on_alarm)
            signal.alarm(max(1, int(total)))
        try:
            run_sections(args.sections, plan, total, started, chk, report)
        except TimeLimit:  # between two sections: the tables still come out
            progress("the run's time limit was reached")
        finally:
            if use_alarm:
                signal.alarm(0)
            if chk.shared_llm is not None:
                chk.shared_llm.shutdown()
                chk.shared_llm = None
    meta = {
        # (timezone.utc, not 3.11's UTC: this line must not be what fails on an older python)
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),  # noqa: UP017
        "command": " ".join(["python3", "-m", "benchmarks.gpu", *(argv or sys.argv[1:])]),
        "device": device_description(device)[0],
        "versions": f"torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton_version()}",
        "plan": plan.name,
        "sections": ordered(args.sections),
        "total_s": time.monotonic() - started,
    }
    print_summary(report, meta)
    print_details(report, meta)
    write_json(
        {
            "meta": meta,
            "ceilings": {"copy_bytes_per_s": chk.copy_ceiling, "matmul_flops": chk.matmul_ceiling},
            "goals": {
                "decode_b256_share_of_copy": DECODE_BANDWIDTH_GOAL,
                "offline_output_tok_s": OFFLINE_GOAL_TOK_S,
            },
            "summary": {
                str(n): {"name": s.name, "status": s.status, "key": s.key, "goal": s.goal}
                for n, s in report.sections.items()
            },
            "rows": [asdict(r) for r in report.rows],
            "sections": {str(n): asdict(s) for n, s in report.sections.items()},
        },
        args.json,
    )
    return 0 if all(s.status == "ok" for s in report.sections.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
