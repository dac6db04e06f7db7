"""Quantized GEMMs on the GPU: bf16, FP8 and W4A16 at the Llama-3-8B linear shapes.

    PYTHONPATH=. python3 -m benchmarks.gpu.quant [--quick] [--json PATH]

(section 6 of the device check, `python3 -m benchmarks.gpu --sections quant`, runs the same
checks and timings at the plan's shapes, within its budget, into the check's tables)

For each linear of a Llama-3-8B layer (qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 ->
28672, down 14336 -> 4096) and M = 1, 64, 256 rows (decode batches), it times

- bf16: torch.mm against the bf16 weight (what an unquantized model runs);
- fp8 mm: torch._scaled_mm on activations already quantized (per token) and a per-channel
  fp8 weight (rowwise scaling), where the GPU has FP8 matmuls (capability >= 8.9);
- fp8 linear: engine.kernels.fp8.fp8_linear, the per-token quantization of x included;
- w4a16: engine.kernels.triton.quant_gemm.w_int_gemm, 4-bit, group 128, asymmetric (int32
  zeros), its planned launch (split-K for the small M), with each of its two ways of
  unpacking the packed words (`reshape`, the default, and `gather`): which one to keep;

in microseconds per call (CUDA events, best of three loops after a warm-up) and as bandwidth:
the bytes the call must read (weight, its scales and zeros, x) and write (y), per second, and
that as a share of the measured device-to-device copy bandwidth (bytes read + written by one
large copy_, the ceiling a memory-bound kernel is held to). Each call reads one of several
copies of its weights in turn, together larger than the L2 cache, so the weights come from
HBM as in a model's step. Each variant's output is also checked once against a torch
reference (max|y - ref| / max|ref|; W4A16 and bf16 against the same dequantized weight,
fp8 against W8A8 emulated in fp32).

First (unless --no-check) a correctness pass that needs no pytest (the GPU image has none):
W4A16 / W8A16 over the layouts (groups 32/64/128/channel, sym and asym, act-order raw and
repacked, bf16 and fp16, decode rows with split-K and prefill rows) against
dequantize_reference, the per-token fp8 kernel byte for byte against torch, fp8_linear
against W8A8 in fp32; a row that fails says FAILED and the exit status is 1.

The table goes to stdout, progress to stderr, the figures as JSON to $OUT/gpu_quant.json when
$OUT is set (and to --json PATH). --quick: M = 1 and 64, the qkv and down shapes, shorter
loops. --sweep: at M = 1, W4A16 launches around the planned one too (BLOCK_N, BLOCK_K, split),
the figures to tune plan_launch by. Without a CUDA device only --quick runs: tiny shapes on
the CPU with the Triton kernel under the interpreter, a smoke run of the script (its times
mean nothing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if not torch.cuda.is_available():  # the Triton kernel on CPU tensors: set before its import
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.gpu.measure import (  # noqa: E402
    best_seconds,
    device_description,
    free_memory,
    measure_copy_bandwidth,
    sync,
    triton_version,
)
from benchmarks.gpu.plan import LLAMA3_8B_LINEARS, QUICK  # noqa: E402
from benchmarks.gpu.quant_check import Row, check_kernels, rel_err  # noqa: E402
from benchmarks.gpu.report import SKIPPED, Budget, Report, fmt_bandwidth  # noqa: E402

if TYPE_CHECKING:
    from benchmarks.gpu.check import Check

TINY_LINEARS = QUICK.quant_linears
GROUP = 128
ROTATE_BYTES = 256 * 2**20  # the weight copies a variant cycles through: well past the L2


def progress(text: str) -> None:
    print(f"[gpu_quant] {text}", file=sys.stderr, flush=True)


def copies_for(nbytes: int, device: torch.device) -> int:
    return max(1, min(64, -(-ROTATE_BYTES // max(1, nbytes)))) if device.type == "cuda" else 1


class Rotation:
    """Calls fn(weights[i]) for i = 0, 1, ... in turn: a weight is read from HBM, not L2."""

    def __init__(self, weights: list, fn) -> None:
        self.weights, self.fn, self.i = weights, fn, 0

    def __call__(self):
        w = self.weights[self.i]
        self.i = (self.i + 1) % len(self.weights)
        return self.fn(w)


def time_variant(rows, shape, m, kind, device, copy_bw, target_s, bytes_moved, rotation, check):
    """One row: check once (rel_err from `check`), then time `rotation`."""
    row = Row(shape, m, kind, bytes_moved=bytes_moved)
    try:
        row.rel_err = check()
        s = best_seconds(rotation, device, target_s=target_s)
        row.us = s * 1e6
        row.bandwidth = bytes_moved / s
        row.share_of_copy = row.bandwidth / copy_bw if copy_bw else None
    except Exception as e:  # one failing variant leaves its error in the table
        traceback.print_exc()
        row.note = f"ERROR {type(e).__name__}: {str(e)[:200]}"
    rows.append(row)
    progress(
        f"{shape} M={m} {kind}: "
        + (f"{row.us:.1f} us, {fmt_bandwidth(row.bandwidth)}" if row.us else row.note)
    )


def sweep_launches(qg, m, n, k, device) -> list:
    """Launches around the planned one at M = 1: BLOCK_N 32/64/128 x BLOCK_K 64/128 x the
    planned split / 2, x 1, x 2 (the reshape unpack)."""
    if m != 1:
        return []
    planned = qg.plan_launch(m, n, k, GROUP, False, qg._num_sms(device))
    out = []
    for bn in (32, 64, 128):
        for bk in (64, 128):
            for split in sorted(
                {max(1, planned.split_k // 2), planned.split_k, planned.split_k * 2}
            ):
                out.append(qg.GemmLaunch(planned.block_m, bn, bk, split, 4, planned.num_stages))
    return out


def bench_shape(rows, name, k, n, ms, device, copy_bw, target_s, sweep=False):
    from engine.kernels import fp8
    from engine.kernels.triton import quant_gemm as qg

    dtype = torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    # W4A16 weights: random 4-bit integers, group scales, int32 zeros (the canonical layout)
    q = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    qweight = qg.pack_int(q.to(device), 4)
    del q
    scales = ((torch.rand(k // GROUP, n, generator=g) + 0.5) / 64).to(dtype).to(device)
    zeros = torch.randint(0, 16, (k // GROUP, n), generator=g, dtype=torch.int32).to(device)
    w = qg.dequantize_reference(qweight, scales, zeros, None, 4, GROUP).to(dtype)  # [K, N]
    w_nk = w.t().contiguous()  # [N, K]: the bf16 linear's weight
    w_fp8, w_scale = fp8.quantize_weight_fp8(w_nk)
    del w

    w4_bytes = qweight.numel() * 4 + scales.numel() * 2 + zeros.numel() * 4
    bf16_bytes = w_nk.numel() * 2
    fp8_bytes = w_fp8.numel() + w_scale.numel() * 4
    bf16_copies = [w_nk] + [w_nk.clone() for _ in range(copies_for(bf16_bytes, device) - 1)]
    w4_copies = [(qweight, scales, zeros)] + [
        (qweight.clone(), scales.clone(), zeros.clone())
        for _ in range(copies_for(w4_bytes, device) - 1)
    ]
    fp8_ok = fp8.supports_fp8_matmul(device)
    fp8_copies = [w_fp8] + [w_fp8.clone() for _ in range(copies_for(fp8_bytes, device) - 1)]

    for m in ms:
        x = torch.randn(m, k, generator=g).to(dtype).to(device)
        io = m * k * 2 + m * n * 2  # x read, y written (bf16)
        ref = x.float() @ w_nk.float().t()

        time_variant(
            rows, name, m, "bf16 torch.mm", device, copy_bw, target_s, bf16_bytes + io,
            Rotation(bf16_copies, lambda wt, x=x: torch.mm(x, wt.t())),
            lambda x=x, ref=ref: rel_err(torch.mm(x, w_nk.t()), ref),
        )  # fmt: skip
        if fp8_ok:
            xq, xs = fp8.per_token_quant_fp8(x)
            ws = w_scale.reshape(1, -1).contiguous()
            io8 = m * k + m * 4 + m * n * 2

            def scaled(wq, xq=xq, xs=xs, ws=ws):
                return torch._scaled_mm(
                    xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16
                )

            ref8 = fp8.fp8_linear_reference(x, w_fp8, w_scale)
            time_variant(
                rows, name, m, "fp8 _scaled_mm (rowwise)", device, copy_bw, target_s,
                fp8_bytes + io8, Rotation(fp8_copies, scaled),
                lambda scaled=scaled, ref8=ref8: rel_err(scaled(w_fp8), ref8),
            )  # fmt: skip
            time_variant(
                rows, name, m, "fp8 linear (+ per-token quant)", device, copy_bw, target_s,
                fp8_bytes + io8 + m * k * 2,  # x read once more by the quantization
                Rotation(fp8_copies, lambda wq, x=x: fp8.fp8_linear(x, wq, w_scale)),
                lambda x=x, ref8=ref8: rel_err(fp8.fp8_linear(x, w_fp8, w_scale), ref8),
            )  # fmt: skip
        else:  # the weight-only fallback: what fp8_linear runs here (dequantized per call)
            deq = fp8.dequantize_fp8(w_fp8, w_scale, dtype).float()
            time_variant(
                rows, name, m, "fp8 linear (weight-only fallback)", device, copy_bw, target_s,
                fp8_bytes + io,
                Rotation(fp8_copies, lambda wq, x=x: fp8.fp8_linear(x, wq, w_scale)),
                lambda x=x, deq=deq: rel_err(
                    fp8.fp8_linear(x, w_fp8, w_scale), x.float() @ deq.t()
                ),
            )  # fmt: skip
            del deq
        for unpack in ("reshape", "gather"):  # the kernel's two ways of unpacking its words

            def w4(t, x=x, unpack=unpack):
                return qg.w_int_gemm(x, *t, None, 4, GROUP, unpack=unpack)

            time_variant(
                rows, name, m, f"w4a16 g{GROUP} asym, {unpack} (triton)", device, copy_bw,
                target_s, w4_bytes + io, Rotation(w4_copies, w4),
                lambda w4=w4, ref=ref: rel_err(w4((qweight, scales, zeros)), ref),
            )  # fmt: skip
        for launch in sweep_launches(qg, m, n, k, device) if sweep else ():

            def w4s(t, x=x, launch=launch):
                return qg.w_int_gemm(x, *t, None, 4, GROUP, launch=launch)

            time_variant(
                rows, name, m,
                f"w4a16 sweep BN={launch.block_n} BK={launch.block_k} split={launch.split_k}",
                device, copy_bw, target_s, w4_bytes + io, Rotation(w4_copies, w4s),
                lambda w4s=w4s, ref=ref: rel_err(w4s((qweight, scales, zeros)), ref),
            )  # fmt: skip
        free_memory()
    del bf16_copies, w4_copies, fp8_copies
    free_memory()


def fmt_row(r: Row, bf16_us: float | None) -> str:
    us = f"{r.us:.1f}" if r.us is not None else "-"
    speed = f"{bf16_us / r.us:.2f}x" if r.us and bf16_us else "-"
    bw = fmt_bandwidth(r.bandwidth) if r.bandwidth else "-"
    share = f"{r.share_of_copy:.0%}" if r.share_of_copy is not None else "-"
    err = f"{r.rel_err:.1e}" if r.rel_err is not None else "-"
    mb = f"{r.bytes_moved / 1e6:.1f}" if r.bytes_moved else "-"
    cells = (r.shape, r.m, r.kind, us, speed, mb, bw, share, err, r.note)
    return "| " + " | ".join(str(c) for c in cells) + " |"


def print_table(rows: list[Row], meta: dict) -> None:
    print(f"\n## Tessera quantized GEMMs: {meta['device']}, {meta['date']}\n")
    print(f"`{meta['command']}`; {meta['versions']}; copy ceiling {meta['copy']}\n")
    print("| linear | M | kind | us | vs bf16 | MB moved | bandwidth | of copy | rel err | note |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    bf16 = {(r.shape, r.m): r.us for r in rows if r.kind.startswith("bf16")}
    for r in rows:
        print(fmt_row(r, bf16.get((r.shape, r.m))))
    print(flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 -m benchmarks.gpu.quant", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer shapes and rows; on a CPU: tiny"
    )
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument(
        "--no-check", action="store_true", help="skip the correctness checks (timings only)"
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also time W4A16 launches around the planned one at the decode rows (tuning)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        print("gpu_quant: the full run needs a GPU; on the CPU use --quick", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        linears = (
            {s: LLAMA3_8B_LINEARS[s] for s in ("qkv", "down")} if args.quick else LLAMA3_8B_LINEARS
        )
        ms = (1, 64) if args.quick else (1, 64, 256)
        target_s = 0.03 if args.quick else 0.1
        copy_bw = measure_copy_bandwidth(device, 1 << 30)
    else:
        linears, ms, target_s, copy_bw = TINY_LINEARS, (1, 4), 0.0, None
    started = time.monotonic()
    rows: list[Row] = []
    if not args.no_check:
        progress("correctness checks")
        check_kernels(rows, device)
        for r in rows:
            progress(f"{r.kind} M={r.m}: {r.note} {r.rel_err if r.rel_err is not None else ''}")
    for name, (k, n) in linears.items():
        progress(f"{name}: K={k}, N={n}")
        try:
            bench_shape(rows, name, k, n, ms, device, copy_bw, target_s, args.sweep)
        except Exception as e:
            traceback.print_exc()
            rows.append(Row(name, 0, "setup", note=f"ERROR {type(e).__name__}: {str(e)[:200]}"))
        sync(device)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),  # noqa: UP017
        "command": " ".join(["python3", "-m", "benchmarks.gpu.quant", *(argv or sys.argv[1:])]),
        "device": " / ".join(device_description(device)),
        "versions": (
            f"torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton_version()}"
        ),
        "copy": fmt_bandwidth(copy_bw) if copy_bw else "not measured (CPU)",
        "total_s": time.monotonic() - started,
    }
    print_table(rows, meta)
    result = {"meta": meta, "copy_bytes_per_s": copy_bw, "rows": [asdict(r) for r in rows]}
    paths = [Path(args.json)] if args.json else []
    if os.environ.get("OUT"):
        paths.append(Path(os.environ["OUT"]) / "gpu_quant.json")
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=str))
        progress(f"figures written to {path}")
    failed = [r for r in rows if r.note.startswith(("ERROR", "FAILED"))]
    return 1 if failed else 0


# -- section 6 of the device check ----------------------------------------------------------


def section_quant(chk: Check, out: Report, budget: Budget) -> None:
    """The correctness pass, then each of the plan's linears while the budget lasts: one
    detail row a variant; the summary is W4A16's best share of the copy ceiling at M=1."""
    rows: list[Row] = []
    check_kernels(rows, chk.device)
    failed = [r for r in rows if r.note != "ok"]
    out.row(
        6,
        "quant kernels correctness",
        f"{len(rows) - len(failed)}/{len(rows)} ok",
        note="; ".join(f"{r.kind} M={r.m}: {r.note}" for r in failed)[:300],
    )
    copy = chk.copy_bandwidth()
    target_s = 0.1 if chk.device.type == "cuda" else 0.0
    for name, (k, n) in chk.plan.quant_linears.items():
        if budget.spent:
            out.row(6, f"quant {name}", SKIPPED)
            continue
        start = len(rows)
        bench_shape(rows, name, k, n, chk.plan.quant_rows, chk.device, copy, target_s)
        bf16 = {r.m: r.us for r in rows[start:] if r.kind.startswith("bf16")}
        for r in rows[start:]:
            speed = f"{bf16[r.m] / r.us:.2f}x bf16" if r.us and bf16.get(r.m) else ""
            bw = f"{fmt_bandwidth(r.bandwidth)}" if r.bandwidth else ""
            of = f" = {r.share_of_copy:.0%} of copy" if r.share_of_copy is not None else ""
            err = f"rel err {r.rel_err:.1e}" if r.rel_err is not None else ""
            out.row(
                6,
                f"{r.kind}, {name} K={k} N={n}, M={r.m}",
                f"{r.us:,.1f} µs" if r.us is not None else r.note,
                f"{bw}{of}",
                "; ".join(x for x in (speed, err) if x),
            )
            out.result(6, **asdict(r))
    w4 = [r for r in rows if r.m == 1 and r.kind.startswith("w4a16") and r.us is not None]
    best = max(w4, key=lambda r: r.share_of_copy or 0.0, default=None)
    key = f"{len(rows) - len(failed)}/{len(rows)} checks ok"
    if best is not None and best.share_of_copy is not None:
        key += f"; W4A16 at M=1 up to {best.share_of_copy:.0%} of copy ({best.shape})"
    out.summary(6, key, "all checks ok: " + ("met" if not failed else "NOT met"))
    if failed:
        raise RuntimeError(f"{len(failed)} quantized kernel checks failed")


if __name__ == "__main__":
    sys.exit(main())
