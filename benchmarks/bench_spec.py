"""Speculative decoding against plain decoding, in one run: vLLM's ngram method, or with
--draft PATH a draft model (a small model sharing the target's tokenizer), with --eagle PATH an
EAGLE-1 head for the target, with --eagle3 PATH an EAGLE-3 head.

    tessera bench spec [--model M] [--dtype bfloat16] [--streams 1,8] [--output-len 128]
                       [--num-speculative-tokens 3] [--prompt-lookup-max 4]
                       [--prompt-lookup-min 1] [--draft PATH | --eagle PATH | --eagle3 PATH] [--rounds 2]
                       [--adaptive on|off|both] [--json PATH]

Three workloads: copy-heavy prompts (a passage given twice, then its opening again: the model
goes on copying, so the n-gram lookups hit), open-ended ones (instructions to write something
new: few hits), and (--workloads json) a record to return as JSON under a schema of its keys
(structured output: the drafts cut to what the grammar allows; each request ends with its
grammar, not at --output-len). Each runs at every stream count (that many requests at once) on
one engine without speculation and one with it, both loaded at once and their runs
interleaved (--rounds of each, the order alternating; the best counts), greedy with
ignore_eos so both produce the same tokens (up to the roundings of their different kernel
paths on quantized models, see the README). Reports per workload and stream count the mean time per output token
(TPOT, after the first token) of each engine, their ratio (plain / speculative: above 1,
speculation pays), the draft acceptance rate and the mean tokens per verification step,
and whether both engines produced the same tokens. --adaptive: the draft controller
(speculative_config's "adaptive") on (the default), off (every step drafts), or both: a third
engine, the same speculation with the controller off, interleaved with the other two (its
columns marked "fixed"); the share of the controller's decisions that drafted is reported.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time

import torch

from engine import LLM, SamplingParams

PASSAGES = (
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion, the members agreed to increase funding for the library, the public parks "
    "and the after-school programs, while the road maintenance budget stayed the same.",
    "def merge(left, right):\n    out = []\n    i = j = 0\n    while i < len(left) and "
    "j < len(right):\n        if left[i] <= right[j]:\n            out.append(left[i])\n"
    "            i += 1\n        else:\n            out.append(right[j])\n            j += 1\n"
    "    return out + left[i:] + right[j:]\n",
    "Dear customer, thank you for your order number 48213. Your package containing two "
    "blue notebooks, one set of pencils and a desk lamp will ship within three business "
    "days. You can track it on our website with the code in this message.",
    "To install the tool, download the archive, unpack it into a folder of your choice, "
    "add that folder to your PATH and run the setup command once. The setup command "
    "creates a configuration file in your home directory with the default settings.",
)

OPEN_ENDED = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in your own words why the sky looks blue during the day.",
    "Describe your ideal weekend in the mountains, with as much detail as you like.",
    "Invent a new board game and explain its rules to a group of friends.",
)


# The json workload: a record to return as JSON under a schema of its keys (structured output
# with speculation: the drafts cut to what the grammar allows, each position under its mask).
RECORDS = (
    {"order": 48213, "customer": "Ada Lovelace", "items": ["blue notebook", "pencil set"],
     "express": False, "city": "London"},
    {"name": "merge", "language": "python", "arguments": ["left", "right"], "lines": 11,
     "pure": True},
    {"title": "Budget review", "day": "Tuesday", "topics": ["library", "parks", "roads"],
     "approved": True, "members": 9},
)  # fmt: skip


def record_schema(record: dict) -> dict:
    kinds = {bool: "boolean", int: "integer", str: "string", list: "array"}
    props = {k: {"type": kinds[type(v)]} for k, v in record.items()}
    return {"type": "object", "properties": props, "required": list(record),
            "additionalProperties": False}  # fmt: skip


def copy_prompt(passage: str) -> str:
    head = passage[: len(passage) // 4]
    return f"Text:\n{passage}\n\nThe same text, copied exactly:\n{passage}\n\nOnce more:\n{head}"


def prompts_for(llm: LLM, workload: str, count: int, output_len: int) -> list[list[int]]:
    """count prompts, each cut from the left to leave room for output_len tokens."""
    tok = llm.tokenizer
    if workload == "copy":
        texts = [copy_prompt(PASSAGES[i % len(PASSAGES)]) for i in range(count)]
        prompts = [tok.encode(t) for t in texts]
    elif workload == "json":
        chat = [
            [{"role": "user", "content": "Here is a record:\n"
              f"{json.dumps(RECORDS[i % len(RECORDS)])}\nReturn it as JSON, unchanged."}]
            for i in range(count)
        ]  # fmt: skip
        prompts = [tok.apply_chat_template(m, add_generation_prompt=True) for m in chat]
    else:
        chat = [
            [{"role": "user", "content": OPEN_ENDED[i % len(OPEN_ENDED)]}] for i in range(count)
        ]
        prompts = [tok.apply_chat_template(m, add_generation_prompt=True) for m in chat]
    room = llm.engine.max_model_len - output_len
    return [p[-room:] for p in prompts]


def run_streams(
    llm: LLM, prompts: list[list[int]], output_len: int, workload: str = "copy"
) -> tuple[list, list]:
    """All prompts at once through the engine's step loop: (TPOT of each request in
    seconds, its tokens). The json workload's requests end with their grammar."""
    from engine.sampling_params import StructuredOutputsParams

    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        if workload == "json":
            schema = record_schema(RECORDS[i % len(RECORDS)])
            so = StructuredOutputsParams(json=schema)
            params = SamplingParams(max_tokens=output_len, temperature=0.0, structured_outputs=so)
        engine.add_request(f"b{i}-{start}", p, params)
    first: dict[str, float] = {}
    tpot: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            n = len(out.outputs[0].token_ids)
            if n and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
                tpot[out.request_id] = (now - first[out.request_id]) / max(n - 1, 1)
    order = sorted(tokens, key=lambda r: int(r.split("-")[0][1:]))
    return [tpot[r] for r in order], [tokens[r] for r in order]


