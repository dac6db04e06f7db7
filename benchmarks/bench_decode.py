"""The cost of one decode step: Tessera's ModelRunner (compiled CPU kernel, torch attention)
against HF transformers' decode step, at the same batch sizes and contexts, in one run.

    tessera bench decode [--model M] [--dtype bfloat16] [--batch-sizes 1 32 256] \\
        [--context 64 320] [--steps 20]

The workload (fixed seed): B sequences whose context lengths are drawn uniformly from
[LO, HI], random ordinary token ids. Tessera: a real ModelRunner fills its paged KV cache by
running the prompts as prefill chunks through execute_model (blocks shuffled, as in a server
that has run a while), then times decode steps of one token per sequence (greedy sampling
included). HF: AutoModelForCausalLM from the same folder, a left-padded prefill builds its
dense DynamicCache, then one forward of one token per sequence plus the argmax is timed (the
cache is cropped back after each step, so every timed step does the same work). Each timed
step repeats the same step: best and median of --steps, ms/step and tokens/s.

Each path runs in its own process (the kernel choice is made once per process; HF's memory
and threads stay out of the engine's): `kernel` (the default, compiled CPU kernel), `torch`
(TESSERA_CPU_KERNELS=0) and `hf`. The first timed step's tokens are checked against HF's.
Run it on a quiet machine: other load shows up in every number.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

PATHS = ("kernel", "torch", "hf")
_PATH_TITLES = {
    "kernel": "Tessera, compiled CPU kernels",
    "torch": "Tessera, torch only (TESSERA_CPU_KERNELS=0)",
    "hf": "HF transformers",
}
_RESULT_MARK = "@@bench_decode_result "
_FILL_TOKENS = 2048  # prompt tokens per prefill step while filling the cache


# -- the workload -----------------------------------------------------------------------------


def make_workload(
    num_seqs: int, ctx_lo: int, ctx_hi: int, vocab_size: int, seed: int
) -> list[tuple[list[int], int]]:
    """(prompt token ids of the context length, the token the decode step feeds) per sequence.

    Batch size B uses the first B sequences, so every path and size sees the same data.
    """
    rng = random.Random(seed)
    # Token ids from the middle of the vocabulary: ordinary tokens, no special ones.
    lo, hi = min(1000, vocab_size // 4), max(min(vocab_size, 30000) - 1, 1)
    seqs = []
    for _ in range(num_seqs):
        ctx = rng.randint(ctx_lo, ctx_hi)
        seqs.append(([rng.randint(lo, hi) for _ in range(ctx)], rng.randint(lo, hi)))
    return seqs


def time_steps(
    step: Callable[[], object],
    warmup: int,
    steps: int,
    after: Callable[[], object] | None = None,
) -> list[float]:
    """Seconds per call of step; `after` (untimed) runs after each call."""
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        step()
        if i >= warmup:
            times.append(time.perf_counter() - t)
        if after is not None:
            after()
    return times


def _stats(batch_size: int, times: list[float]) -> dict:
    best, median = min(times), statistics.median(times)
    return {
        "batch_size": batch_size,
        "best_ms": round(best * 1e3, 3),
        "median_ms": round(median * 1e3, 3),
        "best_tok_s": round(batch_size / best, 1),
        "median_tok_s": round(batch_size / median, 1),
    }


def resolve_model_dir(model: str, load_format: str) -> Path:
    from engine.models.loader import resolve_model

    path = Path(model).expanduser()
    # dummy weights need only config.json: resolve_model insists on safetensors.
    if load_format == "dummy" and path.is_dir() and (path / "config.json").is_file():
        return path
    return resolve_model(model)


# -- the workers (one process per path) ------------------------------------------------------


def run_tessera(args: argparse.Namespace, model_dir: Path) -> dict:
    from engine.attention.cpu_kernel import kernel_supports
    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine.outputs import NewRequestData, ScheduledRequest, SchedulerOutput
    from engine.sampling_params import SamplingParams
    from engine.worker.model_runner import ModelRunner

    lo, hi = args.context
    bs = args.block_size
    max_b = max(args.batch_sizes)
    max_model_len = hi + 1
    from engine.models.loader import load_hf_config

    seqs = make_workload(max_b, lo, hi, load_hf_config(model_dir).vocab_size, args.seed)
    tables_len = [-(-(len(p) + 1) // bs) for p, _ in seqs]  # blocks for context + the step
    num_blocks = 1 + max(sum(tables_len), -(-max_model_len // bs) + 1)  # block 0 is reserved
    config = EngineConfig(
        model=ModelConfig(
            # gguf (the default for a .gguf model) reads the blocks from the model's .gguf
            # source, named as the user gave it
            model=args.model if args.quantization in (None, "gguf") else str(model_dir),
            dtype=args.dtype,
            max_model_len=max_model_len,
            load_format=args.load_format,
            quantization=args.quantization,
            seed=args.seed,
            device="cpu",
        ),
        cache=CacheConfig(
            block_size=bs,
            num_blocks=num_blocks,
            enable_prefix_caching=False,
            kv_cache_dtype=args.kv_cache_dtype,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_b,
            max_model_len=max_model_len,
            max_num_batched_tokens=max(_FILL_TOKENS, bs),
            block_size=bs,
        ),
    )
    runner = ModelRunner(config, model_dir=model_dir, rank=0)
    runner.load_model()
    runner.init_kv_cache(num_blocks)
    cfg = runner.hf_config
    kernel = kernel_supports(runner.dtype, runner.device, runner.num_kv_heads, cfg.head_dim)

    # Scattered physical blocks, as in a server whose cache has churned.
    free = list(range(1, num_blocks))
    random.Random(args.seed + 1).shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in tables_len]
    greedy = SamplingParams(temperature=0.0, max_tokens=None)

    # Fill the cache: whole prompts as prefill chunks, about _FILL_TOKENS tokens a step. Each
    # request reaches the runner once, its "prompt" ending with the token the steps decode.
    t0 = time.perf_counter()
    chunk: list[ScheduledRequest] = []
    new: list[NewRequestData] = []
    n = 0
    for i, (prompt, token) in enumerate(seqs):
        new.append(NewRequestData(str(i), [*prompt, token], greedy))
        chunk.append(ScheduledRequest(str(i), 0, len(prompt), tables[i], False))
        n += len(prompt)
        if n >= _FILL_TOKENS or i == len(seqs) - 1:
            runner.execute_model(
                SchedulerOutput(scheduled=chunk, num_batched_tokens=n, new_requests=new)
            )
            chunk, new, n = [], [], 0
    fill_s = time.perf_counter() - t0

    rows = []
    for b in args.batch_sizes:
        # The same decode step each time: the token after each prompt, at the same position.
        step_reqs = [ScheduledRequest(str(i), len(seqs[i][0]), 1, [], True) for i in range(b)]
        so = SchedulerOutput(scheduled=step_reqs, num_batched_tokens=b)
        first = runner.execute_model(so).sampled_token_ids
        times = time_steps(lambda so=so: runner.execute_model(so), args.warmup, args.steps)
        row = _stats(b, times)
        row["tokens"] = [first[str(i)][0] for i in range(b)]
        rows.append(row)
        _progress(args, f"B={b}: median {row['median_ms']:.2f} ms/step")
    return {
        "attention": "compiled CPU kernel" if kernel else "torch",
        "dtype": str(runner.dtype).removeprefix("torch."),
        "quantization": runner.quantization,  # what an unset --quantization resolved to
        "fill_s": round(fill_s, 2),
        "rows": rows,
    }


def run_hf(args: argparse.Namespace, model_dir: Path) -> dict:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.models.loader import load_hf_config, resolve_dtype

    dtype = resolve_dtype(args.dtype, load_hf_config(model_dir), "cpu")
    if args.load_format == "dummy":
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.eval()
    # transformers 5.x renamed past_key_values to cache (the old name warns, then goes).
    cache_kw = (
        "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    )
    lo, hi = args.context
    seqs = make_workload(
        max(args.batch_sizes), lo, hi, model.config.vocab_size, args.seed
    )  # the same data as the engine's
    rows = []
    fill_s = 0.0
    with torch.inference_mode():
        for b in args.batch_sizes:
            batch = seqs[:b]
            width = max(len(p) for p, _ in batch)
            pad = [width - len(p) for p, _ in batch]
            ids = torch.tensor([[0] * n + p for n, (p, _) in zip(pad, batch, strict=True)])
            mask = torch.tensor(
                [[0] * n + [1] * len(p) for n, (p, _) in zip(pad, batch, strict=True)]
            )
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            t0 = time.perf_counter()
            # The base model: a prefill needs no logits (B x L x vocab would be huge).
            out = model.model(
                input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True
            )
            cache = out["cache"] if cache_kw == "cache" else out["past_key_values"]
            fill_s += time.perf_counter() - t0
            step_ids = torch.tensor([[t] for _, t in batch])
            step_mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype)], dim=1)
            step_pos = torch.tensor([[len(p)] for p, _ in batch])

            def step(cache=cache, step_ids=step_ids, step_mask=step_mask, step_pos=step_pos):
                out = model(
                    input_ids=step_ids,
                    attention_mask=step_mask,
                    position_ids=step_pos,
                    use_cache=True,
                    **{cache_kw: cache},
                )
                return out.logits[:, -1].argmax(-1)

            first = step().tolist()
            cache.crop(-1)  # drop the step's token: the next step does the same work
            times = time_steps(step, args.warmup, args.steps, after=lambda c=cache: c.crop(-1))
            row = _stats(b, times)
            row["tokens"] = first
            row["padded_context"] = width
            rows.append(row)
            _progress(args, f"B={b}: median {row['median_ms']:.2f} ms/step")
            del cache
    return {
        "attention": f"{model.config._attn_implementation}, dense DynamicCache",
        "dtype": str(dtype).removeprefix("torch."),
        "fill_s": round(fill_s, 2),
        "transformers": transformers.__version__,
        "rows": rows,
    }


def _progress(args: argparse.Namespace, text: str) -> None:
    print(f"[bench decode {args.worker}] {text}", file=sys.stderr, flush=True)


def worker_main(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model, args.load_format)
    if args.worker == "hf":
        result = run_hf(args, model_dir)
    else:
        result = run_tessera(args, model_dir)
    result["torch_threads"] = torch.get_num_threads()
    print(_RESULT_MARK + json.dumps(result), flush=True)


# -- the driver ------------------------------------------------------------------------------


def machine_info() -> dict:
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": affinity,
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def run_path(path: str, argv: list[str], timeout: float) -> dict:
    """Run one path in a child process; its progress goes to stderr, its result to stdout."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if path == "torch":
        env["TESSERA_CPU_KERNELS"] = "0"
    cmd = [sys.executable, "-m", "benchmarks.bench_decode", *argv, "--worker", path]
    proc = subprocess.run(
        cmd, env=env, cwd=root, stdout=subprocess.PIPE, text=True, timeout=timeout
    )
    for line in proc.stdout.splitlines():
        if line.startswith(_RESULT_MARK):
            return json.loads(line[len(_RESULT_MARK) :])
    raise RuntimeError(f"bench decode: the {path} run exited with {proc.returncode}, no result")


