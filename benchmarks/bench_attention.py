"""Decode attention alone: one step's attention over every layer's paged KV cache, the
compiled CPU kernel (engine/kernels/cpu/paged_attention.c) against the torch path (blocks
gathered, then SDPA) in the same run.

Each layer has its own cache, allocated like the model runner's (transparent huge pages),
so a step reads its K/V from memory as a served step does, not from a warm L3. Blocks are
handed out shuffled, as a long-running server's block pool leaves them.

    tessera bench attention --rows 128 --context 64 320
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="tessera bench attention", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--rows", type=int, default=128, help="decode rows (sequences) in the step")
    p.add_argument("--context", type=int, nargs=2, default=(64, 320), metavar=("LO", "HI"))
    p.add_argument("--layers", type=int, default=30, help="caches read per step (SmolLM2-135M: 30)")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--paths", nargs="+", choices=("kernel", "torch"), default=["kernel", "torch"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    lo, hi = args.context
    if not 1 <= lo <= hi:
        p.error("--context LO HI needs 1 <= LO <= HI")
    if args.rows < 1 or args.layers < 1 or args.steps < 1:
        p.error("--rows, --layers and --steps must be positive")
    if args.heads % args.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    return args


def workload(args: argparse.Namespace) -> tuple[list[tuple[int, int, list[int]]], int]:
    """(seqs as common_metadata_from_seqs takes them: one decode token each, after its cached
    context), and the blocks a cache needs."""
    rng = random.Random(args.seed)
    bs = args.block_size
    lengths = sorted(rng.randint(*args.context) for _ in range(args.rows))
    need = sum(-(-n // bs) for n in lengths)
    free = list(range(need))
    rng.shuffle(free)
    return [(n - 1, 1, [free.pop() for _ in range(-(-n // bs))]) for n in lengths], need


def run_path(path: str, args: argparse.Namespace) -> dict:
    from engine.attention import kv_int8
    from engine.attention.backends.cpu import CpuAttentionBackend
    from engine.attention.backends.torch import TorchAttentionBackend
    from engine.attention.layer import PagedAttention
    from engine.attention.metadata import common_metadata_from_seqs
    from engine.worker import host_memory

    dtype, bs = torch.bfloat16, args.block_size
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    seqs, blocks = workload(args)
    backend_cls = CpuAttentionBackend if path == "kernel" else TorchAttentionBackend
    int8 = args.kv_cache_dtype == "int8"
    kv_dtype = torch.int8 if int8 else dtype
    backend = backend_cls(bs, h, hkv, d, dtype)
    g = torch.Generator().manual_seed(args.seed)  # the same caches and inputs for each path
    layers = []
    for _ in range(args.layers):
        attn = PagedAttention(h, hkv, d, d**-0.5)
        attn.backend = backend
        attn.kv_cache = host_memory.zeros((2, blocks, bs, hkv, d), kv_dtype)
        if int8:
            attn.kv_cache.copy_(
                torch.randint(-127, 128, attn.kv_cache.shape, generator=g, dtype=torch.int8)
            )
            attn.kv_scales = kv_int8.allocate_scales(blocks, bs, hkv, "cpu")
            attn.kv_scales.fill_(0.01)
            attn.kv_spec = kv_int8.Int8KVCacheSpec(bs, hkv, d, dtype)  # the torch path's ops
        else:
            attn.kv_cache.copy_(torch.randn(attn.kv_cache.shape, generator=g))
        layers.append(attn)
    meta = backend.build_metadata(common_metadata_from_seqs(seqs, bs))
    q = torch.randn(args.rows, h, d, generator=g).to(dtype)
    k = torch.randn(args.rows, hkv, d, generator=g).to(dtype)
    v = torch.randn(args.rows, hkv, d, generator=g).to(dtype)

    def step() -> torch.Tensor:
        for attn in layers:
            out = attn(q, k, v, meta)
        return out

    times = []
    with torch.inference_mode():
        last = step().float()  # the last layer's output, to compare the paths
        for _ in range(2):
            step()
        for _ in range(args.steps):
            started = time.perf_counter()
            step()
            times.append(time.perf_counter() - started)
    tokens = sum(start + 1 for start, _, _ in seqs)
    elem = 1 if kv_dtype == torch.int8 else 2
    cache_bytes = tokens * hkv * d * elem * 2 * args.layers  # K and V each token read once
    med = statistics.median(times)
    return {
        "path": path,
        "best_ms": round(min(times) * 1e3, 3),
        "median_ms": round(med * 1e3, 3),
        # three significant digits: a tiny cache read slowly (a loaded machine) is no 0.0 GB/s
        "kv_gb_s": float(f"{cache_bytes / med / 1e9:.3g}"),
        "kv_bytes": cache_bytes,
        "out": last,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine.attention import cpu_kernel

    paths = list(args.paths)
    if "kernel" in paths and not cpu_kernel.kernel_supports(
        torch.bfloat16, torch.device("cpu"), args.kv_heads, args.head_dim
    ):
        print("bench attention: the CPU kernel is unavailable here; torch path only")
        paths.remove("kernel")
    print("bench attention: run it on a quiet machine; other load shows up in every number.")
    results = [run_path(path, args) for path in paths]
    by_path = {r["path"]: r for r in results}
    base = by_path.get("torch")
    diff = None
    if len(by_path) == 2:  # the same caches, queries and K/V: the kernel against the torch path
        diff = (by_path["kernel"]["out"] - base["out"]).abs().max().item()
    for r in results:
        del r["out"]
    print(
        f"\n## decode attention: {args.rows} rows, context {args.context[0]}-{args.context[1]}, "
        f"{args.layers} layers, {args.heads}/{args.kv_heads} heads x {args.head_dim}, "
        f"block {args.block_size}, KV {args.kv_cache_dtype}, {torch.get_num_threads()} threads\n"
    )
    print("| path | ms/step best | ms/step median | K/V read GB/s | torch / this |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        ratio = f"{base['median_ms'] / r['median_ms']:.2f}x" if base else ""
        print(f"| {r['path']} | {r['best_ms']} | {r['median_ms']} | {r['kv_gb_s']} | {ratio} |")
    if diff is not None:
        print(f"\nkernel against torch: max |difference| {diff:.2e} (bf16 outputs)")
    if args.json:
        with open(args.json, "w") as f:
            report = {"benchmark": "attention", "args": vars(args), "results": results}
            json.dump({**report, "max_abs_diff": diff}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
