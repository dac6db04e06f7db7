"""§4 end to end on the plan's model with dummy weights (LLM, token-id prompts): decode tok/s
eager and with step graphs, a short prompt's one-step prefill in each (piecewise graphs take
it where they are on), prefill tok/s of one chunk and of the longest prompt, and the
bandwidth a decode step achieves (weights + KV read per step time)."""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from benchmarks.gpu.check import Check
from benchmarks.gpu.measure import free_memory, option_supported, sync
from benchmarks.gpu.models import (
    decode_weight_bytes,
    kv_bytes_per_token,
    prefill_flops,
    token_prompts,
)
from benchmarks.gpu.plan import DECODE_BANDWIDTH_GOAL
from benchmarks.gpu.report import (
    SKIPPED,
    Budget,
    BudgetSpent,
    Report,
    fmt_bandwidth,
    fmt_flops,
    goal_mark,
    progress,
    share,
)


def start_llm(chk: Check, enforce_eager: bool | None, **extra):
    """LLM on the §4/§5 model (dummy weights); enforce_eager None: the engine's default;
    extra: more engine options (§9's speculative_config)."""
    from engine.llm import LLM

    p = chk.plan
    folder = chk.folder(f"model-{p.name}", p.model)
    options = dict(
        load_format="dummy",
        dtype="bfloat16",
        device=chk.device.type,
        # the CPU's C kernels are another benchmark's business: the smoke run stays cheap
        attention_backend="torch" if chk.device.type == "cpu" else "auto",
        max_num_seqs=p.max_num_seqs,
        max_num_batched_tokens=p.chunk,
        seed=0,
    )
    if p.kv_cache_memory is not None:
        options["kv_cache_memory"] = p.kv_cache_memory
    if enforce_eager is not None:
        options["enforce_eager"] = enforce_eager
    options.update(extra)
    if chk.device.type == "cuda":
        # The engine sizes its KV cache from what is free: an earlier engine or rig that was
        # not freed shows here.
        held = torch.cuda.memory_allocated(chk.device)
        if held > 1 << 30:
            progress(f"{held / 2**30:.1f} GiB still allocated before this engine starts")
    t = time.perf_counter()
    llm = LLM(str(folder), **options)
    sync(chk.device)
    return llm, time.perf_counter() - t


def engine_facts(llm) -> str:
    """What the engine chose (best effort: these are the runner's attributes on main)."""
    try:
        runner = llm.engine.executor.runner
        graph = getattr(runner, "_step_graph", None)
        graph_name = type(graph).__name__ if graph is not None else "none"
        return (
            f"attention {runner.attn_backend.name}, step graph {graph_name}, "
            f"{llm.engine.num_blocks:,} KV blocks"
        )
    except AttributeError as e:
        return f"(engine facts unavailable: {e})"


def measure_decode(
    llm, batch: int, context: int, warmup: int, steps: int, budget: Budget, seed: int
) -> tuple[list[float], list[int]]:
    """Step times and keys attended of the pure decode steps of `batch` requests of a
    `context`-token prompt, once every prefill is done (warm-up steps dropped)."""
    from engine.sampling_params import SamplingParams

    engine = llm.engine
    rng = np.random.default_rng(seed)
    prompts = token_prompts(rng, [context] * batch, engine.vocab_size)
    # The prompts' prefill takes many chunked steps, and the first requests decode in each of
    # them: they must not reach max_tokens before the last prompt is in, or no step decodes
    # all `batch` at once. A step's chunk is what the decodes leave of the token budget.
    chunk = engine.config.scheduler.max_num_batched_tokens
    prefill_steps = math.ceil(batch * context / max(chunk - batch, 1)) + batch
    params = SamplingParams(
        max_tokens=prefill_steps + warmup + steps + 4, temperature=0.0, ignore_eos=True
    )
    ids = [f"decode-{seed}-{i}" for i in range(batch)]
    gen_start = engine.generation_tokens_total
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    times: list[float] = []
    keys: list[int] = []
    try:
        while engine.has_unfinished_requests() and len(times) < warmup + steps:
            if budget.spent:
                raise BudgetSpent(f"decode B={batch}")
            p0, g0 = engine.prompt_tokens_total, engine.generation_tokens_total
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            if engine.prompt_tokens_total == p0 and engine.generation_tokens_total - g0 == batch:
                times.append(dt)
                keys.append(batch * context + g0 - gen_start)  # each attends prompt + sampled
    finally:
        for rid in ids:
            engine.abort_request(rid)
    if len(times) <= warmup:
        raise RuntimeError(f"decode B={batch}: only {len(times)} pure decode steps ran")
    return times[warmup:], keys[warmup:]


def measure_prefill(
    llm, length: int, repeats: int, budget: Budget, seed: int, device: torch.device
) -> list[float]:
    """Seconds from adding a fresh `length`-token prompt (max_tokens 1) to its end, the
    device synchronized, `repeats` times after a warm-up. Whole prompts, not single steps:
    with async scheduling a step returns before its work is done, so a step's host time is
    not its chunk's."""
    from engine.sampling_params import SamplingParams

    engine = llm.engine
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    seconds = []
    for rep in range(repeats + 1):
        if budget.spent:
            raise BudgetSpent("prefill")
        rid = f"prefill-{seed}-{length}-{rep}"
        prompt = token_prompts(rng, [length], engine.vocab_size)[0]  # fresh: no prefix hit
        sync(device)
        t = time.perf_counter()
        engine.add_request(rid, prompt, params)
        try:
            while engine.has_unfinished_requests():
                engine.step()
            sync(device)
        finally:
            engine.abort_request(rid)
        if rep > 0:
            seconds.append(time.perf_counter() - t)
    return seconds


