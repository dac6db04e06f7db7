"""A sliding-window model's KV memory and TPOT at long context against full attention, on the
CPU (issue 41).

    tessera bench window [--context 8192] [--window 1024] [--output-len 64] [--rounds 2]
        [--layers 30] [--hidden 576] [--heads 9] [--kv-heads 3] [--dtype bfloat16]
        [--json PATH]

Two random-weight models (load_format dummy: config.json only, written to a temporary
folder) of one shape, by default the bundled SmolLM2-135M's (30 layers, hidden 576, 9 heads /
3 KV heads of 64, vocabulary 49152): a MistralForCausalLM with `sliding_window` = --window on
every layer, and the same config with `sliding_window` null (full attention). Both engines
are loaded at once, with the same KV pool (room for the whole context), and their runs
alternate (--rounds, the order swapped each round). A run is one request: a prompt of
--context random token ids (a new one each round, the same for both models, so no prefix-cache
hit), chunked prefill, then --output-len greedy tokens with ignore_eos. Reported per model:
TTFT (the prefill's steps), TPOT (the median decode step), the KV blocks the request holds
after its last decode step while it still runs (KVCacheManager.num_held_blocks; the block
pool's used blocks beside it, equal with one request) and their bytes, the most it held
while decoding, and the ratios window / full. Under a window on every layer the manager frees
the blocks behind it, so the windowed model holds at most ceil(window / block_size) + 1
blocks while decoding, the full one every block of its context. Full attention's decode steps
may run on the CPU's one-call decode plan, which declines a windowed model (its steps run the
modules): `step_graph` in the JSON says which path each took. Other load on the machine shows
up in every number; the ratios are measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

MODELS = ("window", "full")


def model_configs(args: argparse.Namespace) -> dict[str, dict]:
    """config.json of the windowed model and of its full-attention twin."""
    full = {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "hidden_act": "silu",
        "max_position_embeddings": args.context + args.output_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "vocab_size": args.vocab,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
        "sliding_window": None,
    }
    return {"window": {**full, "sliding_window": args.window}, "full": full}


def kv_block_bytes(engine, cfg: dict, args: argparse.Namespace) -> int:
    """Bytes one block takes across all layers: the runner's own figure where it lives in
    this process, else the arithmetic of the config (K and V in the model's dtype)."""
    runner = getattr(engine.executor, "runner", None)
    if runner is not None:
        return runner.kv_block_bytes()
    itemsize = 2 if args.dtype == "bfloat16" else 4
    per_token = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * itemsize
    return cfg["num_hidden_layers"] * args.block_size * per_token


def run_once(llm, prompt: list[int], output_len: int, tag: str) -> dict:
    """One request through the engine's step loop: step times, blocks held."""
    from engine import SamplingParams

    engine = llm.engine
    scheduler = engine.scheduler
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    rid = f"{tag}-{time.perf_counter_ns()}"
    start = time.perf_counter()
    engine.add_request(rid, prompt, params)
    ttft = None
    decode_steps: list[float] = []
    held = used = computed = peak_decode = 0
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        t1 = time.perf_counter()
        finished, n = False, 0
        for out in outs:
            if out.request_id != rid:
                continue
            n = len(out.outputs[0].token_ids)
            if n and ttft is None:
                ttft = t1 - start
            elif n > 1:
                decode_steps.append(t1 - t0)
            finished = out.finished
            if finished:
                tokens = list(out.outputs[0].token_ids)
        req = scheduler.get_request(rid)
        if not finished and req is not None and n > 1:  # after a decode step
            held = manager.num_held_blocks(rid)
            used = (pool.num_blocks - 1) - pool.num_free_blocks
            computed = req.num_computed_tokens
            peak_decode = max(peak_decode, held)
    return {
        "ttft_s": ttft,
        "decode_steps_s": decode_steps,
        "held_blocks": held,
        "pool_used_blocks": used,
        "computed_tokens": computed,
        "peak_decode_blocks": peak_decode,
        "tokens": tokens,
    }


def print_table(result: dict) -> None:
    m = result["machine"]
    cfg = result["configs"]["full"]
    print(
        f"\n## Sliding window ({result['window']}) vs full attention, context "
        f"{result['context']} + {result['output_len']} output tokens ({result['dtype']})"
    )
    print(
        f"{m['platform']}, {m['cpus']} CPUs, torch {m['torch']} ({m['torch_threads']} threads); "
        f"MistralForCausalLM, {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
        f"{cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} KV heads, block "
        f"size {result['block_size']}; best of {result['rounds']} rounds\n"
    )
    print("| model | TTFT s | TPOT ms | KV blocks held | KV MiB held | most held decoding |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in MODELS:
        r = result["models"][name]
        print(
            f"| {name} | {r['ttft_s']:.3f} | {r['tpot_ms']:.2f} | {r['kv_blocks_held']} | "
            f"{r['kv_bytes_held'] / 2**20:.1f} | {r['peak_decode_blocks']} |"
        )
    ratio = result["ratio_window_over_full"]
    print(
        f"| window / full | {ratio['ttft']:.2f}x | {ratio['tpot']:.2f}x | "
        f"{ratio['kv_blocks']:.3f}x | {ratio['kv_bytes']:.3f}x | |"
    )
    print(
        f"\n(bound under the window: ceil({result['window']} / {result['block_size']}) + 1 = "
        f"{result['window_block_bound']} blocks while decoding; full attention holds every "
        "block of its context. Step paths: "
        + ", ".join(
            f"{n} {'decode plan' if result['models'][n]['step_graph'] else 'modules'}"
            for n in MODELS
        )  # fmt: skip
        + ")"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tessera bench window", description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=8192, help="prompt tokens")
    p.add_argument("--window", type=int, default=1024, help="the windowed model's window")
    p.add_argument("--output-len", type=int, default=64, help="greedy tokens decoded")
    p.add_argument("--rounds", type=int, default=2, help="alternating runs of each model")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="prefill chunk (default: the engine's)")  # fmt: skip
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.context < 1 or args.window < 1:
        parser.error("--context and --window must be at least 1")
    if args.output_len < 3:
        parser.error("--output-len must be at least 3 (TPOT needs decode steps)")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.block_size < 1:
        parser.error("--block-size must be at least 1")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error("--hidden must divide by --heads, and --heads by --kv-heads")

    import torch

    from engine import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    configs = model_configs(args)
    max_len = args.context + args.output_len
    # The same pool for both: the whole context of one request, and a block to spare.
    num_blocks = math.ceil(max_len / args.block_size) + 2
    options = dict(
        load_format="dummy",
        dtype=args.dtype,
        max_model_len=max_len,
        max_num_seqs=1,
        block_size=args.block_size,
        num_kv_blocks=num_blocks,
        seed=args.seed,
    )
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    print("bench window: run it on a quiet machine; other load shows up in every number.")
    runs: dict[str, list[dict]] = {name: [] for name in MODELS}
    engines: dict = {}
    with tempfile.TemporaryDirectory(prefix="tessera-bench-window-") as tmp:
        for name, cfg in configs.items():
            folder = Path(tmp) / name
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(cfg, indent=2))
            print(f"bench window: loading {name} ...", flush=True)
            engines[name] = LLM(str(folder), **options)
        rng = random.Random(args.seed)
        for llm in engines.values():  # warm-up: first-step costs out of the timings
            run_once(llm, [rng.randrange(3, args.vocab) for _ in range(8)], 3, "warm")
        for r in range(args.rounds):
            prompt = [rng.randrange(3, args.vocab) for _ in range(args.context)]
            for name in MODELS if r % 2 == 0 else MODELS[::-1]:
                run = run_once(engines[name], prompt, args.output_len, f"{name}{r}")
                runs[name].append(run)
                tpot = statistics.median(run["decode_steps_s"]) * 1e3
                print(
                    f"bench window: round {r} {name}: TTFT {run['ttft_s']:.3f} s, TPOT "
                    f"{tpot:.2f} ms, {run['held_blocks']} blocks held",
                    flush=True,
                )
        models: dict = {}
        for name, llm in engines.items():
            best = min(runs[name], key=lambda x: statistics.median(x["decode_steps_s"]))
            block_bytes = kv_block_bytes(llm.engine, configs[name], args)
            runner = getattr(llm.engine.executor, "runner", None)
            models[name] = {
                "ttft_s": round(min(x["ttft_s"] for x in runs[name]), 4),
                "tpot_ms": round(statistics.median(best["decode_steps_s"]) * 1e3, 3),
                "tpot_ms_rounds": [
                    round(statistics.median(x["decode_steps_s"]) * 1e3, 3) for x in runs[name]
                ],
                "decode_steps": len(best["decode_steps_s"]),
                "output_tokens": len(best["tokens"]),
                "kv_blocks_held": best["held_blocks"],
                "pool_used_blocks": best["pool_used_blocks"],
                "computed_tokens": best["computed_tokens"],
                "peak_decode_blocks": max(x["peak_decode_blocks"] for x in runs[name]),
                "kv_block_bytes": block_bytes,
                "kv_bytes_held": best["held_blocks"] * block_bytes,
                "kv_sliding_window": llm.engine.scheduler.kv_cache_manager.sliding_window,
                "step_graph": getattr(runner, "_step_graph", None) is not None,
                "num_kv_blocks": llm.engine.num_blocks,
            }
        for llm in engines.values():
            llm.shutdown()
    engines.clear()
    gc.collect()
    w, f = models["window"], models["full"]
    result = {
        "benchmark": "window",
        "dtype": args.dtype,
        "context": args.context,
        "window": args.window,
        "output_len": args.output_len,
        "rounds": args.rounds,
        "block_size": args.block_size,
        "window_block_bound": math.ceil(args.window / args.block_size) + 1,
        "configs": configs,
        "machine": {
            "platform": f"{platform.system()} {platform.machine()}",
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d"),
        },
        "models": models,
        "ratio_window_over_full": {
            "ttft": round(w["ttft_s"] / f["ttft_s"], 4),
            "tpot": round(w["tpot_ms"] / f["tpot_ms"], 4),
            "kv_blocks": round(w["kv_blocks_held"] / f["kv_blocks_held"], 4),
            "kv_bytes": round(w["kv_bytes_held"] / f["kv_bytes_held"], 4),
        },
    }
    print_table(result)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return result


if __name__ == "__main__":
    main()
