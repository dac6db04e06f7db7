"""§2 kernel correctness: each attention backend (torch, triton), bf16 and fp8 KV cache,
against an fp64 reference over decode steps and prefill chunks on cached prefixes."""

from __future__ import annotations

import math
import traceback

import torch

from benchmarks.gpu.check import Check
from benchmarks.gpu.plan import ATTENTION_BACKENDS, KV_DTYPES, TOLERANCE
from benchmarks.gpu.report import Budget, Report, goal_mark
from benchmarks.gpu.rig import (
    Rig,
    check_cases,
    kv_label,
    make_case,
    make_rig,
    poison,
    reference,
    relative_error,
    run_case,
)


@torch.inference_mode()
def section_correctness(chk: Check, out: Report, budget: Budget) -> None:
    p = chk.plan
    cases = check_cases(p)
    num_blocks = 1 + max(b * -(-ctx // p.block_size) for b, ctx, _ in cases)
    max_context = max(p.check_contexts)
    rigs: dict[tuple[str, str], Rig] = {}
    for name in ATTENTION_BACKENDS:
        for kv in KV_DTYPES:
            rig, status, why = make_rig(chk, name, kv, num_blocks, max_context)
            if rig is None:
                out.row(2, f"correctness {name}, {kv_label(kv)} KV", status, note=why)
                out.result(2, backend=name, kv=kv_label(kv), status=status, why=why)
                continue
            poison(rig.cache)
            rigs[(name, kv)] = rig
    worst: dict[tuple[str, str], tuple[float, str]] = {key: (0.0, "") for key in rigs}
    failures: dict[tuple[str, str], str] = {}
    rounding: dict[str, float] = {}  # kv dtype -> worst error of its rounded K/V's reference
    done = 0
    for i, (b, ctx, mode) in enumerate(cases):
        if budget.spent or not rigs:
            break
        case = make_case(p, b, ctx, mode, num_blocks, seed=1000 + i, device=chk.device)
        refs: dict[str, torch.Tensor] = {}
        for key, rig in rigs.items():
            for kv in {"auto", key[1]} - refs.keys():
                refs[kv] = reference(case, rig.layer.scale, kv)
            if key[1] != "auto":  # what rounding K/V costs, whatever the kernel does
                cost = relative_error(refs[key[1]], refs["auto"])
                rounding[key[1]] = max(rounding.get(key[1], 0.0), cost)
            where = f"B={b}, ctx={ctx}, {mode}"
            try:
                err = relative_error(run_case(rig, case, p.block_size), refs[key[1]])
            except Exception as e:
                err = math.inf
                failures.setdefault(key, f"{where}: {type(e).__name__}: {e}")
                traceback.print_exc()
            if err >= worst[key][0]:
                worst[key] = (err, where)
            out.result(
                2, backend=key[0], kv=kv_label(key[1]), batch=b, context=ctx, mode=mode, rel_err=err
            )
        done += 1
        del case, refs
    marks = []
    for key in rigs:
        err, where = worst[key]
        tol = TOLERANCE[key[1]]
        note = f"worst at {where}" if done else ""
        if key in failures:
            note = f"raised at {failures[key]}"
        if key[1] in rounding:
            note += f"; e4m3 K/V alone cost {rounding[key[1]]:.2e} against bf16 K/V"
        if done < len(cases):
            note += f"; {len(cases) - done} cases skipped: section budget spent"
        out.row(
            2,
            f"correctness {key[0]}, {kv_label(key[1])} KV",
            f"worst rel err {err:.2e} ({done}/{len(cases)} cases)",
            f"tol {tol:.0e}: {'ok' if err <= tol and done else 'FAIL'}",
            note.strip("; "),
        )
        marks.append((f"{key[0]} {kv_label(key[1])} {err:.1e}", err <= tol and done > 0))
    rigs.clear()
    out.summary(
        2,
        f"worst rel err: {', '.join(m for m, _ in marks)} ({done}/{len(cases)} cases)",
        "every backend within tolerance: " + goal_mark(bool(marks) and all(ok for _, ok in marks)),
    )
