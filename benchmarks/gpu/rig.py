"""The attention rig of §2 and §3: a one-layer model of the plan's head shapes built by the
engine's own ModelRunner (so a KV cache and any scales are allocated and bound the way the
engine does it, fp8 included), and the cases run through its backend directly."""

from __future__ import annotations

import contextlib
import math
import traceback
from dataclasses import dataclass

import numpy as np
import torch

from benchmarks.gpu.check import Check
from benchmarks.gpu.measure import option_supported
from benchmarks.gpu.plan import LLAMA3_8B, STALE_VALUE, Plan


@dataclass(slots=True)
class Rig:
    """One attention layer as the engine builds it: the runner's backend, layer and cache."""

    runner: object
    backend: object
    layer: object
    cache: torch.Tensor
    num_blocks: int


def make_rig(
    chk: Check, backend: str, kv_cache_dtype: str, num_blocks: int, max_context: int
) -> tuple[Rig | None, str, str]:
    """(rig, "ok", ""), or (None, status, why): a backend missing from the registry, or one
    the engine refuses (ValueError) for this device or cache dtype, is "not available"; any
    other failure to build it is an "ERROR"."""
    from engine.attention.backends import BACKENDS

    if backend not in BACKENDS:
        return None, "not available", "not in engine.attention.backends.BACKENDS on this branch"
    from engine.worker.model_runner import ModelRunner

    p = chk.plan
    cfg = {
        **LLAMA3_8B,
        "hidden_size": 256,
        "intermediate_size": 256,
        "num_hidden_layers": 1,
        "num_attention_heads": p.heads,
        "num_key_value_heads": p.kv_heads,
        "head_dim": p.head_dim,
        "vocab_size": 256,
        "max_position_embeddings": max_context,
    }
    folder = chk.folder(f"rig-{p.heads}-{p.kv_heads}-{p.head_dim}-{max_context}", cfg, False)
    options = dict(
        model=str(folder),
        dtype="bfloat16",
        load_format="dummy",
        device=chk.device.type,
        attention_backend=backend,
        kv_cache_dtype=kv_cache_dtype,
        block_size=p.block_size,
        num_kv_blocks=num_blocks,
        max_model_len=max_context,
        max_num_seqs=max(*p.check_batches, *p.bench_batches),
        enable_prefix_caching=False,
    )
    try:  # EngineArgs; a baseline tree from before it has EngineConfig.from_options
        from engine.args import EngineArgs

        options["enforce_eager"] = True  # the rig calls the backend itself: nothing to capture

        def make_config(**o):
            return EngineArgs(**o).create_engine_config()
    except ImportError:
        from engine.config import EngineConfig

        options["num_blocks"] = options.pop("num_kv_blocks")
        if option_supported(EngineConfig.from_options, "enforce_eager"):
            options["enforce_eager"] = True
        make_config = EngineConfig.from_options
    try:
        config = make_config(**options)
        runner = ModelRunner(config, model_dir=folder, rank=0)
        runner.load_model()
        runner.init_kv_cache(num_blocks)
    except (ValueError, ImportError, NotImplementedError) as e:
        return None, "not available", f"{type(e).__name__}: {e}"
    except Exception as e:
        traceback.print_exc()
        return None, "ERROR", f"{type(e).__name__}: {e}"
    layer = runner.model.attention_layers()[0]
    return Rig(runner, runner.attn_backend, layer, layer.kv_cache, num_blocks), "ok", ""


def kv_label(kv_cache_dtype: str) -> str:
    return "bf16" if kv_cache_dtype == "auto" else kv_cache_dtype


@dataclass(slots=True)
class Case:
    batch: int
    context: int
    mode: str  # "decode": one query token each; "mixed": the last request is a prefill chunk
    reqs: list[tuple[int, int]]  # (start position, query tokens) per request, batch order
    blocks: list[np.ndarray]  # each request's physical blocks, int32
    q: torch.Tensor  # [T, H, D]
    keys: torch.Tensor  # [B, context, Hkv, D]
    values: torch.Tensor


def check_cases(plan: Plan) -> list[tuple[int, int, str]]:
    cases = []
    for ctx in plan.check_contexts:
        for b in plan.check_batches:
            cases.append((b, ctx, "decode"))
            if ctx > 1:
                cases.append((b, ctx, "mixed"))
    return cases


