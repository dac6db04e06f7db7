"""Pipeline parallelism on the CPU: PP = 2 with two batches in flight against PP = 1 on the
same cores (issue 45).

    tessera bench pp [--model M] [--dtype bfloat16] [--streams 32] [--prompt-len 64]
                     [--output-len 64] [--rounds 3] [--cpus 0,1] [--pp-batch-tokens N]
                     [--json PATH]

Offline generation of N streams (--streams, a list) with fixed prompt and output lengths
(greedy, ignore_eos, the prefix cache off so every round computes the same) on two engines
loaded at once: PP = 1 with two torch threads, and PP = 2, two stages (the driver's process
and one worker process, gloo between them) of one thread each, so both use the same two cores
(--cpus: the benchmark pins itself to them, and the worker inherits the mask). Under PP = 2
the engine keeps up to two batches in flight, but one batch takes every runnable request up
to the step's token budget (and a request in flight waits for its token): the PP = 2
engine's max_num_batched_tokens is --pp-batch-tokens (default half the streams, at least a
block), so the decoding streams split into two batches that follow each other through the
stages (prompts go through in chunks of that budget too). PP = 1 keeps the CPU's default
budget.
Rounds alternate the engines' order; each engine's best round counts.

Reported per stream count: output tokens/s of each (the whole run, and decode alone: after
every stream's first token) and PP = 2 / PP = 1; each stage's idle
share over the best round's wall time: the time it waited for its input (the previous stage's
activations, pp_recv), blocked handing its own on (pp_send: gloo's send waits for the next
stage to take them), plus the time outside a step (a worker waiting for its next batch; the
driver scheduling, collecting the last stage's tokens and detokenizing), from the ranks' own
step timers (engine.stats.StageStats); and whether both produced the same tokens (greedy:
they should, up to the roundings of their different kernel paths on a quantized model, since
PP = 1 runs the CPU decode plan and every PP step is eager). PP = 1's one stage has an idle
share too: the time its process spends outside the forward.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import time

import torch

from engine import LLM, SamplingParams

PASSAGE = (
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion, the members agreed to increase funding for the library, the public parks "
    "and the after-school programs, while the road maintenance budget stayed the same. "
)


def make_prompts(llm: LLM, count: int, prompt_len: int) -> list[list[int]]:
    """count different prompts of exactly prompt_len tokens."""
    prompts = []
    for i in range(count):
        ids = llm.tokenizer.encode(f"Stream {i}. " + PASSAGE * 4)
        while len(ids) < prompt_len:
            ids = ids + ids
        prompts.append(ids[:prompt_len])
    return prompts


def run_streams(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    """All prompts at once through the engine's step loop: wall seconds, each stream's tokens
    and every rank's step time over the run."""
    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    before = engine.executor.stage_stats()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{i}-{start}", p, params)
    tokens: dict[int, list[int]] = {}
    counts: dict[str, int] = {}  # tokens each stream has so far
    decode_start: tuple[float, int] | None = None  # when every stream had its first token
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                tokens[int(out.request_id.split("-")[0])] = list(out.outputs[0].token_ids)
        if decode_start is None and len(counts) == len(prompts) and min(counts.values()) > 0:
            decode_start = (time.perf_counter(), sum(counts.values()))
    end = time.perf_counter()
    wall = end - start
    after = engine.executor.stage_stats()
    stages = []
    for b, a in zip(before, after, strict=True):
        step = a.step_s - b.step_s
        wait, send = a.input_wait_s - b.input_wait_s, a.send_s - b.send_s
        busy = step - wait - send  # gloo's send blocks until the next stage takes it
        stages.append(
            {
                "rank": a.rank,
                "stage": a.pp_rank,
                "steps": a.steps - b.steps,
                "busy_s": round(busy, 4),
                "input_wait_share": round(wait / wall, 4),
                "send_share": round(send / wall, 4),
                "outside_step_share": round(max(0.0, wall - step) / wall, 4),
                "idle_share": round(max(0.0, wall - busy) / wall, 4),
            }
        )
    generated = sum(len(t) for t in tokens.values())
    decode_tok_s = None  # after every stream's first token (prefill done): decode alone
    if decode_start is not None and generated > decode_start[1] and end > decode_start[0]:
        decode_tok_s = round((generated - decode_start[1]) / (end - decode_start[0]), 2)
    return {
        "wall_s": wall,
        "output_tokens": generated,
        "tok_s": generated / wall,
        "decode_tok_s": decode_tok_s,
        "tokens": [tokens[i] for i in range(len(prompts))],
        "stages": stages,
    }


def machine_info(cpus: list[int]) -> dict:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus": cpus,
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
    }


def pin(cpus_arg: str | None) -> list[int]:
    """Pin this process (and the workers it starts) to the CPUs asked for, by default the
    first two it may use; the CPUs pinned."""
    if not hasattr(os, "sched_setaffinity"):
        return list(range(min(2, os.cpu_count() or 1)))
    cpus = (
        [int(c) for c in cpus_arg.split(",") if c.strip()]
        if cpus_arg
        else sorted(os.sched_getaffinity(0))[:2]
    )
    os.sched_setaffinity(0, cpus)
    return sorted(os.sched_getaffinity(0))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera bench pp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder or .gguf (default: bundled)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--streams", default="32", help="comma-separated stream counts")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per stream")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens per stream")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each engine")
    parser.add_argument(
        "--cpus", default=None, help="comma-separated CPU ids (default: the first two usable)"
    )
    parser.add_argument(
        "--pp-batch-tokens",
        type=int,
        default=None,
        help="max_num_batched_tokens of the PP = 2 engine (default: half the streams, rounded "
        "up, at least a block (16): two batches of decodes in flight; 2048: one batch holds "
        "them all)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results to this file")
    return parser


