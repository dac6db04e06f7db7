"""The device check's report: detail rows, each section's record and summary line, the
section and run budgets, and the tables printed at the end (the summary first)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

SKIPPED = "skipped: section budget spent"


@dataclass(slots=True)
class Row:
    section: int
    check: str
    result: str
    versus: str = ""  # against a ceiling or a goal
    note: str = ""


@dataclass(slots=True)
class SectionRecord:
    name: str
    status: str = "not run"  # ok | error | skipped | not run
    seconds: float = 0.0
    error: str | None = None
    key: str = ""  # the section's one figure for the summary
    goal: str = ""  # "met", "NOT met", or what the figure is held to ("" where none)
    results: list[dict] = field(default_factory=list)


class Report:
    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.sections: dict[int, SectionRecord] = {}

    def row(self, section: int, check: str, result: str, versus: str = "", note: str = "") -> Row:
        row = Row(section, check, result, versus, note)
        self.rows.append(row)
        progress(f"§{section} {check}: {result} {versus} {note}".rstrip())
        return row

    def result(self, section: int, **values) -> None:
        self.sections[section].results.append(values)

    def summary(self, section: int, key: str, goal: str = "") -> None:
        """The section's line in the summary table: its key figure and whether a goal is met."""
        rec = self.sections[section]
        rec.key, rec.goal = key, goal


def progress(text: str) -> None:
    print(f"[gpu_check] {text}", file=sys.stderr, flush=True)


class TimeLimit(Exception):
    """The whole run's time limit (SIGALRM): the running section stops, the rest are skipped."""


class BudgetSpent(Exception):
    """A section's own budget ran out inside a measurement."""


class Budget:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def spent(self) -> bool:
        return self.left() <= 0


def fmt_bandwidth(bytes_per_s: float) -> str:
    if bytes_per_s >= 1e12:
        return f"{bytes_per_s / 1e12:.2f} TB/s"
    return f"{bytes_per_s / 1e9:.1f} GB/s"


def fmt_flops(flops: float) -> str:
    if flops >= 1e12:
        return f"{flops / 1e12:.0f} TFLOP/s"
    return f"{flops / 1e9:.1f} GFLOP/s"


def share(value: float, ceiling: float | None, of: str) -> str:
    return f"{value / ceiling:.0%} of {of}" if ceiling else f"(no {of} ceiling)"


def goal_mark(met: bool) -> str:
    return "met" if met else "NOT met"


def _cell(text: str) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def print_summary(report: Report, meta: dict) -> None:
    print(f"\n## Tessera device check: {meta['device']}, {meta['date']}, {meta['plan']} run\n")
    print(f"`{meta['command']}`; {meta['versions']}\n")
    print("| § | section | status | key figure | goal |")
    print("|---|---|---|---|---|")
    for num, rec in report.sections.items():
        status = rec.status if rec.status != "ok" else f"ok, {rec.seconds:.0f} s"
        key = rec.key or (rec.error or "")[:200]
        print(f"| {num} | {_cell(rec.name)} | {status} | {_cell(key)} | {_cell(rec.goal)} |")
    print()


def print_details(report: Report, meta: dict) -> None:
    print("| § | check | result | vs ceiling / goal | note |")
    print("|---|---|---|---|---|")
    for r in report.rows:
        print(
            f"| {r.section} | {_cell(r.check)} | {_cell(r.result)} | {_cell(r.versus)} | {_cell(r.note)} |"
        )
    times = ", ".join(f"§{n} {s.status} {s.seconds:.0f} s" for n, s in report.sections.items())
    print(f"\nsections: {times}; total {meta['total_s']:.0f} s\n", flush=True)
