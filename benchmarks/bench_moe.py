"""A mixture of experts against a dense model of equal active parameters: decode steps on the
CPU (issue 41).

    tessera bench moe [--batch-sizes 1 32 128] [--hidden 512] [--layers 4] [--experts 8]
        [--top-k 2] [--expert-intermediate 512] [--dense llama] [--steps 20] [--json PATH]

Two random-weight models (load_format dummy: config.json only, written to a temporary
folder) with the same attention, embedding and head: a Qwen3-MoE (every layer's MLP a
SparseMoeBlock of --experts experts of width --expert-intermediate, top --top-k,
renormalized) and a dense model (--dense: Llama, or Qwen3 for the very same attention with
its q/k norms) whose MLP is --top-k x --expert-intermediate wide: each token multiplies as
many weights in both (the MoE's router, hidden x experts, aside), so the ratio of their step
times is what routing and the experts' kernels cost. Each model runs
benchmarks/bench_decode.py's Tessera worker (its workload: B sequences of contexts drawn
from --context, the cache filled by prefill, one token per sequence per timed step) in its
own process, at each --batch-sizes. At B rows and E experts, top-k spreads B x k token rows
over the experts: B = 1 touches k experts' weights, B = 128 all of them, each multiplying
about B k / E rows.
Other load on the machine shows up in every number; the ratio is measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MODELS = ("moe", "dense")


def model_configs(args: argparse.Namespace) -> dict[str, dict]:
    """config.json of the MoE and of the dense model of equal active parameters."""
    head_dim = args.hidden // args.heads
    common = {
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "vocab_size": args.vocab,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    dense_width = args.top_k * args.expert_intermediate
    moe = {
        **common,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "intermediate_size": dense_width,  # a dense layer's, were there any (none here)
        "moe_intermediate_size": args.expert_intermediate,
        "num_experts": args.experts,
        "num_experts_per_tok": args.top_k,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    arch = {"llama": ("LlamaForCausalLM", "llama"), "qwen3": ("Qwen3ForCausalLM", "qwen3")}
    name, model_type = arch[args.dense]
    dense = {
        **common,
        "architectures": [name],
        "model_type": model_type,
        "intermediate_size": dense_width,
        "mlp_bias": False,
    }
    return {"moe": moe, "dense": dense}


def parameter_counts(cfg: dict) -> dict:
    """Total and active (per token) parameters of the decoder layers, and the embedding's and
    head's."""
    h, n = cfg["hidden_size"], cfg["num_hidden_layers"]
    d = cfg["head_dim"]
    attn = h * d * (cfg["num_attention_heads"] * 2 + cfg["num_key_value_heads"] * 2)
    if cfg.get("num_experts"):
        expert = 3 * h * cfg["moe_intermediate_size"]
        router = h * cfg["num_experts"]
        total = attn + cfg["num_experts"] * expert + router
        active = attn + cfg["num_experts_per_tok"] * expert + router
    else:
        total = active = attn + 3 * h * cfg["intermediate_size"]
    return {
        "layers_total": n * total,
        "layers_active": n * active,
        "embedding_and_head": 2 * cfg["vocab_size"] * h,
    }


