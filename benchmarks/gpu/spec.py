"""§9 speculative verification: what a verification step (every request with k drafts, so
B x (k + 1) query tokens) costs against a plain decode step (B tokens), on one engine of the
plan's model with n-gram speculation configured. The engine's proposer is swapped for one
that always drafts k tokens (its last token again: the step's cost does not depend on what
is accepted) or for none, alternating step by step once every prompt is in, so both kinds
of step share the engine, the contexts and the machine's noise. Speculation turns async
scheduling off, so a step's wall time is its work. On a GPU both kinds replay CUDA graphs, as
they do in service: the decode graphs and the verification graphs (every request padded to
k + 1 tokens, engine.worker.cuda_graph), captured up to the largest batch measured; the row
says how many verification steps a graph took. Break-even: a verification step must yield
more than its cost ratio in tokens a request (1 + accepted drafts) to pay."""

from __future__ import annotations

import time

import numpy as np

from benchmarks.gpu.check import Check
from benchmarks.gpu.end_to_end import engine_facts, start_llm
from benchmarks.gpu.measure import free_memory
from benchmarks.gpu.models import token_prompts
from benchmarks.gpu.report import SKIPPED, Budget, BudgetSpent, Report


class AlwaysDraft:
    """A proposer that drafts k tokens every time, fewer only where the scheduler's limit
    (what the step's budget and the request's max_tokens leave) is lower: its `propose`."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, token_ids, limit: int | None = None) -> list[int]:
        n = self.k if limit is None else min(self.k, limit)
        return [token_ids[-1]] * max(n, 0)


def measure_steps(llm, batch: int, context: int, k: int, steps: int, budget: Budget, seed: int):
    """{"verify": [s, ...], "plain": [s, ...]}: step seconds of each kind, alternating, over
    `batch` requests of a `context`-token prompt once every prefill is done (a warm-up step of
    each kind dropped)."""
    from engine.sampling_params import SamplingParams

    engine = llm.engine
    scheduler = engine.scheduler
    saved = scheduler.proposer
    rng = np.random.default_rng(seed)
    prompts = token_prompts(rng, [context] * batch, engine.vocab_size)
    max_tokens = 4 * (k + 1) * (steps + 2) + 16  # never the limit of the steps timed
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"spec-{seed}-{i}" for i in range(batch)]
    times: dict[str, list[float]] = {"verify": [], "plain": []}
    drafter = AlwaysDraft(k)
    try:
        scheduler.proposer = None  # the prompts go in plainly
        for rid, prompt in zip(ids, prompts, strict=True):
            engine.add_request(rid, prompt, params)
        all_in = False
        i = 0
        while engine.has_unfinished_requests() and min(map(len, times.values())) < steps + 1:
            if budget.spent:
                raise BudgetSpent(f"spec B={batch}")
            kind = "verify" if i % 2 == 0 else "plain"
            if all_in:
                scheduler.proposer = drafter if kind == "verify" else None
            p0, g0 = engine.prompt_tokens_total, engine.generation_tokens_total
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            pure = engine.prompt_tokens_total == p0 and engine.generation_tokens_total - g0 >= batch
            if pure and all_in:
                times[kind].append(dt)
                i += 1
            all_in = all_in or pure
    finally:
        scheduler.proposer = saved
        for rid in ids:
            engine.abort_request(rid)
    if min(map(len, times.values())) < 2:
        raise RuntimeError(f"spec B={batch}: too few steps of each kind ran")
    return {kind: ts[1:] for kind, ts in times.items()}


def section_spec(chk: Check, out: Report, budget: Budget) -> None:
    p = chk.plan
    k = p.spec_tokens
    config = {"method": "ngram", "num_speculative_tokens": k}
    # graphs captured up to the largest batch measured: the capture stays short
    llm, start_s = start_llm(chk, None, speculative_config=config, max_num_seqs=max(p.spec_batches))
    graphs = llm.engine.executor.runner._step_graph
    ratios = []
    try:
        out.row(9, "engine start (n-gram speculation)", f"{start_s:.1f} s", note=engine_facts(llm))
        for b in p.spec_batches:
            if budget.spent:
                out.row(9, f"verify vs decode, B={b}", SKIPPED)
                continue
            try:
                times = measure_steps(llm, b, p.spec_context, k, 6, budget, seed=9000 + b)
            except BudgetSpent:
                out.row(9, f"verify vs decode, B={b}", SKIPPED)
                continue
            verify, plain = float(np.median(times["verify"])), float(np.median(times["plain"]))
            ratios.append((b, verify / plain))
            replays = sum(getattr(graphs, "verify_runs", {}).values())
            out.row(
                9,
                f"verify step (k={k}) vs decode step, B={b}, ctx {p.spec_context}",
                f"{verify * 1e3:.2f} ms vs {plain * 1e3:.2f} ms",
                f"{verify / plain:.2f}x",
                f"medians of {len(times['verify'])} + {len(times['plain'])} steps, alternating; "
                f"{b * (k + 1)} vs {b} query tokens; verification graph replays so far: "
                f"{replays}",
            )
            out.result(
                9,
                batch=b,
                drafts=k,
                context=p.spec_context,
                verify_s=verify,
                plain_s=plain,
                verify_steps=times["verify"],
                plain_steps=times["plain"],
            )
    finally:
        llm.shutdown()
        llm = None
        free_memory()
    key = ", ".join(f"B={b} {r:.2f}x" for b, r in ratios)
    out.summary(
        9,
        f"verify (k={k}) / decode step: {key}" if ratios else "nothing measured",
        f"pays where a step accepts more than (ratio - 1) of {k} drafts",
    )
