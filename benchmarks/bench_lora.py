"""LoRA's cost per decode step: batches mixing 0, 1 or several adapters against the base model.

    tessera bench lora [--model M] [--dtype bfloat16] [--streams 8,32] [--adapters 0,1,4]
                       [--ranks 8,16] [--output-len 64] [--rounds 2] [--json PATH]
                       [--swap-rank 16] [--swap-repeats 10] [--swap-only]
                       [--experts E [--top-k 2]]

Adapters are written by peft (ranks cycled from --ranks, on q/k/v/o and the MLP's
gate/up/down) into a temporary folder. Two engines are loaded at once: the base model
without LoRA, and the same model with enable_lora (max_loras = the most adapters asked
for). For each stream count, a batch of that many greedy requests (ignore_eos, so every
run decodes the same number of steps) runs on the base engine and on the LoRA engine
with 0 adapters (the base rows of a LoRA engine), 1 adapter (every stream on it) and k
adapters (streams spread round-robin); the runs are interleaved over --rounds with the
order alternating, and the best round counts (a shared machine's load swings hit all
sides alike). The figure is the median wall time of a decode step (every request past
its first token), and its ratio to the base engine's (above 1: LoRA costs that much).

The swap table: what bringing an adapter of --swap-rank into a resident slot costs on the
LoRA engine's runner (engine.lora.manager), the median of --swap-repeats: "load" reads its
folder into the CPU cache (safetensors read, float32, scaling folded in, this rank's shard;
the file is in the page cache after the first read, so this is not a cold disk), "to slot"
copies a CPU-cached adapter into a slot of every layer (the LRU's swap). Two adapters: the
projections alone, and the projections with embed_tokens and lm_head (vocabulary-sized A
and B). --swap-only runs only this table (one engine, a few seconds).

--experts E: the model's shape as a mixture of experts instead (Qwen3-MoE: E experts, top
--top-k, each expert intermediate_size / top-k wide, so a token multiplies as many MLP weights
as in the dense model; random weights, the model's tokenizer), and adapters on q/k/v/o and on
every expert's gate_up and down (peft's target_parameters: engine.lora.experts) whose B is 0
(peft's initialization): a MoE step's cost depends on how its tokens spread over the experts,
so the adapters keep the base's tokens and routing, and the ratio is the LoRA work alone (the
kernels multiply the zeros all the same).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine import LLM, LoRARequest, SamplingParams

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in your own words why the sky looks blue during the day.",
    "Describe your ideal weekend in the mountains, with as much detail as you like.",
    "Invent a new board game and explain its rules to a group of friends.",
    "List the steps to bake a loaf of bread at home, from flour to the first slice.",
)


def make_adapters(
    model_dir: Path,
    out_dir: Path,
    ranks: list[int],
    seed: int = 0,
    targets: list[str] | None = None,
    tag: str = "adapter",
    target_parameters: list[str] | None = None,
    zero_b: bool = False,
) -> list[Path]:
    """One PEFT LoRA folder per rank in `ranks`, random A and B of a modest scale (a delta
    that changes the tokens without blowing up the logits; zero_b: B = 0, peft's own
    initialization, so the tokens stay the base's). The base weights do not matter to an
    adapter's file: the model is built from its config alone."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    experts = getattr(config, "num_experts", 1)  # an expert's part of B: rank r of r x E
    paths = []
    for i, r in enumerate(ranks):
        lora = LoraConfig(
            r=r,
            lora_alpha=2 * r,
            target_modules=targets or TARGETS,
            target_parameters=target_parameters,
            lora_dropout=0.0,
            init_lora_weights=False,
        )
        model = get_peft_model(base, lora, adapter_name=f"a{i}")
        g = torch.Generator().manual_seed(seed + i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_A" in name or "lora_B" in name:
                    fan_in = p.shape[1] / (experts if ".experts." in name else 1)
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5 / fan_in**0.5)
                    if zero_b and "lora_B" in name:
                        p.zero_()
        path = out_dir / f"{tag}-{i}-r{r}"
        model.save_pretrained(str(path), selected_adapters=[f"a{i}"])
        # peft nests a named adapter's files one folder down; engines read the folder itself.
        nested = path / f"a{i}"
        if nested.is_dir():
            for f in nested.iterdir():
                f.rename(path / f.name)
            nested.rmdir()
        base = model.unload()  # the plain model back, for the next adapter
        paths.append(path)
    return paths


EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "generation_config.json")  # fmt: skip