def spec_counts(llm: LLM) -> tuple[int, int, int, int, int]:
    """The spec counters (drafts, draft tokens, accepted) and the draft controller's
    (decisions, decisions to draft; zeros without it)."""
    scheduler = llm.engine.scheduler
    s = scheduler.stats().spec_decoding
    c = getattr(scheduler, "draft_controller", None)
    decisions = (c.num_decisions, c.num_drafting) if c is not None else (0, 0)
    return (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, *decisions) if s else (0,) * 5


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="tessera bench spec", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default=None, help="model folder or .gguf (default: bundled)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--streams", default="1,8", help="comma-separated stream counts")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=1)
    parser.add_argument(
        "--draft",
        default=None,
        help="a draft model's folder: measure it instead of the n-gram proposer",
    )
    parser.add_argument(
        "--eagle",
        default=None,
        help="an EAGLE-1 head's folder: measure it instead of the n-gram proposer",
    )
    parser.add_argument(
        "--eagle3",
        default=None,
        help="an EAGLE-3 head's folder: measure it instead of the n-gram proposer",
    )
    parser.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=None,
        help="speculative_config's disable_by_batch_size: no drafts in steps of this many "
        "running requests or more",
    )
    parser.add_argument(
        "--adaptive",
        choices=("on", "off", "both"),
        default="on",
        help="the draft controller (speculative_config's adaptive): on, off (every step "
        "drafts), or both (a third engine with it off, interleaved)",
    )
    parser.add_argument("--workloads", default="copy,open", help="copy, open and/or json")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved runs per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    try:
        streams = [int(s) for s in args.streams.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--streams must be comma-separated integers, got {args.streams!r}")
    if not streams or min(streams) < 1:
        parser.error("--streams needs stream counts of at least 1")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.output_len < 2:
        parser.error("--output-len must be at least 2 (TPOT needs a second token)")
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not workloads or set(workloads) - {"copy", "open", "json"}:
        parser.error(f"--workloads must name copy, open and/or json, got {args.workloads!r}")
    spec: dict = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": args.prompt_lookup_max,
        "prompt_lookup_min": args.prompt_lookup_min,
    }
    side = "ngram"
    given = {
        side: path
        for side, path in (("draft", args.draft), ("eagle", args.eagle), ("eagle3", args.eagle3))
        if path is not None
    }
    if len(given) > 1:
        parser.error("--draft, --eagle and --eagle3 measure one proposer each: give one of them")
    if given:
        [(side, path)] = given.items()
        spec = {
            "method": "draft_model" if side == "draft" else side,
            "model": path,
            "num_speculative_tokens": args.num_speculative_tokens,
        }
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    spec["adaptive"] = args.adaptive != "off"
    common = dict(dtype=args.dtype, max_num_seqs=max(streams), seed=args.seed)
    # The engines loaded at once and their runs interleaved (the order rotating by round),
    # so a shared machine's load swings hit every side alike; the best round counts.
    engines = {
        "plain": LLM(args.model, speculative_config=None, **common),
        side: LLM(args.model, speculative_config=spec, **common),
    }
    fixed = f"{side}-fixed"
    if args.adaptive == "both":
        engines[fixed] = LLM(args.model, speculative_config={**spec, "adaptive": False}, **common)
    names = list(engines)
    for llm in engines.values():
        for workload in workloads:  # warm-up: first-step costs out of the timings
            run_streams(llm, prompts_for(llm, workload, 1, 4), 4, workload)
    runs: dict[str, dict] = {}  # the best round of each
    decisions: dict[str, list[int]] = {}  # the controller's [decisions, drafting] over all rounds
    for workload in workloads:
        for n in streams:
            for r in range(args.rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    llm = engines[name]
                    before = spec_counts(llm)
                    prompts = prompts_for(llm, workload, n, args.output_len)
                    tpot, tokens = run_streams(llm, prompts, args.output_len, workload)
                    after = spec_counts(llm)
                    key = f"{name}/{workload}/{n}"
                    run = {
                        "tpot_s": statistics.fmean(tpot),
                        "tokens": tokens,
                        "drafts": after[0] - before[0],
                        "draft_tokens": after[1] - before[1],
                        "accepted": after[2] - before[2],
                        "decisions": after[3] - before[3],
                        "drafting": after[4] - before[4],
                    }
                    if key not in runs or run["tpot_s"] < runs[key]["tpot_s"]:
                        runs[key] = run
                    decided = decisions.setdefault(key, [0, 0])  # over every round
                    decided[0] += run["decisions"]
                    decided[1] += run["drafting"]
                    print(f"{name} {workload} x{n}: TPOT {run['tpot_s'] * 1e3:.2f} ms", flush=True)
    for llm in engines.values():
        llm.shutdown()
    del engines, llm
    gc.collect()
    rows = []
    for workload in workloads:
        for n in streams:
            plain = runs[f"plain/{workload}/{n}"]
            row = {
                "workload": workload,
                "streams": n,
                "tpot_plain_ms": round(plain["tpot_s"] * 1e3, 3),
            }
            for name, suffix in ((side, ""), (fixed, "_fixed")):
                if name not in names:
                    continue
                ngram = runs[f"{name}/{workload}/{n}"]
                drafted, drafts = ngram["draft_tokens"], ngram["drafts"]
                row |= {
                    f"tpot_{side}{suffix}_ms": round(ngram["tpot_s"] * 1e3, 3),
                    f"tpot_ratio{suffix}": round(plain["tpot_s"] / ngram["tpot_s"], 3),
                    f"acceptance_rate{suffix}": round(ngram["accepted"] / drafted, 3)
                    if drafted
                    else 0.0,
                    f"tokens_per_verification{suffix}": round(1 + ngram["accepted"] / drafts, 3)
                    if drafts
                    else 1.0,
                }
            if spec["adaptive"]:  # the share of the controller's decisions that drafted
                decided, drafting = decisions[f"{side}/{workload}/{n}"]
                row["drafted_share"] = round(drafting / decided, 3) if decided else 0.0
            row["same_tokens"] = all(
                runs[f"{name}/{workload}/{n}"]["tokens"] == plain["tokens"] for name in names
            )
            rows.append(row)
    both = fixed in names
    print(
        f"\n{'workload':<9}{'streams':>8}{'TPOT plain':>12}{'TPOT ' + side:>12}{'ratio':>8}"
        f"{'accept':>8}{'tok/step':>10}"
        + (f"{'drafted':>9}" if spec["adaptive"] else "")
        + (f"{'TPOT fixed':>12}{'ratio':>8}{'accept':>8}" if both else "")
        + f"{'same':>6}"
    )
    for r in rows:
        print(
            f"{r['workload']:<9}{r['streams']:>8}{r['tpot_plain_ms']:>10.2f}ms"
            f"{r[f'tpot_{side}_ms']:>10.2f}ms{r['tpot_ratio']:>8.2f}{r['acceptance_rate']:>8.2f}"
            f"{r['tokens_per_verification']:>10.2f}"
            + (f"{r['drafted_share']:>9.2f}" if spec["adaptive"] else "")
            + (
                f"{r[f'tpot_{side}_fixed_ms']:>10.2f}ms{r['tpot_ratio_fixed']:>8.2f}"
                f"{r['acceptance_rate_fixed']:>8.2f}"
                if both
                else ""
            )
            + f"{'yes' if r['same_tokens'] else 'no':>6}"
        )
    result = {
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
        "model": args.model or "default",
        "dtype": args.dtype,
        "output_len": args.output_len,
        "speculative_config": spec,
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
