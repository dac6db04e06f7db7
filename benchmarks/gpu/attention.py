"""§3 attention microbenchmark: one layer's decode forward, triton vs torch: microseconds per
call, KV bytes read per second, share of the copy ceiling."""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.gpu.check import Check
from benchmarks.gpu.measure import best_seconds, free_memory
from benchmarks.gpu.plan import DECODE_BANDWIDTH_GOAL, Plan
from benchmarks.gpu.report import SKIPPED, Budget, Report, Row, fmt_bandwidth, goal_mark, share
from benchmarks.gpu.rig import Rig, kv_label, make_rig


def time_decode_forward(
    rig: Rig, plan: Plan, batch: int, context: int, seed: int, device: torch.device
) -> float:
    """Seconds per forward of one decode step (B sequences of `context` keys) on one layer."""
    from engine.attention.metadata import common_metadata_from_seqs

    bs = plan.block_size
    rng = np.random.default_rng(seed)
    free = rng.permutation(np.arange(1, rig.num_blocks, dtype=np.int32))
    nb = -(-context // bs)
    seqs = [(context - 1, 1, free[r * nb : (r + 1) * nb]) for r in range(batch)]
    meta = rig.backend.build_metadata(common_metadata_from_seqs(seqs, bs))
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(
        (batch, plan.heads, plan.head_dim), generator=gen, device=device, dtype=torch.bfloat16
    )
    k = torch.randn(
        (batch, plan.kv_heads, plan.head_dim), generator=gen, device=device, dtype=torch.bfloat16
    )
    v = torch.randn_like(k)
    rig.backend.write_kv(rig.layer, k, v, rig.cache, meta)
    return best_seconds(lambda: rig.backend.forward(rig.layer, q, k, v, rig.cache, meta), device)


@torch.inference_mode()
def section_attention(chk: Check, out: Report, budget: Budget) -> None:
    p = chk.plan
    copy = chk.copy_bandwidth()
    shapes = [(b, ctx) for ctx in p.bench_contexts for b in p.bench_batches]
    num_blocks = 1 + max(p.bench_batches) * -(-max(p.bench_contexts) // p.block_size)
    max_context = max(p.bench_contexts)
    triton_rows: dict[tuple[int, int], tuple[Row, float]] = {}
    figures: dict[tuple[str, str, int, int], float] = {}  # bytes/s by backend, kv, B, context
    # triton first: it is what this section is for if the budget runs short
    for name, kv in (("triton", "auto"), ("torch", "auto"), ("triton", "fp8")):
        label = f"{name}, {kv_label(kv)} KV"
        if budget.spent:
            out.row(3, f"attention {label}", SKIPPED)
            continue
        rig, status, why = make_rig(chk, name, kv, num_blocks, max_context)
        if rig is None:
            out.row(3, f"attention {label}", status, note=why)
            out.result(3, backend=name, kv=kv_label(kv), status=status, why=why)
            continue
        for i, (b, ctx) in enumerate(shapes):
            if budget.spent:
                out.row(3, f"attention {label}", SKIPPED, note=f"{len(shapes) - i} shapes left")
                break
            t = time_decode_forward(rig, p, b, ctx, seed=2000 + i, device=chk.device)
            kv_bytes = b * ctx * p.kv_heads * p.head_dim * 2 * rig.cache.element_size()
            bw = kv_bytes / t
            versus = share(bw, copy, "copy")
            if b == 256 and copy:
                versus += f"; goal {DECODE_BANDWIDTH_GOAL:.0%}: {goal_mark(bw >= DECODE_BANDWIDTH_GOAL * copy)}"
            note = ""
            if name == "torch" and (b, ctx) in triton_rows:
                trow, t_triton = triton_rows[(b, ctx)]
                trow.note = f"{t / t_triton:.1f}x the torch reference"
                note = "the reference (gather + SDPA)"
            row = out.row(
                3,
                f"attention {label}, B={b}, ctx={ctx}",
                f"{t * 1e6:,.1f} µs",
                f"{fmt_bandwidth(bw)} = {versus}",
                note,
            )
            if name == "triton" and kv == "auto":
                triton_rows[(b, ctx)] = (row, t)
            figures[(name, kv, b, ctx)] = bw
            out.result(
                3,
                backend=name,
                kv=kv_label(kv),
                batch=b,
                context=ctx,
                seconds=t,
                kv_bytes=kv_bytes,
                kv_bytes_per_s=bw,
            )
        rig = None
        free_memory()
    summarize(out, figures, copy)


def summarize(out: Report, figures: dict[tuple[str, str, int, int], float], copy) -> None:
    """The best share of copy at the largest batch timed, triton first (bf16 KV), else torch."""
    for name in ("triton", "torch"):
        mine = {
            (b, ctx): bw for (n, kv, b, ctx), bw in figures.items() if (n, kv) == (name, "auto")
        }
        if not mine:
            continue
        top = max(b for b, _ in mine)
        bw, ctx = max((bw, ctx) for (b, ctx), bw in mine.items() if b == top)
        goal = ""
        if top == 256 and copy:
            goal = f"{DECODE_BANDWIDTH_GOAL:.0%} of copy at B=256: {goal_mark(bw >= DECODE_BANDWIDTH_GOAL * copy)}"
        out.summary(
            3,
            f"{name} bf16 B={top}: {fmt_bandwidth(bw)} = {share(bw, copy, 'copy')} (ctx {ctx})",
            goal,
        )
        return
