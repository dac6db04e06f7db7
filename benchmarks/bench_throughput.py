"""Offline throughput: Tessera's LLM.generate vs HF transformers' static batching.

    tessera bench throughput [--model M] [--num-prompts 128] [--dtype bfloat16 float32]

The workload: N requests with distinct prompts and output lengths drawn uniformly from
[min_output, max_output] (fixed seed, ignore_eos so every request runs to its length).
The baseline, measured in the same run on the same weights and dtype: HF transformers
`model.generate` in static batches (left padding); a batch runs until its longest request,
and only the tokens each request asked for are counted. Reports output tokens/s of both,
the ratio, and peak RSS.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import resource
import time

import torch

from engine import LLM, SamplingParams


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_workload(
    vocab_size: int, num_prompts: int, input_len: int, min_out: int, max_out: int, seed: int
):
    rng = random.Random(seed)
    # Token ids from the middle of the vocabulary: ordinary tokens, no special ones.
    lo, hi = 1000, min(vocab_size, 30000) - 1
    prompts = [[rng.randint(lo, hi) for _ in range(input_len)] for _ in range(num_prompts)]
    out_lens = [rng.randint(min_out, max_out) for _ in range(num_prompts)]
    return prompts, out_lens


def run_tessera(llm: LLM, prompts, out_lens) -> float:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in out_lens]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(out_lens), (produced, sum(out_lens))
    return elapsed


def run_hf(
    model_dir: str, dtype: torch.dtype, prompts, out_lens, batch_size: int, pad_id: int
) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    order = list(range(len(prompts)))
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(order), batch_size):
            batch = [prompts[j] for j in order[i : i + batch_size]]
            width = max(map(len, batch))
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            new = max(out_lens[j] for j in order[i : i + batch_size])
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad_id,
            )
    elapsed = time.perf_counter() - start
    del model
    gc.collect()
    return elapsed


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="tessera bench throughput", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--model", default=None, help="model name or HF folder (default: the bundled SmolLM2)"
    )
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--min-output-len", type=int, default=16)
    parser.add_argument("--max-output-len", type=int, default=256)
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--no-hf", action="store_true", help="skip the HF baseline")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)

    results = {
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, {platform.python_version()}",
        "runs": [],
    }
    for dtype_name in args.dtype:
        llm = LLM(args.model, dtype=dtype_name, max_num_seqs=args.max_num_seqs, seed=args.seed)
        prompts, out_lens = make_workload(
            llm.engine.vocab_size,
            args.num_prompts,
            args.input_len,
            args.min_output_len,
            args.max_output_len,
            args.seed,
        )
        total_out = sum(out_lens)
        t_tessera = run_tessera(llm, prompts, out_lens)
        tessera_rss = peak_rss_mib()  # before HF loads anything: Tessera's own peak
        model_dir = str(llm.engine.model_dir)
        pad_id = llm.tokenizer.eos_token_id or 0
        llm.shutdown()
        del llm
        gc.collect()
        row = {
            "dtype": dtype_name,
            "requests": args.num_prompts,
            "output_tokens": total_out,
            "tessera_tok_s": round(total_out / t_tessera, 1),
            "tessera_peak_rss_mib": round(tessera_rss),
        }
        if not args.no_hf:
            t_hf = run_hf(
                model_dir, getattr(torch, dtype_name), prompts, out_lens, args.hf_batch_size, pad_id
            )
            row["hf_tok_s"] = round(total_out / t_hf, 1)
            row["ratio"] = round(t_hf / t_tessera, 2)
        results["runs"].append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