def add_agreement(paths: dict[str, dict]) -> None:
    """same_tokens_as_hf: how many sequences' greedy decode token equals HF's, per row."""
    ref = {r["batch_size"]: r["tokens"] for r in paths.get("hf", {}).get("rows", [])}
    for name, res in paths.items():
        for r in res.get("rows", []):
            if name != "hf" and r["batch_size"] in ref:
                pairs = zip(r["tokens"], ref[r["batch_size"]], strict=True)
                r["same_tokens_as_hf"] = sum(a == b for a, b in pairs)
    for res in paths.values():  # the tokens themselves would only bloat the JSON
        for r in res.get("rows", []):
            r.pop("tokens", None)


def print_table(result: dict) -> None:
    m = result["machine"]
    print(
        f"\n## decode step: {result['model']} ({result['dtype']}"
        f"{', Tessera ' + result['quantization'] if result.get('quantization') else ''}"
        f"{', int8 KV cache' if result.get('kv_cache_dtype') == 'int8' else ''}), context "
        f"{result['context'][0]}-{result['context'][1]}, {m['date']}"
    )
    print(
        f"{m['platform']}, {m['usable_cpus']}/{m['cpu_count']} CPUs, load {m['load_avg_1m']}, "
        f"torch {m['torch']}; steps {result['steps']} (best / median)\n"
    )
    header = (
        "| path | batch | ms/step best | ms/step median | tok/s (median) | vs HF | tokens = HF |"
    )
    print(header)
    print("|---|---:|---:|---:|---:|---:|---:|")
    hf = {r["batch_size"]: r for r in result["paths"].get("hf", {}).get("rows", [])}
    for b in result["batch_sizes"]:
        for path, res in result["paths"].items():
            row = next((r for r in res.get("rows", []) if r["batch_size"] == b), None)
            if row is None:
                continue
            title = _PATH_TITLES[path]
            if path == "kernel" and res.get("attention") != "compiled CPU kernel":
                title += " (kernel unavailable: torch path ran)"
            ratio = ""
            if path != "hf" and b in hf:
                ratio = f"{hf[b]['median_ms'] / row['median_ms']:.2f}x"
            print(
                f"| {title} | {b} | {row['best_ms']:.2f} | {row['median_ms']:.2f} | "
                f"{row['median_tok_s']:.0f} | {ratio} | {_agree(row)} |"
            )
    print(
        "\n(vs HF: HF's median ms/step over this path's; >1 means Tessera is faster. "
        "Run on a quiet machine.)"
    )