def make_case(
    plan: Plan,
    batch: int,
    context: int,
    mode: str,
    num_blocks: int,
    seed: int,
    device: torch.device,
) -> Case:
    bs = plan.block_size
    reqs = [(context - 1, 1)] * batch
    if mode == "mixed":
        q_len = min(context, plan.check_chunk)
        reqs[-1] = (context - q_len, q_len)
    rng = np.random.default_rng(seed)
    free = rng.permutation(np.arange(1, num_blocks, dtype=np.int32))  # scattered, in any order
    nb = -(-context // bs)
    blocks = [free[r * nb : (r + 1) * nb] for r in range(batch)]
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, context, plan.kv_heads, plan.head_dim)
    keys = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
    values = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
    t = sum(n for _, n in reqs)
    q = torch.randn(
        (t, plan.heads, plan.head_dim), generator=gen, device=device, dtype=torch.bfloat16
    )
    return Case(batch, context, mode, reqs, blocks, q, keys, values)


def stored(x: torch.Tensor, kv_cache_dtype: str, kv_scale: float) -> torch.Tensor:
    """x as the cache holds it, in fp64: rounded to e4m3 for an fp8 cache."""
    if kv_cache_dtype != "fp8":
        return x.double()
    from engine.attention import kv_fp8

    return kv_fp8.dequantize(kv_fp8.quantize(x, kv_scale), kv_scale, torch.float64)


def reference(case: Case, scale: float, kv_cache_dtype: str = "auto") -> torch.Tensor:
    """fp64 attention of every query row over its request's context, causal, over K/V as the
    cache stores them: [T, H * D]."""
    from engine.attention import kv_fp8

    outs = []
    row = 0
    for r, (start, n) in enumerate(case.reqs):
        ctx = start + n
        q = case.q[row : row + n].double()  # [n, H, D]
        k = stored(case.keys[r, :ctx], kv_cache_dtype, kv_fp8.K_SCALE)  # [ctx, Hkv, D]
        v = stored(case.values[r, :ctx], kv_cache_dtype, kv_fp8.V_SCALE)
        hkv, d = k.shape[1], k.shape[2]
        qg = q.view(n, hkv, -1, d)  # the query heads that share a KV head
        s = torch.einsum("qhgd,khd->hgqk", qg, k) * scale
        q_pos = torch.arange(start, ctx, device=q.device)
        future = torch.arange(ctx, device=q.device)[None, :] > q_pos[:, None]
        s = s.masked_fill(future, float("-inf"))
        o = torch.einsum("hgqk,khd->qhgd", torch.softmax(s, dim=-1), v)
        outs.append(o.reshape(n, -1))
        row += n
    return torch.cat(outs)


def run_case(rig: Rig, case: Case, block_size: int) -> torch.Tensor:
    """The cached prefixes written through the backend, then one step: write_kv + forward."""
    from engine.attention.metadata import common_metadata_from_seqs

    backend, layer, cache = rig.backend, rig.layer, rig.cache
    # Prefixes as one prefill step; the metadata wants one-token requests first.
    fill = sorted(
        ((r, start) for r, (start, _) in enumerate(case.reqs) if start > 0),
        key=lambda x: x[1] != 1,
    )
    if fill:
        seqs = [(0, start, case.blocks[r]) for r, start in fill]
        meta = backend.build_metadata(common_metadata_from_seqs(seqs, block_size))
        k = torch.cat([case.keys[r, :start] for r, start in fill])
        v = torch.cat([case.values[r, :start] for r, start in fill])
        backend.write_kv(layer, k, v, cache, meta)
    seqs = [(start, n, case.blocks[r]) for r, (start, n) in enumerate(case.reqs)]
    meta = backend.build_metadata(common_metadata_from_seqs(seqs, block_size))
    k = torch.cat([case.keys[r, s : s + n] for r, (s, n) in enumerate(case.reqs)])
    v = torch.cat([case.values[r, s : s + n] for r, (s, n) in enumerate(case.reqs)])
    backend.write_kv(layer, k, v, cache, meta)
    return backend.forward(layer, case.q, k, v, cache, meta)


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    got = got.double().reshape(ref.shape)
    if not bool(torch.isfinite(got).all()):
        return math.inf
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def poison(cache: torch.Tensor) -> None:
    with contextlib.suppress(RuntimeError, TypeError):  # a dtype without fill_: zeros stay
        cache.fill_(STALE_VALUE)
