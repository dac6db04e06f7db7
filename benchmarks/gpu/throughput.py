"""§5 offline throughput like `tessera bench throughput`: ShareGPT-like lengths (lognormal,
fixed seed), output tok/s through the engine's own loop, with a deadline."""

from __future__ import annotations

import math
import time

import numpy as np

from benchmarks.gpu.check import Check
from benchmarks.gpu.end_to_end import engine_facts, start_llm
from benchmarks.gpu.measure import free_memory
from benchmarks.gpu.models import token_prompts
from benchmarks.gpu.plan import FULL, OFFLINE_GOAL_TOK_S
from benchmarks.gpu.report import Budget, Report, goal_mark


def sharegpt_like_workload(
    num: int, input_mean: int, output_mean: int, max_len: int, vocab_size: int, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """Prompts (token ids) and output lengths with ShareGPT's long-tailed shape: lognormal
    lengths (sigma 0.9) around the given means, at least 4 tokens, prompt + output within
    max_len. Fixed by the seed."""
    rng = np.random.default_rng(seed)
    sigma = 0.9

    def lengths(mean: int) -> np.ndarray:
        raw = rng.lognormal(math.log(mean) - sigma**2 / 2, sigma, size=num)
        return np.clip(np.rint(raw), 4, max_len // 2).astype(int)

    ins, outs = lengths(input_mean), lengths(output_mean)
    prompts = token_prompts(rng, ins, vocab_size)
    return prompts, [int(o) for o in outs]


def section_throughput(chk: Check, out: Report, budget: Budget) -> None:
    from engine.sampling_params import SamplingParams

    p = chk.plan
    llm, chk.shared_llm = chk.shared_llm, None
    fresh = llm is None
    try:
        if fresh:
            llm, start_s = start_llm(chk, None)
            out.row(5, "engine start (default)", f"{start_s:.1f} s", note=engine_facts(llm))
        engine = llm.engine
        prompts, outs = sharegpt_like_workload(
            p.requests, p.input_mean, p.output_mean, engine.max_model_len, engine.vocab_size, seed=0
        )
        if fresh:  # warm-up: JIT, autotuning, the allocator (section 4 did it otherwise)
            warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            llm.generate(prompts[:4], warm, use_tqdm=False)
        params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outs]
        ids = [f"offline-{i}" for i in range(len(prompts))]
        finished, complete = 0, True
        g0 = engine.generation_tokens_total
        t0 = time.perf_counter()
        try:
            for rid, prompt, sp in zip(ids, prompts, params, strict=True):
                engine.add_request(rid, prompt, sp)
            while engine.has_unfinished_requests():
                if budget.spent:
                    complete = False
                    break
                finished += sum(o.finished for o in engine.step())
        finally:
            elapsed = time.perf_counter() - t0
            produced = engine.generation_tokens_total - g0
            if not complete:
                for rid in ids:
                    engine.abort_request(rid)
        if complete and produced != sum(outs):
            raise RuntimeError(f"{produced} output tokens, expected {sum(outs)}")
        tok_s = produced / elapsed
        total_s = (produced + sum(map(len, prompts))) / elapsed
        if p is FULL:
            versus = f"goal {OFFLINE_GOAL_TOK_S:,}: {goal_mark(tok_s >= OFFLINE_GOAL_TOK_S)}"
        else:
            versus = f"(goal {OFFLINE_GOAL_TOK_S:,} is for the full run)"
        note = (
            f"input {np.mean([len(x) for x in prompts]):.0f} / output {np.mean(outs):.0f} "
            f"tokens on average; {total_s:,.0f} tok/s in + out; {elapsed:.1f} s; "
            f"{finished}/{len(prompts)} requests"
        )
        if not complete:
            note += "; stopped at the section budget (partial)"
        out.row(
            5, f"offline output, {len(prompts):,} requests", f"{tok_s:,.0f} tok/s", versus, note
        )
        out.summary(
            5,
            f"{tok_s:,.0f} output tok/s, {finished}/{len(prompts)} requests"
            + ("" if complete else " (partial)"),
            versus,
        )
        out.result(
            5,
            requests=len(prompts),
            finished=finished,
            complete=complete,
            output_tokens=produced,
            seconds=elapsed,
            output_tok_s=tok_s,
            total_tok_s=total_s,
        )
    finally:
        if llm is not None:
            llm.shutdown()
        llm = None
        free_memory()