def _agree(row: dict) -> str:
    same = row.get("same_tokens_as_hf")
    return "" if same is None else f"{same}/{row['batch_size']}"


def build_parser() -> argparse.ArgumentParser:
    from engine.config import DEFAULT_MODEL
    from engine.layers.quantization import QUANTIZATION_CHOICES

    p = argparse.ArgumentParser(prog="tessera bench decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="model folder, .gguf or the default")
    p.add_argument("--load-format", choices=("auto", "safetensors", "dummy"), default="auto")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    p.add_argument(
        "--quantization",
        choices=QUANTIZATION_CHOICES,
        default=None,
        help="Tessera's weights (not HF's; default: gguf for a .gguf model, else none)",
    )
    p.add_argument(
        "--kv-cache-dtype", choices=("auto", "int8"), default="auto", help="Tessera's KV cache"
    )
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument(
        "--context", type=int, nargs=2, default=[64, 320], metavar=("LO", "HI"),
        help="context lengths drawn uniformly from [LO, HI]",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per path at most")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--worker", choices=PATHS, default=None, help=argparse.SUPPRESS)
    return p


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    lo, hi = args.context
    if lo < 1 or hi < lo:
        p.error(f"--context LO HI needs 1 <= LO <= HI, got {lo} {hi}")
    if any(b < 1 for b in args.batch_sizes):
        p.error("--batch-sizes must all be at least 1")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    _validate(parser, args)
    if args.worker:
        worker_main(args)
        return {}
    result: dict = {
        "benchmark": "decode",
        "model": args.model,
        "load_format": args.load_format,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "batch_sizes": args.batch_sizes,
        "context": args.context,
        "steps": args.steps,
        "warmup": args.warmup,
        "machine": machine_info(),
        "paths": {},
    }
    if args.threads:
        result["machine"]["torch_threads"] = args.threads
    print("bench decode: run it on a quiet machine; other load shows up in every number.")
    for path in args.paths:
        print(f"bench decode: {_PATH_TITLES[path]} ...", flush=True)
        try:
            result["paths"][path] = run_path(path, argv, args.timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            result["paths"][path] = {"error": str(e), "rows": []}
            print(f"bench decode: {e}", file=sys.stderr)
    add_agreement(result["paths"])
    if result["quantization"] is None:  # unset: what the Tessera path resolved it to
        result["quantization"] = result["paths"].get("kernel", {}).get("quantization")
    print_table(result)
    print(json.dumps(result, default=str))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return result


if __name__ == "__main__":
    main()