def moe_folder(model: str | None, out_dir: Path, experts: int, top_k: int) -> Path:
    """The model's shape as a Qwen3-MoE of `experts` experts, top_k of them a token, each
    intermediate_size / top_k wide: config.json (weights: load_format dummy) and the model's
    tokenizer files."""
    import shutil

    from engine.config import DEFAULT_MODEL
    from engine.models.loader import resolve_model

    source = resolve_model(model or DEFAULT_MODEL)
    cfg = json.loads((source / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    cfg.update(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=cfg["intermediate_size"] // top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out_dir / name)
    return out_dir


def prompts_for(llm: LLM, count: int) -> list[list[int]]:
    tok = llm.tokenizer
    chats = [
        [{"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} (#{i})"}] for i in range(count)
    ]
    return [tok.apply_chat_template(m, add_generation_prompt=True) for m in chats]


def decode_steps(
    llm: LLM, prompts: list[list[int]], adapters: list[LoRARequest | None], output_len: int
) -> tuple[list[float], list[list[int]]]:
    """All prompts at once (request i on adapters[i]): the wall time of each step taken while
    every request already had its first token, and each request's tokens."""
    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    tag = time.perf_counter_ns()
    for i, (p, a) in enumerate(zip(prompts, adapters, strict=True)):
        engine.add_request(f"l{i}-{tag}", p, params, lora_request=a)
    started: set[str] = set()
    tokens: dict[str, list[int]] = {}
    steps: list[float] = []
    while engine.has_unfinished_requests():
        decoding = len(started) == len(prompts)
        t0 = time.perf_counter()
        outs = engine.step()
        if decoding:
            steps.append(time.perf_counter() - t0)
        for out in outs:
            if out.outputs[0].token_ids:
                started.add(out.request_id)
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    order = sorted(tokens, key=lambda r: int(r.split("-")[0][1:]))
    return steps, [tokens[r] for r in order]


def swap_costs(llm: LLM, folders: dict[str, Path], rank: int, repeats: int) -> list[dict]:
    """Per adapter folder: the median ms of reading it into the CPU cache and of copying it
    from there into a slot, on the LoRA engine's runner (one rank), the engine idle."""
    manager = llm.engine.executor.runner.lora_manager
    rows = []
    for i, (label, folder) in enumerate(folders.items()):
        request = LoRARequest(f"swap-{i}", 10_000 + i, str(folder))
        loads, fills = [], []
        for _ in range(repeats):
            manager.remove(request.lora_int_id)  # out of the CPU cache and any slot
            t0 = time.perf_counter()
            shard = manager._load(request)
            loads.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            manager._fill(0, request.lora_int_id, shard)
            if manager.batch.device.type == "cuda":
                torch.cuda.synchronize()
            fills.append(time.perf_counter() - t0)
        manager.remove(request.lora_int_id)
        nbytes = sum(
            t.numel() * t.element_size()
            for slices in shard.weights.values()
            for ab in slices
            if ab is not None
            for t in ab
        )
        rows.append(
            {
                "adapter": label,
                "rank": rank,
                "shard_mib": round(nbytes / 2**20, 2),
                "load_ms": round(statistics.median(loads) * 1e3, 3),
                "to_slot_ms": round(statistics.median(fills) * 1e3, 3),
            }
        )
    return rows


def parse_counts(parser: argparse.ArgumentParser, flag: str, text: str, low: int) -> list[int]:
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        parser.error(f"{flag} must be comma-separated integers, got {text!r}")
    if not values or min(values) < low:
        parser.error(f"{flag} needs values of at least {low}, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="tessera bench lora", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default=None, help="model folder or .gguf (default: bundled)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--streams", default="8,32", help="comma-separated batch sizes")
    parser.add_argument("--adapters", default="0,1,4", help="distinct adapters in a batch")
    parser.add_argument("--ranks", default="8,16", help="adapter ranks, cycled over adapters")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved runs per cell")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--swap-rank", type=int, default=16, help="the swap table's rank")
    parser.add_argument("--swap-repeats", type=int, default=10, help="swaps timed per adapter")
    parser.add_argument("--swap-only", action="store_true", help="only the swap table")
    parser.add_argument("--experts", type=int, default=0, help="the model as a MoE of E experts")
    parser.add_argument("--top-k", type=int, default=2, help="--experts: experts a token")
    args = parser.parse_args(argv)
    streams = parse_counts(parser, "--streams", args.streams, 1)
    counts = parse_counts(parser, "--adapters", args.adapters, 0)
    ranks = parse_counts(parser, "--ranks", args.ranks, 1)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.swap_rank < 1 or args.swap_repeats < 1:
        parser.error("--swap-rank and --swap-repeats must be at least 1")
    if args.swap_only:
        return swap_main(args)
    if args.output_len < 3:
        parser.error("--output-len must be at least 3 (decode steps after the first token)")
    if max(counts) > min(streams):
        parser.error(f"--adapters {max(counts)} is more than the smallest batch {min(streams)}")
    if args.experts and not 0 < args.top_k <= args.experts:
        parser.error("--top-k must be in 1..--experts")
    n_adapters = max(max(counts), 1)
    adapter_ranks = [ranks[i % len(ranks)] for i in range(n_adapters)]
    common = dict(
        dtype=args.dtype,
        max_num_seqs=max(streams),
        max_model_len=args.max_model_len,
        seed=args.seed,
    )
    targets, parameters, model = None, None, args.model
    with tempfile.TemporaryDirectory(prefix="tessera-bench-lora-") as tmp:
        if args.experts:
            model = str(moe_folder(args.model, Path(tmp) / "moe", args.experts, args.top_k))
            common["load_format"] = "dummy"
            targets, parameters = TARGETS[:4], EXPERT_PARAMETERS
        engines = {
            "base": LLM(model, **common),
            "lora": LLM(
                model,
                enable_lora=True,
                max_loras=n_adapters,
                max_lora_rank=max(*adapter_ranks, args.swap_rank),
                **common,
            ),
        }
        folders = make_adapters(
            engines["lora"].engine.model_dir, Path(tmp), adapter_ranks, targets=targets,
            target_parameters=parameters, zero_b=bool(args.experts),
        )  # fmt: skip
        requests = [LoRARequest(f"bench-{i}", i + 1, str(p)) for i, p in enumerate(folders)]
        # Each cell: which engine, and how many distinct adapters (None: the base engine).
        cells: list[tuple[str, int | None]] = [("base", None)]
        cells += [("lora", k) for k in counts]
        for name, k in cells:  # warm-up: first-step costs and adapter loads out of the timings
            llm = engines[name]
            plan = spread(requests, k, 2)
            decode_steps(llm, prompts_for(llm, 2), plan, 4)
        best: dict[tuple[int, str], dict] = {}
        for n in streams:
            prompts = prompts_for(engines["base"], n)
            for r in range(args.rounds):
                for name, k in cells if r % 2 == 0 else cells[::-1]:
                    steps, tokens = decode_steps(
                        engines[name], prompts, spread(requests, k, n), args.output_len
                    )
                    label = "base" if k is None else f"{k} adapters"
                    run = {
                        "step_s": statistics.median(steps),
                        "steps": len(steps),
                        "tokens": tokens,
                    }
                    if (n, label) not in best or run["step_s"] < best[(n, label)]["step_s"]:
                        best[(n, label)] = run
                    print(f"x{n} {label}: step {run['step_s'] * 1e3:.2f} ms", flush=True)
        swaps = []
        if not args.experts:  # the swap table's adapters are the dense model's
            swaps = swap_costs(
                engines["lora"], swap_folders(engines["lora"], Path(tmp), args.swap_rank),
                args.swap_rank, args.swap_repeats,
            )  # fmt: skip
    model_name = args.model or "default"
    if args.experts:
        model_name += f" as Qwen3-MoE, {args.experts} experts top-{args.top_k}"
    for llm in engines.values():
        llm.shutdown()
    del engines, llm
    gc.collect()
    rows = []
    for n in streams:
        base = best[(n, "base")]
        for k in counts:
            run = best[(n, f"{k} adapters")]
            rows.append(
                {
                    "streams": n,
                    "adapters": k,
                    "ranks": adapter_ranks[:k],
                    "step_base_ms": round(base["step_s"] * 1e3, 3),
                    "step_lora_ms": round(run["step_s"] * 1e3, 3),
                    "ratio": round(run["step_s"] / base["step_s"], 3),
                    "decode_steps": run["steps"],
                    # 0 adapters: the LoRA engine's base rows must give the base tokens.
                    "same_tokens_as_base": run["tokens"] == base["tokens"],
                }
            )
    print(f"\n{'streams':>8}{'adapters':>9}{'base step':>12}{'lora step':>12}{'ratio':>8}")
    for r in rows:
        print(
            f"{r['streams']:>8}{r['adapters']:>9}{r['step_base_ms']:>10.2f}ms"
            f"{r['step_lora_ms']:>10.2f}ms{r['ratio']:>8.2f}"
        )
    result = {
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
        "model": model_name,
        "dtype": args.dtype,
        "output_len": args.output_len,
        "targets": targets or TARGETS,
        "target_parameters": parameters,
        "rows": rows,
        "swap": swaps,
    }
    if swaps:
        print_swaps(swaps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def swap_folders(llm: LLM, root: Path, rank: int) -> dict[str, Path]:
    """The swap table's two adapters: the projections, and those with the vocabulary's."""
    model_dir = llm.engine.model_dir
    return {
        "q/k/v/o, gate/up/down": make_adapters(model_dir, root, [rank], tag="swap-proj")[0],
        "+ embed_tokens, lm_head": make_adapters(
            model_dir, root, [rank], targets=[*TARGETS, "embed_tokens", "lm_head"], tag="swap-vocab"
        )[0],
    }


def print_swaps(rows: list[dict]) -> None:
    print(f"\n{'swap: adapter':<26}{'rank':>5}{'MiB':>8}{'load':>11}{'to slot':>11}")
    for r in rows:
        print(
            f"{r['adapter']:<26}{r['rank']:>5}{r['shard_mib']:>8.2f}"
            f"{r['load_ms']:>9.2f}ms{r['to_slot_ms']:>9.2f}ms"
        )


def swap_main(args: argparse.Namespace) -> dict:
    """--swap-only: one LoRA engine (one slot), the swap table alone."""
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        enable_lora=True,
        max_loras=1,
        max_lora_rank=args.swap_rank,
    )
    try:
        with tempfile.TemporaryDirectory(prefix="tessera-bench-lora-") as tmp:
            folders = swap_folders(llm, Path(tmp), args.swap_rank)
            swaps = swap_costs(llm, folders, args.swap_rank, args.swap_repeats)
    finally:
        llm.shutdown()
    print_swaps(swaps)
    result = {
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
        "model": args.model or "default",
        "dtype": args.dtype,
        "swap": swaps,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def spread(requests: list[LoRARequest], k: int | None, n: int) -> list[LoRARequest | None]:
    """n streams over k distinct adapters, round-robin (None or 0: all on the base model)."""
    if not k:
        return [None] * n
    return [requests[i % k] for i in range(n)]


if __name__ == "__main__":
    main()