def decode_argv(args: argparse.Namespace, folder: Path) -> list[str]:
    argv = ["--model", str(folder), "--load-format", "dummy", "--dtype", args.dtype,
            "--batch-sizes", *map(str, args.batch_sizes),
            "--context", *map(str, args.context), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--seed", str(args.seed)]  # fmt: skip
    if args.threads:
        argv += ["--threads", str(args.threads)]
    return argv


def print_table(result: dict) -> None:
    m = result["machine"]
    moe, dense = result["configs"]["moe"], result["configs"]["dense"]
    print(
        f"\n## MoE vs dense decode step ({result['dtype']}), context {result['context'][0]}-"
        f"{result['context'][1]}, {m['date']}"
    )
    print(
        f"{m['platform']}, {m['usable_cpus']}/{m['cpu_count']} CPUs, load {m['load_avg_1m']}, "
        f"torch {m['torch']}; steps {result['steps']} (best / median)\n"
    )
    pm, pd = result["params"]["moe"], result["params"]["dense"]
    print(
        f"MoE: Qwen3-MoE, {moe['num_hidden_layers']} layers, hidden {moe['hidden_size']}, "
        f"{moe['num_experts']} experts of {moe['moe_intermediate_size']}, top "
        f"{moe['num_experts_per_tok']}: {pm['layers_total'] / 1e6:.2f} M layer parameters, "
        f"{pm['layers_active'] / 1e6:.2f} M active a token.\n"
        f"dense: {dense['architectures'][0]}, intermediate {dense['intermediate_size']}: "
        f"{pd['layers_active'] / 1e6:.2f} M layer parameters. Embedding + head "
        f"{pm['embedding_and_head'] / 1e6:.2f} M in both.\n"
    )
    print("| batch | MoE ms/step best | MoE median | dense ms/step best | dense median "
          "| MoE / dense (median) | MoE / dense (best) | MoE tok/s | dense tok/s |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = {name: {r["batch_size"]: r for r in res.get("rows", [])}
            for name, res in result["paths"].items()}  # fmt: skip
    for b in result["batch_sizes"]:
        a, d = rows.get("moe", {}).get(b), rows.get("dense", {}).get(b)
        if a is None or d is None:
            continue
        print(
            f"| {b} | {a['best_ms']:.2f} | {a['median_ms']:.2f} | {d['best_ms']:.2f} | "
            f"{d['median_ms']:.2f} | {a['median_ms'] / d['median_ms']:.2f}x | "
            f"{a['best_ms'] / d['best_ms']:.2f}x | "
            f"{a['median_tok_s']:.0f} | {d['median_tok_s']:.0f} |"
        )
    for name, res in result["paths"].items():
        if "error" in res:
            print(f"\n{name}: {res['error']}")
    print("\n(MoE / dense: the MoE's ms/step over the dense model's; 1.00x: routing and the "
          "experts cost nothing over the dense MLP of the same active width. On a loaded "
          "machine the best steps' ratio is the steadier one.)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tessera bench moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-intermediate", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dense", choices=("llama", "qwen3"), default="llama",
                   help="the dense model's family (qwen3: the MoE's attention, q/k norms too)")  # fmt: skip
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--context", type=int, nargs=2, default=[64, 320], metavar=("LO", "HI"))
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per model at most")
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p


def main(argv: list[str] | None = None) -> dict:
    from benchmarks import bench_decode

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    lo, hi = args.context
    if lo < 1 or hi < lo:
        parser.error(f"--context LO HI needs 1 <= LO <= HI, got {lo} {hi}")
    if any(b < 1 for b in args.batch_sizes):
        parser.error("--batch-sizes must all be at least 1")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    if not 1 <= args.top_k <= args.experts:
        parser.error("--top-k must be between 1 and --experts")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error("--hidden must divide by --heads, and --heads by --kv-heads")
    configs = model_configs(args)
    result: dict = {
        "benchmark": "moe",
        "dtype": args.dtype,
        "configs": configs,
        "params": {name: parameter_counts(cfg) for name, cfg in configs.items()},
        "batch_sizes": args.batch_sizes,
        "context": args.context,
        "steps": args.steps,
        "warmup": args.warmup,
        "machine": bench_decode.machine_info(),
        "paths": {},
    }
    if args.threads:
        result["machine"]["torch_threads"] = args.threads
    print("bench moe: run it on a quiet machine; other load shows up in every number.")
    with tempfile.TemporaryDirectory(prefix="tessera-bench-moe-") as tmp:
        for name, cfg in configs.items():
            folder = Path(tmp) / name
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(cfg, indent=2))
            print(f"bench moe: decode steps, {name} ...", flush=True)
            try:
                res = bench_decode.run_path("kernel", decode_argv(args, folder), args.timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                res = {"error": str(e), "rows": []}
                print(f"bench moe: {e}", file=sys.stderr)
            for r in res.get("rows", []):
                r.pop("tokens", None)
            result["paths"][name] = res
    dense = {r["batch_size"]: r for r in result["paths"]["dense"].get("rows", [])}
    for r in result["paths"]["moe"].get("rows", []):
        if r["batch_size"] in dense:
            d = dense[r["batch_size"]]
            r["moe_over_dense"] = round(r["median_ms"] / d["median_ms"], 3)
            r["moe_over_dense_best"] = round(r["best_ms"] / d["best_ms"], 3)
    print_table(result)
    print(json.dumps(result, default=str))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return result


if __name__ == "__main__":
    main()
