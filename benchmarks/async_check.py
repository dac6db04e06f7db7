"""Async scheduling on a device: the same tokens with and without it, and what it gains.

    PYTHONPATH=. python3 benchmarks/async_check.py [--device cuda|cpu] [--quick]

1. exactness: a mixed batch (greedy, seeded sampling, stop token ids, n=2, penalties,
   logprobs, different lengths) on a small fp32 Llama of dummy weights, async scheduling on
   and off: tokens and finish reasons compared request by request (reported, not asserted:
   a batch that differs between the two loops may flip a near-tie on a GPU).
2. decode: the Llama-3-8B shape (--quick: the small one) with dummy bf16 weights, the engine's
   defaults (CUDA graphs), B requests of a 128-token prompt decoding --tokens tokens, off then
   on (one engine at a time: each takes the GPU's memory): TPOT (ms per decode step after the
   first token) and output tok/s, with the on/off ratios.

Every figure goes to stdout as one JSON line per row, and to $OUT/async_check.json when $OUT
is set. On the CPU (--device cpu --quick) it is a smoke run of the script itself.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.gpu.models import write_model_folder
from benchmarks.gpu.plan import LLAMA3_8B, TINY_LLAMA
from engine import LLM, SamplingParams


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def exactness(folder: Path, device: str) -> dict:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 1000, size=n).tolist() for n in (5, 17, 33, 64, 9, 26, 130)]
    params = [
        SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=32, temperature=0.0, stop_token_ids=[5, 6, 7]),
        SamplingParams(max_tokens=16, temperature=1.0, seed=3, n=2, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.7, seed=5, min_tokens=4, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
    ]
    got = {}
    for mode in (False, True):
        llm = LLM(str(folder), load_format="dummy", dtype="float32", device=device,
                  async_scheduling=mode, seed=0, max_model_len=512)  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
        got[mode] = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]
        leaked = llm.engine.scheduler.stats().kv_usage
        llm.shutdown()
        del llm
        _free(device)
    same = sum(a == b for a, b in zip(got[False], got[True], strict=True))
    return {"check": "exactness", "requests": len(prompts), "identical": same, "kv_left": leaked}


def decode(folder: Path, device: str, batches: list[int], tokens: int, repeats: int) -> list[dict]:
    rows = []
    results: dict[tuple[bool, int], tuple[float, float]] = {}
    for mode in (False, True):
        llm = LLM(str(folder), load_format="dummy", dtype="bfloat16", device=device,
                  async_scheduling=mode, seed=0, max_num_seqs=max(batches))  # fmt: skip
        engine = llm.engine
        rng = np.random.default_rng(1)
        for b in batches:
            tpots, tputs = [], []
            for r in range(repeats + 1):  # the first is a warm-up
                params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
                for i in range(b):
                    engine.add_request(f"{mode}-{b}-{r}-{i}", rng.integers(2, min(engine.vocab_size, 30000), 128).tolist(), params)  # fmt: skip
                t0, first = time.perf_counter(), None
                while engine.has_unfinished_requests():
                    outs = engine.step()
                    if first is None and any(o.outputs[0].token_ids for o in outs):
                        first = time.perf_counter()
                t1 = time.perf_counter()
                if r:
                    tpots.append((t1 - first) / (tokens - 1) * 1e3)
                    tputs.append(b * tokens / (t1 - t0))
            results[(mode, b)] = (float(np.median(tpots)), float(np.median(tputs)))
        llm.shutdown()
        del llm, engine
        _free(device)
    for b in batches:
        (off_tpot, off_tput), (on_tpot, on_tput) = results[(False, b)], results[(True, b)]
        rows.append({
            "check": "decode", "batch": b, "tokens": tokens,
            "tpot_ms_off": round(off_tpot, 3), "tpot_ms_on": round(on_tpot, 3),
            "tok_s_off": round(off_tput, 1), "tok_s_on": round(on_tput, 1),
            "tpot_on_over_off": round(on_tpot / off_tpot, 3),
            "tok_s_on_over_off": round(on_tput / off_tput, 3),
        })  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="the small model, short runs")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    quick = args.quick or args.device == "cpu"
    batches = args.batch_sizes or ([1, 4] if quick else [1, 64, 256])
    tokens = args.tokens or (16 if quick else 128)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        small = write_model_folder(Path(tmp) / "small", TINY_LLAMA)
        rows.append(exactness(small, args.device))
        print(json.dumps(rows[-1]), flush=True)
        big = small if quick else write_model_folder(Path(tmp) / "big", LLAMA3_8B)
        for row in decode(big, args.device, batches, tokens, 1 if quick else args.repeats):
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, "async_check.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
