"""The serving path's own ceiling: the share of the engine's offline throughput that
`tessera serve` streams on this host, with a model so small that its forward costs little (a
tiny Llama of dummy weights: hidden 64, 2 layers), so that what is measured is the HTTP front
end, the engine's Python and the one GIL they share.

    tessera bench frontend [--concurrency 64 256] [--rounds 4] [--input-words 32]
        [--output-len 128] [--stream-interval 1] [--modes thread process api2 api4]
        [--device cpu|cuda]
        [--no-pin] [--no-stream] [--baseline-tree PATH [--bursts 6]]

The device check's §10 (benchmarks/gpu/serving.py) on this model: `tessera serve` (a
subprocess on loopback, the engine's own attention backend; one server with the engine on a
thread, one with it in a process of its own, `--engine-process`, and with `--modes api2` /
`api4` one with 2 / 4 API server processes in front of it, `--api-server-count`) against the bench-serve
client at each concurrency (streaming completions, ignore_eos), then the top concurrency's
requests offline (LLM.generate in this process, the same engine options); the share is served
/ offline output tok/s there. With two CPUs or more, the server and the offline engine run
on the first half of them and the client on the rest (--no-pin: all on all). Prints the
check's detail table.

--baseline-tree PATH measures a change instead: for each mode, this checkout's server and
PATH's (e.g. `git worktree add /tmp/base HEAD~1`) run at once, on the same CPUs, and the
client's bursts (the top concurrency, a request a stream, each burst its own prompts)
alternate between them: the medians of each side's output tok/s and server CPU a token, and
their ratio. A shared VM's speed drifts by a third over minutes; alternating cancels that,
two runs one after the other do not.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.gpu.check import Check
from benchmarks.gpu.plan import QUICK, TINY_LLAMA
from benchmarks.gpu.report import Budget, Report, SectionRecord, print_details
from benchmarks.gpu.serving import SERVE_MODES, measure_against_tree, measure_serving

FRONTEND_MODEL = {
    **TINY_LLAMA,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tessera bench frontend", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    p.add_argument("--rounds", type=int, default=4, help="requests per stream")
    p.add_argument("--input-words", type=int, default=32, help="prompt words (a token each)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens (ignore_eos)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--stream-interval", type=int, default=1, help="the server's (tokens)")
    p.add_argument(
        "--modes",
        nargs="+",
        choices=tuple(SERVE_MODES),
        default=["thread", "process"],
        help="a server each: the engine on a thread, in a process (--engine-process), or 2 / 4 "
        "API server processes in front of it (api2, api4: --api-server-count)",
    )
    p.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the server and the offline engine on half the CPUs, the client on the rest "
        "(their torch threads as many): both figures on the same cores, the client's apart",
    )
    p.add_argument(
        "--baseline-tree",
        type=Path,
        default=None,
        help="another checkout (a worktree of the commit before a change, say): its servers "
        "and this tree's run at once and the client's bursts alternate between them, instead "
        "of the offline comparison",
    )
    p.add_argument("--bursts", type=int, default=6, help="with --baseline-tree: bursts a side")
    p.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--no-stream: the client asks for whole answers",
    )
    p.add_argument("--time-limit", type=float, default=900.0, help="seconds in all")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if min(args.concurrency) < 1 or args.rounds < 1 or args.output_len < 1 or args.bursts < 1:
        raise SystemExit("--concurrency, --rounds, --output-len and --bursts must be at least 1")
    if args.baseline_tree is not None:
        args.baseline_tree = args.baseline_tree.resolve()
        if not (args.baseline_tree / "api" / "cli" / "main.py").is_file():
            raise SystemExit(f"--baseline-tree must be a Tessera checkout: {args.baseline_tree}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    plan = dataclasses.replace(
        QUICK,
        name="frontend",
        model=FRONTEND_MODEL,
        chunk=2048,
        kv_cache_memory=1 << 30,
        serve_concurrency=tuple(sorted(args.concurrency)),
        serve_rounds=args.rounds,
        serve_input_words=args.input_words,
        serve_output_len=args.output_len,
        serve_modes=tuple(args.modes),
        serve_stream=args.stream,
    )
    report = Report()
    record = report.sections[10] = SectionRecord("serving")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tessera-bench-frontend-") as tmp:
        chk = Check(plan, device, Path(tmp), report)
        extra = {"stream_interval": args.stream_interval}
        budget = Budget(args.time_limit)
        if args.baseline_tree is not None:
            measure_against_tree(
                chk, report, budget, args.baseline_tree, args.bursts, extra=extra, pin=args.pin
            )
        else:
            measure_serving(chk, report, budget, extra=extra, pin=args.pin)
    record.status = "ok"
    print_details(report, {"total_s": time.monotonic() - started})
    print(f"{record.key}" + (f" ({record.goal})" if record.goal else ""))
    return {"rows": [dataclasses.asdict(r) for r in report.rows], "results": record.results}


if __name__ == "__main__":
    main()
