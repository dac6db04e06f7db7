"""Latency of one batch, end to end (vLLM's `benchmark_latency`): Tessera's LLM.generate
against HF transformers' `generate` on the same batch, weights and dtype, in one run.

    tessera bench latency [--model M] [--batch-size 8] [--input-len 32] [--output-len 128]
                          [--num-iters-warmup 3] [--num-iters 10] [--json PATH]

Each iteration sends batch-size prompts of input-len random ordinary tokens and waits for
all of their output-len tokens (greedy, ignore_eos: every request runs to its length). The
warm-up iterations are not timed. Reports each side's mean and percentiles of the
iteration's seconds, and the ratio of the medians (HF / Tessera: above 1, Tessera is faster).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import time

import torch

from engine import LLM, SamplingParams

PERCENTILES = (10, 25, 50, 75, 90, 99)


def make_batch(vocab_size: int, batch_size: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Token ids away from both ends of the vocabulary: ordinary tokens, no special ones.
    lo, hi = min(1000, vocab_size // 4), max(min(vocab_size, 30000) - 1, vocab_size // 2)
    return [[rng.randint(lo, hi) for _ in range(input_len)] for _ in range(batch_size)]


def summary(seconds: list[float]) -> dict:
    ordered = sorted(seconds)

    def pct(p: float) -> float:
        k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
        return ordered[k]

    return {
        "mean_s": round(statistics.fmean(seconds), 4),
        **{f"p{p}_s": round(pct(p), 4) for p in PERCENTILES},
    }


def time_iterations(run, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        run()
    seconds = []
    for _ in range(iters):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return seconds


def tessera_run(llm: LLM, prompts: list[list[int]], output_len: int):
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)

    def run() -> None:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == output_len for o in outs)

    return run


def hf_run(model, prompts: list[list[int]], output_len: int, pad_id: int):
    ids = torch.tensor(prompts)  # one length: no padding needed
    mask = torch.ones_like(ids)

    def run() -> None:
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=pad_id,
            )
        assert out.shape[1] == ids.shape[1] + output_len

    return run


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="tessera bench latency", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default=None, help="model folder or .gguf (default: bundled)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters-warmup", type=int, default=3)
    parser.add_argument("--num-iters", type=int, default=10)
    parser.add_argument("--no-hf", action="store_true", help="skip the HF baseline")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    for name in ("batch_size", "input_len", "output_len", "num_iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(args.batch_size, 1), seed=args.seed)
    prompts = make_batch(llm.engine.vocab_size, args.batch_size, args.input_len, args.seed)
    print(f"tessera: {args.num_iters_warmup} warm-up + {args.num_iters} timed batches", flush=True)
    tessera = time_iterations(
        tessera_run(llm, prompts, args.output_len), args.num_iters_warmup, args.num_iters
    )
    model_dir, pad_id = str(llm.engine.model_dir), llm.tokenizer.eos_token_id or 0
    llm.shutdown()
    del llm
    gc.collect()
    result = {
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
        "model": args.model or "default",
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "tessera": summary(tessera),
    }
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        print("hf transformers: the same batches", flush=True)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
        hf = time_iterations(
            hf_run(model.eval(), prompts, args.output_len, pad_id),
            args.num_iters_warmup,
            args.num_iters,
        )
        result["hf"] = summary(hf)
        result["ratio_p50"] = round(statistics.median(hf) / statistics.median(tessera), 2)
    print(json.dumps(result, indent=2), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