def parse_streams(parser: argparse.ArgumentParser, text: str) -> list[int]:
    try:
        streams = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--streams must be comma-separated integers, got {text!r}")
    if not streams or min(streams) < 1:
        parser.error("--streams needs stream counts of at least 1")
    return streams


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    streams = parse_streams(parser, args.streams)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.prompt_len < 1 or args.output_len < 1:
        parser.error("--prompt-len and --output-len must be at least 1")
    if args.pp_batch_tokens is not None and args.pp_batch_tokens < 16:
        parser.error("--pp-batch-tokens must cover a block (16 tokens)")
    cpus = pin(args.cpus)
    if len(cpus) < 2:
        parser.error(f"needs two CPUs to compare on, this process may use {cpus}")
    threads = {1: len(cpus), 2: max(1, len(cpus) // 2)}  # PP = 1: all; PP = 2: half a stage
    rows = []
    for n in streams:
        blocks = n * math.ceil((args.prompt_len + args.output_len) / 16) + 16
        common = dict(
            dtype=args.dtype,
            seed=args.seed,
            enable_prefix_caching=False,
            num_kv_blocks=blocks,
            max_model_len=args.prompt_len + args.output_len,
        )
        pp_tokens = args.pp_batch_tokens or max(16, math.ceil(n / 2))
        engines = {}
        torch.set_num_threads(threads[1])
        engines[1] = LLM(args.model, pipeline_parallel_size=1, max_num_seqs=n, **common)
        torch.set_num_threads(threads[2])  # the driver's; its worker splits the pinned CPUs
        engines[2] = LLM(
            args.model,
            pipeline_parallel_size=2,
            max_num_seqs=n,
            max_num_batched_tokens=pp_tokens,
            **common,
        )
        prompts = make_prompts(engines[1], n, args.prompt_len)
        best: dict[int, dict] = {}
        try:
            for pp, llm in engines.items():  # warm-up: first steps of each size untimed
                torch.set_num_threads(threads[pp])
                run_streams(llm, prompts, 3)
            for r in range(args.rounds):
                for pp in (1, 2) if r % 2 == 0 else (2, 1):
                    torch.set_num_threads(threads[pp])
                    run = run_streams(engines[pp], prompts, args.output_len)
                    idle = ", ".join(f"{s['idle_share']:.0%}" for s in run["stages"])
                    print(
                        f"PP={pp} x{n} round {r + 1}: {run['tok_s']:.1f} tok/s, stage idle {idle}",
                        flush=True,
                    )
                    if pp not in best or run["tok_s"] > best[pp]["tok_s"]:
                        best[pp] = run
        finally:
            for llm in engines.values():
                llm.shutdown()
            del engines
            gc.collect()
        one, two = best[1], best[2]
        rows.append(
            {
                "streams": n,
                "pp2_batch_tokens": pp_tokens,
                "pp1": {k: v for k, v in one.items() if k != "tokens"} | {"threads": threads[1]},
                "pp2": {k: v for k, v in two.items() if k != "tokens"}
                | {"threads_per_stage": threads[2]},
                "ratio": round(two["tok_s"] / one["tok_s"], 3),
                "decode_ratio": round(two["decode_tok_s"] / one["decode_tok_s"], 3)
                if one["decode_tok_s"] and two["decode_tok_s"]
                else None,
                "same_tokens": one["tokens"] == two["tokens"],
            }
        )
    result = {
        "machine": machine_info(cpus),
        "model": args.model or "default",
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "rounds": args.rounds,
        "rows": rows,
    }
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def print_table(result: dict) -> None:
    m = result["machine"]
    print(
        f"\n## PP = 2 vs PP = 1 on CPUs {m['cpus']} ({result['dtype']}, prompt "
        f"{result['prompt_len']}, output {result['output_len']}, best of {result['rounds']}), "
        f"{m['date']}, load {m['load_avg_1m']}\n"
    )
    print(
        "| streams | PP=1 tok/s | PP=2 tok/s | PP=2 / PP=1 | decode alone: PP=1 / PP=2 tok/s "
        "| PP=1 idle | PP=2 stage 0 idle (send) | PP=2 stage 1 idle (input wait) | same tokens |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for r in result["rows"]:
        s1, s2 = r["pp1"]["stages"], r["pp2"]["stages"]
        last = s2[-1]
        decode = (
            f"{r['pp1']['decode_tok_s']:.1f} / {r['pp2']['decode_tok_s']:.1f} = "
            f"{r['decode_ratio']:.2f}x"
            if r["decode_ratio"]
            else "-"
        )
        print(
            f"| {r['streams']} | {r['pp1']['tok_s']:.1f} | {r['pp2']['tok_s']:.1f} | "
            f"{r['ratio']:.2f}x | {decode} | {s1[0]['idle_share']:.0%} | "
            f"{s2[0]['idle_share']:.0%} ({s2[0]['send_share']:.0%}) | {last['idle_share']:.0%} "
            f"({last['input_wait_share']:.0%}) | {'yes' if r['same_tokens'] else 'no'} |"
        )
    print(
        "\n(idle: the share of the wall time a stage was not computing: waiting for its "
        "input, blocked sending its output, or outside a step; PP=1 runs the CPU decode plan, every PP step is eager.)"
    )


if __name__ == "__main__":
    main()