def section_end_to_end(chk: Check, out: Report, budget: Budget) -> None:
    from engine.llm import LLM

    p = chk.plan
    cfg = p.model
    weights = decode_weight_bytes(cfg)
    per_token = kv_bytes_per_token(cfg)
    copy = chk.copy_bandwidth()
    if chk.device.type != "cuda":
        why_not = "no CUDA device: the default path only"
    elif not option_supported(LLM.__init__, "enforce_eager"):
        why_not = "LLM has no enforce_eager option on this branch: the default path only"
    else:
        why_not = None
    if why_not is None:
        modes = [("eager", True), ("graphs", False)]
    else:
        modes = [("default", None)]
        out.row(4, "CUDA graphs", "not measured", note=why_not)
    shape = (
        f"{cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
        f"{cfg['num_attention_heads']}/{cfg['num_key_value_heads']} heads"
    )
    start_s = 0.0  # the last start's seconds: the next is not begun without that much left
    for m, (label, eager) in enumerate(modes):
        last = m == len(modes) - 1
        if budget.left() < start_s + 10:
            out.row(4, f"{label}: decode and prefill", SKIPPED)
            continue
        llm, start_s = start_llm(chk, eager)
        measured = False
        try:
            out.row(
                4,
                f"engine start ({label})",
                f"{start_s:.1f} s",
                note=f"{shape}; {engine_facts(llm)}",
            )
            out.result(4, mode=label, start_s=start_s, facts=engine_facts(llm))
            for b in p.decode_batches:
                if budget.spent:
                    out.row(4, f"decode {label}, B={b}", SKIPPED)
                    continue
                try:
                    times, keys = measure_decode(
                        llm,
                        b,
                        p.decode_context,
                        p.decode_warmup,
                        p.decode_steps,
                        budget,
                        seed=3000 + b,
                    )
                except BudgetSpent:
                    out.row(4, f"decode {label}, B={b}", SKIPPED)
                    continue
                step = float(np.median(times))
                read = weights + float(np.mean(keys)) * per_token
                bw = read / step
                versus = f"{fmt_bandwidth(bw)} = {share(bw, copy, 'copy')}"
                if b == 256 and copy:
                    versus += f"; goal {DECODE_BANDWIDTH_GOAL:.0%}: {goal_mark(bw >= DECODE_BANDWIDTH_GOAL * copy)}"
                key = f"decode {label} B={b}: {b / step:,.0f} tok/s, {versus}"
                goal = ""
                if b == 256 and copy:
                    goal = f"{DECODE_BANDWIDTH_GOAL:.0%} of copy at B=256: {goal_mark(bw >= DECODE_BANDWIDTH_GOAL * copy)}"
                out.summary(4, key.split("; goal")[0], goal)  # the last mode's largest batch
                out.row(
                    4,
                    f"decode {label}, B={b}, ctx {p.decode_context}",
                    f"{b / step:,.0f} tok/s ({step * 1e3:.2f} ms/step)",
                    versus,
                    f"median of {len(times)} steps; reads {read / 1e9:.1f} GB/step",
                )
                out.result(
                    4,
                    mode=label,
                    batch=b,
                    context=p.decode_context,
                    step_s=step,
                    tok_s=b / step,
                    bytes_read=read,
                    bytes_per_s=bw,
                    steps=times,
                )
            short_prefill_rows(chk, out, budget, llm, label)
            if last:
                prefill_rows(chk, out, budget, llm)
            measured = True
        finally:
            if last and measured and chk.keep_llm_for_throughput:
                chk.shared_llm = llm
            else:
                llm.shutdown()
            llm = None
            free_memory()


SHORT_PROMPTS = (32, 256)  # a step each, under piecewise graphs' 512 tokens


def short_prefill_rows(chk: Check, out: Report, budget: Budget, llm, label: str) -> None:
    """A short prompt's time to its token (one step: eager, or the pieces of a piecewise
    graph with attention between them), median of 5."""
    for n in SHORT_PROMPTS:
        try:
            seconds = measure_prefill(llm, n, 5, budget, seed=5000 + n, device=chk.device)
        except BudgetSpent:
            out.row(4, f"prefill {label}, a {n}-token prompt", SKIPPED)
            continue
        t = float(np.median(seconds))
        out.row(
            4,
            f"prefill {label}, a {n}-token prompt",
            f"{t * 1e3:.2f} ms",
            note=f"median of {len(seconds)}, add to finish (one step)",
        )
        out.result(4, mode=label, short_prompt=n, seconds=t)


def prefill_rows(chk: Check, out: Report, budget: Budget, llm) -> None:
    """One chunk from scratch, and the longest prompt (its chunks on growing prefixes)."""
    p = chk.plan
    flops_ceiling = chk.matmul_flops()
    longest = llm.engine.max_model_len - 1
    for n, name in ((p.chunk, "one chunk"), (longest, f"{-(-longest // p.chunk)} chunks")):
        try:
            seconds = measure_prefill(llm, n, 2, budget, seed=4000 + n, device=chk.device)
        except BudgetSpent:
            out.row(4, f"prefill of {n:,} tokens", SKIPPED)
            continue
        t = min(seconds)
        flops = prefill_flops(p.model, 0, n) / t
        out.row(
            4,
            f"prefill of a {n:,}-token prompt ({name})",
            f"{n / t:,.0f} tok/s ({t * 1e3:.1f} ms)",
            f"{fmt_flops(flops)} = {share(flops, flops_ceiling, 'matmul')}",
            f"best of {len(seconds)}, add to finish; max_num_batched_tokens {p.chunk}",
        )
        out.result(4, prefill=name, tokens=n, seconds=t, flops_per_s=flops)
