"""Server-side pictures: SVG line and bar charts, and the KV block map's cells.

SVG is built from numbers and escaped labels only, with presentation attributes (no style
attributes), so the console's Content-Security-Policy can forbid inline styles and scripts.
Colours come from CSS classes (s0, s1, ...) in static/console/console.css.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

MAX_BLOCK_CELLS = 2048
# block_states() bytes: 0 free, 1 in use, 2 free but holding a cached prefix.
FREE, USED, CACHED = 0, 1, 2


def nice_max(value: float) -> float:
    """The smallest 1/2/4/6/8 x 10^k at or above value: an axis top whose quarters are short
    round numbers (so tick labels stay within four characters)."""
    if value <= 0:
        return 1.0
    exp = math.floor(math.log10(value))
    for m in (1, 2, 4, 6, 8, 10):
        top = m * 10**exp
        if top >= value * (1 - 1e-9):
            return float(top)
    return float(10 ** (exp + 1))


def _fmt(v: float) -> str:
    if v >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:g}"


def line_chart(
    series: dict[str, list[tuple[float, float]]],
    *,
    x_span: tuple[float, float],
    x_labels: Sequence[tuple[float, str]] = (),
    width: int = 1000,
    height: int = 200,
    title: str = "",
) -> Markup:
    """Lines of (x, y) points; y from 0 to a round maximum. One CSS class per series."""
    left, right, top, bottom = 64, 8, 10, 30
    pw, ph = width - left - right, height - top - bottom
    x0, x1 = x_span
    ymax = nice_max(max((y for pts in series.values() for _, y in pts), default=0.0))

    def sx(x: float) -> float:
        return left + (x - x0) / ((x1 - x0) or 1) * pw

    def sy(y: float) -> float:
        return top + ph - y / ymax * ph

    parts = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{escape(title)}">'
    ]
    for i in range(5):
        y = ymax * i / 4
        parts.append(
            f'<line class="grid" x1="{left}" x2="{width - right}" y1="{sy(y):.1f}" '
            f'y2="{sy(y):.1f}"/><text class="axis" x="{left - 4}" y="{sy(y) + 4:.1f}" '
            f'text-anchor="end">{_fmt(y)}</text>'
        )
    for x, label in x_labels:
        # Labels at the plot's edges are anchored inwards so they are not clipped.
        anchor = "start" if x <= x0 else "end" if x >= x1 else "middle"
        parts.append(
            f'<text class="axis" x="{sx(x):.1f}" y="{height - 4}" text-anchor="{anchor}">'
            f"{escape(label)}</text>"
        )
    for i, (name, pts) in enumerate(series.items()):
        if not pts:
            continue
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        parts.append(
            f'<polyline class="line s{i}" fill="none" points="{coords}">'
            f"<title>{escape(name)}</title></polyline>"
        )
    parts.append("</svg>")
    return Markup("".join(parts))


def bar_chart(
    labels: Sequence[str],
    stacks: dict[str, Sequence[float]],
    *,
    width: int = 640,
    height: int = 200,
    title: str = "",
) -> Markup:
    """Stacked bars: one bar per label, one stacked segment (CSS class sN) per series."""
    left, right, top, bottom = 64, 8, 10, 34
    pw, ph = width - left - right, height - top - bottom
    n = max(len(labels), 1)
    totals = [sum(s[i] for s in stacks.values()) for i in range(len(labels))]
    ymax = nice_max(max(totals, default=0.0))
    slot = pw / n
    bar = max(min(slot * 0.7, 48.0), 1.0)
    parts = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{escape(title)}">'
    ]
    for i in range(5):
        y = top + ph - ph * i / 4
        parts.append(
            f'<line class="grid" x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text class="axis" x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">'
            f"{_fmt(ymax * i / 4)}</text>"
        )
    every = max(1, math.ceil(n / 10))  # at most ~10 x labels
    for i, label in enumerate(labels):
        x = left + slot * i + (slot - bar) / 2
        base = top + ph
        for k, (name, values) in enumerate(stacks.items()):
            h = values[i] / ymax * ph
            if h <= 0:
                continue
            base -= h
            parts.append(
                f'<rect class="bar s{k}" x="{x:.1f}" y="{base:.1f}" width="{bar:.1f}" '
                f'height="{h:.1f}"><title>{escape(name)} {escape(label)}: {values[i]:g}'
                "</title></rect>"
            )
        if i % every == 0:
            parts.append(
                f'<text class="axis" x="{x + bar / 2:.1f}" y="{height - 18}" '
                f'text-anchor="middle">{escape(label)}</text>'
            )
    parts.append("</svg>")
    return Markup("".join(parts))


@dataclass(slots=True, frozen=True)
class BlockMap:
    cells: list[str]  # CSS class per cell: "f" free, "u" used, "c" cached-free, "n" null block
    blocks_per_cell: int
    free: int
    used: int
    cached: int

    @property
    def total(self) -> int:
        return self.free + self.used + self.cached


def block_map(states: bytes, max_cells: int = MAX_BLOCK_CELLS) -> BlockMap:
    """One cell per block, or per group of blocks when the pool is larger than max_cells.

    Block 0 is the engine's reserved null block. A group cell takes the state most of its
    blocks are in, with in-use winning ties: the picture must not hide memory pressure."""
    n = len(states)
    per = max(1, math.ceil((n - 1) / max_cells)) if n > 1 else 1
    counts = [states.count(FREE, 1), states.count(USED, 1), states.count(CACHED, 1)]
    cells = ["n"] if n else []
    names = {FREE: "f", USED: "u", CACHED: "c"}
    for start in range(1, n, per):
        group = states[start : start + per]
        if per == 1:
            cells.append(names.get(group[0], "f"))
            continue
        used, cached = group.count(USED), group.count(CACHED)
        free = len(group) - used - cached
        if used >= max(cached, free):
            cells.append("u")
        elif cached >= free:
            cells.append("c")
        else:
            cells.append("f")
    return BlockMap(cells, per, *counts)
