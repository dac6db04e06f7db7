"""Scheduler overhead: one schedule() + update_from_output() with N running decode requests.

    python -m benchmarks.bench_scheduler [--num-requests 256] [--steps 2000]

The workload: N requests of ~prompt-len tokens (the first shared-prefix-len tokens shared by
groups of requests, so the prefix cache has hits), prefix caching on, admitted and prefilled
first; then every step decodes one token for each of them (no request finishes during the
measurement). The model is replaced by a constant-time fake, built outside the timed region:
the figure is the scheduler's own cost per step, the time a GPU would wait for it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time

from engine.config import CacheConfig, SchedulerConfig
from engine.core.scheduler import Scheduler
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.request import Request
from engine.sampling_params import SamplingParams


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tessera bench scheduler", description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=200, help="mean prompt length (+-10%%)")
    p.add_argument("--shared-prefix-len", type=int, default=128)
    p.add_argument("--num-prefixes", type=int, default=8, help="groups sharing a prefix")
    p.add_argument("--steps", type=int, default=2000, help="measured decode steps")
    p.add_argument("--warmup", type=int, default=200, help="decode steps before measuring")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    return p.parse_args(argv)


def fake_model(out: SchedulerOutput) -> ModelRunnerOutput:
    """One token per request that samples: a cheap function of its position."""
    return ModelRunnerOutput(
        {s.request_id: [(s.start_pos * 7 + 11) % 30000] for s in out.scheduled if s.sample}
    )


def build(args: argparse.Namespace) -> Scheduler:
    rng = random.Random(args.seed)
    n, bs = args.num_requests, args.block_size
    max_prompt = int(args.prompt_len * 1.1) + 1
    max_model_len = max_prompt + args.warmup + args.steps + 16
    blocks_per_request = -(-max_model_len // bs)
    sched_cfg = SchedulerConfig(
        max_num_seqs=n,
        max_num_batched_tokens=8192,
        max_model_len=max_model_len,
        block_size=bs,
    )
    cache_cfg = CacheConfig(block_size=bs, enable_prefix_caching=not args.no_prefix_caching)
    scheduler = Scheduler(sched_cfg, cache_cfg, num_blocks=n * blocks_per_request + 1)
    prefixes = [
        [rng.randrange(1000, 30000) for _ in range(args.shared_prefix_len)]
        for _ in range(args.num_prefixes)
    ]
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    for i in range(n):
        length = rng.randint(int(args.prompt_len * 0.9), int(args.prompt_len * 1.1))
        prefix = prefixes[i % len(prefixes)][: min(length - 1, args.shared_prefix_len)]
        suffix = [rng.randrange(1000, 30000) for _ in range(length - len(prefix))]
        scheduler.add_request(Request(f"req-{i}", prefix + suffix, params, eos_token_id=2))
    return scheduler


def run(args: argparse.Namespace) -> dict:
    scheduler = build(args)
    # Admit and prefill everyone, then warm up.
    for _ in range(10_000):
        if scheduler.num_waiting == 0 and all(
            r.num_computed_tokens == r.num_tokens - 1 for r in scheduler.running
        ):
            break
        out = scheduler.schedule()
        scheduler.update_from_output(out, fake_model(out))
    assert scheduler.num_running == args.num_requests, "not all requests are running"
    for _ in range(args.warmup):
        out = scheduler.schedule()
        scheduler.update_from_output(out, fake_model(out))

    # Wall time is what a GPU would wait; thread CPU time leaves out the time this process
    # was descheduled, which on a shared machine is most of the noise.
    wall, cpu = time.perf_counter_ns, time.thread_time_ns
    samples_us, cpu_us = [], []
    for _ in range(args.steps):
        c0, t0 = cpu(), wall()
        out = scheduler.schedule()
        t1, c1 = wall(), cpu()
        runner_output = fake_model(out)  # the "GPU": not timed
        c2, t2 = cpu(), wall()
        scheduler.update_from_output(out, runner_output)
        t3, c3 = wall(), cpu()
        assert len(out.scheduled) == args.num_requests
        samples_us.append(((t1 - t0) + (t3 - t2)) / 1000)
        cpu_us.append(((c1 - c0) + (c3 - c2)) / 1000)
    samples_us.sort()
    cpu_us.sort()
    stats = scheduler.stats()
    return {
        "num_requests": args.num_requests,
        "steps": args.steps,
        "prefix_caching": not args.no_prefix_caching,
        "mean_us": statistics.fmean(samples_us),
        "p50_us": samples_us[len(samples_us) // 2],
        "p99_us": samples_us[min(len(samples_us) - 1, int(len(samples_us) * 0.99))],
        "cpu_mean_us": statistics.fmean(cpu_us),
        "cpu_p50_us": cpu_us[len(cpu_us) // 2],
        "prefix_hit_rate": stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1),
        "kv_usage": stats.kv_usage,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return 0
    cmd = "python -m benchmarks.bench_scheduler " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"command:  {cmd.strip()}")
    print(
        f"machine:  {result['platform']}, {result['cpu_count']} CPUs ({result['processor']}), "
        f"Python {result['python']}"
    )
    print(
        f"workload: {result['num_requests']} running decode requests, prefix caching "
        f"{'on' if result['prefix_caching'] else 'off'} "
        f"(prompt hit rate {result['prefix_hit_rate']:.0%}), {result['steps']} steps"
    )
    print(
        f"schedule()+update_from_output(): mean {result['mean_us']:.0f} us, "
        f"p50 {result['p50_us']:.0f} us, p99 {result['p99_us']:.0f} us per step (wall); "
        f"CPU time mean {result['cpu_mean_us']:.0f} us, p50 {result['cpu_p50_us']:.0f} us"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
